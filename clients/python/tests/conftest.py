"""Fixtures: every test that can runs twice, against PG_ONCE_DSN (direct connections) and
PG_ONCE_BOUNCER_DSN (the same server through PgBouncer in transaction mode, with the
LISTEN connection direct), and a third time against PG_ONCE_TLS_DSN (a server that takes
TCP only over TLS) when that is set. Tests that need a server skip, with a message, when
the variable of their setup is not set; tests that need none (the offline vectors) always
run."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import threading
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import psycopg
import pytest

from pg_once import AsyncClient, Client

DIRECT = os.environ.get("PG_ONCE_DSN")
BOUNCER = os.environ.get("PG_ONCE_BOUNCER_DSN")
TLS = os.environ.get("PG_ONCE_TLS_DSN")
# A hot standby listed before the server itself, with target_session_attrs (read-write in
# the key/value form, primary in the URL form): docs/clients.md, N7.
STANDBY_FIRST = {"standby_first_kv": os.environ.get("PG_ONCE_STANDBY_FIRST_DSN"),
                 "standby_first_url": os.environ.get("PG_ONCE_STANDBY_FIRST_URL")}
CHILD = str(Path(__file__).with_name("child.py"))


@dataclass
class Setup:
    name: str
    dsn: str          # what the pool connects to
    listen_dsn: str   # the LISTEN connection: always direct
    admin_dsn: str    # the server itself, for looking at and poking it

    def client(self, **kw) -> Client:
        if "pool" in kw:
            return Client(listen_conninfo=self.listen_dsn, **kw)
        return Client(self.dsn, listen_conninfo=self.listen_dsn, **kw)

    def async_client(self, **kw) -> AsyncClient:
        if "pool" in kw:
            return AsyncClient(listen_conninfo=self.listen_dsn, **kw)
        return AsyncClient(self.dsn, listen_conninfo=self.listen_dsn, **kw)


def need_server() -> None:
    if not DIRECT:
        pytest.skip("set PG_ONCE_DSN (and PG_ONCE_BOUNCER_DSN) to run the tests against a server")


@pytest.fixture(scope="session")
def extension():
    need_server()
    for dsn in [DIRECT, TLS] if TLS else [DIRECT]:
        with psycopg.connect(dsn, autocommit=True) as conn:
            # The SQL edition (docs/sql-edition.md) is installed by a script, not by
            # CREATE EXTENSION, which would fail there: a schema once already present
            # (either edition's) is used as it is.
            if conn.execute("SELECT to_regnamespace('once') IS NULL").fetchone()[0]:
                conn.execute("CREATE EXTENSION pg_once")


def make_setup(name: str) -> Setup:
    need_server()
    if name == "direct":
        return Setup("direct", DIRECT, DIRECT, DIRECT)
    if name == "bouncer":
        if not BOUNCER:
            pytest.skip("PG_ONCE_BOUNCER_DSN is not set")
        return Setup("bouncer", BOUNCER, DIRECT, DIRECT)
    if name in STANDBY_FIRST:
        if not STANDBY_FIRST[name]:
            pytest.skip("PG_ONCE_STANDBY_FIRST_DSN / _URL is not set")
        return Setup(name, STANDBY_FIRST[name], STANDBY_FIRST[name], DIRECT)
    if not TLS:
        pytest.skip("PG_ONCE_TLS_DSN is not set")
    return Setup("tls", TLS, TLS, TLS)


@pytest.fixture(params=["direct", "bouncer"])
def setup(request, extension) -> Setup:
    return make_setup(request.param)


# Both flavours by default; PG_ONCE_FLAVOURS=sync runs the shared tests with Client only
# (scripts/test.sh does so against the server without pg_once preloaded, to keep CI's time:
# the preloaded server runs both).
FLAVOURS = os.environ.get("PG_ONCE_FLAVOURS", "sync async").split()


@pytest.fixture(params=FLAVOURS)
def clients(setup, request):
    """Make clients of the test's setup, all closed after the test: Clients, and then, for
    the same tests, AsyncClients behind the sync API (BlockingAsyncClient), so that both
    flavours get the same coverage."""
    made: List[Client] = []

    def make(**kw) -> Client:
        if request.param == "sync":
            c = setup.client(**kw)
        elif "pool" in kw:
            pytest.skip("a sync pool: the async flavour has its own test")
        else:
            c = BlockingAsyncClient(setup.async_client(**kw))
        made.append(c)
        return c
    yield make
    for c in made:
        c.close()


class BlockingAsyncClient:
    """An AsyncClient behind the sync Client's API, run on an event loop in a thread of its
    own; compute functions and handlers run in threads (asyncio.to_thread)."""

    def __init__(self, client: AsyncClient):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._client = client
        self._run(client.open())

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def __getattr__(self, name):   # calls, _listener, serializer, ...
        return getattr(self._client, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self, **kw) -> None:
        try:
            self._run(self._client.close(**kw))
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)

    def owner_pid(self):
        return self._run(self._client.owner_pid())

    def get_or_compute(self, key, compute, **kw):
        async def acompute():
            return await asyncio.to_thread(compute)
        return self._run(self._client.get_or_compute(key, acompute, **kw))

    def cached(self, fn=None, **kw):
        decorator = self._client.cached(**kw)   # checks the options now, as Client.cached

        def decorate(func):
            @functools.wraps(func)
            async def afunc(*args, **kwargs):
                return await asyncio.to_thread(func, *args, **kwargs)
            wrapped = decorator(afunc)

            @functools.wraps(func)
            def call(*args, **kwargs):
                return self._run(wrapped(*args, **kwargs))
            call.invalidate = lambda *a, **k: self._run(wrapped.invalidate(*a, **k))
            call.refresh = lambda *a, **k: self._run(wrapped.refresh(*a, **k))
            call.cache_key = wrapped.cache_key
            return call
        return decorate if fn is None else decorate(fn)

    def invalidate(self, key):
        return self._run(self._client.invalidate(key))

    def refresh(self, key, **kw):
        return self._run(self._client.refresh(key, **kw))

    def enqueue(self, key, payload=None, **kw):
        return self._run(self._client.enqueue(key, payload, **kw))

    def enqueue_many(self, jobs, **kw):
        return self._run(self._client.enqueue_many(jobs, **kw))

    def worker(self, queue, handler, **kw):
        async def ahandler(job):
            return await asyncio.to_thread(handler, job)
        return _BlockingWorker(self, self._client.worker(queue, ahandler, **kw))

    def work(self, queue, handler, **kw):
        return self.worker(queue, handler, **kw).run()


class _BlockingWorker:
    def __init__(self, client: BlockingAsyncClient, worker):
        self._client, self._worker = client, worker

    def __getattr__(self, name):   # completed, failed, released, ...
        return getattr(self._worker, name)

    def run(self):
        return self._client._run(self._worker.run())

    def stop(self, now: bool = False):
        self._client._loop.call_soon_threadsafe(self._worker.stop, now)


@pytest.fixture
def key(request) -> str:
    """A key no other test (or earlier run) uses."""
    return f"py-test/{request.node.name}/{uuid.uuid4().hex[:8]}"


@pytest.fixture
def admin(extension):
    """A direct autocommit connection for looking at and poking the server."""
    with psycopg.connect(DIRECT, autocommit=True) as conn:
        yield conn


def state(admin, key: str) -> Optional[str]:
    row = admin.execute("SELECT state FROM once.entries WHERE key_hash = once.key_hash(%s)",
                        (key,)).fetchone()
    return row and row[0]


class Child:
    """A client in another OS process (tests/child.py), speaking JSON lines on stdout."""

    def __init__(self, mode: str, setup: Setup, **args):
        args.update(dsn=setup.dsn, listen_dsn=setup.listen_dsn)
        self.proc = subprocess.Popen([sys.executable, CHILD, mode, json.dumps(args)],
                                     stdout=subprocess.PIPE, text=True)

    def line(self) -> dict:
        text = self.proc.stdout.readline()
        if not text:
            raise AssertionError(f"child exited (code {self.proc.wait()}) without reporting")
        return json.loads(text)

    def finish(self, timeout: float = 30) -> dict:
        out, _ = self.proc.communicate(timeout=timeout)
        assert self.proc.returncode == 0, f"child exited with {self.proc.returncode}"
        return json.loads(out.strip().splitlines()[-1])
