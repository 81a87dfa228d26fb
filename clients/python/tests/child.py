"""A pg_once client in its own OS process, for the multi-process tests.

    python child.py MODE '{"dsn": ..., "listen_dsn": ..., ...}'

Modes print JSON lines on stdout:
  callers   many threads call get_or_compute on some keys; prints what they got and how
            many computations and claim_key calls this process made
  stale     at wall-clock time start_at, many threads ask for a key with stale=...; prints
            what each got and how long it took, and how many refreshes this process ran
            (after close() has waited for them)
  owner     claims a key and "computes" until killed; prints {"computing": true} first
  worker    runs the queue worker loop until SIGTERM; prints its counts
  aworker   the same with AsyncClient
"""

import asyncio
import json
import os
import sys
import threading
import time

from pg_once import AsyncClient, Client


def make_client(a):
    return Client(a["dsn"], listen_conninfo=a["listen_dsn"], pool_size=a.get("pool_size", 4))


def callers(a):
    client = make_client(a)
    computed, lock = [], threading.Lock()
    start = threading.Barrier(a["threads"])

    def compute(key):
        with lock:
            computed.append(key)
        time.sleep(a["compute_seconds"])
        return {"key": key, "pid": os.getpid()}

    answers = []

    def caller(i):
        key = a["keys"][i % len(a["keys"])]
        start.wait()
        t0 = time.monotonic()
        value = client.get_or_compute(key, lambda: compute(key), ttl=60, wait=30)
        with lock:
            answers.append({"key": key, "value": value, "seconds": time.monotonic() - t0})

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(a["threads"])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps({"computed": len(computed), "answers": answers,
                      "claim_key": client.calls["claim_key"], "calls": client.calls.total}), flush=True)
    client.close()


def stale(a):
    client = make_client(a)
    computed, answers, lock = [], [], threading.Lock()

    def compute():
        with lock:
            computed.append(1)
        time.sleep(a["compute_seconds"])
        return {"by": os.getpid()}

    def caller():
        time.sleep(max(0.0, a["start_at"] - time.time()))
        t0 = time.monotonic()
        value = client.get_or_compute(a["key"], compute, ttl=a["ttl"], stale=a["stale"])
        with lock:
            answers.append({"value": value, "seconds": time.monotonic() - t0})

    threads = [threading.Thread(target=caller) for _ in range(a["threads"])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    client.close(refresh_timeout=30)   # lets a background refresh finish and store
    print(json.dumps({"computed": len(computed), "answers": answers}), flush=True)


def owner(a):
    client = make_client(a)

    def compute():
        print(json.dumps({"computing": True, "owner_pid": client.owner_pid()}), flush=True)
        time.sleep(600)

    client.get_or_compute(a["key"], compute, lease=a.get("lease", 30))


def worker(a):
    client = make_client(a)

    def handler(job):
        time.sleep(job.payload.get("seconds", 0.01) if job.payload else 0.01)
        return {"key": job.key, "pid": os.getpid()}

    w = client.worker(a["queue"], handler, concurrency=a.get("concurrency", 4),
                      idle_wait=0.5, lease=10)
    print(json.dumps({"ready": True}), flush=True)
    completed = w.run()
    print(json.dumps({"completed": completed, "failed": w.failed, "released": w.released}),
          flush=True)
    client.close()


def aworker(a):
    async def handler(job):
        await asyncio.sleep(job.payload.get("seconds", 0.01) if job.payload else 0.01)
        return {"key": job.key, "pid": os.getpid()}

    async def main():
        async with AsyncClient(a["dsn"], listen_conninfo=a["listen_dsn"], pool_size=4) as client:
            w = client.worker(a["queue"], handler, concurrency=a.get("concurrency", 4),
                              idle_wait=0.5, lease=10)
            print(json.dumps({"ready": True}), flush=True)
            completed = await w.run()
            print(json.dumps({"completed": completed, "failed": w.failed,
                              "released": w.released}), flush=True)
    asyncio.run(main())


if __name__ == "__main__":
    {"callers": callers, "stale": stale, "owner": owner, "worker": worker, "aworker": aworker}[sys.argv[1]](json.loads(sys.argv[2]))
