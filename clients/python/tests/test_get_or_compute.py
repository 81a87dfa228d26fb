"""get_or_compute and cached in one process: one computation, coalescing, errors."""

import os
import threading
import time
from datetime import timedelta

import pytest
from psycopg_pool import ConnectionPool

from pg_once import ConfigurationError, NotSerializable, OnceFailed, OnceTimeout
from conftest import BlockingAsyncClient, state


def run_threads(n, target):
    results, errors = [None] * n, [None] * n
    barrier = threading.Barrier(n)

    def run(i):
        barrier.wait()
        try:
            results[i] = target(i)
        except BaseException as exc:
            errors[i] = exc
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results, errors


def test_many_threads_one_computation_per_key_and_one_claim_per_key(clients, key):
    client = clients()
    keys = [f"{key}/{i}" for i in range(3)]
    computed, lock = [], threading.Lock()

    def compute(k):
        with lock:
            computed.append(k)
        time.sleep(0.3)
        return {"k": k}

    results, errors = run_threads(30, lambda i: client.get_or_compute(
        keys[i % 3], lambda: compute(keys[i % 3]), ttl=60))
    assert errors == [None] * 30
    assert sorted(computed) == sorted(keys)                        # once per key
    assert [r["k"] for r in results] == [keys[i % 3] for i in range(30)]  # everyone answered
    # In-process coalescing: the 10 callers of a key made a single claim_key call.
    assert client.calls["claim_key"] == 3
    assert client.calls["complete_key"] == 3
    # Later callers are served from the cache.
    assert client.get_or_compute(keys[0], lambda: 1 / 0) == {"k": keys[0]}


def test_second_process_waits_and_reads_the_result(clients, key):
    owner, other = clients(), clients()   # two clients: two "processes" as the server sees it
    started = threading.Event()

    def slow():
        started.set()
        time.sleep(1.6)
        return [1, 2, 3]

    t = threading.Thread(target=lambda: owner.get_or_compute(key, slow, ttl=timedelta(minutes=1)))
    t.start()
    started.wait(5)
    t0 = time.monotonic()
    assert other.get_or_compute(key, lambda: pytest.fail("computed twice")) == [1, 2, 3]
    # Woken by the notification, not by a lease (30 s).
    assert time.monotonic() - t0 < 5
    t.join()
    # The waiter held no connection while waiting, and did not poll: it asked once, again
    # at each recheck (every 0.8 to 1.2 s: one or two in 1.6 s), and once more when
    # notified. A busy answer (another transaction holds once.entries: autovacuum
    # truncating it, create_namespace in a test running beside this one) is asked again
    # after 20 ms, and may add one. Polling (50 ms, doubling) would have asked 7 times.
    assert other.calls["claim_key"] <= 5


def test_cached_decorator(clients, key):
    client = clients()
    calls = []

    @client.cached(key=lambda x: f"{key}/{x}", ttl=60)
    def square(x):
        calls.append(x)
        return x * x

    assert [square(3), square(3), square(4)] == [9, 9, 16]
    assert calls == [3, 4]


def test_compute_raising_is_shared_and_the_key_is_not_stuck(clients, key):
    owner, other = clients(), clients()
    started = threading.Event()

    def boom():
        started.set()
        time.sleep(0.5)
        raise ValueError("upstream returned 503")

    errors = []

    def own(i):
        try:
            owner.get_or_compute(key, boom, retry_after=1.5)
        except Exception as exc:
            errors.append(exc)
    threads = [threading.Thread(target=own, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    started.wait(5)
    # Another process waiting for it gets the failure, with its text and retry_at.
    with pytest.raises(OnceFailed) as failed:
        other.get_or_compute(key, lambda: pytest.fail("the failure was not shared"))
    assert "upstream returned 503" in failed.value.error
    assert failed.value.retry_at is not None
    for t in threads:
        t.join()
    # The owner's in-process followers got the compute's own exception.
    assert len(errors) == 3 and all(isinstance(e, ValueError) for e in errors)
    assert owner.calls["fail_key"] == 1
    # After retry_after the next caller computes afresh.
    time.sleep(1.6)
    assert other.get_or_compute(key, lambda: "fixed") == "fixed"


def test_non_serialisable_result_is_a_clear_error_and_the_key_is_not_stuck(clients, key, admin):
    client = clients()
    with pytest.raises(NotSerializable) as err:
        client.get_or_compute(key, lambda: {"when": object()}, retry_after=0)
    assert isinstance(err.value, TypeError)
    assert "object has no JSON form" in str(err.value) and key in str(err.value)
    assert "serializer=" in str(err.value)
    assert state(admin, key) != "running"
    # NaN is not JSON either.
    with pytest.raises(NotSerializable):
        client.get_or_compute(key, lambda: float("nan"), retry_after=0)
    assert client.get_or_compute(key, lambda: {"ok": True}) == {"ok": True}


def test_wait_running_out_names_the_key(clients, key):
    owner, other = clients(), clients()
    started, release = threading.Event(), threading.Event()

    def slow():
        started.set()
        release.wait(10)
        return 1

    t = threading.Thread(target=lambda: owner.get_or_compute(key, slow))
    t.start()
    started.wait(5)
    try:
        with pytest.raises(OnceTimeout) as err:
            other.get_or_compute(key, lambda: 2, wait=0.5)
        assert key in str(err.value)
    finally:
        release.set()
        t.join()


def test_heartbeats_keep_a_computation_longer_than_its_lease(clients, key):
    owner, other = clients(), clients()
    computed = []
    started = threading.Event()

    def slow():
        computed.append(1)
        started.set()
        time.sleep(2.5)
        return "done"

    t = threading.Thread(target=lambda: owner.get_or_compute(key, slow, lease=0.9))
    t.start()
    started.wait(5)
    assert other.get_or_compute(key, lambda: computed.append(2) or "again", lease=0.9) == "done"
    t.join()
    assert computed == [1]
    assert owner.calls["heartbeat_key"] >= 4


def test_a_pool_not_in_autocommit_is_refused_clearly(setup, key, admin):
    pool = ConnectionPool(setup.dsn, min_size=1, max_size=2, open=True)   # no autocommit
    try:
        client = setup.client(pool=pool)
        with pytest.raises(ConfigurationError, match="autocommit"):
            client.get_or_compute(key, lambda: 1)
        assert state(admin, key) is None   # nothing was claimed
        client.close()
    finally:
        pool.close()


def test_waiters_do_not_starve_the_owner(setup, key):
    """40 callers of one key, each its own client (no in-process coalescing), sharing a
    psycopg_pool of 4 connections: waiters poll without holding a connection, so the
    owner's complete_key gets one at once and everyone is answered promptly."""
    pool = ConnectionPool(setup.dsn, min_size=4, max_size=4, open=True, timeout=5,
                          kwargs={"autocommit": True, "prepare_threshold": None})
    made = []
    try:
        for _ in range(40):
            made.append(setup.client(pool=pool, listen=False))
        computed = []

        def call(i):
            t0 = time.monotonic()
            value = made[i].get_or_compute(key, lambda: computed.append(i) or time.sleep(1) or "v")
            return value, time.monotonic() - t0

        results, errors = run_threads(40, call)
        assert errors == [None] * 40
        assert len(computed) == 1
        assert all(v == "v" for v, _ in results)
        # 1 s of computation, then at most ~1.2 s of polling back-off.
        assert max(s for _, s in results) < 3.0, sorted(s for _, s in results)
    finally:
        for c in made:
            c.close()
        pool.close()


def test_a_lost_claim_is_not_stored(clients, key, admin):
    from pg_once import ClaimLost
    client = clients()

    def compute():
        time.sleep(0.3)
        # Forgetting the key cancels our claim (invalidate_key would let the run finish).
        admin.execute("SELECT once.invalidate_keys(prefix => %s)", (key,))
        time.sleep(0.5)                                          # a heartbeat notices (lease/3)
        return "stale"

    with pytest.raises(ClaimLost) as err:
        client.get_or_compute(key, compute, lease=0.6)
    # Threads run compute() to its end and keep its value; asyncio cancels it (rule L3).
    assert err.value.value == (None if isinstance(client, BlockingAsyncClient) else "stale")
    assert state(admin, key) != "done"


def test_a_waiter_for_a_namespace_key_is_woken_by_its_digest(admin, key):
    # A namespace that announces digests (the default) sends encode(once.key_hash(key),
    # 'hex') instead of the key: the listener must wake the key's waiters on it.
    from pg_once._common import notified_names
    from pg_once._sync.listener import Listener

    prefix = key + "/ns/"
    admin.execute("SELECT once.create_namespace(%s, current_user::regrole)", (prefix,))
    ns_key = prefix + "k"
    digest = admin.execute("SELECT encode(once.key_hash(%s), 'hex')", (ns_key,)).fetchone()[0]
    assert notified_names(ns_key) == (ns_key, digest)
    listener = Listener(os.environ["PG_ONCE_DSN"])
    listener.start()
    try:
        event = listener.watch(ns_key)
        token = admin.execute("SELECT token FROM once.claim_key(%s)", (ns_key,)).fetchone()[0]
        admin.execute("SELECT once.complete_key(%s, %s, '1')", (ns_key, token))
        # Only a notification sets the event: the listener has no timer of its own.
        assert event.wait(5), "not woken by the digest notification"
        listener.unwatch(ns_key, event)
    finally:
        listener.close()
        admin.execute("SELECT once.invalidate_key(%s)", (ns_key,))
        admin.execute("SELECT once.drop_namespace(%s)", (prefix,))
