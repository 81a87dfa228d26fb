#!/usr/bin/env python3
"""Benchmark of the Python client (clients/python) behind connection pools.

    python bench/pooled.py --dsn "host=127.0.0.1 port=5432 user=postgres dbname=postgres" \
        --bouncer-dsn "host=127.0.0.1 port=6432 user=postgres dbname=postgres"

Not a test: prints one JSON line per row. For each setup,
  direct       Client(dsn): its own small pool of direct connections (10 per process)
  pgbouncer    Client(bouncer_dsn, listen_conninfo=dsn): PgBouncer in transaction mode
  psycopg_pool Client(pool=ConnectionPool(dsn, max_size=4)): 4 connections per process
and, as baselines, two raw-SQL setups without the client, each caller (a thread) on a
connection of its own following the README's server-side waiting loop (claim_key with
lease 30 s and wait 10 s until it is answered; claimed: compute, complete_key):
  raw-direct   a direct server connection per caller (as pg_once was first built for)
  raw-pgbouncer a connection per caller to PgBouncer in transaction mode
it runs 100 callers in 4 processes and 1,000 callers in 10 processes (threads), all
asking at the same moment for 3 keys whose computation takes 1 s, and reports the
computations, callers answered, p50/p99 answer time and database calls per caller.
(raw-direct runs only the 100-caller row: 1,000 callers would need 1,000 server
connections.)
A last row per setup kills (SIGKILL) a process that owns a key mid-compute and reports
how long until a waiting process took it over. Needs pg_once installed in the venv
(`pip install ./clients/python`) and the extension created in the database.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

SETUPS = ("raw-direct", "raw-pgbouncer", "direct", "pgbouncer", "psycopg_pool")
# How long a raw caller keeps asking before it counts as unanswered. Through PgBouncer its
# calls queue for a server connection that other callers' waits hold, for minutes if let
# be; the child process then exits with those calls still queued.
RAW_GIVE_UP_S = 30
ROWS = ((100, 4), (1000, 10))   # (callers, processes)


def make_client(args):
    from pg_once import Client
    if args["setup"] == "direct":
        return Client(args["dsn"], pool_size=10)
    if args["setup"] == "pgbouncer":
        return Client(args["bouncer_dsn"], listen_conninfo=args["dsn"], pool_size=10)
    from psycopg_pool import ConnectionPool
    pool = ConnectionPool(args["dsn"], min_size=4, max_size=4, open=True,
                          kwargs={"autocommit": True, "prepare_threshold": None})
    return Client(pool=pool)


# -- child processes --------------------------------------------------------------------

def child_raw_callers(args):
    """The README's server-side waiting loop, one connection per caller, no client."""
    import psycopg
    from psycopg.types.json import Jsonb
    dsn = args["dsn"] if args["setup"] == "raw-direct" else args["bouncer_dsn"]
    computed, calls, lock = [0], [0], threading.Lock()
    times, errors = [], []

    def caller(i):
        key = args["keys"][i % len(args["keys"])]
        try:
            conn = psycopg.connect(dsn, autocommit=True, prepare_threshold=None)
        except Exception as exc:
            with lock:
                errors.append(repr(exc))
            return
        time.sleep(max(0.0, args["start_at"] - time.time()))   # everyone at once
        try:
            while time.time() - args["start_at"] < RAW_GIVE_UP_S:
                with lock:
                    calls[0] += 1
                outcome, token = conn.execute(
                    "SELECT outcome, token FROM once.claim_key(%s, '30 s', wait => '10 s')",
                    (key,)).fetchone()
                if outcome == "claimed":
                    with lock:
                        computed[0] += 1
                    time.sleep(args["compute_seconds"])
                    with lock:
                        calls[0] += 1
                    conn.execute("SELECT once.complete_key(%s, %s, %s, '300 s')",
                                 (key, token, Jsonb({"key": key})))
                if outcome in ("hit", "claimed"):
                    with lock:
                        times.append(time.time() - args["start_at"])
                    return
        except Exception as exc:
            with lock:
                errors.append(repr(exc))
        finally:
            conn.close()

    threads = [threading.Thread(target=caller, args=(i,), daemon=True)
               for i in range(args["threads"])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, args["start_at"] + RAW_GIVE_UP_S - time.time()))
    with lock:
        print(json.dumps({"computed": computed[0], "times": list(times), "errors": list(errors),
                          "calls": calls[0]}), flush=True)
    os._exit(0)   # callers still queued in PgBouncer count as unanswered


def child_callers(args):
    client = make_client(args)
    computed, lock = [0], threading.Lock()
    times, errors = [], []

    def compute(key):
        with lock:
            computed[0] += 1
        time.sleep(args["compute_seconds"])
        return {"key": key}

    def caller(i):
        key = args["keys"][i % len(args["keys"])]
        time.sleep(max(0.0, args["start_at"] - time.time()))   # everyone at once
        try:
            client.get_or_compute(key, lambda: compute(key), ttl=300, wait=60)
            with lock:
                times.append(time.time() - args["start_at"])
        except Exception as exc:
            with lock:
                errors.append(repr(exc))

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(args["threads"])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps({"computed": computed[0], "times": times, "errors": errors,
                      "calls": client.calls.total}), flush=True)
    client.close()


def child_owner(args):
    client = make_client(args)

    def compute():
        print(json.dumps({"computing": time.time()}), flush=True)
        time.sleep(600)
    client.get_or_compute(args["key"], compute, lease=30)


def child_taker(args):
    client = make_client(args)
    took = {}

    def compute():
        took["at"] = time.time()
        return "taken over"
    client.get_or_compute(args["key"], compute, lease=30, wait=60)
    print(json.dumps({"took_over_at": took.get("at")}), flush=True)
    client.close()


# -- the parent ----------------------------------------------------------------------------

def spawn(mode, args):
    return subprocess.Popen([sys.executable, __file__, "--child", mode, json.dumps(args)],
                            stdout=subprocess.PIPE, text=True)


def percentile(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))] if values else None


def callers_row(base, setup, callers, processes):
    keys = [f"bench-pooled/{uuid.uuid4().hex[:8]}/{i}" for i in range(3)]
    per = callers // processes
    args = dict(base, setup=setup, keys=keys, threads=per, compute_seconds=1.0,
                start_at=time.time() + 2.0 + 0.1 * processes)   # time to import and connect
    mode = "raw_callers" if setup.startswith("raw-") else "callers"
    children = [spawn(mode, args) for _ in range(processes)]
    reports = [json.loads(c.communicate()[0].strip().splitlines()[-1]) for c in children]
    times = [t for r in reports for t in r["times"]]
    return {"row": "callers", "setup": setup, "callers": callers, "processes": processes,
            "keys": 3, "compute_s": 1.0,
            "computations": sum(r["computed"] for r in reports),
            "answered": len(times),
            "errors": sum(len(r["errors"]) for r in reports),
            "p50_s": round(percentile(times, 50), 3) if times else None,
            "p99_s": round(percentile(times, 99), 3) if times else None,
            "db_calls_per_caller": round(sum(r["calls"] for r in reports) / callers, 3)}


def takeover_row(base, setup):
    key = f"bench-pooled/takeover/{uuid.uuid4().hex[:8]}"
    args = dict(base, setup=setup, key=key)
    owner = spawn("owner", args)
    json.loads(owner.stdout.readline())            # it holds the claim and computes
    taker = spawn("taker", args)
    time.sleep(1.5)                                # the taker is waiting on the key
    killed_at = time.time()
    os.kill(owner.pid, signal.SIGKILL)
    owner.wait()
    report = json.loads(taker.communicate(timeout=90)[0].strip().splitlines()[-1])
    return {"row": "takeover", "setup": setup, "lease_s": 30,
            "takeover_ms": round((report["took_over_at"] - killed_at) * 1000, 1)}


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        {"callers": child_callers, "raw_callers": child_raw_callers, "owner": child_owner,
         "taker": child_taker}[sys.argv[2]](
            json.loads(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", required=True, help="direct libpq conninfo")
    parser.add_argument("--bouncer-dsn", help="the same server through PgBouncer in transaction mode")
    parser.add_argument("--setups", default=",".join(SETUPS), help="comma-separated subset of " + ",".join(SETUPS))
    parser.add_argument("--rows", default="100x4,1000x10", help="callersxprocesses, comma-separated")
    opts = parser.parse_args()
    base = {"dsn": opts.dsn, "bouncer_dsn": opts.bouncer_dsn}
    rows = [tuple(int(x) for x in r.split("x")) for r in opts.rows.split(",")]
    for setup in opts.setups.split(","):
        if setup == "pgbouncer" and not opts.bouncer_dsn:
            print(json.dumps({"setup": setup, "skipped": "no --bouncer-dsn"}), flush=True)
            continue
        if setup.startswith("raw-") and not opts.bouncer_dsn and setup == "raw-pgbouncer":
            continue
        for callers, processes in rows:
            if setup == "raw-direct" and callers > 200:
                continue   # one server connection per caller
            print(json.dumps(callers_row(base, setup, callers, processes)), flush=True)
            if setup == "raw-pgbouncer":
                time.sleep(12)   # the waits abandoned callers left running end (wait 10 s)
        if not setup.startswith("raw-"):
            print(json.dumps(takeover_row(base, setup)), flush=True)


if __name__ == "__main__":
    main()
