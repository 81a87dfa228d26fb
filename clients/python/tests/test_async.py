"""AsyncClient and AsyncWorker: the same guarantees with asyncio tasks."""

import asyncio
import time

import pytest

from pg_once import NotSerializable, OnceFailed


def run(coro):
    return asyncio.run(coro)


def test_async_many_tasks_one_computation_one_claim(setup, key):
    async def main():
        async with setup.async_client() as client, setup.async_client() as other:
            computed = []

            async def compute(k):
                computed.append(k)
                await asyncio.sleep(0.5)
                return {"k": k}

            keys = [f"{key}/{i}" for i in range(3)]
            calls = [c.get_or_compute(keys[i % 3], lambda i=i: compute(keys[i % 3]), ttl=60)
                     for i in range(60) for c in [client if i % 2 else other]]
            results = await asyncio.gather(*calls)
            assert sorted(computed) == sorted(keys)
            assert [r["k"] for r in results] == [keys[i % 3] for i in range(60)]
            # The first client to ask for a key made one claim; the other waited.
            assert client.calls["claim_key"] + other.calls["claim_key"] <= 3 + 3 * 3
            assert min(client.calls["claim_key"], other.calls["claim_key"]) >= 3
    run(main())


def test_async_single_client_one_claim_per_key(setup, key):
    async def main():
        async with setup.async_client() as client:
            n = []

            async def compute():
                n.append(1)
                await asyncio.sleep(0.2)
                return 42
            assert await asyncio.gather(*[client.get_or_compute(key, compute) for _ in range(50)]) == [42] * 50
            assert n == [1] and client.calls["claim_key"] == 1
    run(main())


def test_async_errors(setup, key):
    async def main():
        async with setup.async_client() as client, setup.async_client() as other:
            started = asyncio.Event()

            async def boom():
                started.set()
                await asyncio.sleep(0.3)
                raise ValueError("nope")

            owner = asyncio.ensure_future(client.get_or_compute(key, boom, retry_after=1))
            # Its claim is taken (and committed) once its computation starts: a sleep
            # instead may end before the claim on a loaded machine.
            await started.wait()
            with pytest.raises(OnceFailed, match="nope"):
                await other.get_or_compute(key, boom)
            with pytest.raises(ValueError):
                await owner

            async def bad():
                return {1, 2}
            with pytest.raises(NotSerializable):
                await client.get_or_compute(key + "/set", bad, retry_after=0)

            async def good():
                return "ok"
            assert await client.get_or_compute(key + "/set", good) == "ok"
    run(main())


def test_async_worker(setup, admin, key):
    queue = f"py-a{abs(hash(key)) % 10**8}"
    admin.execute("SELECT once.create_queue(%s)", (queue,))
    keys = [f"{key}/{i}" for i in range(20)]
    for k in keys:
        admin.execute("SELECT once.enqueue_key(%s, NULL, %s)", (k, queue))
    try:
        async def main():
            async with setup.async_client() as client:
                seen = []

                async def handler(job):
                    seen.append(job.key)
                    await asyncio.sleep(0.02)
                    if len(set(seen)) == len(keys):
                        worker.stop()
                    return {"key": job.key}
                worker = client.worker(queue, handler, concurrency=4, idle_wait=0.2, signals=False)
                done = await asyncio.wait_for(worker.run(), 20)
                assert done == len(keys) and sorted(seen) == sorted(keys)
        run(main())
    finally:
        admin.execute("SELECT once.invalidate_keys(queue => %s)", (queue,))
        admin.execute("SELECT once.drop_queue(%s)", (queue,))


def test_async_lost_claim_cancels_the_computation(setup, key, admin):
    from pg_once import ClaimLost

    async def main():
        async with setup.async_client() as client:
            finished = []

            async def compute():
                await asyncio.sleep(0.2)
                admin.execute("SELECT once.invalidate_keys(prefix => %s)", (key,))   # cancels our claim
                await asyncio.sleep(5)
                finished.append(1)
                return "stale"
            t0 = time.monotonic()
            with pytest.raises(ClaimLost):
                await client.get_or_compute(key, compute, lease=0.6)
            assert time.monotonic() - t0 < 2 and finished == []
    run(main())


async def until(predicate, seconds):
    """Whether `predicate()` came true within `seconds` (a condition waited for, not a
    duration)."""
    deadline = time.monotonic() + seconds
    while not predicate() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    return predicate()


def test_async_worker_cancelled_with_its_claim_on_the_way_gives_the_job_back(admin, key):
    """X2 and R2 for claim_next: the worker's task cancelled while the server's answer is
    held on its way; the job it claimed goes back to the queue at once, not after the
    lease. Direct only: the pool goes through the conformance runner's proxy."""
    from conformance import HoldingProxy
    from conftest import DIRECT
    from pg_once import AsyncClient
    queue = f"py-c{abs(hash(key)) % 10**8}"
    admin.execute("SELECT once.create_queue(%s)", (queue,))

    def job_state():
        return admin.execute("SELECT state::text FROM once.entries WHERE key = %s",
                             (f"{key}/job",)).fetchone()

    async def main():
        proxy = await HoldingProxy(DIRECT).start()
        try:
            async with AsyncClient(proxy.dsn(), listen_conninfo=DIRECT) as client:
                await client.get_or_compute(f"{key}/warm", lambda: 0)   # a pooled connection
                handled = []

                async def handler(job):
                    handled.append(job.key)
                worker = client.worker(queue, handler, lease=60, idle_wait=0.2, signals=False)
                proxy.pause()
                admin.execute("SELECT once.enqueue_key(%s, NULL, %s)", (f"{key}/job", queue))
                running = asyncio.create_task(worker.run())
                assert await until(lambda: job_state() == ("running",), 10)
                running.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await running
                proxy.resume()
                assert await until(lambda: job_state() != ("running",), 5), \
                    "the job is still claimed: it waits for its 60 s lease"
                assert job_state() == ("queued",) and handled == []
        finally:
            await proxy.close()
    try:
        run(main())
    finally:
        admin.execute("SELECT once.invalidate_keys(queue => %s)", (queue,))
        admin.execute("SELECT once.drop_queue(%s)", (queue,))


def test_async_claim_with_no_wait_and_its_answer_held_times_out_at_connect_timeout(admin, key):
    """R2 and N6: a claim told wait=0 has no wait to bound its answer by, so R2's budget of
    every other statement does: connect_timeout, then Timeout; and the claim the server
    made meanwhile is given back when its answer comes (X2). Direct only (the proxy)."""
    from conformance import HoldingProxy
    from conftest import DIRECT
    from pg_once import AsyncClient, OnceTimeout

    def state():
        return admin.execute("SELECT state::text FROM once.entries WHERE key = %s",
                             (key,)).fetchone()

    async def main():
        proxy = await HoldingProxy(DIRECT).start()
        try:
            async with AsyncClient(proxy.dsn(), listen_conninfo=DIRECT,
                                   connect_timeout=1) as client:
                await client.get_or_compute(f"{key}/warm", lambda: 0)   # a pooled connection
                proxy.pause()
                call = asyncio.create_task(
                    client.get_or_compute(key, lambda: "computed for nobody", wait=0, lease=60))
                assert await until(lambda: state() == ("running",), 10)
                t0 = time.monotonic()
                # Bounded, so that a client that waits for the held answer fails, not hangs.
                with pytest.raises(OnceTimeout):
                    await asyncio.wait_for(call, 15)
                assert time.monotonic() - t0 < 5
                proxy.resume()
                assert await until(lambda: state() != ("running",), 5), \
                    "the claim made for nobody is still held: it waits for its 60 s lease"
        finally:
            proxy.resume()
            await proxy.close()
    run(main())

