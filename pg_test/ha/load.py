#!/usr/bin/env python3
"""The Python client's load in the HA test (pg_test/ha/README.md): compute-once calls on
keys the Node and Rust loads ask for at the same moment (so some claim, some wait), and a
queue worker, through the multi-host connection string, until the stop file appears.
Every call is one JSON line in --out."""

import argparse
import asyncio
import json
import os
import time
import uuid

from pg_once import AsyncClient

WAIT = 10.0      # each call's wait; an answer later than this (plus slack) is reported
SLACK = 2.0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dsn", required=True)
    p.add_argument("--mode", required=True)
    p.add_argument("--stop", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    asyncio.run(run(args))


async def run(args):
    out = open(args.out, "w")

    def record(**rec):
        rec["t"] = time.time()
        out.write(json.dumps(rec) + "\n")
        out.flush()

    mine = set()       # the values this process computed
    reported = set()
    client = AsyncClient(args.dsn, pool_size=4, connect_timeout=3)
    stop = asyncio.Event()
    pending = 0

    async def getter(n):
        nonlocal pending
        while not stop.is_set():
            # 0.5 s buckets: the three loads ask for the same key at about the same time.
            key = f"ha:{args.mode}:s:{int(time.time() * 2)}"

            async def compute():
                await asyncio.sleep(0.1)
                v = {"by": "python", "pid": os.getpid(), "u": uuid.uuid4().hex}
                mine.add(v["u"])
                return v

            started = time.monotonic()
            pending += 1
            try:
                v = await client.get_or_compute(key, compute, lease=10, wait=WAIT)
                computed = v["u"] in mine and v["u"] not in reported
                reported.add(v["u"])
                took = time.monotonic() - started
                record(op="get", key=key, ok=True, value=v, computed=computed,
                       ms=round(took * 1000), slow=took > WAIT + SLACK)
            except Exception as exc:   # a connection error in flight: asked again below
                record(op="get", key=key, ok=False, error=f"{type(exc).__name__}: {exc}"[:200],
                       slow=time.monotonic() - started > WAIT + SLACK)
                await asyncio.sleep(0.1)
            finally:
                pending -= 1
            await asyncio.sleep(0.05)

    async def handler(job):
        record(op="job", key=job.key, token=job.token)
        return {"by": "python", "token": job.token}

    worker = client.worker(f"ha_{args.mode}", handler, concurrency=2, lease=10, idle_wait=1,
                           signals=False, grace=5)
    work = asyncio.ensure_future(worker.run())
    getters = [asyncio.ensure_future(getter(n)) for n in range(2)]
    record(op="start")
    while not os.path.exists(args.stop):
        await asyncio.sleep(0.1)
    stop.set()
    worker.stop()
    done, left = await asyncio.wait(getters + [work], timeout=WAIT + SLACK)
    record(op="end", pending=pending + len(left))
    for t in left:
        t.cancel()
    await client.close(refresh_timeout=1)
    out.close()


if __name__ == "__main__":
    main()
