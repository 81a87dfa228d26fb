"""BENCHMARKS.md's tables and plots, from the JSON lines scripts/bench.sh's sections append
to bench/results/results.jsonl (one line per run or round): the one renderer of benchmark
reports. bench.sh writes the prose around the tables; every figure comes from here.

usage: report.py table NAME RESULTS.jsonl    one table, in markdown (names: TABLES below)
       report.py plots RESULTS.jsonl OUTPUT_DIR

Medians are the lower middle value of the rounds (every run so far has an odd number of
them) and ratios divide the medians as printed, so a row reads consistently.
"""

import json
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import freshness as freshness_run  # the model the XFetch check compares against


def load(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def pyplot():
    """matplotlib, only for plots: the tables need nothing beyond the standard library."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, ax, path, xlabel, ylabel, title, legend_size=None):
    """Labels, grid and legend every chart shares; writes the PNG."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=legend_size)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_cycles(rows, out):
    """claim+complete cycles/s by clients: pg_once vs hand-made, per link."""
    fig, ax = pyplot().subplots(figsize=(7, 4.5))
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


def plot_queue(rows, out):
    """jobs/s by workers, one connection each: pg_once vs plain SKIP LOCKED table, n = 1 and 10."""
    fig, ax = pyplot().subplots(figsize=(7, 4.5))
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


def plot_stampede(rows, out):
    """Distribution of answer latency per waiting strategy (all rounds pooled)."""
    fig, ax = pyplot().subplots(figsize=(8, 4.8))
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


def plot_freshness(rows, out):
    """XFetch (section 7, mode c) against the paper's model: the chance that one read
    draws the early refresh, and when the first draw came before expiry."""
    runs = [r for r in rows if r["bench"] == "freshness" and r.get("xfetch", {}).get("generations")]
    if not runs:
        return
    x = runs[-1]["xfetch"]
    ttl, beta, lam = x["ttl_s"], x["beta"], x["lambda_per_key"]
    fig, (left, right) = pyplot().subplots(1, 2, figsize=(12, 4.6))
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


def plot_scale(path, out):
    """Per-call paths by number of keys, from bench/scale-sizes.sh's JSON lines (if any)."""
    if not path.exists():
        return
    rows = sorted(load(path), key=lambda r: r["keys"])
    keys = [r["keys"] for r in rows]
    fig, ax = pyplot().subplots(figsize=(8, 5))
    for field, label in [("hit_p50_ms", "hit (p50)"), ("cycle_p50_ms", "claim + complete (p50)"),
                         ("queue_p50_ms", "claim_next(10) + complete_keys (p50)"),
                         ("reap_ms", "reap_stale round, nothing to purge"),
                         ("stats_ms", "once.stats"), ("queue_stats_ms", "once.queue_stats")]:
        ax.plot(keys, [r[field] for r in rows], marker="o", label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    save(fig, ax, out / "scale.png", "keys in once.entries", "ms",
         "Per-call and per-scrape paths as the table grows", legend_size=8)


def plots(rows, results, out):
    plot_cycles(rows, out)
    plot_queue(rows, out)
    plot_stampede(rows, out)
    plot_freshness(rows, out)
    plot_scale(Path(results).with_name("scale-sizes.jsonl"), out)


# -- tables ------------------------------------------------------------------------------


def median_range(values, decimals=0):
    """`median (min-max)` of the rounds, and the median as printed (for ratios)."""
    values = sorted(values)
    f = "%%.%df" % decimals
    m = f % statistics.median_low(values)
    return "%s (%s-%s)" % (m, f % values[0], f % values[-1]), float(m)


def of(rows, bench):
    return [r for r in rows if r["bench"] == bench]


def by_label(rows):
    """Rows grouped by their label, in the order of their first round."""
    groups = {}
    for r in rows:
        groups.setdefault(r["label"], []).append(r)
    return groups


def table_cycles(rows):
    """Section 1: pgbench, A and B alternating."""
    print("| A vs B | A tx/s | B tx/s | A / B |")
    print("|---|---|---|---|")
    for r in of(rows, "pgbench"):
        a, ma = median_range(r["a_tps"])
        b, mb = median_range(r["b_tps"])
        print("| %s | %s | %s | %.2fx |" % (r["label"], a, b, ma / mb))


def ratio_2g(a, b):
    return "%.2gx" % (a / b)


STRATEGY_ORDER = ["server", "listen", "lock", "poll100", "poll1000"]


def table_stampede(rows):
    """Section 2: each row's latest answer against retrying every 100 ms, by callers."""
    print("| how callers wait | computations | p50 ms | p99 ms | max ms | max vs retry every 100 ms |")
    print("|---|---|---|---|---|---|")
    groups = by_label(of(rows, "stampede"))
    callers = list(dict.fromkeys(g[0]["callers"] for g in groups.values()))
    for n in callers:
        mine = [g for g in groups.values() if g[0]["callers"] == n]
        mine.sort(key=lambda g: STRATEGY_ORDER.index(g[0]["strategy"]))
        cells = {}
        for g in mine:
            cells[id(g)] = [median_range([r["computations"] for r in g])] + [
                median_range([r[f] for r in g], 1) for f in ("p50_ms", "p99_ms", "max_ms")]
        base = next(cells[id(g)][3][1] for g in mine if g[0]["strategy"] == "poll100")
        for g in mine:
            c = cells[id(g)]
            print("| %s | %s | %s | %s | %s | %s |" % (
                g[0]["label"], c[0][0], c[1][0], c[2][0], c[3][0], ratio_2g(c[3][1], base)))


def table_takeover(rows):
    """Section 3: takeover against a lease alone."""
    print("| design | takeover ms | vs lease only |")
    print("|---|---|---|")
    groups = list(by_label(of(rows, "takeover")).values())
    groups.sort(key=lambda g: g[0]["lease_only"])
    cells = [median_range([r["takeover_ms"] for r in g], 1) for g in groups]
    base = next(c[1] for g, c in zip(groups, cells) if g[0]["lease_only"])
    for g, c in zip(groups, cells):
        print("| %s | %s | %s |" % (g[0]["label"], c[0], ratio_2g(c[1], base)))


def table_listeners(rows):
    """Section 4: commits/s by once.notify, against off."""
    print("| listeners | once.notify | tx/s | vs off |")
    print("|---|---|---|---|")
    runs = of(rows, "listeners")
    for kind in dict.fromkeys(r["kind"] for r in runs):
        mine = [r for r in runs if r["kind"] == kind]
        off = next(median_range(r["tps"])[1] for r in mine if r["notify"] == "off")
        for r in mine:
            cell, m = median_range(r["tps"])
            print("| 100 %s | %s | %s | %.0f%% |" % (kind, r["notify"], cell, 100 * m / off))


def queue_setups(rows):
    """{batch: {setup label: {impl: [jobs/s of each round]}}}, in the order they ran, and
    which setups give each worker its own connection."""
    batches, own = {}, set()
    for r in of(rows, "queue"):
        w, c, f = r["workers"], r["connections"], r["in_flight"]
        if c < w:
            label = "%d over %d connections" % (w, c)
        elif f < w:
            label = "%d, %d in flight" % (w, f)
        else:
            label = str(w)
            own.add(label)
        setups = batches.setdefault(r["batch"], {})
        # One decimal, as the rounds were first reported.
        setups.setdefault(label, defaultdict(list))[r["with"]].append(float("%.1f" % r["cycles_per_s"]))
    return batches, own


def table_queue(rows):
    """Section 5: pg_once against the plain SKIP LOCKED table."""
    print("| workers | n | pg_once jobs/s | plain jobs/s | pg_once / plain | pg_once of peak | plain of peak |")
    print("|---|---|---|---|---|---|---|")
    batches, own = queue_setups(rows)
    for n, setups in batches.items():
        cells = {s: {impl: median_range(v) for impl, v in runs.items()} for s, runs in setups.items()}
        peak = {impl: max(c[impl][1] for s, c in cells.items() if s in own) for impl in ("once", "plain")}
        for s, c in cells.items():
            (a, ma), (b, mb) = c["once"], c["plain"]
            print("| %s | %s | %s | %s | %.2fx | %.0f%% | %.0f%% |" % (
                s, n, a, b, ma / mb, 100 * ma / peak["once"], 100 * mb / peak["plain"]))


def table_pgmq(rows):
    """Section 5: pg_once against pgmq, when the run had it (nothing otherwise)."""
    batches, _ = queue_setups(rows)
    lines = []
    for n, setups in batches.items():
        for s, runs in setups.items():
            if runs.get("pgmq"):
                ma = median_range(runs["once"])[1]
                c, mc = median_range(runs["pgmq"])
                lines.append("| %s | %s | %.0f | %s | %.2fx |" % (s, n, ma, c, ma / mc))
    if lines:
        print("| workers | n | pg_once jobs/s | pgmq jobs/s | pg_once / pgmq |")
        print("|---|---|---|---|---|")
        print("\n".join(lines))


def mb(b):
    return "%.1f MB" % (b / 1e6)


def table_bloat(rows):
    """Section 5: sizes of once.entries along the bloat run."""
    r = of(rows, "bloat")[-1]
    print("| after cycles | heap | indexes | dead rows | once.attempts |")
    print("|---|---|---|---|---|")
    for s in r["sizes"]:
        print("| %d | %s | %s | %d | %s |" % (s["cycles"], mb(s["heap_bytes"]), mb(s["index_bytes"]),
                                           s["dead_tuples"], mb(s["attempts_bytes"])))
    print()
    print("%d cycles in %.0f s (%.0f cycles/s)." % (r["cycles"], r["seconds"], r["cycles"] / r["seconds"]))


def table_pooled(rows):
    """Section 6: the Python client's callers, and the takeover of a killed pooled owner."""
    rows = of(rows, "pooled")
    label = {"raw-direct": "raw SQL, direct connection per caller",
             "raw-pgbouncer": "raw SQL, PgBouncer connection per caller",
             "direct": "client, direct", "pgbouncer": "client, PgBouncer (pool 6)",
             "psycopg_pool": "client, psycopg_pool (4 per process)"}
    base = {r["callers"]: r for r in rows if r.get("row") == "callers" and r["setup"] == "raw-direct"}
    print("| setup | callers / processes | computations | answered | p50 | p99 | p99 / raw direct (100) | db calls per caller |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r.get("row") != "callers":
            continue
        b = base.get(100)
        ratio = "%.2fx" % (r["p99_s"] / b["p99_s"]) if b and r["p99_s"] and b["p99_s"] else "-"
        fmt = lambda v: "%.2f s" % v if v is not None else "-"  # noqa: E731
        print("| %s | %d / %d | %d | %d of %d | %s | %s | %s | %.2f |" % (
            label[r["setup"]], r["callers"], r["processes"], r["computations"], r["answered"],
            r["callers"], fmt(r["p50_s"]), fmt(r["p99_s"]), ratio, r["db_calls_per_caller"]))
    print()
    print("A killed owner process (SIGKILL mid-compute, 30 s lease), time until a waiting process")
    print("of the same setup took the key over:")
    print()
    print("| setup | takeover |")
    print("|---|---|")
    for r in rows:
        if r.get("row") == "takeover":
            print("| %s | %.0f ms |" % (label[r["setup"]], r["takeover_ms"]))


def ms(v):
    """Milliseconds to two significant digits at least, without a spurious fraction."""
    return "%.0f" % v if v >= 100 else "%.1f" % v if v >= 1 else "%.2f" % v


def table_freshness(rows):
    """Section 7: the four modes side by side, then each one's details."""
    rows = {r["mode"]: r for r in of(rows, "freshness")}

    def ratio(r, base, field):
        b = rows.get(base)
        if not b or not b[field]:
            return "-"
        return "%.2gx" % (r[field] / b[field])

    def spread(r, field):
        values = [x[field] for x in r["rounds_latency"]]
        return "%s (%s-%s)" % (ms(r[field]), ms(min(values)), ms(max(values)))

    print("| mode | computations per key per ttl | computations per refresh | p50 ms | p99 ms | max ms "
          "| answers over 50 ms | answers stale | largest staleness | p99 vs (a) / (d) "
          "| computations vs (a) / (d) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for mode in sorted(rows):
        r = rows[mode]
        print("| (%s) %s | %.2f | %.2f | %s | %s | %s | %.2f%% | %.1f%% | %s | %s / %s | %s / %s |" % (
            mode, r["label"], r["computations_per_key_per_ttl"], r["computations_per_episode"],
            spread(r, "p50_ms"), spread(r, "p99_ms"), spread(r, "max_ms"),
            100 * r["slow_share"], 100 * r["stale_share"],
            "%.0f ms" % (1e3 * r["max_staleness_s"]) if r["max_staleness_s"] else "-",
            ratio(r, "a", "p99_ms"), ratio(r, "d", "p99_ms"),
            ratio(r, "a", "computations"), ratio(r, "d", "computations")))
    print()
    for mode in sorted(rows):
        r = rows[mode]
        print("(%s): %d answers (%s), %d computations in %d refreshes; all rounds together: p50 %s ms, "
              "p99 %s ms, max %s ms; the answering statement in the server: p50 %s ms, p99 %s ms, "
              "max %s ms; client start lag p50 %.2f ms, p99 %.2f ms, max %.1f ms; client "
              "processes %.0f%% of a core; %d errors%s." % (
                  mode, r["answers"], ", ".join("%s %d" % kv for kv in sorted(r["outcomes"].items())),
                  r["computations"], r["episodes"], ms(r["pooled_p50_ms"]), ms(r["pooled_p99_ms"]),
                  ms(r["pooled_max_ms"]), ms(r["server_p50_ms"]), ms(r["server_p99_ms"]),
                  ms(r["server_max_ms"]), r["lag_p50_ms"], r["lag_p99_ms"], r["lag_max_ms"],
                  100 * r["client_cpu_share"],
                  r["errors"], (": " + "; ".join(r["error_samples"])) if r["errors"] else ""))


def table_xfetch(rows):
    """Section 7: XFetch's draws against the model (freshness_run.model_cdf)."""
    rows = {r["mode"]: r for r in of(rows, "freshness")}
    x = rows.get("c", {}).get("xfetch")
    if x and not x["generations"]:
        print("XFetch model check (c): no result lived its whole ttl inside a measured window "
              "(measure longer).")
    elif x:
        late = sum(1 for s, d in x["early"] if s < d)
        model_late = statistics.fmean(freshness_run.model_cdf(d, x["lambda_per_key"], x["beta"], d, x["ttl_s"])
                                      for _, d in x["early"])
        print("XFetch model check (c): beta = %g, %.0f reads/s per key, delta (the compute_time the "
              "server measured for each result) median %.1f ms, 10%%-90%% %.1f-%.1f ms. %d results lived their whole ttl inside the measured window; %d (%.1f%%) drew no early "
              "refresh (model: %.1f%%); %d drew two; %.1f%% drew it less than their delta before the "
              "expiry, so that callers past the expiry waited for it (model: %.1f%%). Kolmogorov-Smirnov distance between the measured "
              "and the model distribution of how long before expiry the refresh was drawn: %.3f "
              "(5%% critical value for n = %d: %.3f)." % (
                  x["beta"], x["lambda_per_key"], 1e3 * x["delta_s"], 1e3 * x["delta_p10_s"],
                  1e3 * x["delta_p90_s"], x["generations"], x["no_early_refresh"],
                  100 * x["no_early_refresh"] / max(1, x["generations"]), 100 * x["model_no_early"],
                  x["generations_with_two_refreshes"], 100 * late / len(x["early"]), 100 * model_late,
                  x["ks_d"], x["generations"],
                  1.36 / math.sqrt(max(1, x["generations"]))))


def table_hold(rows):
    """Section 8: jobs/s before, during and after a held snapshot."""
    print("| queue | before jobs/s | held | after | back to 90% of before | first autovacuum after the release |")
    print("|---|---|---|---|---|---|")
    for r in of(rows, "hold"):
        rate = lambda v: "-" if v is None else "%.0f" % v  # noqa: E731
        within = lambda s: "not within %.0f s" % r["after_s"] if s is None else "%.0f s" % s  # noqa: E731
        print("| %s | %.0f | %s | %s | %s | %s |" % (
            r["label"], r["before_jobs_per_s"], rate(r["held_jobs_per_s"]), rate(r["after_jobs_per_s"]),
            within(r["recovery_s"]), within(r["autovacuum_after_release_s"])))


def table_hold_sizes(rows):
    """Section 8: the queue table's sizes at the end of each phase."""
    runs = of(rows, "hold")[-2:]
    print("| queue | before | held | after |")
    print("|---|---|---|---|")
    for r in runs:
        ends = {}
        for i in r["intervals"]:
            ends[i["phase"]] = i
        cells = [f"{mb(ends[p]['heap_bytes'])} / {mb(ends[p]['index_bytes'])}" if p in ends else "-"
                 for p in ("before", "held", "after")]
        print(f"| {r['with']} | " + " | ".join(cells) + " |")


def table_memory(rows):
    """Section 8: memory per server process, and shared memory."""
    print("| connections | private MB median | private MB max | Pss MB median | Pss MB max | pg_once shared MB | server shared MB |")
    print("|---|---|---|---|---|---|---|")
    for label, runs in by_label(of(rows, "memory")).items():
        cells = [median_range([r[f] for r in runs], d)[0] for f, d in (
            ("private_median_mb", 2), ("private_max_mb", 2), ("pss_median_mb", 2), ("pss_max_mb", 2),
            ("once_shmem_mb", 2), ("shared_memory_mb", 0))]
        print("| %s | %s |" % (label, " | ".join(cells)))


def table_curve(rows):
    """Section 9: once.entries and each of its indexes along the long bloat run."""
    r = of(rows, "curve")[-1]
    mb1 = lambda b: "%.1f" % (b / 1e6)  # noqa: E731
    print("| after cycles | heap MB | indexes MB | entries_queue_idx | entries_pkey | entries_running_idx | once.attempts MB | dead rows | autovacuums |")
    print("|---|---|---|---|---|---|---|---|---|")
    for s in r["sizes"]:
        each = {k.split(".")[-1]: v for k, v in s["index_bytes_each"].items()}
        print("| %d | %s | %s | %s | %s | %s | %s | %d | %d |" % (
            s["cycles"], mb1(s["heap_bytes"]), mb1(s["index_bytes"]), mb1(each["entries_queue_idx"]),
            mb1(each["entries_pkey"]), mb1(each["entries_running_idx"]), mb1(s["attempts_bytes"]),
            s["dead_tuples"], s["autovacuums"]))
    print()
    print("%d cycles in %.0f s (%.0f cycles/s), %d autovacuums of once.entries."
          % (r["cycles"], r["seconds"], r["cycles"] / r["seconds"], r["sizes"][-1]["autovacuums"]))


def table_idempotency(rows):
    """Issue 27: POST /orders through each idempotency middleware against the same handler
    bare, rounds alternating (bench/idempotency/bench.py)."""
    runs = [r for r in of(rows, "idempotency") if r["row"] == "throughput"]
    print("| service | idempotent POST req/s | bare POST req/s | idempotent / bare "
          "| p50 ms idempotent / bare | p99 ms idempotent / bare |")
    print("|---|---|---|---|---|---|")
    for service in dict.fromkeys(r["service"] for r in runs):
        cells = {}
        for route in ("/orders", "/bare/orders"):
            mine = [r for r in runs if r["service"] == service and r["route"] == route]
            cells[route] = [median_range([r[f] for r in mine], d)
                            for f, d in (("rps", 0), ("p50_ms", 1), ("p99_ms", 1))]
        (a, ma), (b, mb) = cells["/orders"][0], cells["/bare/orders"][0]
        print("| %s | %s | %s | %.2fx | %s / %s | %s / %s |" % (
            service, a, b, ma / mb, cells["/orders"][1][0], cells["/bare/orders"][1][0],
            cells["/orders"][2][0], cells["/bare/orders"][2][0]))


def table_idempotency_duplicates(rows):
    """Issue 27: handler runs per key under concurrent identical requests, each middleware
    against the check-then-set baseline (the latest run of each service)."""
    latest = {r["service"]: r for r in of(rows, "idempotency") if r["row"] == "duplicates"}
    print("| service | keys x identical requests at once | handler runs | keys run more than once "
          "| most runs of one key | extra runs per key |")
    print("|---|---|---|---|---|---|")
    for r in sorted(latest.values(), key=lambda r: r["baseline"]):
        name = r["service"] + (" (check-then-set baseline)" if r["baseline"] else "")
        print("| %s | %d x %d | %d | %d | %d | %.2f |" % (
            name, r["keys"], r["retries"], r["handler_runs"], r["keys_run_more_than_once"],
            r["max_runs_per_key"], (r["handler_runs"] - r["keys"]) / r["keys"]))


def table_edition(rows):
    """Issue 28: the SQL edition against the extension, sides alternating in one run
    (bench/edition/edition.sh): each figure's median (range) on both, and their ratio."""
    runs = of(rows, "edition")
    measured = [r for r in runs if r["measure"] != "run"]
    # (row title, measure, size field, size, figure, decimals, what is better)
    lines = []
    for (measure, size_field) in (("hit", "clients"), ("cycle", "clients"),
                                  ("stampede", "callers"), ("takeover", None)):
        sizes = dict.fromkeys(r.get(size_field) for r in measured if r["measure"] == measure)
        for n in sizes:
            if measure in ("hit", "cycle"):
                what = "cache hits/s (claim_key)" if measure == "hit" else "claim+complete cycles/s"
                lines.append(("%s, %d client%s" % (what, n, "" if n == 1 else "s"), measure, size_field, n, "tps", 0, "higher"))
            elif measure == "stampede":
                for f in ("p50_ms", "p99_ms"):
                    lines.append(("stampede wake-up %s ms, %d callers" % (f[:3], n),
                                  measure, size_field, n, f, 1, "lower"))
            else:
                lines.append(("takeover ms (killed owner, 30 s lease)", measure, None, None,
                              "takeover_ms", 1, "lower"))
    print("| measure | extension | SQL edition | edition / extension |")
    print("|---|---|---|---|")
    for title, measure, size_field, n, field, decimals, _ in lines:
        cells = {}
        for side in ("extension", "edition"):
            mine = [r for r in measured if r["measure"] == measure and r["side"] == side
                    and (size_field is None or r.get(size_field) == n)]
            cells[side] = median_range([r[field] for r in mine], decimals) if mine else ("-", None)
        (a, ma), (b, mb) = cells["extension"], cells["edition"]
        ratio = "%.2fx" % (mb / ma) if ma and mb is not None else "-"
        print("| %s | %s | %s | %s |" % (title, a, b, ratio))
    # Waiting: per round and side, the extra server CPU of the longer stampede over the
    # 500 ms one of the same callers, per second of the extra computation.
    busy = {}
    for w in (r for r in measured if r["measure"] == "waiting"):
        short = [r for r in measured if r["measure"] == "stampede" and r["side"] == w["side"]
                 and r["round"] == w["round"] and r["callers"] == w["callers"]]
        if short and "server_cpu_s" in w:
            busy.setdefault((w["callers"], w["side"]), []).append(
                (w["server_cpu_s"] - short[0]["server_cpu_s"]) / w["longer_by_s"])
    for n in dict.fromkeys(c for c, _ in busy):
        a = median_range(busy.get((n, "extension"), [0]), 2)
        b = median_range(busy.get((n, "edition"), [0]), 2)
        ratio = "%.2gx" % (b[1] / a[1]) if a[1] > 0 else "-"
        print("| server cores busy while %d callers wait | %s | %s | %s |" % (n, a[0], b[0], ratio))
    computations = sorted({r["computations"] for r in measured if r["measure"] == "stampede"})
    loads = [r["load1"] for r in measured]
    for run in (r for r in runs if r["measure"] == "run"):
        print()
        print("pg_once %s (release build, preloaded) on PostgreSQL %s against the SQL edition of "
              "commit %s; %d rounds alternating the sides, %d s pgbench runs, %d cores; "
              "computations per stampede: %s; 1-minute load average %.1f to %.1f over the rows "
              "(%s before the run, %s after)." % (
                  run["extension_version"], run["postgres"], run["edition_commit"], run["rounds"],
                  run["seconds_per_run"], run["cores"], ", ".join(map(str, computations)) or "-",
                  min(loads, default=0), max(loads, default=0), run["load_before"], run["load_after"]))


TABLES = {
    "edition": table_edition,
    "cycles": table_cycles, "stampede": table_stampede, "takeover": table_takeover,
    "listeners": table_listeners, "queue": table_queue, "pgmq": table_pgmq, "bloat": table_bloat,
    "pooled": table_pooled, "freshness": table_freshness, "xfetch": table_xfetch,
    "hold": table_hold, "hold_sizes": table_hold_sizes, "memory": table_memory, "curve": table_curve,
    "idempotency": table_idempotency, "idempotency_duplicates": table_idempotency_duplicates,
}


def main():
    if len(sys.argv) == 4 and sys.argv[1] == "table" and sys.argv[2] in TABLES:
        TABLES[sys.argv[2]](load(sys.argv[3]))
    elif len(sys.argv) == 4 and sys.argv[1] == "plots":
        plots(load(sys.argv[2]), sys.argv[2], Path(sys.argv[3]))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
