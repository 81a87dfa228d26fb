"""Idempotent HTTP endpoints for WSGI applications (Flask, Django): a request with an
`Idempotency-Key` header runs at most once per key, across every process; its retries get
the stored response (docs/clients.md, rule I). The twin of pg_once.asgi, on the sync Client.

    from pg_once.wsgi import IdempotencyMiddleware
    app.wsgi_app = IdempotencyMiddleware(app.wsgi_app, conninfo="host=db dbname=app")  # Flask

Flask turns a handler's exception into its own 500 page before a WSGI middleware sees it;
set PROPAGATE_EXCEPTIONS = True to get the middleware's problem+json 500 instead (either
way the claim is given back and a retry runs again)."""

from __future__ import annotations

import io
import logging
from http import HTTPStatus
from typing import Any, Callable, Iterable, Iterator, Optional
from urllib.parse import quote, urlsplit

from . import _idempotency as I
from ._sync.client import Client
from ._sync.idempotency import Idempotency, RequestClaim
from .errors import ClaimLost

__all__ = ["IdempotencyMiddleware", "RequestClaim"]

log = logging.getLogger("pg_once")

CLAIM = "pg_once.claim"   # where a handler finds its request's claim, in the environ (I8)


class IdempotencyMiddleware:
    """Runs each covered request at most once per key (rule I).

    `conninfo=` (and Client options, e.g. `listen_conninfo=`, `pool_size=`): the middleware
    makes its own Client with the first request of each process (so a server that forks
    workers after importing the application, gunicorn --preload, still gets one per
    worker); close() closes it. `client=`: a Client the application owns. Options as for
    pg_once.asgi.IdempotencyMiddleware; `scope` is a function of the WSGI environ."""

    def __init__(self, app: Callable, *, conninfo: Optional[str] = None,
                 client: Optional[Client] = None, methods=("POST", "PATCH"),
                 header: str = "Idempotency-Key", required: bool = False,
                 namespace: str = "", scope=None, fingerprint=None, ttl=24 * 3600,
                 lease=30, in_flight: str = "conflict", wait=10, store=None,
                 store_cookies: bool = False, max_body: int = I.MiB,
                 max_request_body: int = I.MiB, secret=None, **client_options: Any) -> None:
        self.app = app
        self.options = I.Options.build(
            methods=methods, header=header, required=required, namespace=namespace,
            scope=scope, fingerprint=fingerprint, ttl=ttl, lease=lease, in_flight=in_flight,
            wait=wait, store=store, store_cookies=store_cookies, max_body=max_body,
            max_request_body=max_request_body, secret=secret)
        self._gate = Idempotency(self.options, client, conninfo, client_options)
        self._header = "HTTP_" + self.options.header.upper().replace("-", "_")

    def __call__(self, environ: dict, start_response: Callable) -> Iterable[bytes]:
        method = environ.get("REQUEST_METHOD", "GET").upper()
        if method not in self.options.methods:
            return self.app(environ, start_response)
        try:
            # A WSGI server joins repeated header lines with ", ", which no key contains.
            value = environ.get(self._header)
            key = I.request_key(self.options, [] if value is None else [value])
            if key is None:
                return self.app(environ, start_response)
            body = _read_body(environ, self.options)
        except I.Problem as problem:
            return _answer(start_response, problem.reply())
        environ["wsgi.input"], environ["CONTENT_LENGTH"] = io.BytesIO(body), str(len(body))
        answer = self._gate.claim(key, self._scope_of(environ), method, _raw_path(environ),
                                  environ.get("QUERY_STRING", ""), body)
        if isinstance(answer, I.Reply):
            return _answer(start_response, answer)
        return self._run(answer, environ, start_response)

    def close(self) -> None:
        """Close the client the middleware made."""
        self._gate.close()

    def _scope_of(self, environ: dict) -> Optional[str]:
        if self.options.scope is not None:
            return self.options.scope(environ)
        return I.default_scope(environ.get("HTTP_AUTHORIZATION"))

    def _run(self, claim: RequestClaim, environ: dict, start_response: Callable) -> Iterator[bytes]:
        """Run the handler under the claim; its response goes to the caller as it is
        produced and is collected meanwhile (I5). A generator: the server drives it."""
        environ[CLAIM] = claim
        response = I.Collected(self.options.max_body)
        started: dict = {}

        def start_collected(status: str, headers: list, exc_info=None):
            started.update(status=status, headers=headers, exc_info=exc_info)
            return response.add   # the legacy write(): kept, not sent (rare, and pre-WSGI)

        try:
            result = self.app(environ, start_collected)
        except Exception as exc:
            self._gate.give_back(claim)
            yield from self._failed(claim, exc, start_response)
            return
        sent = False
        last = b""   # held back until the response is stored (below)
        try:
            for chunk in result:
                if not sent and started:
                    if claim.lost:
                        break
                    start_response(started["status"], started["headers"], started["exc_info"])
                    sent = True
                if chunk:
                    response.add(chunk)
                    if last:
                        yield last
                    last = chunk
            if not claim.lost and not sent:
                start_response(started["status"], started["headers"], started["exc_info"])
                sent = True
        except BaseException as exc:
            if sent:
                # A broken stream, or the server closing it (GeneratorExit, the caller gone):
                # the head went out, the handler ran and its side effects may have
                # committed, so the claim is kept, stored without its body (I5).
                response.cut()
                self._finish(claim, response, started)
                raise
            self._gate.give_back(claim)
            if not isinstance(exc, Exception):
                raise
            yield from self._failed(claim, exc, start_response)
            return
        finally:
            close = getattr(result, "close", None)
            if close is not None:
                close()
        if claim.lost and not sent:   # the framework made an error page of the lost claim (I8)
            yield from _answer(start_response, I.in_flight(self.options).reply())
            return
        # Stored before the response's last bytes reach the caller, so that a retry sent on
        # seeing its end is replayed rather than told it still runs.
        self._finish(claim, response, started)
        if last:
            yield last

    def _finish(self, claim: RequestClaim, response: I.Collected, started: dict) -> None:
        response.status = int(started["status"].split()[0])
        response.headers = started["headers"]
        self._gate.finish(claim, response)

    def _failed(self, claim: RequestClaim, exc: Exception, start_response) -> Iterator[bytes]:
        if claim.lost or isinstance(exc, ClaimLost):
            reply = I.in_flight(self.options).reply()
        else:
            log.error("pg_once: the handler of %r raised; answering 500", claim.key, exc_info=exc)
            reply = I.handler_failed().reply()
        yield from _answer(start_response, reply)


def _read_body(environ: dict, options: I.Options) -> bytes:
    """The whole request body (I3), Problem 413 past max_request_body."""
    stream = environ["wsgi.input"]
    length = environ.get("CONTENT_LENGTH") or ""
    if length.isdigit():
        if int(length) > options.max_request_body:
            raise I.body_too_large(options)
        return stream.read(int(length)) if int(length) else b""
    if not environ.get("wsgi.input_terminated"):
        return b""   # no length and no end-of-input promise: WSGI says there is no body
    body = stream.read(options.max_request_body + 1)
    if len(body) > options.max_request_body:
        raise I.body_too_large(options)
    return body


def _raw_path(environ: dict) -> str:
    """The path as received, not decoded (I3): the request target's, where the server
    gives it (gunicorn RAW_URI, others REQUEST_URI), else PATH_INFO encoded again."""
    target = environ.get("RAW_URI") or environ.get("REQUEST_URI")
    if target:
        return urlsplit(target).path if not target.startswith("/") else target.split("?")[0]
    path = environ.get("SCRIPT_NAME", "") + environ.get("PATH_INFO", "")
    return quote(path.encode("latin-1"), safe="/;=,!$&'()*+:@~-._")


def _status_line(status: int) -> str:
    try:
        return f"{status} {HTTPStatus(status).phrase}"
    except ValueError:
        return f"{status} Unknown"


def _answer(start_response: Callable, reply: I.Reply) -> Iterator[bytes]:
    start_response(_status_line(reply.status), reply.headers)
    return iter([reply.body])
