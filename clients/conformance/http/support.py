"""What the scenarios use besides HTTP: the database's view of a request (its handler runs,
its orders, its pg_once entry), and a client that spreads requests over the instances."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import itertools
import json
import time
import uuid

import httpx
import psycopg

from services import SECRET, Running

TABLES = """
CREATE SCHEMA IF NOT EXISTS idem_demo;
CREATE TABLE IF NOT EXISTS idem_demo.started (id bigserial PRIMARY KEY, idempotency_key text, pid int,
                                              at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE TABLE IF NOT EXISTS idem_demo.orders (id bigserial PRIMARY KEY, idempotency_key text, sku jsonb,
                                             pid int, at timestamptz NOT NULL DEFAULT clock_timestamp());
"""


def create_schema(conn: psycopg.Connection):
    """Schema idem_demo with the tables of README.md, if missing (autocommit connection)."""
    conn.execute(TABLES)


def fresh_key() -> str:
    return str(uuid.uuid4())


def entry_key(key: str, scope: str | None = None) -> str:
    """pg_once's key of a request's entry (docs/clients.md, I2) for a key without namespace,
    keyed with the run's secret; `scope` is the Authorization header as received (one
    character per byte), or None. (json.dumps is rule K2's ENCODE for these ASCII keys.)"""
    encoded = json.dumps(["idempotency-key", scope, key], separators=(",", ":"), ensure_ascii=False)
    digest = hmac.new(SECRET.encode(), encoded.encode("utf-8"), hashlib.sha256).hexdigest()
    return f"idempotency:#hmac-sha256:{digest}"


class Db:
    def __init__(self, conn: psycopg.Connection):
        self.conn = conn

    def value(self, sql, *params):
        row = self.conn.execute(sql, params).fetchone()
        return row[0] if row else None

    def started(self, key: str) -> list[int]:
        """The pids of the handler runs of key, in order."""
        return [r[0] for r in self.conn.execute(
            "SELECT pid FROM idem_demo.started WHERE idempotency_key = %s ORDER BY id", (key,))]

    def orders(self, key: str) -> list[tuple[int, int]]:
        """(id, pid) of key's orders."""
        return self.conn.execute(
            "SELECT id, pid FROM idem_demo.orders WHERE idempotency_key = %s ORDER BY id", (key,)).fetchall()

    def orders_of_sku(self, sku: str) -> int:
        return self.value("SELECT count(*) FROM idem_demo.orders WHERE sku = to_jsonb(%s::text)", sku)

    def started_total(self) -> int:
        return self.value("SELECT count(*) FROM idem_demo.started")

    def owner_pid(self, key: str) -> int | None:
        return self.value("SELECT owner_pid FROM once.entries WHERE key = %s", entry_key(key))

    def has_entry(self, key: str) -> bool:
        return self.value("SELECT count(*) FROM once.entries WHERE key = %s", entry_key(key)) > 0

    def terminate(self, pid: int, timeout: float = 5):
        """Ends server backend pid and waits until it is gone."""
        self.conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
        deadline = time.monotonic() + timeout
        while self.value("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", pid):
            if time.monotonic() > deadline:
                raise AssertionError(f"backend {pid} still there {timeout} s after pg_terminate_backend")
            time.sleep(0.01)


class Api:
    """Requests to the service, spread over its instances unless one is named."""

    def __init__(self, http: httpx.AsyncClient, running: Running, db: Db):
        self.http, self.running, self.db = http, running, db
        self.turn = itertools.count()

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, running: Running, db: Db):
        """An Api on running's instances, restarting first any that a scenario killed."""
        running.revive()
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=200)) as http:
            yield cls(http, running, db)

    def url(self, instance: int | None) -> str:
        urls = self.running.urls
        return urls[next(self.turn) % len(urls) if instance is None else instance]

    async def post(self, path: str, body: dict | bytes, key: str | None = None, *, instance: int | None = None,
                   headers: dict | None = None, timeout: float = 60) -> httpx.Response:
        return await self.http.post(self.url(instance) + path, content=encode(body),
                                    headers=request_headers(key, headers), timeout=timeout)

    def stream(self, path: str, body: dict, key: str | None = None, *, instance: int | None = None):
        return self.http.stream("POST", self.url(instance) + path, content=encode(body),
                                headers=request_headers(key, None))

    async def get(self, path: str, key: str | None = None) -> httpx.Response:
        return await self.http.get(self.url(None) + path, headers=request_headers(key, None))


def encode(body: dict | bytes) -> bytes:
    """The request body's bytes, the same for every repetition (the fingerprint covers them)."""
    return body if isinstance(body, bytes) else json.dumps(body).encode()


def request_headers(key, extra) -> dict:
    headers = {"content-type": "application/json", **(extra or {})}
    if key is not None:
        headers["idempotency-key"] = key
    return headers
