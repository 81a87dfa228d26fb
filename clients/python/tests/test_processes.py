"""Several OS processes: one computation per key across all of them, and liveness: a
killed owner process is taken over within about a second, while an owner whose pooled
server connections are closed under it keeps its claim."""

import os
import signal
import threading
import time

import psycopg
import pytest
from psycopg_pool import ConnectionPool

from conftest import Child
from pg_once._common import RECHECK_SECONDS


def test_many_processes_one_computation_per_key(setup, key):
    keys = [f"{key}/{i}" for i in range(2)]
    children = [Child("callers", setup, keys=keys, threads=10, compute_seconds=1.0)
                for _ in range(4)]
    reports = [c.finish(timeout=40) for c in children]
    assert sum(r["computed"] for r in reports) == len(keys)
    answers = [a for r in reports for a in r["answers"]]
    assert len(answers) == 40                                   # every caller answered
    for a in answers:
        assert a["value"]["key"] == a["key"]
    # One computing process per key: every caller of a key got that process's value.
    for k in keys:
        assert len({a["value"]["pid"] for a in answers if a["key"] == k}) == 1
    # Coalescing: the 10 callers of a key in a process make one claim_key at a time: a
    # first look, a look when woken by the key's completion, one more per recheck while
    # they wait (at most one every RECHECK_SECONDS less its 20% jitter), and one for a wake
    # of every waiter (C3: the LISTEN connection reconnecting, or another transaction's
    # announcement of many keys at once), which a loaded run of the suite against the SQL
    # edition met: 8 looks for two keys waited 1.09 s each, where the bound had allowed 6.
    # How long they wait is the machine's to say (on a loaded one, the computing process
    # may start seconds later), so the bound counts it; without coalescing each caller
    # would look on its own, 10 per key at least.
    shortest_recheck = 0.8 * RECHECK_SECONDS
    for r in reports:
        waited = {k: max(a["seconds"] for a in r["answers"] if a["key"] == k) for k in keys}
        looks = sum(3 + int(w / shortest_recheck) for w in waited.values())
        assert r["claim_key"] <= looks, (r["claim_key"], waited)


def test_killed_owner_process_is_taken_over_within_seconds(setup, clients, key):
    owner = Child("owner", setup, key=key, lease=30)
    assert owner.line()["computing"]
    client = clients()
    t_kill = []

    def kill():
        time.sleep(0.3)
        t_kill.append(time.monotonic())
        os.kill(owner.proc.pid, signal.SIGKILL)
    threading.Thread(target=kill).start()
    value = client.get_or_compute(key, lambda: "taken over", lease=30)
    took = time.monotonic() - t_kill[0]
    owner.proc.wait()
    assert value == "taken over"
    assert took < 2.5, f"takeover took {took:.2f} s (the lease is 30 s)"


POOL_TAG = "pg_once-test-pool"


def _pool_backends(setup):
    """The server backends behind the test's pool: its own connections (direct), or
    PgBouncer's server connections (through PgBouncer)."""
    if setup.name == "bouncer":
        console_dsn = psycopg.conninfo.make_conninfo(setup.dsn, dbname="pgbouncer")
        with psycopg.connect(console_dsn, autocommit=True, cursor_factory=psycopg.ClientCursor) as c:
            cur = c.execute("SHOW SERVERS")
            col = [d.name for d in cur.description].index("remote_pid")
            return [row[col] for row in cur.fetchall()]
    with psycopg.connect(setup.listen_dsn, autocommit=True) as c:
        return [pid for (pid,) in c.execute(
            "SELECT pid FROM pg_stat_activity WHERE application_name = %s", (POOL_TAG,))]


def _terminate_pool_backends(setup, admin):
    pids = _pool_backends(setup)
    admin.execute("SELECT pg_terminate_backend(pid) FROM unnest(%s::int[]) pid", (pids,))
    return len(pids)


@pytest.mark.serial    # terminates every test pool's server connections, not only its own
def test_owner_whose_pooled_connections_are_closed_keeps_its_claim(setup, clients, key, admin):
    pool = ConnectionPool(setup.dsn, min_size=2, max_size=2, open=True, timeout=5,
                          kwargs={"autocommit": True, "prepare_threshold": None,
                                  "application_name": POOL_TAG})
    try:
        owner = clients(pool=pool)
        waiter = clients()
        computed, killed = [], []
        started = threading.Event()

        def compute():
            computed.append(1)
            started.set()
            time.sleep(0.6)
            killed.append(_terminate_pool_backends(setup, admin))   # mid-compute, twice
            time.sleep(0.6)
            killed.append(_terminate_pool_backends(setup, admin))
            time.sleep(0.6)
            return "kept"

        got = {}
        t = threading.Thread(target=lambda: got.setdefault("owner", owner.get_or_compute(
            key, compute, lease=1.2)))
        t.start()
        started.wait(5)
        assert waiter.get_or_compute(key, lambda: computed.append(2) or "stolen", lease=1.2) == "kept"
        t.join()
        assert killed[0] >= 1
        # complete_key returned true (ClaimLost otherwise), and nobody else computed.
        assert got["owner"] == "kept"
        assert computed == [1]
        assert owner.calls["complete_key"] == 1
    finally:
        pool.close()


@pytest.mark.serial    # RECONNECT recycles every client's server connections
def test_owner_keeps_its_claim_across_pgbouncer_reconnect(setup, clients, key):
    if setup.name != "bouncer":
        pytest.skip("PgBouncer's admin console")
    admin_dsn = psycopg.conninfo.make_conninfo(setup.dsn, dbname="pgbouncer")
    with psycopg.connect(admin_dsn, autocommit=True, cursor_factory=psycopg.ClientCursor) as console:
        def server_pids():
            cur = console.execute("SHOW SERVERS")
            col = [d.name for d in cur.description].index("remote_pid")
            return {row[col] for row in cur.fetchall()}

        owner, waiter = clients(), clients()
        computed, before = [], []
        started = threading.Event()

        def compute():
            computed.append(1)
            started.set()
            before.extend(server_pids())
            for _ in range(3):                 # recycle every server connection, 3 times
                time.sleep(0.5)
                console.execute("RECONNECT")
            time.sleep(0.5)
            return "kept"

        got = {}
        t = threading.Thread(target=lambda: got.setdefault("owner", owner.get_or_compute(
            key, compute, lease=1.2)))
        t.start()
        started.wait(5)
        assert waiter.get_or_compute(key, lambda: computed.append(2) or "stolen", lease=1.2) == "kept"
        t.join()
        assert got["owner"] == "kept" and computed == [1]
        assert owner.calls["complete_key"] == 1 and owner.calls["heartbeat_key"] >= 3
        assert set(before) - server_pids(), "RECONNECT recycled no server connection"
