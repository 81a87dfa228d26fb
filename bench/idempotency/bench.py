#!/usr/bin/env python3
"""What the idempotency middleware costs, and what it saves (issue 27).

    PG_ONCE_DSN="host=127.0.0.1 port=5460 user=postgres dbname=idem_http" \\
        python bench/idempotency/bench.py [--seconds 5] [--rounds 3] [--out FILE]

For every example service (examples/idempotency/*/, or the directories in
PG_ONCE_HTTP_SERVICES), run as two instances by the driver of
clients/conformance/http (services.py):

- throughput: POST /orders with a fresh Idempotency-Key per request (claim, handler,
  complete in the order's transaction) against POST /bare/orders (the same handler, no
  middleware), `--concurrency` connections for `--seconds` per round, the two routes
  alternating round by round (ABBA...) so that drift in the shared machine's load falls
  on both; requests/s, p50 and p99 per round;
- duplicates: `--keys` keys, one after the other, each sent `--retries` identical
  requests at once (a client's concurrent retries), the handler sleeping
  `--duplicate-sleep-ms`; handler runs per key counted in idem_demo.started. The
  check-then-set baseline (bench/idempotency/naive) runs this part too.

One JSON line per round and per duplicates run, `"bench": "idempotency"`, appended to
`--out` (default bench/results/idempotency.jsonl); `bench/report.py table idempotency
FILE` and `table idempotency_duplicates FILE` render them.

Throughput is measured by wrk (Debian package `wrk`; post.lua makes the keys) against
the first instance, whose processes use every core; the duplicates, by httpx over both.
Everything shares the machine: wrk's threads take CPU from the service, the same way for
both routes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
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
    shutil.which("wrk") or sys.exit("bench.py measures with wrk: apt-get install wrk")
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
    """Rounds of the two routes, alternating ABBA..., against the first instance (its
    processes use every core); one row per round."""
    for route in ROUTES:  # warm up both routes' pools
        wrk(urls[0], route, 1, args.concurrency)
    for n in range(args.rounds):
        for route in ROUTES if n % 2 == 0 else ROUTES[::-1]:
            yield {"route": route, "round": n, "concurrency": args.concurrency,
                   **wrk(urls[0], route, args.seconds, args.concurrency)}


def wrk(url, route, seconds, concurrency):
    """wrk (post.lua) posting to route for `seconds` with `concurrency` connections; a
    fresh Idempotency-Key per request except on /bare/orders."""
    run = uuid.uuid4().hex[:12]
    argv = ["wrk", "-t", str(min(concurrency, os.cpu_count() or 1)), "-c", str(concurrency),
            "-d", f"{seconds}s", "--timeout", "30s", "-s", str(HERE / "post.lua"), url + route, "--",
            "plain" if route.startswith("/bare/") else "keyed", run]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{' '.join(argv)} exited {done.returncode}:\n{done.stdout}{done.stderr}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    seconds = result["duration_us"] / 1e6
    return {"seconds": round(seconds, 3), "requests": result["requests"],
            "failures": {k: v for k, v in result["errors"].items() if v},
            "rps": round(result["requests"] / seconds, 1),
            "p50_ms": result["p50_us"] / 1e3, "p99_ms": result["p99_us"] / 1e3}


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
