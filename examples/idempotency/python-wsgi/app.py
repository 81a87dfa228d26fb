"""An idempotent order endpoint with Flask and pg_once.wsgi (served by gunicorn).

    PG_ONCE_DSN=postgresql://app@db/app IDEMPOTENCY_SECRET=$(openssl rand -hex 32) \
        gunicorn app:app -w 2 --threads 16 -b 127.0.0.1:8000

The routes and the handler are those of clients/conformance/http/README.md: POST /orders
(a retry with the same Idempotency-Key gets the stored response), /wait/orders (a
duplicate waits for the first one's response), /strict/orders (the header is required),
/bare/orders (no middleware) and GET /health."""

import json
import os
import time

from flask import Flask, Response, request
from psycopg.types.json import Jsonb
from psycopg_pool import ConnectionPool

from pg_once import Client
from pg_once.wsgi import IdempotencyMiddleware

DSN = os.environ["PG_ONCE_DSN"]
# Keys the entries and authenticates the stored responses (docs/clients.md, I2): the same
# in every process of the service, kept like any other secret of the application.
SECRET = os.environ["IDEMPOTENCY_SECRET"]
PID = os.getpid()

flask_app = Flask(__name__)
# Let a handler's exception reach the middleware, which answers a problem+json 500 (and
# gives the claim back either way).
flask_app.config["PROPAGATE_EXCEPTIONS"] = True
# Made as the module is imported, by each gunicorn worker (without --preload, the default:
# connections and threads do not survive a fork).
once = Client(DSN)                                  # one per process: claims, LISTEN
db = ConnectionPool(DSN, open=True, max_size=20)    # the handler's own connections


@flask_app.post("/orders")
@flask_app.post("/wait/orders")
@flask_app.post("/strict/orders")
@flask_app.post("/bare/orders")
def create_order():
    order = request.get_json(force=True, silent=True) or {}
    key = request.headers.get("Idempotency-Key")
    with db.connection() as conn:                   # committed at once
        conn.execute("INSERT INTO idem_demo.started (idempotency_key, pid) VALUES (%s, %s)",
                     (key, PID))
    time.sleep(order.get("sleep_ms", 0) / 1000)
    if order.get("raise"):
        raise RuntimeError("asked to raise")
    status = order.get("status", 201)
    if status >= 500:
        return {"error": "asked"}, status
    if order.get("chunks", 0) > 0:
        with db.connection() as conn:
            insert_order(conn, key, order)
        return Response(chunks(order["chunks"], order.get("size", 0)), status=201,
                        content_type="text/plain")

    claim = request.environ.get("pg_once.claim")    # None on /bare/orders
    with db.connection() as conn:
        with conn.transaction():                    # the order and its response, together
            order_id = insert_order(conn, key, order)
            headers = {"content-type": "application/json", "location": f"/orders/{order_id}",
                       "set-cookie": "visited=1", "x-handler-pid": str(PID)}
            body = json.dumps({"order_id": order_id, "sku": order.get("sku"), "pid": PID,
                               "padding": "x" * order.get("size", 0)}).encode()
            if claim is not None:
                claim.complete(conn, status, headers, body)   # ClaimLost rolls back
    return Response(body, status=status, headers=headers)


def insert_order(conn, key, order) -> int:
    return conn.execute(
        "INSERT INTO idem_demo.orders (idempotency_key, sku, pid) VALUES (%s, %s, %s) RETURNING id",
        (key, Jsonb(order.get("sku")), PID)).fetchone()[0]


def chunks(count: int, size: int):
    for _ in range(count):
        yield b"x" * size
        time.sleep(0.01)


@flask_app.get("/health")
def health():
    return {"ok": True, "pid": PID}


def idempotent(**options) -> IdempotencyMiddleware:
    return IdempotencyMiddleware(flask_app.wsgi_app, client=once, secret=SECRET, ttl=3600,
                                 max_body=1 << 20, **options)


# Each route's middleware; any other path goes to Flask as it is.
ROUTES = {"/orders": idempotent(), "/wait/orders": idempotent(in_flight="wait", wait=10),
          "/strict/orders": idempotent(required=True)}


def app(environ, start_response):
    return ROUTES.get(environ.get("PATH_INFO"), flask_app.wsgi_app)(environ, start_response)
