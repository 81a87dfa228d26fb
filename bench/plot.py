"""Plots for BENCHMARKS.md from bench/results/results.jsonl (written by scripts/bench.sh).

usage: plot.py RESULTS.jsonl OUTPUT_DIR
"""

import json
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


def main():
    rows = load(sys.argv[1])
    out = Path(sys.argv[2])
    cycles(rows, out)
    queue(rows, out)
    stampede(rows, out)


if __name__ == "__main__":
    main()
