#!/usr/bin/env python3
"""Freshness benchmark (issue 16): what callers see when cached results expire.

    python bench/freshness.py run --dsn "host=127.0.0.1 port=5432 user=postgres dbname=postgres" \
        [--modes a,b,c,d] [--duration 60] > rows.jsonl

bench/report.py renders its table and the XFetch check (tables freshness and xfetch).

Not a test: `run` prints one JSON line per mode. Simulated traffic: KEYS keys, RATE
requests/s in all, Poisson arrivals (the sum of PROCESSES independent Poisson streams,
each request for a key drawn uniformly), a result lives TTL seconds and takes COMPUTE
seconds to compute (an asyncio sleep that holds no database connection: the caller
claims on a pooled connection, gives it back, sleeps, takes one again to complete). The
load is open loop: every request has a scheduled arrival time and its latency counts from
then, so a request stuck behind a stall, a full pool or a late client counts it all.
Modes, each on keys of its own, measured for DURATION seconds in all: in ROUNDS rounds
the modes take turns (a b c d, then d c b a, ...), each turn measured for DURATION /
ROUNDS seconds after WARMUP seconds of the same traffic and followed by COOLDOWN more:

  a  today's expiry: claim_key(wait => '5 s'); 'claimed' computes and completes with
     ttl; everyone else waits inside claim_key for the result.
  b  stale-while-revalidate: claim_key(serve_stale => true), complete_key(ttl, stale =>
     STALE). 'refresh' answers the old result at once and recomputes in the background;
     'stale' answers the old result at once.
  c  XFetch: claim_key(serve_stale => true), complete_key(ttl, beta => BETA). 'refresh'
     (drawn early by the server) answers the still-fresh result at once and recomputes
     in the background. No stale window: past expiry a caller waits as in (a).
  d  no coordination: a plain table; SELECT, and on a miss or an expired row every such
     caller computes and upserts.

Every turn starts from filled keys whose first expiries are spread evenly over one ttl
(filled together they would all expire at once, every ttl, a different benchmark). The
child processes (PROCESSES, each an asyncio loop with its own asyncpg pool, CONNECTIONS
shared between them) run the traffic; background refreshes run in the process that drew
them. Needs asyncpg and uvloop (or --loop asyncio), and pg_once 0.2 created in the
database. Each turn of a, b and c starts by deleting every row of once.entries: run it
on a throwaway cluster, as scripts/bench.sh does.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import random
import statistics
import sys
import time
from datetime import timedelta

MODES = {
    "a": "expiry, waiting (today)",
    "b": "stale-while-revalidate",
    "c": "XFetch",
    "d": "no coordination (plain table)",
}
PLAIN_TABLE = "freshness_plain_cache"
# An answer slower than this counts as having waited (for a computation, a pool
# connection or the client's own loop).
SLOW_S = 0.050
CLAIM_LEASE = "30 s"
CLAIM_WAIT = "5 s"
# Completions (complete_key, the plain table's upsert) take a connection from a small pool
# of their own. From the callers' pool they would queue behind callers that wait inside
# claim_key for that very completion, each holding a connection: once the pool is
# exhausted, nothing completes until the waits time out (5 s), and the backlog of an open
# loop never drains. An application has to keep them apart in the same way.
WRITE_CONNECTIONS = 8
# The model check (c) bins reads by how long before expiry they came, in units of beta
# delta.
READ_BIN_WIDTH = 0.2
READ_BINS = 40


def connect_kwargs(dsn):
    """asyncpg's keywords from a libpq conninfo ("host=... port=... user=... dbname=...")."""
    kw = dict(part.split("=", 1) for part in dsn.split())
    if "dbname" in kw:
        kw["database"] = kw.pop("dbname")
    if "port" in kw:
        kw["port"] = int(kw["port"])
    return kw


def epoch(column):
    return f"extract(epoch FROM {column})::float8"


# How long the statement has been running in the server (waiting included).
SPENT = epoch("clock_timestamp() - statement_timestamp()")


def claim_sql(mode):
    serve_stale = ", serve_stale => true" if mode in ("b", "c") else ""
    return (f"SELECT outcome, token, result, {epoch('expires_at')}, {epoch('clock_timestamp()')},"
            f" {SPENT} FROM once.claim_key($1, lease => '{CLAIM_LEASE}', wait => '{CLAIM_WAIT}'{serve_stale})")


def complete_sql(mode):
    extra = {"a": "", "b": ", stale => $5::interval", "c": ", beta => $5::float8"}[mode]
    return (f"SELECT once.complete_key($1, $2, $3::jsonb, ttl => $4::interval{extra}),"
            f" {epoch('clock_timestamp()')}")


GENERATION = f"SELECT {epoch('expires_at')}, {epoch('compute_time')} FROM once.entries WHERE key = $1"


def complete_args(mode, args, ttl_s):
    extra = {"a": (), "b": (timedelta(seconds=args["stale"]),), "c": (args["beta"],)}[mode]
    return (timedelta(seconds=ttl_s),) + extra


SELECT_PLAIN = (f"SELECT value, {epoch('expires_at')}, {epoch('clock_timestamp()')}, {SPENT}"
                f" FROM {PLAIN_TABLE} WHERE key = $1")
UPSERT_PLAIN = (f"INSERT INTO {PLAIN_TABLE} (key, value, expires_at)"
                f" VALUES ($1, $2::jsonb, clock_timestamp() + $3::interval)"
                f" ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value, expires_at = EXCLUDED.expires_at"
                f" RETURNING {epoch('clock_timestamp()')}")


def value_for(key):
    return json.dumps({"key": key, "computed_at": time.time(), "pid": os.getpid()})


# -- child: one process's share of the traffic ------------------------------------------

class Traffic:
    """One process's open-loop traffic for one mode.

    answers: (key index, outcome, latency s, start lag s, server time of the answer,
              expiry of the result served or None for a result just computed,
              scheduled arrival in s from the start, seconds the answering statement
              spent in the server)
    computations: (key index, kind, start, end, completed, generation, server time of the
                  claim, server time of the completion) with start and end by the client;
                  for (c) generation is the expiry the completion gave the result and the
                  compute_time the server measured for it (what its early-refresh draws
                  use), else None
    """

    def __init__(self, args, pool, write_pool):
        self.args, self.pool, self.write_pool, self.mode = args, pool, write_pool, args["mode"]
        self.loop = asyncio.get_running_loop()
        self.answers, self.computations, self.errors = [], [], []
        self.background = set()
        self.claim = claim_sql(self.mode) if self.mode != "d" else None
        self.complete = complete_sql(self.mode) if self.mode != "d" else None

    def key(self, i):
        return f"{self.args['prefix']}{i}"

    def answer(self, i, outcome, scheduled, started, srv_now, expires, spent):
        now = self.loop.time()
        self.answers.append((i, outcome, now - scheduled, started - scheduled, srv_now, expires,
                             scheduled - self.start_mono, spent))

    async def compute_and_complete(self, i, kind, token, srv_claim):
        """The computation: sleep holding no connection, then complete_key on one."""
        start = time.time()
        await asyncio.sleep(self.args["compute"])
        generation = None
        async with self.write_pool.acquire() as conn:
            ok, srv_done = await conn.fetchrow(self.complete, self.key(i), token, value_for(self.key(i)),
                                               *complete_args(self.mode, self.args, self.args["ttl"]))
            if ok and self.mode == "c":
                # The result just stored stays until the next completion, which needs a
                # claim and a computation first.
                generation = tuple(await conn.fetchrow(GENERATION, self.key(i)))
        self.computations.append((i, kind, start, time.time(), bool(ok), generation, srv_claim, srv_done))
        if not ok:
            self.errors.append(f"complete_key of {self.key(i)} returned false")

    async def refresh_in_background(self, i, token, srv_claim):
        try:
            await self.compute_and_complete(i, "background", token, srv_claim)
        except Exception as exc:  # recorded, reported in the row
            self.errors.append(repr(exc))

    async def request_once(self, i, scheduled):
        started = self.loop.time()
        while True:
            async with self.pool.acquire() as conn:
                outcome, token, _result, expires, srv_now, spent = await conn.fetchrow(self.claim, self.key(i))
            if outcome == "hit":
                return self.answer(i, outcome, scheduled, started, srv_now, expires, spent)
            if outcome in ("refresh", "stale"):
                # The result at hand is answered at once; 'refresh' recomputes behind it.
                if outcome == "refresh":
                    task = asyncio.create_task(self.refresh_in_background(i, token, srv_now))
                    self.background.add(task)
                    task.add_done_callback(self.background.discard)
                return self.answer(i, outcome, scheduled, started, srv_now, expires, spent)
            if outcome == "claimed":
                await self.compute_and_complete(i, "foreground", token, srv_now)
                return self.answer(i, outcome, scheduled, started, srv_now, None, spent)
            # 'wait' (5 s passed) or 'failed': ask again, as a caller would.
            self.errors.append(f"claim_key answered {outcome}")

    async def request_plain(self, i, scheduled):
        started = self.loop.time()
        async with self.pool.acquire() as conn:
            row = await conn.fetchrow(SELECT_PLAIN, self.key(i))
        if row is not None and row[1] > row[2]:
            return self.answer(i, "hit", scheduled, started, row[2], row[1], row[3])
        start = time.time()
        await asyncio.sleep(self.args["compute"])
        async with self.write_pool.acquire() as conn:
            srv_done = await conn.fetchval(UPSERT_PLAIN, self.key(i), value_for(self.key(i)),
                                           timedelta(seconds=self.args["ttl"]))
        self.computations.append((i, "foreground", start, time.time(), True, None,
                                  row[2] if row else None, srv_done))
        self.answer(i, "computed", scheduled, started, srv_done, None, row[3] if row else None)

    async def request(self, i, scheduled):
        try:
            if self.mode == "d":
                await self.request_plain(i, scheduled)
            else:
                await self.request_once(i, scheduled)
        except Exception as exc:
            self.errors.append(repr(exc))

    async def run(self, start_mono):
        """Poisson arrivals at rate / processes from start_mono, for warmup + duration +
        cooldown seconds."""
        args = self.args
        self.start_mono = start_mono
        rng = random.Random(args["seed"])
        rate = args["rate"] / args["processes"]
        end = start_mono + args["warmup"] + args["duration"] + args["cooldown"]
        t, requests = start_mono, set()
        while True:
            t += rng.expovariate(rate)
            if t >= end:
                break
            delay = t - self.loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(self.request(rng.randrange(args["keys"]), t))
            requests.add(task)
            task.add_done_callback(requests.discard)
        while requests or self.background:
            await asyncio.gather(*requests, *self.background)


async def child_main(args):
    import asyncpg
    pool = await asyncpg.create_pool(min_size=args["connections"], max_size=args["connections"],
                                     **connect_kwargs(args["dsn"]))
    write_pool = await asyncpg.create_pool(min_size=WRITE_CONNECTIONS, max_size=WRITE_CONNECTIONS,
                                           **connect_kwargs(args["dsn"]))
    print("ready", flush=True)
    start_at = float(await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline))
    traffic = Traffic(args, pool, write_pool)
    cpu_before = time.process_time()
    start_mono = traffic.loop.time() + (start_at - time.time())
    # A collection of the growing record lists would pause the loop for milliseconds,
    # and the pause would count as latency.
    gc.disable()
    await traffic.run(start_mono)
    cpu = time.process_time() - cpu_before
    gc.enable()
    await pool.close()
    await write_pool.close()
    print(json.dumps({"answers": traffic.answers, "computations": traffic.computations, "cpu_s": cpu,
                      "errors": traffic.errors[:20], "error_count": len(traffic.errors)}), flush=True)


# -- parent: fill, run the children, summarize ------------------------------------------

async def fill(conn, mode, args):
    """Fill every key, with first expiries spread evenly over one ttl after the fill.

    For pg_once the fill is a real claim, COMPUTE seconds, complete: XFetch's delta is
    then a real computation time from the first generation on."""
    keys = [f"{args['prefix']}{i}" for i in range(args["keys"])]
    ttls = [args["ttl"] * (i + 1) / args["keys"] for i in range(args["keys"])]
    random.Random(args["seed"]).shuffle(ttls)
    if mode == "d":
        await conn.execute(f"CREATE TABLE IF NOT EXISTS {PLAIN_TABLE}"
                           " (key text PRIMARY KEY, value jsonb NOT NULL, expires_at timestamptz NOT NULL)")
        await conn.execute(f"TRUNCATE {PLAIN_TABLE}")
        await asyncio.sleep(args["compute"])
        for key, ttl in zip(keys, ttls):
            await conn.fetchval(UPSERT_PLAIN, key, value_for(key), timedelta(seconds=ttl))
        return
    tokens = []
    for key in keys:
        outcome, token = await conn.fetchrow(
            f"SELECT outcome, token FROM once.claim_key($1, lease => '{CLAIM_LEASE}')", key)
        if outcome != "claimed":
            raise SystemExit(f"fill: claim_key({key}) answered {outcome}")
        tokens.append(token)
    await asyncio.sleep(args["compute"])
    sql = complete_sql(mode)
    for key, token, ttl in zip(keys, tokens, ttls):
        ok, _ = await conn.fetchrow(sql, key, token, value_for(key), *complete_args(mode, args, ttl))
        if not ok:
            raise SystemExit(f"fill: complete_key({key}) returned false")


async def run_segment(mode, opts, round_no):
    """One round's traffic of one mode: fresh keys, fresh client processes; returns what
    they recorded and the measured window."""
    import asyncpg
    args = {
        "mode": mode, "dsn": opts.dsn, "keys": opts.keys, "rate": opts.rate, "ttl": opts.ttl,
        "compute": opts.compute, "stale": opts.stale, "beta": opts.beta,
        "duration": opts.duration / opts.rounds, "warmup": opts.warmup, "cooldown": opts.cooldown,
        "processes": opts.processes, "loop": opts.loop,
        "connections": max(1, opts.connections // opts.processes),
        "prefix": f"freshness-{mode}-{os.getpid()}-{round_no}-", "seed": opts.seed + round_no,
    }
    conn = await asyncpg.connect(**connect_kwargs(opts.dsn))
    if mode != "d":
        # Each mode starts on an empty once.entries, as the plain table starts empty.
        await conn.execute("DELETE FROM once.entries")
    await conn.execute("VACUUM ANALYZE")
    children = []
    for p in range(opts.processes):
        child = await asyncio.create_subprocess_exec(
            sys.executable, os.path.abspath(__file__), "child",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, limit=1 << 30)
        child.stdin.write((json.dumps(dict(args, seed=args["seed"] * 1000 + p)) + "\n").encode())
        await child.stdin.drain()
        children.append(child)
    for child in children:
        line = await child.stdout.readline()
        if line.strip() != b"ready":
            raise SystemExit(f"child did not start: {line!r}")
    await fill(conn, mode, args)
    start_at = time.time() + 0.05
    for child in children:
        child.stdin.write(f"{start_at}\n".encode())
        await child.stdin.drain()
    results = []
    for child in children:
        out = await child.stdout.readline()
        await child.wait()
        if not out:
            raise SystemExit(f"mode {mode}: a child process failed")
        results.append(json.loads(out))
    await conn.close()
    # The measured window, by this machine's clock, which the server's clock_timestamp()
    # reads too.
    window = (start_at + args["warmup"], start_at + args["warmup"] + args["duration"])
    return {"args": args, "window": window, "processes": results}


def percentile(sorted_values, q):
    if not sorted_values:
        return None
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def episodes(computations):
    """Computations of the same key that overlap in time form one episode: one refresh.
    Their times are the server's, from the claim to the completion: the client's own
    would stretch with any delay in answering it and make turns that followed each other
    at the server look concurrent."""
    by_key = {}
    for key, _kind, start, end, _ok, _gen, srv_claim, srv_done in computations:
        if srv_claim is not None and srv_done is not None:
            start, end = srv_claim, srv_done
        by_key.setdefault(key, []).append((start, end))
    count = 0
    for spans in by_key.values():
        spans.sort()
        reach = -math.inf
        for start, end in spans:
            if start > reach:
                count += 1
            reach = max(reach, end)
    return count


def summarize(mode, opts, segments):
    """The row of one mode, from its segments (one per round): requests that arrived in a
    measured window, computations that started in one."""
    args = segments[0]["args"]
    answers, computations, results, rounds = [], [], [], []
    for seg in segments:
        a0, a1 = seg["args"]["warmup"], seg["args"]["warmup"] + seg["args"]["duration"]
        w0, w1 = seg["window"]
        latencies = []
        for r in seg["processes"]:
            measured = [tuple(a) for a in r["answers"] if a0 <= a[6] < a1]
            answers += measured
            latencies += [a[2] for a in measured]
            computations += [tuple(c) for c in r["computations"] if w0 <= c[2] < w1]
            results.append(r)
        latencies.sort()
        rounds.append({"p50_ms": 1e3 * percentile(latencies, 0.50), "p99_ms": 1e3 * percentile(latencies, 0.99),
                       "max_ms": 1e3 * latencies[-1]})
    latencies = sorted(a[2] for a in answers)
    lags = sorted(a[3] for a in answers)
    spent = sorted(a[7] for a in answers if a[7] is not None)
    # A hit is fresh by the server's judgement when it read the row; the answer's time
    # stamp comes a little later and may pass the expiry by microseconds. 'stale' and
    # 'refresh' answers serve the result they carry, past its expiry or not.
    stale_ages = [a[4] - a[5] for a in answers
                  if a[1] in ("stale", "refresh") and a[5] is not None and a[5] < a[4]]
    outcomes = {}
    for a in answers:
        outcomes[a[1]] = outcomes.get(a[1], 0) + 1
    traffic_s = sum(seg["args"]["warmup"] + seg["args"]["duration"] + seg["args"]["cooldown"]
                    for seg in segments)
    row = {
        "mode": mode, "label": MODES[mode], "keys": args["keys"], "rate": args["rate"],
        "ttl_s": args["ttl"], "compute_s": args["compute"], "duration_s": opts.duration,
        "rounds": opts.rounds, "processes": args["processes"],
        "connections": args["connections"] * args["processes"],
        "stale_s": args["stale"] if mode == "b" else None, "beta": args["beta"] if mode == "c" else None,
        "answers": len(answers), "outcomes": outcomes,
        "computations": len(computations),
        "computations_per_key_per_ttl": len(computations) / (args["keys"] * opts.duration / args["ttl"]),
        "episodes": episodes(computations),
        # Latency by round (each round is a run of its own: a burst of other work on the
        # machine lands on one) and over all rounds together.
        "rounds_latency": rounds,
        "p50_ms": statistics.median(r["p50_ms"] for r in rounds),
        "p99_ms": statistics.median(r["p99_ms"] for r in rounds),
        "max_ms": statistics.median(r["max_ms"] for r in rounds),
        "pooled_p50_ms": 1e3 * percentile(latencies, 0.50), "pooled_p99_ms": 1e3 * percentile(latencies, 0.99),
        "pooled_max_ms": 1e3 * latencies[-1],
        "slow_share": sum(1 for v in latencies if v > SLOW_S) / len(latencies),
        "lag_p50_ms": 1e3 * percentile(lags, 0.50), "lag_p99_ms": 1e3 * percentile(lags, 0.99),
        "lag_max_ms": 1e3 * lags[-1],
        "server_p50_ms": 1e3 * percentile(spent, 0.50), "server_p99_ms": 1e3 * percentile(spent, 0.99),
        "server_max_ms": 1e3 * spent[-1],
        "stale_share": len(stale_ages) / len(answers),
        "max_staleness_s": max(stale_ages, default=0.0),
        "client_cpu_share": sum(r["cpu_s"] for r in results) / traffic_s,
        "errors": sum(r["error_count"] for r in results),
        "error_samples": [e for r in results for e in r["errors"]][:5],
    }
    row["computations_per_episode"] = row["computations"] / max(1, row["episodes"])
    if mode == "c":
        row["xfetch"] = xfetch_check(args, segments)
    return row


def xfetch_check(args, segments):
    """What the model check needs, from the reads of (c) and its computations.

    A generation is one result: a key and the expiry its completion gave it. Its delta is
    the compute_time the server measured for it, which is what the draws on it use (it
    varies with the machine's load). Only generations that lived their whole ttl inside
    the measured window count, with all their reads, warm-up and cool-down traffic
    included, so that no draw goes unseen.
      reads: every read that could have drawn an early refresh (a hit on the generation
             before its refresh was drawn, or the drawing read itself), by how long
             before the expiry it came in units of beta delta, and whether it drew;
      early: for every generation, how long before its expiry the refresh was drawn (0:
             none was, the first caller past the expiry recomputed), with its delta."""
    ttl, beta = args["ttl"], args["beta"]
    deltas, generations = {}, {}
    for n, seg in enumerate(segments):
        window = seg["window"]
        for r in seg["processes"]:
            for c in r["computations"]:
                if c[5] is not None:
                    deltas[(n, c[0], round(c[5][0], 6))] = c[5][1]
            for key, outcome, _lat, _lag, srv_now, expires, *_ in r["answers"]:
                if (expires is not None and outcome in ("hit", "refresh")
                        and window[0] <= expires - ttl and expires <= window[1]):
                    generations.setdefault((n, key, expires), []).append((srv_now, outcome))
    early, bins, multi, unknown = [], {}, 0, 0
    for (n, key, expires), reads in generations.items():
        delta = deltas.get((n, key, round(expires, 6)))
        if delta is None:
            unknown += 1
            continue
        reads.sort()
        drawn = [t for t, o in reads if o == "refresh" and t < expires]
        if len(drawn) > 1:
            multi += 1
        first = drawn[0] if drawn else math.inf
        for t, _o in reads:
            if t > first or t >= expires:
                break
            b = min(READ_BINS - 1, int((expires - t) / (beta * delta) / READ_BIN_WIDTH))
            seen, hits = bins.get(b, (0, 0))
            bins[b] = (seen + 1, hits + (1 if t == first else 0))
        early.append((expires - first if drawn else 0.0, delta))
    lam = args["rate"] / args["keys"]
    sorted_deltas = sorted(d for _, d in early)
    return {
        "beta": beta, "lambda_per_key": lam, "ttl_s": ttl,
        "delta_s": statistics.median(sorted_deltas) if early else None,
        "delta_p10_s": percentile(sorted_deltas, 0.1), "delta_p90_s": percentile(sorted_deltas, 0.9),
        "generations": len(early), "generations_without_delta": unknown,
        "early": sorted([round(s, 5), round(d, 5)] for s, d in early),
        "no_early_refresh": sum(1 for s, _ in early if s == 0.0),
        "generations_with_two_refreshes": multi,
        "read_bins": [[b * READ_BIN_WIDTH, (b + 1) * READ_BIN_WIDTH, seen, hits]
                      for b, (seen, hits) in sorted(bins.items())],
        "model_no_early": statistics.fmean(model_cdf(0.0, lam, beta, d, ttl) for d in sorted_deltas)
        if early else None,
        "ks_d": ks_distance(early, lam, beta, ttl),
    }


def model_cdf(s, lam, beta, delta, ttl):
    """P(the first early refresh is drawn at most s before expiry), Poisson reads at rate lam.

    A read s before expiry draws with probability exp(-s / (beta delta)) (the paper's
    rule); reads arrive at rate lam from the completion (ttl before expiry) on, and the
    first draw is the refresh. No draw in (s, ttl]: exp(-lam * integral of
    exp(-u / (beta delta)) du over (s, ttl])."""
    bd = beta * delta
    return math.exp(-lam * bd * (math.exp(-s / bd) - math.exp(-ttl / bd)))


def ks_distance(early, lam, beta, ttl):
    """Kolmogorov-Smirnov distance between the empirical CDF of the draws' times before
    expiry and the model's: the mean of model_cdf over the generations' deltas."""
    xs = sorted(s for s, _ in early)
    deltas = [d for _, d in early]
    n, d = len(xs), 0.0
    for i, x in enumerate(xs):
        f = statistics.fmean(model_cdf(x, lam, beta, delta, ttl) for delta in deltas)
        d = max(d, abs((i + 1) / n - f), abs(i / n - f) if x > 0 else 0.0)
    return d


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        args = json.loads(sys.stdin.readline())
        if args["loop"] == "uvloop":
            # libuv's loop costs the client about a third less CPU per request than
            # asyncio's own; the client's CPU is latency when the machine is busy.
            import uvloop
            asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
        asyncio.run(child_main(args))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["run"])
    parser.add_argument("--dsn", required=True, help="libpq conninfo of a server with pg_once")
    parser.add_argument("--modes", default="a,b,c,d", help="comma-separated, of " + ",".join(MODES))
    parser.add_argument("--keys", type=int, default=100)
    parser.add_argument("--rate", type=float, default=2000, help="requests/s in all")
    parser.add_argument("--ttl", type=float, default=2.0, help="seconds")
    parser.add_argument("--compute", type=float, default=0.3, help="seconds per computation")
    parser.add_argument("--stale", type=float, default=10.0, help="stale window of (b), seconds")
    parser.add_argument("--beta", type=float, default=1.0, help="XFetch beta of (c)")
    parser.add_argument("--duration", type=float, default=60, help="seconds measured per mode, in all")
    parser.add_argument("--rounds", type=int, default=4,
                        help="the modes take turns this many times, each measured duration / rounds")
    parser.add_argument("--warmup", type=float, default=5,
                        help="seconds of traffic before the measured window (connections and"
                             " prepared statements warm, expiries in their steady pattern)")
    parser.add_argument("--cooldown", type=float, default=2,
                        help="seconds of traffic after it, so that its last requests still see"
                             " the same load")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--connections", type=int, default=200, help="in all, shared by the processes")
    parser.add_argument("--seed", type=int, default=16)
    parser.add_argument("--raw", metavar="PREFIX",
                        help="also write every answer and computation to PREFIX<mode>.json")
    parser.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop",
                        help="the client processes' event loop")
    opts = parser.parse_args()
    modes = opts.modes.split(",")
    for mode in modes:
        if mode not in MODES:
            parser.error(f"unknown mode {mode}")
    asyncio.run(run(opts, modes))


async def run(opts, modes):
    """Every round runs every mode, in the opposite order from the round before (a b c d,
    d c b a, ...), so that a slow spell of the machine falls on several modes' rounds."""
    segments = {mode: [] for mode in modes}
    for round_no in range(opts.rounds):
        for mode in (modes if round_no % 2 == 0 else modes[::-1]):
            segments[mode].append(await run_segment(mode, opts, round_no))
    for mode in modes:
        if opts.raw:
            with open(f"{opts.raw}{mode}.json", "w") as f:
                json.dump(segments[mode], f)
        print(json.dumps(summarize(mode, opts, segments[mode])), flush=True)


if __name__ == "__main__":
    main()
