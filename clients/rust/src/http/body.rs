//! The body of a claimed request's response (rule I5): streamed to the caller as the
//! handler produces it, collected meanwhile (up to `max_body`), and stored when it ends.
//!
//! The last frame is held back until the response is stored: the frame after which the
//! handler's body says it has ended (`is_end_stream`, as a whole-buffer body does at
//! once) or has sent its `content-length`, else the end of the stream. So a caller that has
//! the whole response and retries at once is replayed it, never told the key still runs.
//! (hyper stops polling a body once it has sent `content-length` bytes: storing at the end
//! of the stream alone would never happen for such a body, and dropping it would release
//! the claim.) A stream that breaks, or a caller that goes away before the end (the body
//! is dropped), keeps the claim: the handler ran and its side effects may have committed,
//! so the response is stored without its body, as one over `max_body` is, and a retry is
//! replayed its status and headers rather than run again.

use super::claim::Held;
use super::rules;
use bytes::{Bytes, BytesMut};
use futures_util::future::BoxFuture;
use http::{HeaderMap, StatusCode};
use http_body::{Body, Frame, SizeHint};
use http_body_util::combinators::UnsyncBoxBody;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

/// Errors of the bodies the middleware hands on.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The body of every response of [`super::Idempotency`].
pub type ResponseBody = UnsyncBoxBody<Bytes, BoxError>;

/// What the response is stored with, besides its body.
pub(crate) struct Store {
    pub held: Arc<Held>,
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub ttl: Duration,
    pub max_body: usize,
    pub stored_for: Arc<rules::StoredFor>,
}

pub(crate) struct StoringBody {
    inner: ResponseBody,
    /// The body so far; None once it outgrew `max_body` (stored without it).
    collected: Option<BytesMut>,
    /// How many bytes were passed on, and how many the response says it has.
    sent: u64,
    length: Option<u64>,
    /// Some until the response is stored or the claim released.
    store: Option<Store>,
    /// Storing, then the frame held back (None: the end of the stream).
    storing: Option<(BoxFuture<'static, ()>, Option<Frame<Bytes>>)>,
}

impl StoringBody {
    pub(crate) fn new(inner: ResponseBody, store: Store) -> Self {
        let declared = store
            .headers
            .get(http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok()?.parse().ok());
        StoringBody {
            collected: Some(BytesMut::new()),
            sent: 0,
            length: declared.or(inner.size_hint().exact()),
            inner,
            store: Some(store),
            storing: None,
        }
    }

    fn collect(&mut self, data: &Bytes) {
        self.sent += data.len() as u64;
        let max = self.store.as_ref().map_or(0, |s| s.max_body);
        if let Some(collected) = &mut self.collected {
            if collected.len() + data.len() > max {
                self.collected = None;
            } else {
                collected.extend_from_slice(data);
            }
        }
    }

    /// Start storing the response, holding `then` back until it is stored.
    fn start_storing(&mut self, then: Option<Frame<Bytes>>) {
        let Some(store) = self.store.take() else {
            self.storing = Some((Box::pin(async {}), then));
            return;
        };
        let body = self.collected.take().map(BytesMut::freeze);
        let storing = async move { store.finish(body.as_deref()).await };
        self.storing = Some((Box::pin(storing), then));
    }
}

impl Store {
    /// Store the response with `body` (None: it was over `max_body`). A claim lost
    /// meanwhile stores nothing (logged: the response is on its way already); a response
    /// that cannot be stored gives the claim back, so that a retry runs again.
    pub(crate) async fn finish(self, body: Option<&[u8]>) {
        let stored = rules::stored_response(self.status, &self.headers, body, &self.stored_for);
        let mut done = self.held.complete(&stored, self.ttl).await;
        if body.is_some() && done.as_ref().is_err_and(|e| e.sqlstate() == Some("54000")) {
            // Over the server's once.max_result_size: kept without its body (I5), so that
            // the request still runs once.
            let stored = rules::stored_response(self.status, &self.headers, None, &self.stored_for);
            done = self.held.complete(&stored, self.ttl).await;
        }
        match done {
            Ok(true) => {}
            Ok(false) => tracing::warn!(
                key = self.held.key,
                "pg_once: a request's claim was lost before its response was stored"
            ),
            Err(e) => {
                tracing::warn!(key = self.held.key, error = %e,
                    "pg_once: could not store a response; releasing its claim");
                self.held.release().await;
            }
        }
    }
}

impl Body for StoringBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        loop {
            if let Some((storing, _)) = &mut this.storing {
                ready!(storing.as_mut().poll(cx));
                let (_, then) = this.storing.take().expect("storing");
                return Poll::Ready(then.map(Ok));
            }
            if this.store.is_none() {
                return Pin::new(&mut this.inner).poll_frame(cx);
            }
            match ready!(Pin::new(&mut this.inner).poll_frame(cx)) {
                Some(Ok(frame)) => {
                    if let Some(data) = frame.data_ref() {
                        this.collect(data);
                    }
                    if this.inner.is_end_stream() || this.length == Some(this.sent) {
                        this.start_storing(Some(frame));
                        continue;
                    }
                    return Poll::Ready(Some(Ok(frame)));
                }
                Some(Err(e)) => {
                    store_cut_in_background(this.store.take());
                    return Poll::Ready(Some(Err(e)));
                }
                None => this.start_storing(None),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.store.is_none() && self.storing.is_none() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for StoringBody {
    fn drop(&mut self) {
        // The caller went away before the end: the handler ran all the same, so the
        // response is stored without the body it did not get to the end of.
        store_cut_in_background(self.store.take());
    }
}

/// Store a response cut short (a broken stream, a caller gone) without its body (I5).
fn store_cut_in_background(store: Option<Store>) {
    let Some(store) = store else { return };
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => {
            runtime.spawn(store.finish(None));
        }
        Err(_) => tracing::warn!(
            key = store.held.key,
            "pg_once: a response ended outside a tokio runtime; its claim ends with its lease"
        ),
    }
}
