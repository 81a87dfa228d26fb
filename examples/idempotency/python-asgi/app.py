"""An idempotent order endpoint with Starlette and pg_once.asgi (served by uvicorn).

    PG_ONCE_DSN=postgresql://app@db/app IDEMPOTENCY_SECRET=$(openssl rand -hex 32) \
        uvicorn app:app --workers 2 --port 8000

The routes and the handler are those of clients/conformance/http/README.md: POST /orders
(a retry with the same Idempotency-Key gets the stored response), /wait/orders (a
duplicate waits for the first one's response), /strict/orders (the header is required),
/bare/orders (no middleware) and GET /health."""

import asyncio
import contextlib
import json
import os

from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route

from pg_once import AsyncClient
from pg_once.asgi import IdempotencyMiddleware

DSN = os.environ["PG_ONCE_DSN"]
# Keys the entries and authenticates the stored responses (docs/clients.md, I2): the same
# in every process of the service, kept like any other secret of the application.
SECRET = os.environ["IDEMPOTENCY_SECRET"]
PID = os.getpid()

once = AsyncClient(DSN)                                   # one per process: claims, LISTEN
db = AsyncConnectionPool(DSN, open=False, max_size=20)   # the handler's own connections


async def create_order(request: Request) -> Response:
    order = json.loads(await request.body() or b"{}")
    key = request.headers.get("idempotency-key")
    async with db.connection() as conn:                   # committed at once
        await conn.execute("INSERT INTO idem_demo.started (idempotency_key, pid) VALUES (%s, %s)",
                           (key, PID))
    await asyncio.sleep(order.get("sleep_ms", 0) / 1000)
    if order.get("raise"):
        raise RuntimeError("asked to raise")
    status = order.get("status", 201)
    if status >= 500:
        return JSONResponse({"error": "asked"}, status_code=status)
    if order.get("chunks", 0) > 0:
        async with db.connection() as conn:
            await insert_order(conn, key, order)
        return StreamingResponse(chunks(order["chunks"], order.get("size", 0)), status_code=201,
                                 media_type="text/plain")

    claim = request.scope.get("pg_once.claim")            # None on /bare/orders
    async with db.connection() as conn:
        async with conn.transaction():                    # the order and its response, together
            order_id = await insert_order(conn, key, order)
            headers = {"content-type": "application/json", "location": f"/orders/{order_id}",
                       "set-cookie": "visited=1", "x-handler-pid": str(PID)}
            body = json.dumps({"order_id": order_id, "sku": order.get("sku"), "pid": PID,
                               "padding": "x" * order.get("size", 0)}).encode()
            if claim is not None:
                await claim.complete(conn, status, headers, body)   # ClaimLost rolls back
    return Response(body, status_code=status, headers=headers)


async def insert_order(conn, key, order) -> int:
    cur = await conn.execute(
        "INSERT INTO idem_demo.orders (idempotency_key, sku, pid) VALUES (%s, %s, %s) RETURNING id",
        (key, Jsonb(order.get("sku")), PID))
    return (await cur.fetchone())[0]


async def chunks(count: int, size: int):
    for _ in range(count):
        yield b"x" * size
        await asyncio.sleep(0.01)


async def health(request: Request) -> Response:
    return JSONResponse({"ok": True, "pid": PID})


@contextlib.asynccontextmanager
async def lifespan(app):
    await db.open()
    await once.open()
    yield
    await once.close()
    await db.close()


def idempotent(**options) -> Middleware:
    return Middleware(IdempotencyMiddleware, client=once, secret=SECRET, ttl=3600,
                      max_body=1 << 20, **options)


orders = [Route("/orders", create_order, methods=["POST"])]
app = Starlette(routes=[
    Route("/health", health),
    Route("/bare/orders", create_order, methods=["POST"]),
    Mount("/wait", routes=orders, middleware=[idempotent(in_flight="wait", wait=10)]),
    Mount("/strict", routes=orders, middleware=[idempotent(required=True)]),
    Mount("", routes=orders, middleware=[idempotent()]),
], lifespan=lifespan)
