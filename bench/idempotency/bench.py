#!/usr/bin/env python3
"""What the idempotency middleware costs, and what it saves (issue 27).

    PG_ONCE_DSN="host=127.0.0.1 port=5460 user=postgres dbname=idem_http" \\
        python bench/idempotency/bench.py [--seconds 5] [--rounds 3] [--out FILE]

For every example service (examples/idempotency/*/, or the directories in
PG_ONCE_HTTP_SERVICES), run as two instances by the driver of
clients/conformance/http (services.py):

- throughput: POST /orders with a fresh Idempotency-Key per request (claim, handler,
  complete in the order's transaction) against POST /bare/orders (the same handler, no
  middleware), `--concurrency` requests in flight over both instances for `--seconds`
  per round, the two routes alternating round by round (ABBA...) so that drift in the
  shared machine's load falls on both; requests/s, p50 and p99 per round;
- duplicates: `--keys` keys, one after the other, each sent `--retries` identical
  requests at once (a client's concurrent retries), the handler sleeping
  `--duplicate-sleep-ms`; handler runs per key counted in idem_demo.started. The
  check-then-set baseline (bench/idempotency/naive) runs this part too.

One JSON line per round and per duplicates run, `"bench": "idempotency"`, appended to
`--out` (default bench/results/idempotency.jsonl); `bench/report.py table idempotency
FILE` and `table idempotency_duplicates FILE` render them. The load generator is this
process (httpx, one asyncio loop) on the same machine: it caps what a fast service can
show, the same way for both routes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import httpx
import psycopg

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "clients" / "conformance" / "http"))
from services import BASELINE, Running, discover, load  # noqa: E402
from support import create_schema  # noqa: E402

ROUTES = ("/orders", "/bare/orders")


def main():
    args = parse_args()
    dsn = os.environ.get("PG_ONCE_DSN") or sys.exit("PG_ONCE_DSN is not set")
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_schema(conn)
    services = discover()
    if not services:
        sys.exit("no service: none under examples/idempotency/*/service.json, and PG_ONCE_HTTP_SERVICES unset")
    out = open(args.out, "a")
    for service in services + [load(BASELINE)]:
        baseline = service.directory == BASELINE
        print(f"== {service.name}", file=sys.stderr)
        with Running(service, dsn) as running:
            if not baseline:
                for row in throughput(running.urls, args):
                    write(out, {"row": "throughput", "service": service.name, **row})
            write(out, {"row": "duplicates", "service": service.name, "baseline": baseline,
                        **asyncio.run(duplicates(running.urls, dsn, args))})


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=5, help="per round (default 5)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per route (default 3)")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight (default 16)")
    p.add_argument("--keys", type=int, default=50, help="keys of the duplicates run (default 50)")
    p.add_argument("--retries", type=int, default=20, help="identical requests per key (default 20)")
    p.add_argument("--duplicate-sleep-ms", type=int, default=50, help="the handler's sleep (default 50)")
    p.add_argument("--out", default=str(HERE.parent / "results" / "idempotency.jsonl"))
    return p.parse_args()


def write(out, row):
    line = json.dumps({"bench": "idempotency", **row})
    out.write(line + "\n")
    out.flush()
    print(line, file=sys.stderr)


# -- throughput ----------------------------------------------------------------------------

def throughput(urls, args):
    """Rounds of the two routes, alternating ABBA...; one row per round."""
    asyncio.run(load_round(urls, "/orders", 1, args.concurrency))  # warm up both routes' pools
    asyncio.run(load_round(urls, "/bare/orders", 1, args.concurrency))
    for n in range(args.rounds):
        for route in ROUTES if n % 2 == 0 else ROUTES[::-1]:
            row = asyncio.run(load_round(urls, route, args.seconds, args.concurrency))
            yield {"route": route, "round": n, "concurrency": args.concurrency, **row}


async def load_round(urls, route, seconds, concurrency):
    """`concurrency` loops posting to route for `seconds`, each with a fresh key."""
    latencies, failures = [], Counter()
    body = json.dumps({"sku": "bench"}).encode()
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=concurrency)) as http:
        start = time.monotonic()
        deadline = start + seconds

        async def loop(n):
            url = urls[n % len(urls)] + route
            while time.monotonic() < deadline:
                sent = time.monotonic()
                try:
                    r = await http.post(url, content=body, headers={
                        "content-type": "application/json", "idempotency-key": str(uuid.uuid4())})
                    if r.status_code != 201:
                        failures[str(r.status_code)] += 1
                        continue
                except httpx.HTTPError as e:
                    failures[type(e).__name__] += 1
                    continue
                latencies.append(time.monotonic() - sent)

        await asyncio.gather(*(loop(n) for n in range(concurrency)))
        elapsed = time.monotonic() - start
    latencies.sort()
    return {"seconds": round(elapsed, 3), "requests": len(latencies), "failures": dict(failures),
            "rps": round(len(latencies) / elapsed, 1),
            "p50_ms": round(1e3 * percentile(latencies, 0.50), 2),
            "p99_ms": round(1e3 * percentile(latencies, 0.99), 2)}


def percentile(sorted_values, q):
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


# -- duplicates ----------------------------------------------------------------------------

async def duplicates(urls, dsn, args):
    """--keys keys, each sent --retries identical requests at once; handler runs per key."""
    keys = [str(uuid.uuid4()) for _ in range(args.keys)]
    answers = Counter()
    body = json.dumps({"sku": "retried", "sleep_ms": args.duplicate_sleep_ms}).encode()
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=args.retries)) as http:
        for key in keys:
            headers = {"content-type": "application/json", "idempotency-key": key}
            rs = await asyncio.gather(*(http.post(urls[n % len(urls)] + "/orders", content=body, headers=headers)
                                        for n in range(args.retries)), return_exceptions=True)
            for r in rs:
                answers[type(r).__name__ if isinstance(r, Exception) else
                        f"{r.status_code}{' replayed' if r.headers.get('idempotent-replayed') else ''}"] += 1
    with psycopg.connect(dsn, autocommit=True) as conn:
        counts = dict(conn.execute("SELECT idempotency_key, count(*) FROM idem_demo.started "
                                   "WHERE idempotency_key = ANY(%s) GROUP BY 1", (keys,)).fetchall())
    runs = [counts.get(k, 0) for k in keys]
    return {"keys": len(keys), "retries": args.retries, "handler_sleep_ms": args.duplicate_sleep_ms,
            "handler_runs": sum(runs), "keys_run_more_than_once": sum(r > 1 for r in runs),
            "keys_never_run": sum(r == 0 for r in runs), "max_runs_per_key": max(runs),
            "median_runs_per_key": statistics.median(runs), "answers": dict(answers)}


if __name__ == "__main__":
    main()
