"""The check-then-set baseline: the example service of clients/conformance/http/README.md
with the idempotency middleware most libraries shipped before pg_once (django-idempotency-key
and others): look the key's stored response up; if there is none, run the handler, then
store its response with INSERT ... ON CONFLICT DO NOTHING.

Nothing holds the key between the look and the store, so concurrent retries of one request
all find nothing and all run the handler. It is here to prove that the shared scenarios
catch that race ("once, conflict" fails against it) and to measure it
(bench/idempotency/bench.py); it is not an example to follow.

    PG_ONCE_DSN=... PORT=18450 python -m uvicorn app:app --workers 2 --port 18450
"""

import asyncio
import contextlib
import hashlib
import json
import os

from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

HEADER = "idempotency-key"
STORE = """CREATE TABLE IF NOT EXISTS idem_demo.naive_responses (
    key text PRIMARY KEY, status int NOT NULL, headers jsonb NOT NULL, body bytea NOT NULL)"""

pool = AsyncConnectionPool(os.environ["PG_ONCE_DSN"], min_size=2, max_size=10, open=False,
                           kwargs={"autocommit": True})


# -- the naive middleware ---------------------------------------------------------------

def naive_idempotency(handler, required=False):
    async def endpoint(request: Request) -> Response:
        key = request.headers.get(HEADER)
        if key is None:
            if required:
                return problem(400, "key_missing", "this route needs an Idempotency-Key header")
            return await handler(request)
        scope = hashlib.sha256(request.headers["authorization"].encode()).hexdigest() \
            if "authorization" in request.headers else ""
        stored_key = f"{scope}:{key}"
        async with pool.connection() as conn:                       # check ...
            row = await (await conn.execute(
                "SELECT status, headers, body FROM idem_demo.naive_responses WHERE key = %s",
                (stored_key,))).fetchone()
        if row:
            status, headers, body = row
            return Response(bytes(body), status, headers={**dict(headers), "idempotent-replayed": "true"})
        response = await handler(request)                            # ... run ...
        body = await collect(response)
        if response.status_code < 500:                               # ... then set
            headers = [(k.decode(), v.decode()) for k, v in response.raw_headers
                       if k.decode() not in ("content-length", "set-cookie")]
            async with pool.connection() as conn:
                await conn.execute(
                    "INSERT INTO idem_demo.naive_responses VALUES (%s, %s, %s, %s) ON CONFLICT DO NOTHING",
                    (stored_key, response.status_code, Jsonb(dict(headers)), body))
        return Response(body, response.status_code, headers={
            k.decode(): v.decode() for k, v in response.raw_headers if k.decode() != "content-length"})
    return endpoint


async def collect(response: Response) -> bytes:
    if isinstance(response, StreamingResponse):
        return b"".join([c if isinstance(c, bytes) else c.encode() async for c in response.body_iterator])
    return response.body


def problem(status, code, detail):
    return JSONResponse({"type": "about:blank", "title": "Bad Request", "status": status,
                         "detail": detail, "code": code}, status, media_type="application/problem+json")


# -- the handler of README.md ----------------------------------------------------------

async def create_order(request: Request) -> Response:
    spec = {"sku": None, "sleep_ms": 0, "status": 201, "raise": False, "size": 0, "chunks": 0,
            **json.loads(await request.body() or b"{}")}
    key, pid = request.headers.get(HEADER), os.getpid()
    async with pool.connection() as conn:
        await conn.execute("INSERT INTO idem_demo.started (idempotency_key, pid) VALUES (%s, %s)", (key, pid))
    await asyncio.sleep(spec["sleep_ms"] / 1000)
    if spec["raise"]:
        raise RuntimeError("the request asked the handler to raise")
    if spec["status"] >= 500:
        return JSONResponse({"error": "asked"}, spec["status"])
    insert = "INSERT INTO idem_demo.orders (idempotency_key, sku, pid) VALUES (%s, %s, %s) RETURNING id"
    if spec["chunks"] > 0:
        async with pool.connection() as conn:
            await conn.execute(insert, (key, Jsonb(spec["sku"]), pid))

        async def chunks():
            for n in range(spec["chunks"]):
                if n:
                    await asyncio.sleep(0.01)
                yield b"x" * spec["size"]
        return StreamingResponse(chunks(), 201, media_type="text/plain")
    async with pool.connection() as conn, conn.transaction():
        order_id = (await (await conn.execute(insert, (key, Jsonb(spec["sku"]), pid))).fetchone())[0]
    body = json.dumps({"order_id": order_id, "sku": spec["sku"], "pid": pid, "padding": "x" * spec["size"]})
    return Response(body, spec["status"], media_type="application/json", headers={
        "location": f"/orders/{order_id}", "set-cookie": "visited=1", "x-handler-pid": str(pid)})


async def health(request: Request) -> Response:
    return Response("ok")


@contextlib.asynccontextmanager
async def lifespan(app):
    await pool.open()
    async with pool.connection() as conn, conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock(27)")  # the workers start together
        await conn.execute(STORE)
    yield
    await pool.close()


app = Starlette(lifespan=lifespan, routes=[
    Route("/orders", naive_idempotency(create_order), methods=["POST"]),
    Route("/wait/orders", naive_idempotency(create_order), methods=["POST"]),
    Route("/strict/orders", naive_idempotency(create_order, required=True), methods=["POST"]),
    Route("/bare/orders", create_order, methods=["POST"]),
    Route("/health", health, methods=["GET"]),
])
