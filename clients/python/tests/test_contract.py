"""The Python side of docs/clients.md beyond the conformance files: the cached decorator,
serializers, outcomes, retries, heartbeats, cancellation, pooler detection, TLS and
configuration. Tests that need no server run always."""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import threading
import time
from contextlib import contextmanager

import psycopg
import pytest

from pg_once import AsyncClient, Client, NotSerializable
from pg_once import _common as C
from pg_once._sync import _compat
from pg_once._sync import client as sync_client
from conftest import DIRECT, make_setup

SESSION_BOUNCER = os.environ.get("PG_ONCE_SESSION_BOUNCER_DSN")


class Tagged:
    """A serializer that keeps tuples and datetimes: what a caller's serializer= looks like."""

    def dumps(self, value):
        def enc(v):
            if isinstance(v, tuple):
                return {"$tuple": [enc(i) for i in v]}
            if isinstance(v, datetime.datetime):
                return {"$datetime": v.isoformat()}
            return v
        return json.dumps(enc(value))

    def loads(self, text):
        def dec(v):
            if isinstance(v, dict) and "$tuple" in v:
                return tuple(dec(i) for i in v["$tuple"])
            if isinstance(v, dict) and "$datetime" in v:
                return datetime.datetime.fromisoformat(v["$datetime"])
            return v
        return dec(json.loads(text))


# -- no server needed ------------------------------------------------------------------------

def test_cached_refuses_names_that_differ_between_processes():
    client = Client.__new__(Client)   # the decorator needs no connection until called
    client.serializer = C.JSON
    with pytest.raises(TypeError, match="name="):
        Client.cached(client)(lambda x: x)

    def inner(x):
        return x
    with pytest.raises(TypeError, match="name="):
        Client.cached(client)(inner)
    Client.cached(client, name="inner")(inner)   # a name of the caller's is fine
    with pytest.raises(TypeError, match="not both"):
        Client.cached(client, name="a", key=lambda x: "b")(inner)
    with pytest.raises(ValueError, match="ttl"):
        Client.cached(client, ttl=-1)


@pytest.mark.parametrize("flavor", ["sync", "async"])
def test_a_heartbeat_that_failed_is_retried_within_a_second(flavor):
    """H2: a failed heartbeat is tried again within 1 s (lease/6 when shorter), not after
    lease/3: with a lease of 3 s, the first at 1 s, the retry 0.5 s later."""
    calls = []

    def heartbeat(key, token, lease):
        calls.append(time.monotonic())
        if len(calls) == 1:
            raise psycopg.OperationalError("a blip")
        return datetime.datetime.now()

    if flavor == "sync":
        from pg_once._sync import _compat as A
        client = Client(pool=FakePool([]), listen=False)
        client._heartbeat = heartbeat
        task = A.spawn_after(1.0, client._beat, "k", 1, 3.0, A.Event(), name="test")
        time.sleep(2.2)
        task.cancel()
    else:
        async def main():
            client = AsyncClient("")   # opens nothing until used

            async def aheartbeat(*args):
                return heartbeat(*args)
            client._heartbeat = aheartbeat
            from pg_once._async import _compat as AA
            task = AA.spawn_after(1.0, client._beat, "k", 1, 3.0, asyncio.Event(), name="test")
            await asyncio.sleep(2.2)
            task.cancel()
        asyncio.run(main())
    assert len(calls) >= 2 and calls[1] - calls[0] <= 0.6, calls


class FakeConnection:
    """A pooled connection whose statements fail as told: for the retry rules."""

    def __init__(self, failures):
        self.failures, self.autocommit, self.broken = failures, True, False
        self.info = type("Info", (), {"transaction_status": psycopg.pq.TransactionStatus.IDLE})()

    def execute(self, sql, params, prepare=None):
        exc = self.failures.pop(0)
        if exc is None:
            return type("Cursor", (), {"fetchone": lambda self: (True,)})()
        self.broken = isinstance(exc, psycopg.OperationalError) and exc.sqlstate is None
        raise exc

    def close(self):
        pass


class FakePool:
    conninfo = ""

    def __init__(self, failures):
        self.failures, self.lent = failures, 0

    @contextmanager
    def connection(self, timeout=None):
        self.lent += 1
        yield FakeConnection(self.failures)

    def close(self):
        pass


def test_only_lost_connections_are_retried():
    """R1: a statement timeout (57014) is the server's answer: one attempt; a connection
    lost (no SQLSTATE, broken) is sent again on another connection."""
    pool = FakePool([psycopg.errors.QueryCanceled("canceling statement due to statement timeout")])
    client = Client(pool=pool, listen=False)
    with pytest.raises(psycopg.errors.QueryCanceled):
        client._release("k", 1)
    assert pool.lent == 1
    pool = FakePool([psycopg.OperationalError("server closed the connection unexpectedly"), None])
    client = Client(pool=pool, listen=False)
    assert client._release("k", 1) is True and pool.lent == 2
    pool = FakePool([psycopg.errors.AdminShutdown("terminating connection")] * 100)
    client = Client(pool=pool, listen=False, connect_timeout=0.3)
    with pytest.raises(psycopg.errors.AdminShutdown):
        client._release("k", 1)
    assert 3 <= pool.lent < 100


class FakeClock:
    """time.monotonic for the client module, moved on only by the pauses it sleeps."""

    def __init__(self):
        self.now, self.pauses = 1000.0, []

    def monotonic(self):
        return self.now

    def sleep(self, pause):
        self.pauses.append(pause)
        self.now += pause


def test_retries_pause_only_between_attempts(monkeypatch):
    """R2: the first attempt and the second go at once (a sleep(0) before every call would
    hand the GIL to another thread each time), then 50 ms doubling to 1 s, for as long as
    the budget lasts: connect_timeout (here 5 s) without a wait, not 4 attempts (a failover
    takes seconds), and never past it."""
    clock = FakeClock()
    monkeypatch.setattr(_compat, "sleep", clock.sleep)
    monkeypatch.setattr(sync_client, "time", clock)
    pool = FakePool([None])
    assert Client(pool=pool, listen=False)._release("k", 1) is True
    assert clock.pauses == []
    pool = FakePool([psycopg.errors.AdminShutdown("terminating connection")] * 100)
    with pytest.raises(psycopg.errors.AdminShutdown):
        Client(pool=pool, listen=False, connect_timeout=5)._release("k", 1)
    pauses = clock.pauses
    assert pauses[0] == 0 and 0 < pauses[1] < pauses[2] < pauses[3]
    assert max(pauses) <= 1.2 and len(pauses) > 6, pauses     # 1 s ± 20 %, many attempts
    assert 3.5 <= sum(pauses) < 5, pauses                      # the budget, not past it


# -- against a server ---------------------------------------------------------------------------

def test_cached_with_and_without_parentheses(clients, key):
    client = clients()
    runs = []

    @client.cached(name=f"{key}/report")   # a local function needs name=
    def report(n, region="eu"):
        runs.append(n)
        return {"n": n, "region": region}

    def named(n):
        runs.append(-n)
        return n

    assert report(1) == report(1, "eu") == report(n=1, region="eu") == {"n": 1, "region": "eu"}
    assert runs == [1]
    named.__module__, named.__qualname__ = "reports", "named"
    named = client.cached(named)   # without parentheses
    assert named(2) == 2 and named.cache_key(2) == "reports.named:[2]"
    assert named.invalidate(2) is True
    assert named(2) == 2 and runs == [1, -2, -2]
    assert report.cache_key(1) == f'{key}/report:[1,"eu"]'
    assert named.refresh(2) == "expired"


def test_module_level_functions_get_their_qualified_name(clients):
    client = clients()
    wrapped = client.cached(report_for_key_test)
    assert wrapped.cache_key(7, "eu") == 'test_contract.report_for_key_test:[7,"eu"]'


def report_for_key_test(n, region):
    return [n, region]


def test_a_serializer_round_trips_what_json_cannot_and_the_computer_gets_what_others_read(clients, key):
    """V1, V2: with serializer= the computing caller and a reader in another client get
    the same tuple and datetime; without it the same result is refused (V3)."""
    a, b = clients(serializer=Tagged()), clients()
    when = datetime.datetime(2026, 12, 2, 10, 0, tzinfo=datetime.timezone.utc)
    mine = a.get_or_compute(key, lambda: (1, when))
    theirs = b.get_or_compute(key, lambda: "never", serializer=Tagged())
    assert mine == theirs == (1, when) and type(mine) is tuple
    with pytest.raises(NotSerializable, match="tuple"):
        b.get_or_compute(key + "/plain", lambda: (1, 2), retry_after=0)


def test_a_failing_fail_key_never_replaces_the_callers_error(clients, key):
    """F4: the compute's own error reaches the caller even when recording it fails."""
    client = clients()

    def broken_fail(*args):
        raise psycopg.OperationalError("fail_key could not be sent")
    client._fail = broken_fail

    def compute():
        raise KeyError("the caller's own")
    with pytest.raises(KeyError, match="the caller's own"):
        client.get_or_compute(key, compute, lease=1)


def test_enqueue_many_answers_each_key_in_order(clients, key, admin):
    client = clients()
    queue = "py-batch-" + key.rsplit("/", 1)[-1]
    admin.execute("SELECT once.create_queue(%s)", (queue,))
    old, a, b = f"{key}/old", f"{key}/a", f"{key}/b"
    assert client.enqueue(old, queue=queue) == "queued"
    answered = client.enqueue_many({a: None, old: {"n": 1}, b: {"n": 2}}, queue=queue, priority=3)
    assert list(answered.items()) == [(a, "queued"), (old, "duplicate"), (b, "queued")]
    rows = admin.execute("SELECT key, payload, priority FROM once.entries WHERE key IN (%s, %s)"
                         " ORDER BY key", (a, b)).fetchall()
    assert rows == [(a, None, 3), (b, {"n": 2}, 3)]
    assert client.enqueue_many([f"{key}/c", a], queue=queue) == {f"{key}/c": "queued", a: "duplicate"}
    assert client.enqueue_many({}, queue=queue) == {}
    # A repeated key is refused by the server (22023), the whole batch with it.
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="are both"):
        client.enqueue_many([f"{key}/d", f"{key}/d"], queue=queue)
    assert admin.execute("SELECT count(*) FROM once.entries WHERE key = %s",
                         (f"{key}/d",)).fetchone() == (0,)
    with pytest.raises(TypeError):
        client.enqueue_many("one key", queue=queue)
    admin.execute("SELECT once.invalidate_keys(queue => %s)", (queue,))


def test_enqueue_reaches_a_worker_with_its_payload(clients, key, admin):
    client = clients()
    queue = "py-contract-" + key.rsplit("/", 1)[-1]
    admin.execute("SELECT once.create_queue(%s)", (queue,))
    assert client.enqueue(key, {"n": 3}, queue=queue) == "queued"
    seen = []
    worker = client.worker(queue, lambda job: seen.append(job.payload) or job.payload["n"] * 2,
                           signals=False, idle_wait=0.2)
    t = threading.Thread(target=worker.run)
    t.start()
    deadline = time.monotonic() + 10
    while not seen and time.monotonic() < deadline:
        time.sleep(0.05)
    worker.stop()
    t.join(10)
    assert seen == [{"n": 3}]


def test_a_listen_connection_through_a_session_pooler_is_kept(extension, key):
    if not SESSION_BOUNCER:
        pytest.skip("PG_ONCE_SESSION_BOUNCER_DSN (PgBouncer in session mode) is not set")
    with Client(DIRECT, listen_conninfo=SESSION_BOUNCER) as client:
        assert client._listener.behind_proxy
        assert client.get_or_compute(key, lambda: 5) == 5


def test_the_connection_comes_from_the_environment(extension, key, monkeypatch):
    """N1: no conninfo at all: libpq's PG* variables."""
    info = psycopg.conninfo.conninfo_to_dict(DIRECT)
    for name, var in (("host", "PGHOST"), ("port", "PGPORT"), ("user", "PGUSER"),
                      ("dbname", "PGDATABASE")):
        if name in info:
            monkeypatch.setenv(var, str(info[name]))
    with Client() as client:
        assert client.get_or_compute(key, lambda: "env") == "env"
        assert client.owner_pid() > 0


def test_tls_is_used_by_the_pool_and_the_listen_connection(key):
    """N3: with sslmode/sslrootcert in the connection string, both the pooled connections
    and the LISTEN connection are encrypted (the server takes TCP only over TLS)."""
    setup = make_setup("tls")
    with Client(setup.dsn) as client:
        assert client.get_or_compute(key, lambda: "secret") == "secret"
        with client.pool.connection() as conn:
            assert conn.pgconn.ssl_in_use
        assert client._listener._conn.pgconn.ssl_in_use
        listen_pid = client.owner_pid()
        with psycopg.connect(setup.dsn) as admin:
            rows = admin.execute("SELECT pid, ssl FROM pg_stat_ssl WHERE pid = %s",
                                 (listen_pid,)).fetchall()
        assert rows == [(listen_pid, True)]
    plain = psycopg.conninfo.make_conninfo(setup.dsn, sslmode="disable")
    with pytest.raises(psycopg.OperationalError):
        Client(plain)


def test_spans_link_a_coalesced_call_to_the_computing_one(clients, key):
    """O2: one span per call, outcome recorded; the coalesced call links to the leader's."""
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    from pg_once import _tracing
    tracer = provider.get_tracer("test")
    real = _tracing.trace.get_tracer
    _tracing.trace.get_tracer = lambda *a, **kw: tracer
    try:
        client = clients()

        def slow():
            time.sleep(0.4)
            return 1
        t = threading.Thread(target=lambda: client.get_or_compute(key, slow))
        t.start()
        time.sleep(0.15)
        assert client.get_or_compute(key, slow) == 1
        t.join(5)
    finally:
        _tracing.trace.get_tracer = real
    spans = {s.attributes["pg_once.outcome"]: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"claimed", "coalesced"}
    assert all(s.name == "pg_once.get_or_compute" and s.attributes["pg_once.key"] == key
               for s in spans.values())
    assert [link.context.span_id for link in spans["coalesced"].links] == \
        [spans["claimed"].context.span_id]


def test_a_task_spawned_for_later_and_cancelled_before_costs_no_thread():
    """A claim's heartbeat starts lease/3 after it (H1); the threads flavour starts its
    thread only then, so a claim that ends sooner (most requests' do) costs none."""
    ran = []
    before = threading.active_count()
    early = [_compat.spawn_after(0.2, ran.append, n, name="test") for n in range(50)]
    late = _compat.spawn_after(0.3, ran.append, "late", name="test")
    assert threading.active_count() <= before + 1   # the one thread that starts them, at most
    for task in early:
        task.cancel()
    time.sleep(0.6)
    assert ran == ["late"] and late.done()
    assert all(task.done() for task in early)
