"""Plots for BENCHMARKS.md from bench/results/results.jsonl (written by scripts/bench.sh).

usage: plot.py RESULTS.jsonl OUTPUT_DIR
"""

import json
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def save(fig, ax, path, xlabel, ylabel, title, legend_size=None):
    """Labels, grid and legend every chart shares; writes the PNG."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=legend_size)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def cycles(rows, out):
    """claim+complete cycles/s by clients: pg_once vs hand-made, per link."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for link, style in (("socket", "-"), ("rtt", "--")):
        series = defaultdict(dict)
        for r in rows:
            if r["bench"] == "pgbench" and r["a"] == "once_cycle" and r["link"] == link:
                series["pg_once"][r["clients"]] = statistics.median(r["a_tps"])
                series["hand-made"][r["clients"]] = statistics.median(r["b_tps"])
        for name, points in series.items():
            xs = sorted(points)
            where = "local socket" if link == "socket" else "0.5 ms RTT"
            ax.plot(xs, [points[x] for x in xs], style, marker="o", label=f"{name}, {where}")
    ax.set_xscale("log", base=2)
    save(fig, ax, out / "cycles.png", "clients", "claim+complete cycles / s",
         "Cycles on distinct keys (median of rounds)")


def queue(rows, out):
    """jobs/s by workers, one connection each: pg_once vs plain SKIP LOCKED table, n = 1 and 10."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = defaultdict(lambda: defaultdict(list))
    for r in rows:
        # Shared connections and capped in-flight runs are rows of the table, not points here.
        own = r.get("connections", r.get("workers")) == r.get("workers") == r.get("in_flight", r.get("workers"))
        if r["bench"] == "queue" and own:
            series[(r["with"], r["batch"])][r["workers"]].append(r["cycles_per_s"])
    for (impl, batch), points in sorted(series.items()):
        xs = sorted(points)
        name = "pg_once" if impl == "once" else "plain table"
        style = "-" if impl == "once" else "--"
        ax.plot(xs, [statistics.median(points[x]) for x in xs], style, marker="o", label=f"{name}, n = {batch}")
    ax.set_xscale("log", base=2)
    save(fig, ax, out / "queue.png", "workers", "jobs / s", "claim_next + complete, by workers")


def stampede(rows, out):
    """Distribution of answer latency per waiting strategy (all rounds pooled)."""
    fig, ax = plt.subplots(figsize=(8, 4.8))
    pooled = defaultdict(list)
    for r in rows:
        if r["bench"] == "stampede":
            pooled[r["label"]].extend(r["latencies_ms"])
    for label, values in pooled.items():
        values = sorted(values)
        ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=label)
    ax.set_xscale("symlog", linthresh=1)
    save(fig, ax, out / "stampede.png", "ms from the owner's complete_key to the caller's answer",
         "fraction of callers answered", "Stampede on one cold key", legend_size=7)


def freshness(rows, out):
    """XFetch (section 7, mode c) against the paper's model: the chance that one read
    draws the early refresh, and when the first draw came before expiry."""
    runs = [r for r in rows if r["bench"] == "freshness" and r.get("xfetch", {}).get("generations")]
    if not runs:
        return
    x = runs[-1]["xfetch"]
    ttl, beta, lam = x["ttl_s"], x["beta"], x["lambda_per_key"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6))
    mids, probs, errs = [], [], []
    for lo, hi, seen, drawn in x["read_bins"]:
        if seen and drawn:
            p = drawn / seen
            mids.append((lo + hi) / 2)
            probs.append(p)
            errs.append(math.sqrt(p * (1 - p) / seen))
    left.errorbar(mids, probs, yerr=errs, fmt="o", markersize=3, label="measured (+- 1 standard error)")
    top = max(hi for _, hi, _, _ in x["read_bins"])
    grid = [top * i / 200 for i in range(201)]
    left.plot(grid, [math.exp(-u) for u in grid], label="exp(-s / (beta delta))")
    left.set_yscale("log")
    left.set_ylim(math.exp(-top) / 4, 2)
    left.set_xlabel("s / (beta delta): time before expiry of the read, in units of beta delta")
    left.set_ylabel("share of reads that drew the refresh")
    left.set_title("One read: chance to draw an early refresh")
    left.grid(alpha=0.3)
    left.legend(fontsize=8)
    early = sorted(s for s, _ in x["early"])
    deltas = [d for _, d in x["early"]]
    n = len(early)
    right.step(early, [(i + 1) / n for i in range(n)], where="post", label=f"measured, {n} results")
    grid = [ttl * i / 200 for i in range(201)]
    model = [sum(math.exp(-lam * beta * d * (math.exp(-s / (beta * d)) - math.exp(-ttl / (beta * d))))
                 for d in deltas) / n for s in grid]
    right.plot(grid, model, "--", label=f"model: Poisson reads at {lam:.0f}/s per key, each result's delta")
    save(fig, right, out / "freshness.png", "S = how long before expiry the refresh was drawn (s)",
         "P(S <= s); S = 0: none drawn", "First early refresh of each result", legend_size=8)


def scale(path, out):
    """Per-call paths by number of keys, from bench/scale-sizes.sh's JSON lines (if any)."""
    if not path.exists():
        return
    rows = sorted(load(path), key=lambda r: r["keys"])
    keys = [r["keys"] for r in rows]
    fig, ax = plt.subplots(figsize=(8, 5))
    for field, label in [("hit_p50_ms", "hit (p50)"), ("cycle_p50_ms", "claim + complete (p50)"),
                         ("queue_p50_ms", "claim_next(10) + complete_keys (p50)"),
                         ("reap_ms", "reap_stale round, nothing to purge"),
                         ("stats_ms", "once.stats"), ("queue_stats_ms", "once.queue_stats")]:
        ax.plot(keys, [r[field] for r in rows], marker="o", label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    save(fig, ax, out / "scale.png", "keys in once.entries", "ms",
         "Per-call and per-scrape paths as the table grows", legend_size=8)


def main():
    rows = load(sys.argv[1])
    out = Path(sys.argv[2])
    cycles(rows, out)
    queue(rows, out)
    stampede(rows, out)
    freshness(rows, out)
    scale(Path(sys.argv[1]).with_name("scale-sizes.jsonl"), out)


if __name__ == "__main__":
    main()
