"""Freshness (pg_once 0.2.0) through get_or_compute(..., stale=, beta=): inside a stale
window every caller gets the old value at once while one caller, in one process, refreshes
it in the background; a failed refresh keeps the old value served and the next caller
refreshes; with beta a refresh starts before expiry; close() leaves no refresh behind."""

import asyncio
import threading
import time

import pytest

from conftest import BlockingAsyncClient, Child
from test_get_or_compute import run_threads

# The computations below take COMPUTE seconds; a caller that is "answered at once" is
# answered within AT_ONCE, far below it (a wait for the computation cannot be that quick).
COMPUTE = 2.0
AT_ONCE = 0.75


def entry(admin, key):
    """(state, result, error) of the key's row."""
    return admin.execute("SELECT state::text, result, error FROM once.entries"
                         " WHERE key_hash = once.key_hash(%s)", (key,)).fetchone()


def last_outcome(admin, key):
    return admin.execute("SELECT last_outcome FROM once.entries WHERE key_hash = once.key_hash(%s)",
                         (key,)).fetchone()[0]


def wait_until(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.05)


def stored(admin, key, value):
    """Whether `value` is the key's stored result and no refresh of it is running."""
    row = entry(admin, key)
    return row is not None and row[0] == "done" and row[1] == value


def expire_into_stale_window(client, key, value="v1"):
    """Store `value` with a 0.5 s ttl and a 60 s stale window, then wait out the ttl."""
    assert client.get_or_compute(key, lambda: value, ttl=0.5, stale=60) == value
    time.sleep(0.7)


async def async_expire_into_stale_window(setup, key, value="v1"):
    """expire_into_stale_window with an async client of its own, closed before returning."""
    async with setup.async_client() as filler:
        async def compute():
            return value
        assert await filler.get_or_compute(key, compute, ttl=0.5, stale=60) == value
    await asyncio.sleep(0.7)


def test_stale_window_answers_at_once_and_one_background_refresh_replaces_the_value(clients, key, admin):
    expire_into_stale_window(clients(), key)
    readers = [clients() for _ in range(4)]   # four clients: four "processes" to the server
    computed, lock = [], threading.Lock()

    def refresh():
        with lock:
            computed.append(threading.current_thread().name)
        time.sleep(COMPUTE)
        return "v2"

    def call(i):
        t0 = time.monotonic()
        value = readers[i % 4].get_or_compute(key, refresh, ttl=60, stale=60)
        return value, time.monotonic() - t0

    results, errors = run_threads(16, call)
    assert errors == [None] * 16
    assert [v for v, _ in results] == ["v1"] * 16
    slowest = max(s for _, s in results)
    assert slowest < AT_ONCE, f"a caller waited {slowest:.2f} s for a {COMPUTE} s refresh"
    wait_until(lambda: stored(admin, key, "v2"), COMPUTE + 5, "the refresh stored v2")
    # One refresh in all, in a background thread (not in a caller's).
    assert len(computed) == 1, computed
    assert computed[0].startswith("pg_once-refresh") or isinstance(readers[0], BlockingAsyncClient)
    # The refresher's result replaced the old one: a hit, nothing computed again.
    assert readers[1].get_or_compute(key, lambda: pytest.fail("recomputed"), ttl=60, stale=60) == "v2"


def test_one_refresh_per_window_across_processes(setup, clients, key, admin):
    expire_into_stale_window(clients(), key)
    # Three processes of five threads ask at the same moment, during the refresh.
    start_at = time.time() + 2.0
    children = [Child("stale", setup, key=key, threads=5, ttl=60, stale=60,
                      compute_seconds=COMPUTE, start_at=start_at) for _ in range(3)]
    reports = [c.finish(timeout=60) for c in children]
    assert sum(r["computed"] for r in reports) == 1, [r["computed"] for r in reports]
    answers = [a for r in reports for a in r["answers"]]
    assert len(answers) == 15
    assert [a["value"] for a in answers] == ["v1"] * 15
    slowest = max(a["seconds"] for a in answers)
    assert slowest < AT_ONCE, f"a caller waited {slowest:.2f} s for a {COMPUTE} s refresh"
    # The refreshing process stored its result before it closed.
    state, result, _ = entry(admin, key)
    assert state == "done" and set(result) == {"by"}, (state, result)


def test_a_failed_refresh_keeps_the_old_value_served_and_the_next_caller_refreshes(clients, key, admin):
    expire_into_stale_window(clients(), key)
    reader, later = clients(), clients()
    attempts = []

    def boom():
        attempts.append(1)
        time.sleep(0.3)
        raise ValueError("upstream returned 503")

    t0 = time.monotonic()
    assert reader.get_or_compute(key, boom, ttl=60, stale=60, retry_after=0) == "v1"
    assert time.monotonic() - t0 < AT_ONCE
    wait_until(lambda: reader.calls["fail_key"] == 1 and entry(admin, key)[0] != "running",
               10, "the failed refresh was recorded")
    state, result, error = entry(admin, key)
    assert result == "v1" and "upstream returned 503" in (error or ""), (state, result, error)
    # Still the old value, at once; this caller draws the next refresh, which succeeds.
    t0 = time.monotonic()
    assert later.get_or_compute(key, lambda: time.sleep(0.3) or "v2", ttl=60, stale=60) == "v1"
    assert time.monotonic() - t0 < AT_ONCE
    wait_until(lambda: stored(admin, key, "v2"), 10, "the second refresh stored v2")
    assert attempts == [1]
    assert later.get_or_compute(key, lambda: pytest.fail("recomputed"), ttl=60, stale=60) == "v2"


def test_a_call_without_stale_or_beta_waits_for_the_refresh_as_before(clients, key):
    expire_into_stale_window(clients(), key)
    refresher, plain = clients(), clients()
    assert refresher.get_or_compute(key, lambda: time.sleep(1.0) or "v2", ttl=60, stale=60) == "v1"
    # No stale answer for a caller that did not ask for one: it waits for the refresh.
    t0 = time.monotonic()
    assert plain.get_or_compute(key, lambda: pytest.fail("computed beside the refresh"), ttl=60) == "v2"
    assert time.monotonic() - t0 > 0.5


def test_beta_refreshes_early_before_expiry(clients, key):
    client = clients()
    starts = []

    def compute():
        starts.append(time.monotonic())
        time.sleep(0.4)    # the delta pg_once measures (claim to completion)
        return len(starts)

    ttl, beta = 3.0, 10.0
    assert client.get_or_compute(key, compute, ttl=ttl, beta=beta) == 1
    expiry = time.monotonic() + ttl
    # XFetch: a hit at t refreshes with probability exp(-(expiry - t) / (beta * delta)),
    # here at least exp(-3 / 4) = 0.47 a call: about 40 calls leave no room for chance.
    while len(starts) < 2 and time.monotonic() < expiry - 0.8:
        t0 = time.monotonic()
        assert client.get_or_compute(key, compute, ttl=ttl, beta=beta) == 1
        assert time.monotonic() - t0 < 0.3, "a caller waited for the early refresh"
        time.sleep(0.05)
    assert len(starts) == 2, "no early refresh before expiry"
    assert starts[1] < expiry
    wait_until(lambda: client.get_or_compute(key, compute, ttl=ttl, beta=beta) == 2,
               expiry - time.monotonic(), "the early refresh replaced the value before expiry")


def test_close_waits_for_a_running_refresh_to_store_its_result(setup, clients, key, admin):
    expire_into_stale_window(clients(), key)
    client = setup.client()
    assert client.get_or_compute(key, lambda: time.sleep(0.8) or "v2", ttl=60, stale=60) == "v1"
    t0 = time.monotonic()
    client.close(refresh_timeout=10)
    assert time.monotonic() - t0 < 5
    assert stored(admin, key, "v2")


def test_close_gives_back_the_claim_of_a_refresh_still_running(setup, clients, key, admin):
    expire_into_stale_window(clients(), key)
    client = setup.client()
    release = threading.Event()
    assert client.get_or_compute(key, lambda: release.wait(5) and "too late", ttl=60, stale=60) == "v1"
    assert entry(admin, key)[0] == "running"
    t0 = time.monotonic()
    client.close(refresh_timeout=0.5)
    assert time.monotonic() - t0 < 2.5
    # Released by close() itself, not ended later because the LISTEN connection closed.
    assert entry(admin, key)[0] != "running" and last_outcome(admin, key) == "released"
    # Given back: the next caller draws the refresh at once, not after a lease.
    other = clients()
    assert other.get_or_compute(key, lambda: "v2", ttl=60, stale=60) == "v1"
    wait_until(lambda: stored(admin, key, "v2"), 5, "the next caller's refresh stored v2")
    release.set()   # the abandoned computation ends and stores nothing
    time.sleep(0.3)
    assert stored(admin, key, "v2")


def test_cached_decorator_passes_the_freshness_options(clients, key):
    client = clients()
    computed = []

    @client.cached(key=lambda: key, ttl=0.5, stale=60)
    def page():
        computed.append(1)
        time.sleep(0.3 * (len(computed) - 1))
        return len(computed)

    assert page() == 1
    time.sleep(0.7)
    t0 = time.monotonic()
    assert page() == 1          # stale, at once; the refresh runs in the background
    assert time.monotonic() - t0 < 0.25
    wait_until(lambda: page() == 2, 5, "the background refresh replaced the value")


def test_freshness_options_are_checked_before_anything_is_claimed(clients, key, admin):
    client = clients()
    with pytest.raises(ValueError, match="need a ttl"):
        client.get_or_compute(key, lambda: 1, stale=60)
    with pytest.raises(ValueError, match="beta"):
        client.get_or_compute(key, lambda: 1, ttl=10, beta=1000)
    with pytest.raises(ValueError, match="jitter"):
        client.get_or_compute(key, lambda: 1, ttl=10, jitter=1.0)
    with pytest.raises(ValueError, match="need a ttl"):
        client.cached(beta=1.0)
    assert entry(admin, key) is None
    # jitter alone reaches complete_key: each key's ttl is shortened by up to half, drawn
    # per key (all 8 left above 95 s by chance: 0.1^8).
    keys = [f"{key}/{i}" for i in range(8)]
    for k in keys:
        client.get_or_compute(k, lambda: 1, ttl=100, jitter=0.5)
    left = [float(s) for (s,) in admin.execute(
        "SELECT extract(epoch FROM expires_at - now()) FROM once.entries"
        " WHERE key_hash = ANY (SELECT once.key_hash(k) FROM unnest(%s::text[]) k)", (keys,))]
    assert len(left) == 8 and all(45 < s <= 100 for s in left), left
    assert min(left) < 95, left


def test_async_stale_window_and_background_refresh_task(setup, key, admin):
    async def main():
        await async_expire_into_stale_window(setup, key)
        computed = []

        async def refresh():
            computed.append(1)
            await asyncio.sleep(COMPUTE)
            return "v2"

        async with setup.async_client() as a, setup.async_client() as b:
            async def call(client):
                t0 = time.monotonic()
                value = await client.get_or_compute(key, refresh, ttl=60, stale=60)
                return value, time.monotonic() - t0
            results = await asyncio.gather(*[call(a if i % 2 else b) for i in range(20)])
            assert [v for v, _ in results] == ["v1"] * 20
            assert max(s for _, s in results) < AT_ONCE
            assert computed == [1]
        # Leaving the block closed the clients, which waited for the refresh to store.
        assert stored(admin, key, "v2")
    asyncio.run(main())


def test_async_close_cancels_a_refresh_still_running_and_gives_its_claim_back(setup, key, admin):
    async def main():
        await async_expire_into_stale_window(setup, key)
        cancelled, started = [], asyncio.Event()

        async def hang():
            started.set()
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                cancelled.append(1)
                raise
            return "too late"

        client = setup.async_client()
        assert await client.get_or_compute(key, hang, ttl=60, stale=60) == "v1"
        # The refresh runs in the background: closed before it has started, it would be
        # cancelled before hang() could see it (a loaded run did so).
        await asyncio.wait_for(started.wait(), 10)
        t0 = time.monotonic()
        await client.close(refresh_timeout=0.5)
        assert time.monotonic() - t0 < 2.5 and cancelled == [1]
        assert entry(admin, key)[0] != "running" and last_outcome(admin, key) == "released"
        async with setup.async_client() as other:
            async def v2():
                return "v2"
            assert await other.get_or_compute(key, v2, ttl=60, stale=60) == "v1"
        assert stored(admin, key, "v2")
    asyncio.run(main())
