"""Idempotent HTTP endpoints for ASGI applications (Starlette, FastAPI, Litestar, Django's
ASGI handler): a request with an `Idempotency-Key` header runs at most once per key,
across every process; its retries get the stored response (docs/clients.md, rule I).

    from pg_once.asgi import IdempotencyMiddleware
    app.add_middleware(IdempotencyMiddleware, conninfo="host=db dbname=app")   # Starlette
    app = IdempotencyMiddleware(app, client=once)                              # any ASGI app

A plain ASGI middleware: it imports no framework."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable, MutableMapping, Optional

from . import _idempotency as I
from ._async.client import AsyncClient
from ._async.idempotency import AsyncIdempotency, AsyncRequestClaim
from .errors import ClaimLost

__all__ = ["IdempotencyMiddleware", "AsyncRequestClaim"]

log = logging.getLogger("pg_once")

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
CLAIM = "pg_once.claim"   # where a handler finds its request's claim, in the ASGI scope (I8)


class IdempotencyMiddleware:
    """Runs each covered request at most once per key (rule I).

    `conninfo=` (and AsyncClient options, e.g. `listen_conninfo=`, `pool_size=`): the
    middleware makes its own AsyncClient, opens it at lifespan startup (or with the first
    request) and closes it at lifespan shutdown. `client=`: an AsyncClient the
    application opens and closes. Options (checked here, rule I9): `methods` (POST,
    PATCH), `header` ("Idempotency-Key"), `required` (False: a request without the header
    passes through), `namespace` (""), `secret` (bytes or str of 32 bytes or more, the
    same in every process, e.g. from an environment variable: the entry's key is then an
    HMAC of scope and key, and a replay needs the secret's MAC; required with the default
    scope), `scope` (a function of the ASGI scope giving the authenticated principal, a
    str or None; default: the Authorization header, keyed by `secret`),
    `fingerprint` (a function of method, path, query and body giving 1 to 64 bytes, or
    None), `ttl` (24 h), `lease` (30 s), `in_flight` ("conflict": 409 at once; "wait":
    wait up to `wait`, 10 s, for the running request's response), `store` (a function of
    the status: whether to keep the response; default below 500), `store_cookies`
    (False), `max_body` (1 MiB kept per response), `max_request_body` (1 MiB read)."""

    def __init__(self, app: Callable, *, conninfo: Optional[str] = None,
                 client: Optional[AsyncClient] = None, methods=("POST", "PATCH"),
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
        self._gate = AsyncIdempotency(self.options, client, conninfo, client_options)
        self._header = self.options.header_lower.encode("latin-1")

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(scope, receive, send)
        elif scope["type"] != "http" or scope["method"].upper() not in self.options.methods:
            await self.app(scope, receive, send)
        else:
            await self._request(scope, receive, send)

    async def close(self) -> None:
        """Close the client the middleware made (lifespan shutdown does it)."""
        await self._gate.close()

    # -- one covered request ----------------------------------------------------------------

    async def _request(self, scope: Message, receive: Receive, send: Send) -> None:
        options = self.options
        try:
            key = I.request_key(options, [v.decode("latin-1") for n, v in scope["headers"]
                                          if n.lower() == self._header])
            if key is None:
                await self.app(scope, receive, send)
                return
            body = await _read_body(scope, receive, options)
        except I.Problem as problem:
            await _answer(send, problem.reply())
            return
        if body is None:
            return   # the client went away while sending its body
        path = (scope.get("raw_path") or scope["path"].encode("utf-8")).split(b"?")[0]
        answer = await self._gate.claim(
            key, self._scope_of(scope), scope["method"].upper(), path.decode("latin-1"),
            scope.get("query_string", b"").decode("latin-1"), body)
        if isinstance(answer, I.Reply):
            await _answer(send, answer)
        else:
            await self._run(answer, scope, receive, send, body)

    def _scope_of(self, scope: Message) -> Optional[str]:
        if self.options.scope is not None:
            return self.options.scope(scope)
        values = [v for n, v in scope["headers"] if n.lower() == b"authorization"]
        return I.default_scope(values[0].decode("latin-1") if values else None)

    async def _run(self, claim: AsyncRequestClaim, scope: Message, receive: Receive,
                   send: Send, body: bytes) -> None:
        """Run the handler under the claim: the body it reads is the one already read; its
        response goes to the caller as it is produced and is collected meanwhile (I5)."""
        response = I.Collected(self.options.max_body)
        state = {"started": False, "ended": False, "swallowed": False, "body_given": False}

        async def receive_body() -> Message:
            if state["body_given"]:
                return await receive()
            state["body_given"] = True
            return {"type": "http.request", "body": body, "more_body": False}

        async def send_collected(message: Message) -> None:
            kind = message["type"]
            if kind == "http.response.start":
                if claim.lost:
                    # The handler's completion found its claim taken over (I8) and the
                    # framework made an error page of it: the answer is a duplicate's.
                    state["swallowed"] = True
                    return
                response.status = message["status"]
                response.headers = list(message.get("headers", []))
                state["started"] = True
            elif kind == "http.response.body" and not state["swallowed"]:
                response.add(message.get("body", b""))
                if not message.get("more_body", False):
                    # Stored before its end reaches the caller, so that a retry sent on
                    # seeing the end is replayed rather than told it still runs.
                    state["ended"] = True
                    await self._gate.finish(claim, response)
            if not state["swallowed"]:
                await send(message)

        try:
            await self.app({**scope, CLAIM: claim}, receive_body, send_collected)
        except BaseException as exc:
            if state["started"]:
                await self._keep_cut(claim, response, state)
                raise   # a broken stream: the caller has its head, nothing more can be said
            await self._gate.give_back(claim)
            if not isinstance(exc, Exception):
                raise   # a cancellation
            if claim.lost or isinstance(exc, ClaimLost):
                await _answer(send, I.in_flight(self.options).reply())
            else:
                log.error("pg_once: the handler of %r raised; answering 500", claim.key,
                          exc_info=exc)
                await _answer(send, I.handler_failed().reply())
            return
        if state["swallowed"]:
            await _answer(send, I.in_flight(self.options).reply())
        elif state["started"]:   # a stream cut short (Starlette's, when the caller hangs up)
            await self._keep_cut(claim, response, state)
        elif not state["ended"]:   # the handler returned without answering
            await self._gate.give_back(claim)

    async def _keep_cut(self, claim: AsyncRequestClaim, response: I.Collected,
                        state: dict) -> None:
        """The response's head went out and its body did not end: the handler ran (its side
        effects may have committed), so the claim is kept, stored without its body (I5).
        Shielded: a cancelled request (a caller gone) still stores it."""
        if not state["ended"]:
            state["ended"] = True
            response.cut()
            await asyncio.shield(self._gate.finish(claim, response))

    # -- the lifespan: the middleware's own client -------------------------------------------

    async def _lifespan(self, scope: Message, receive: Receive, send: Send) -> None:
        async def receive_opening() -> Message:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self._gate.open()
                except Exception as exc:   # requests answer 503 until it opens
                    log.error("pg_once: cannot open the idempotency store at startup (%s); "
                              "trying again with each request", exc)
            return message

        async def send_closing(message: Message) -> None:
            if message["type"] == "lifespan.shutdown.complete":
                await self._gate.close()
            await send(message)

        await self.app(scope, receive_opening, send_closing)


async def _read_body(scope: Message, receive: Receive, options: I.Options) -> Optional[bytes]:
    """The whole request body (I3), Problem 413 past max_request_body, None if the client
    disconnected."""
    for name, value in scope["headers"]:
        if name.lower() == b"content-length" and value.isdigit() and \
                int(value) > options.max_request_body:
            raise I.body_too_large(options)
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > options.max_request_body:
            raise I.body_too_large(options)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _answer(send: Send, reply: I.Reply) -> None:
    await send({"type": "http.response.start", "status": reply.status,
                "headers": [(n.encode("latin-1"), v.encode("latin-1")) for n, v in reply.headers]})
    await send({"type": "http.response.body", "body": reply.body})
