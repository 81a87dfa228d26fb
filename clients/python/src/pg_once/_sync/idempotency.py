# Generated from pg_once/_async/idempotency.py by tools/generate_sync.py: edit that file,
# not this one, then run the tool again.
"""The flow of rule I around one request, with its I/O, for the protocol adapters
pg_once.asgi (this flavour) and pg_once.wsgi (the generated sync one): claim the request's
entry with its fingerprint, answer what is not ours to run, and store or give back the
claim once the handler has answered. The pure parts (keys, forms, problems, options) are
in pg_once/_idempotency.py."""

from __future__ import annotations

import logging
from typing import Any, Optional, Union

import psycopg

from .. import _idempotency as I
from ..errors import ClaimLost, ConfigurationError
from . import _compat as A
from .client import Claim, Client

log = logging.getLogger("pg_once")


class RequestClaim:
    """The claim of the request being handled, as a handler finds it (rule I8:
    `scope["pg_once.claim"]` in ASGI, `environ["pg_once.claim"]` in WSGI)."""

    def __init__(self, claim: Claim, options: I.Options,
                 fingerprint: Optional[bytes]) -> None:
        self.key = claim.key
        self._claim, self._options, self._fingerprint = claim, options, fingerprint
        self.completed = False   # the handler stored the response itself (I8)
        self.lost = False        # the handler's completion found the claim taken over

    def complete(self, conn: psycopg.Connection, status: int, headers: Any,
                       body: bytes) -> None:
        """Store the response (`headers` a list of (name, value) pairs or a mapping) on
        `conn`, inside the handler's own transaction, before it commits: the side effects
        and the stored response commit together, or neither does. Raises ClaimLost when
        the claim was taken over meanwhile (its process stopped, then resumed): roll back;
        the middleware answers 409, as to a concurrent duplicate."""
        if hasattr(headers, "items"):
            headers = list(headers.items())
        try:
            self._claim.store(I.stored_text(self._options, self.key, self._fingerprint,
                                                  status, headers, body), conn)
        except ClaimLost:
            self.lost = True
            raise
        self.completed = True


class Idempotency:
    """One middleware's claims: its options, and the client it claims with (given, or its
    own, made and opened by the first request or by open())."""

    def __init__(self, options: I.Options, client: Optional[Client],
                 conninfo: Optional[str], client_options: dict) -> None:
        if client is not None and (conninfo is not None or client_options):
            raise ConfigurationError("pass either client= (an open pg_once client) or conninfo= "
                                     "and its options, not both")
        self.options = options
        self._client, self._own = client, client is None
        self._conninfo, self._client_options = conninfo, client_options
        self._lock = A.Lock()

    def open(self) -> Client:
        """The client, made and opened once; a failure leaves none, for the next request
        to try again."""
        if self._client is None:
            with self._lock:
                if self._client is None:
                    client = Client(self._conninfo, **self._client_options)
                    client.open()
                    self._client = client
        return self._client

    def close(self) -> None:
        """Close the client if the middleware made it."""
        if self._own and self._client is not None:
            client, self._client = self._client, None
            client.close()

    def claim(self, key: str, scope: Optional[str], method: str, path: str, query: str,
                    body: bytes) -> Union[I.Reply, RequestClaim]:
        """The request's claim to run it, or the answer that replaces running it (I4)."""
        options = self.options
        entry = I.entry_key(options.namespace, scope, key, options.secret)
        fingerprint = I.fingerprint_of(options, method, path, query, body)
        try:
            client = self.open()
            answer = client.claim(entry, fingerprint=fingerprint, lease=options.lease,
                                        wait=options.claim_wait, ttl=options.ttl)
        except (psycopg.Error, ConfigurationError) as exc:
            # Without the store there is no guarantee, so the handler does not run.
            log.error("pg_once: idempotency store unavailable (%s); answering 503", exc)
            return I.unavailable().reply()
        if answer.outcome == "claimed":
            return RequestClaim(answer.claim, options, fingerprint)
        if answer.outcome == "hit":
            try:
                return I.replay(options, entry, fingerprint, answer.result)
            except I.Untrusted as refused:
                log.error("pg_once: not replaying the entry %r: %s; something other than this "
                          "middleware wrote it (a role with pg_once's rights in its key space?)",
                          entry, refused.why)
                return refused.reply()
        if answer.outcome == "mismatch":
            return I.mismatch(options).reply()
        if answer.outcome == "failed":
            return I.failed(options, answer.retry_at).reply()
        return I.in_flight(options).reply()   # 'wait': someone runs it

    def finish(self, claim: RequestClaim, response: I.Collected) -> None:
        """The handler answered in full: store its response (I5), unless it did so itself
        (I8) or its status is not stored; then give the claim back. The response is sent
        by now, so a failure here is logged, never the caller's."""
        if claim.lost:
            return
        if claim.completed or not self.options.store(response.status):
            # A completion in the handler's transaction that rolled back left the claim
            # ours, unheartbeated: it goes back (release_key answers false if it committed).
            self.give_back(claim)
            return
        try:
            try:
                self._store(claim, response.status, response.headers, response.body)
            except psycopg.Error as exc:
                if exc.sqlstate != "54000" or response.body is None:
                    raise
                # Over the server's once.max_result_size: keep the request answered once,
                # with its status and headers (I5's body over max_body).
                log.warning("pg_once: the response to %r is too large to store (%s); "
                            "storing it without its body", claim.key, exc)
                self._store(claim, response.status, response.headers, None)
        except ClaimLost:
            log.warning("pg_once: the claim on %r was taken over while its handler ran; its "
                        "response was sent but not stored", claim.key)
        except Exception as exc:
            log.error("pg_once: could not store the response to %r (%s); giving the claim "
                      "back, so a retry runs the request again", claim.key, exc)
            self.give_back(claim)

    def _store(self, claim: RequestClaim, status, headers, body) -> None:
        claim._claim.store(I.stored_text(self.options, claim.key, claim._fingerprint,
                                               status, headers, body))

    def give_back(self, claim: RequestClaim) -> None:
        """Release the claim (a 5xx, an exception before the response started): a retry
        runs again. A completion made in the handler's transaction (I8) that then failed was
        rolled back with it, so it is released too (release_key answers false if it did commit). A
        release that fails is logged: the claim then ends with its owner or lease (F4)."""
        if claim.lost or claim._claim.ended:
            return
        try:
            claim._claim.release()
        except Exception as exc:
            log.warning("pg_once: could not release the claim on %r (%s); it ends with its "
                        "owner or lease", claim.key, exc)
