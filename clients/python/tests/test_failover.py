"""Failover (docs/clients.md, N7, R2, L4): a client given both servers of a primary and its
hot standby (PG_ONCE_FAILOVER_DSN, the key/value form; PG_ONCE_FAILOVER_URL, a URL) goes on
when the primary dies and the standby is promoted: a computation in flight is stored on the
new primary if its claim survived there (a lease-only claim, replicated before the crash)
and otherwise reported as ClaimLost, never stored twice; the LISTEN connection and the pool
move to the new primary. scripts/failover.sh (PG_ONCE_FAILOVER) kills and promotes;
scripts/test.sh step 6 starts the pair."""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
import time
import uuid

import psycopg
import pytest

from pg_once import AsyncClient, ClaimLost, Client

from conftest import BlockingAsyncClient

FAILOVER = os.environ.get("PG_ONCE_FAILOVER")
WHERE = {"sync": os.environ.get("PG_ONCE_FAILOVER_DSN"),
         "async": os.environ.get("PG_ONCE_FAILOVER_URL")}
OUTAGE = 2.0   # seconds without a primary
BOUND = 60.0   # seconds: what a loaded 2-core machine may take to replicate, kill, promote


def failover(command: str) -> None:
    subprocess.run([FAILOVER, command], check=True, timeout=BOUND)


def with_target(dsn: str, target: str) -> str:
    """The same servers, asking for another kind (psycopg reads both forms)."""
    if dsn.startswith("postgres"):
        return dsn.replace("target_session_attrs=read-write", f"target_session_attrs={target}")
    return dsn.replace("target_session_attrs=read-write", "") + f" target_session_attrs={target}"


def until(condition, what: str) -> None:
    deadline = time.monotonic() + BOUND
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.05)


def warm(client, n: int) -> None:
    """Have `n` connections in the client's pool, idle: after the failover each of them is
    a connection to the dead server, which psycopg finds out only by using it."""
    pool = client.pool
    if isinstance(client, BlockingAsyncClient):
        async def hold():
            async with contextlib.AsyncExitStack() as stack:
                for _ in range(n):
                    await stack.enter_async_context(pool.connection())
        client._run(hold())
    else:
        with contextlib.ExitStack() as stack:
            for _ in range(n):
                stack.enter_context(pool.connection())


def one(dsn: str, sql: str, params=()):
    with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as conn:
        return conn.execute(sql, params).fetchone()


@pytest.mark.serial    # both flavours kill and promote the one pair
@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_client_follows_a_failover(flavour):
    dsn = WHERE[flavour]
    if not (FAILOVER and dsn):
        pytest.skip("PG_ONCE_FAILOVER and PG_ONCE_FAILOVER_DSN / _URL are not set (scripts/test.sh step 6)")
    failover("ready")
    make = Client if flavour == "sync" else (lambda d, **kw: BlockingAsyncClient(AsyncClient(d, **kw)))
    owned = make(dsn)                   # claims owned by its LISTEN connection's backend
    leased = make(dsn, listen=False)    # lease-only claims: they survive a promotion
    prefix = f"py-failover/{flavour}/{uuid.uuid4().hex[:8]}"
    k_owned, k_leased, k_after = f"{prefix}/owned", f"{prefix}/leased", f"{prefix}/after"
    for client in (owned, leased):
        warm(client, 6)
    gate = threading.Event()
    results = {}

    def call(client, key, value):
        def compute():
            assert gate.wait(BOUND)
            return value
        try:
            results[key] = ("value", client.get_or_compute(key, compute, lease=60, wait=BOUND))
        except BaseException as exc:   # noqa: BLE001 - the test reports what came out
            results[key] = ("error", exc)

    threads = [threading.Thread(target=call, args=(owned, k_owned, "owned")),
               threading.Thread(target=call, args=(leased, k_leased, "leased"))]
    try:
        for t in threads:
            t.start()
        # Both claims replicated to the standby before the primary dies.
        standby = with_target(dsn, "standby")
        until(lambda: one(standby, "SELECT count(*) FROM once.entries WHERE key IN (%s, %s)"
                          " AND state = 'running'", (k_owned, k_leased))[0] == 2,
              "both claims replayed on the standby")
        old_pid = owned.owner_pid()
        failover("kill")
        gate.set()          # the computations end while no server takes writes
        # The outage lasts as a failover manager's would, seconds: longer than the half
        # second of retries R2 allowed before 0.3.0. What is tested is the client across
        # it, not how fast the machine promotes.
        time.sleep(OUTAGE)
        failover("promote")
        for t in threads:
            t.join(BOUND)
        # L4: the lease-only claim survived on the new primary: its completion, retried
        # across the promotion (R2), is stored there, once.
        assert results[k_leased] == ("value", "leased"), results[k_leased]
        primary = dsn
        assert one(primary, "SELECT state::text, result #>> '{}' FROM once.entries WHERE key = %s",
                   (k_leased,)) == ("done", "leased")
        # The owned claim named a backend of the old primary: stored if the completion came
        # before the new primary's reaper, else ClaimLost; never a connection error, never
        # reported stored when it is not.
        kind, got = results[k_owned]
        row = one(primary, "SELECT state::text, result #>> '{}' FROM once.entries WHERE key = %s",
                  (k_owned,))
        if kind == "value":
            assert got == "owned" and row == ("done", "owned"), (got, row)
        else:
            assert isinstance(got, ClaimLost), repr(got)
            assert row != ("done", "owned"), row
        # N4, N7: the LISTEN connection is on the new primary, with a new owner pid, and
        # the pool's calls go there too.
        assert owned.get_or_compute(k_after, lambda: "after", wait=BOUND) == "after"
        new_pid = owned.owner_pid()
        assert new_pid != old_pid
        assert one(primary, "SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (new_pid,)) == (1,)
    finally:
        gate.set()
        for t in threads:
            t.join(BOUND)
        owned.close()
        leased.close()
