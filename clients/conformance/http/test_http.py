"""The shared HTTP scenarios of README.md (docs/clients.md, rule I), run against every
example service as two instances of its real server. Each scenario checks the HTTP
answers and, in idem_demo, how many times the handler ran (`started`) and what it left
behind (`orders`), per key; keys are fresh per scenario."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections import Counter

import httpx
import pytest

from support import fresh_key

pytestmark = pytest.mark.anyio

BURST = 50


async def test_once_conflict(api):
    key, body = fresh_key(), {"sku": "conflict", "sleep_ms": 1000}
    answers = await burst(api, "/orders", body, key)

    runs = api.db.started(key)
    assert len(runs) == 1, (f"{BURST} concurrent requests with one key ran the handler {len(runs)} times "
                            f"(pids {Counter(runs)}); answers: {summary(answers)}")
    assert len(api.db.orders(key)) == 1
    first = [r for r in answers if r.status_code == 201 and not replayed(r)]
    conflicts = [r for r in answers if r.status_code == 409]
    assert (len(first), len(conflicts)) == (1, BURST - 1), \
        f"want one 201 and {BURST - 1} 409s while the handler runs, got {summary(answers)}"
    for r in conflicts:
        assert_problem(r, 409, "in_flight")
        assert r.headers.get("retry-after", "").isdigit(), f"409 without Retry-After: {dict(r.headers)}"
    [created] = first
    assert "set-cookie" in created.headers, "the handler's first response lost its set-cookie"

    replay = await api.post("/orders", body, key)
    assert_replay_of(replay, created)
    assert "set-cookie" not in replay.headers, "set-cookie was stored and replayed (I5: not unless store_cookies)"
    assert len(api.db.started(key)) == 1, "the retry after completion ran the handler again"


async def test_once_wait(api):
    key, body = fresh_key(), {"sku": "wait", "sleep_ms": 1000}
    answers = await burst(api, "/wait/orders", body, key)

    runs = api.db.started(key)
    assert len(runs) == 1, (f"{BURST} concurrent requests with one key ran the handler {len(runs)} times; "
                            f"answers: {summary(answers)}")
    assert len(api.db.orders(key)) == 1
    assert [r.status_code for r in answers] == [201] * BURST, f"want {BURST} 201s, got {summary(answers)}"
    assert len({r.content for r in answers}) == 1, "the waiters got other bodies than the first response's"
    assert sum(replayed(r) for r in answers) == BURST - 1, \
        f"want {BURST - 1} answers marked idempotent-replayed, got {summary(answers)}"


async def test_fingerprint_mismatch(api):
    key = fresh_key()
    first = await api.post("/orders", {"sku": "a"}, key)
    assert first.status_code == 201, show(first)

    other = await api.post("/orders", {"sku": "b"}, key)
    assert_problem(other, 422, "fingerprint_mismatch")
    assert len(api.db.started(key)) == 1, "another body with the key ran the handler"
    assert len(api.db.orders(key)) == 1
    assert_replay_of(await api.post("/orders", {"sku": "a"}, key), first)


async def test_without_key(api):
    sku = fresh_key()
    answers = [await api.post("/orders", {"sku": sku}) for _ in range(2)]
    assert [r.status_code for r in answers] == [201, 201], f"two requests without a key: {summary(answers)}"
    assert not any(replayed(r) for r in answers), "a request without a key was answered as a replay"
    assert api.db.orders_of_sku(sku) == 2, "two requests without a key must both run"

    before = api.db.started_total()
    assert_problem(await api.post("/strict/orders", {"sku": sku}), 400, "key_missing")
    for bad in ("has space", "k" * 256, "caf\u00e9".encode()):
        answer = await api.post("/orders", {"sku": sku}, bad)
        assert_problem(answer, 400, "key_invalid", f" for the key {bad!r}")
    assert api.db.started_total() == before, "a refused request ran the handler"
    assert api.db.orders_of_sku(sku) == 2


async def test_get_passes_through(api):
    key = fresh_key()
    answers = [await api.get("/health", key) for _ in range(2)]
    assert [r.status_code for r in answers] == [200, 200], f"GET /health with a key: {summary(answers)}"
    assert not any(replayed(r) for r in answers), "a GET was replayed"
    assert not api.db.has_entry(key), "a GET with a key made a pg_once entry"


async def test_scopes(api):
    key, body = fresh_key(), {"sku": "scoped"}
    alice = await api.post("/orders", body, key, headers={"authorization": "Bearer alice"})
    bob = await api.post("/orders", body, key, headers={"authorization": "Bearer bob"})
    assert (alice.status_code, bob.status_code) == (201, 201), \
        f"one key under two Authorization headers: {summary([alice, bob])}"
    assert not replayed(bob), "another Authorization got the first caller's response"
    assert len(api.db.orders(key)) == 2, "one key under two Authorization headers must run twice"
    assert_replay_of(await api.post("/orders", body, key, headers={"authorization": "Bearer alice"}), alice)


async def test_5xx_releases(api):
    key, body = fresh_key(), {"sku": "fails", "status": 500}
    answers = [await api.post("/orders", body, key) for _ in range(2)]
    assert [r.status_code for r in answers] == [500, 500], \
        f"want the handler's 500, then again for the retry (a 5xx releases the claim), got {summary(answers)}"
    assert all(r.json() == {"error": "asked"} and not replayed(r) for r in answers), \
        f"want the handler's own 500 twice, got {summary(answers)}"
    assert len(api.db.started(key)) == 2, "a 5xx was stored: the retry did not run the handler"
    assert api.db.orders(key) == []


async def test_exception_releases(api):
    key, body = fresh_key(), {"sku": "raises", "raise": True}
    for _ in range(2):
        assert_problem(await api.post("/orders", body, key), 500, "handler_failed")
    assert len(api.db.started(key)) == 2, "after an exception the retry did not run the handler"
    assert api.db.orders(key) == []


async def test_killed_worker(api):
    key, body = fresh_key(), {"sku": "killed", "sleep_ms": 5000}
    doomed = asyncio.create_task(api.post("/orders", body, key, instance=0))
    pid = await handler_started(api, key, 1)
    victim = owning_instance(api, pid)
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()

    # A client retries as told: a 409 in_flight (the server may not have seen the owner's
    # connection close yet) is tried again after its Retry-After.
    retry = asyncio.create_task(retry_in_flight(api, "/orders", body, key, instance=1 - victim))
    await handler_started(api, key, 2, timeout=2, waiting_for="a retry on the other instance",
                          pending=retry)
    took = time.monotonic() - killed
    answers = await retry
    assert answers[-1].status_code == 201 and not replayed(answers[-1]), \
        f"the retry after the kill was answered {summary(answers)}"
    assert len(api.db.orders(key)) == 1
    outcome = await settle(doomed)
    assert not (isinstance(outcome, httpx.Response) and outcome.status_code < 300), \
        f"the killed worker's request was answered {show(outcome)}"
    print(f"takeover after SIGKILL: the retry's handler started {took * 1000:.0f} ms after the kill "
          f"({summary(answers)})")


async def test_zombie(api):
    key, body = fresh_key(), {"sku": "zombie", "sleep_ms": 3000}
    zombie = asyncio.create_task(api.post("/orders", body, key, instance=0))
    pid = await handler_started(api, key, 1)
    victim = owning_instance(api, pid)
    os.kill(pid, signal.SIGSTOP)
    try:
        owner = api.db.owner_pid(key)
        assert owner, f"no owner_pid in once.entries for the running request's key {key}"
        api.db.terminate(owner)
        retry = await api.post("/orders", body, key, instance=1 - victim)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert retry.status_code == 201 and not replayed(retry), \
        f"the retry after the owner session ended: {show(retry)}"

    late = await zombie
    assert_problem(late, 409, "in_flight", " for the resumed process whose claim was taken over")
    orders = api.db.orders(key)
    assert [o_pid for _, o_pid in orders] == [int(retry.headers["x-handler-pid"])], \
        f"want only the retry's order, got (id, pid) {orders}; the stopped process was {pid}"
    assert len(api.db.started(key)) == 2

    # The resumed process lost its owner session: it must open another, not fail every
    # request from now on. Its instance may have other worker processes, so ask three
    # times as many times, each on a new connection, to reach it.
    after = [await api.post("/orders", {"sku": "after zombie"}, fresh_key(), instance=victim,
                            headers={"connection": "close"})
             for _ in range(3 * api.running.service.processes)]
    assert all(r.status_code == 201 for r in after), \
        f"after its owner session was ended, instance {victim} (handler pid {pid}) answers {summary(after)}"


async def test_streaming(api):
    key, body = fresh_key(), {"sku": "stream", "chunks": 5, "size": 64 * 1024}
    arrivals, content = [], b""
    async with api.stream("/orders", body, key) as first:
        async for chunk in first.aiter_raw():
            arrivals.append(time.monotonic())
            content += chunk
    assert first.status_code == 201 and first.headers["content-type"].startswith("text/plain"), show(first)
    assert content == b"x" * (5 * 64 * 1024), f"streamed body of {len(content)} bytes, want {5 * 64 * 1024} x's"
    spread = arrivals[-1] - arrivals[0]
    assert spread >= 0.02, f"the 5 chunks, produced 10 ms apart, arrived within {spread * 1000:.1f} ms: not streamed"

    replay = await api.post("/orders", body, key)
    assert replay.status_code == 201 and replayed(replay), \
        f"a retry sent once the streamed response had ended was answered {show(replay)} (the response " \
        "must be stored before its end reaches the caller)"
    assert replay.content == content, "the replay differs from the streamed body"
    assert len(api.db.started(key)) == 1


async def test_large_bodies(api):
    key, body = fresh_key(), {"sku": "512k", "size": 512 * 1024}
    first = await api.post("/orders", body, key)
    assert first.status_code == 201, show(first)
    assert_replay_of(await api.post("/orders", body, key), first)

    key, body = fresh_key(), {"sku": "2m", "size": 2 * 1024 * 1024}
    first = await api.post("/orders", body, key)
    assert first.status_code == 201 and len(first.json()["padding"]) == 2 * 1024 * 1024, show(first)
    replay = await api.post("/orders", body, key)
    assert replay.status_code == 201 and replayed(replay), show(replay)
    assert replay.content == b"", f"a body over max_body was replayed ({len(replay.content)} bytes)"
    assert replay.headers.get("location") == first.headers["location"], "the replay lost the stored headers"
    assert len(api.db.started(key)) == 1, "a response over max_body was not stored: the retry ran again"


# -- helpers -------------------------------------------------------------------------------

async def burst(api, path, body, key) -> list[httpx.Response]:
    """BURST identical requests at once, alternating between the instances."""
    return await asyncio.gather(*(api.post(path, body, key) for _ in range(BURST)))


async def retry_in_flight(api, path, body, key, instance) -> list[httpx.Response]:
    """Posts until the answer is not a 409 in_flight, waiting its Retry-After between."""
    answers = [await api.post(path, body, key, instance=instance)]
    while answers[-1].status_code == 409 and answers[-1].headers.get("retry-after", "").isdigit():
        await asyncio.sleep(int(answers[-1].headers["retry-after"]))
        answers.append(await api.post(path, body, key, instance=instance))
    return answers


async def handler_started(api, key, runs, timeout=10.0, waiting_for="the request", pending=None) -> int:
    """Waits until key's handler has started `runs` times; the pid of the last run."""
    deadline = time.monotonic() + timeout
    while len(pids := api.db.started(key)) < runs:
        if time.monotonic() > deadline:
            answered = ""
            if pending and pending.done() and not pending.exception():
                answered = "; it was answered " + ", ".join(map(show, pending.result()))
            raise AssertionError(f"the handler had not started for {waiting_for} within {timeout} s "
                                 f"(handler runs of the key: {pids}){answered}")
        await asyncio.sleep(0.02)
    return pids[-1]


def owning_instance(api, pid) -> int:
    """Which instance the handler's process belongs to: signals go to no other process."""
    instance = api.running.instance_of(pid)
    assert instance is not None, f"the handler's pid {pid} belongs to no instance this driver started"
    return api.running.instances.index(instance)


async def settle(task):
    try:
        return await task
    except httpx.HTTPError as e:
        return e


def replayed(r: httpx.Response) -> bool:
    return r.headers.get("idempotent-replayed") == "true"


def assert_replay_of(replay: httpx.Response, first: httpx.Response):
    assert not replayed(first), "the first response carries idempotent-replayed"
    assert replay.status_code == first.status_code and replayed(replay), \
        f"want the {first.status_code} replayed, got {show(replay)}"
    assert replay.content == first.content, "the replay's body differs from the first response's"
    for name in ("location", "content-type", "x-handler-pid"):
        assert replay.headers.get(name) == first.headers.get(name), \
            f"replayed {name}: {replay.headers.get(name)!r}, first response: {first.headers.get(name)!r}"


def assert_problem(r: httpx.Response, status: int, code: str, where: str = ""):
    """An answer the middleware made itself (I7): status, problem+json and its members."""
    assert r.status_code == status, f"want {status} {code}{where}, got {show(r)}"
    assert r.headers.get("content-type", "").startswith("application/problem+json"), \
        f"{status}{where} is not application/problem+json: {show(r)}"
    problem = r.json()
    assert problem.get("code") == code, f"want code {code}{where}, got {problem}"
    assert problem.get("status") == status and problem.get("type") == "about:blank", problem
    assert isinstance(problem.get("title"), str) and isinstance(problem.get("detail"), str), problem


def show(r) -> str:
    if not isinstance(r, httpx.Response):
        return repr(r)
    body = r.content[:300].decode(errors="replace")
    return f"{r.status_code} {dict(r.headers)} {body!r}{'...' if len(r.content) > 300 else ''}"


def summary(answers) -> str:
    """e.g. `201 x1, 409 in_flight x49`."""
    def kind(r):
        if r.status_code >= 400 and r.headers.get("content-type", "").startswith("application/problem+json"):
            return f"{r.status_code} {json.loads(r.content).get('code')}"
        return f"{r.status_code}{' replayed' if replayed(r) else ''}"
    return ", ".join(f"{k} x{n}" for k, n in Counter(map(kind, answers)).most_common())
