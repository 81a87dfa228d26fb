#!/usr/bin/env python3
"""Check pg_once's monitoring against a live server and a real postgres_exporter.

    check-monitoring.py METRICS_URL PSQL DSN

METRICS_URL is the /metrics page of a postgres_exporter that reads the server at DSN with
monitoring/postgres_exporter.yml; PSQL is the psql to run statements with. Checks:
- the exporter ran pg_once's queries without error;
- the metrics it exports are exactly those docs/operations.md documents (name and type);
- using pg_once moves them: a new key claimed, completed and hit, a job enqueued. When
  pg_once is preloaded (pg_once_shared_memory = 1) the call counters grow with the calls;
  otherwise they are NaN (once.stats shows them NULL);
- every metric named in a PromQL expression of monitoring/grafana-dashboard.json or
  monitoring/alerts.yml is one the exporter produced or the documentation lists;
- promtool (Prometheus) parses every one of those expressions, and the alerting rules
  pass their unit tests (monitoring/alerts_test.yml).
"""

import json
import math
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

root = Path(__file__).resolve().parent.parent
url, psql, dsn = sys.argv[1:4]
failures = []


def check(ok, message):
    if not ok:
        failures.append(message)


def scrape():
    """{(name, frozenset(labels)): value} and {name: type} of one scrape."""
    text = urllib.request.urlopen(url, timeout=30).read().decode()
    values, types = {}, {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            types[name] = kind
        elif line and not line.startswith("#"):
            m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)$", line)
            assert m, f"unparsable metrics line: {line!r}"
            labels = frozenset(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(3) or ""))
            values[(m.group(1), labels)] = float(m.group(4))
    return values, types


def value(values, name, **labels):
    """The value of the one series of `name` whose labels include `labels` (NaN, and a
    failure, if there is not exactly one)."""
    found = [v for (n, ls), v in values.items() if n == name and set(labels.items()) <= ls]
    check(len(found) == 1, f"{name}{labels}: {len(found)} series, expected 1")
    return found[0] if len(found) == 1 else math.nan


def sql(statement):
    subprocess.run([psql, "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", dsn, "-c", statement],
                   check=True, stdout=subprocess.DEVNULL)


# The documented metrics: the rows of the metrics table in docs/operations.md,
# | `name` | type | meaning |
docs = (root / "docs/operations.md").read_text()
documented = dict(re.findall(r"^\| `(pg_once_\w+)` \| (gauge|counter) \|", docs, flags=re.M))
check(len(documented) > 10, f"docs/operations.md documents only {len(documented)} metrics")

# A queue of our own, so that its depth moves only with our job.
sql("SELECT once.create_queue('ops-check') WHERE NOT EXISTS "
    "(SELECT FROM once.queue_stats WHERE queue = 'ops-check')")
before, types = scrape()
check(value(before, "pg_exporter_user_queries_load_error") == 0,
      "postgres_exporter could not load monitoring/postgres_exporter.yml")
check(value(before, "pg_exporter_last_scrape_error") == 0,
      "postgres_exporter's last scrape failed: see its log")
exported = {n for n, _ in before if n.startswith("pg_once")}
for name in sorted(exported - documented.keys()):
    check(False, f"{name} is exported but not documented in docs/operations.md")
for name in sorted(documented.keys() - exported):
    check(False, f"{name} is documented but the exporter did not produce it")
for name in sorted(exported & documented.keys()):
    check(types.get(name) == documented[name],
          f"{name}: exported as {types.get(name)}, documented as {documented[name]}")

# Use pg_once: two new keys claimed and completed, one read back, one job enqueued.
key = f"ops-check/{time.time_ns()}"
# Two claims: before a database's first claim, last_token already shows the value that
# claim will get (the token sequence's start), so one claim alone may not move it.
for k in [key, key + "/2"]:
    sql(f"SELECT once.complete_key('{k}', (once.claim_key('{k}')).token, '1')")
sql(f"SELECT once.claim_key('{key}')")
sql(f"SELECT once.enqueue_key('{key}/job', '{{}}', 'ops-check')")
after, _ = scrape()

check(value(after, "pg_once_done") >= value(before, "pg_once_done") + 2,
      "pg_once_done did not grow with the completed keys")
check(value(after, "pg_once_queue_depth", queue="ops-check")
      == value(before, "pg_once_queue_depth", queue="ops-check") + 1,
      "pg_once_queue_depth{queue=\"ops-check\"} did not grow by the enqueued job")
check(value(after, "pg_once_last_token") > value(before, "pg_once_last_token"),
      "pg_once_last_token did not grow with a claim")
counters = [n for n, kind in documented.items() if n.endswith("_total")]
if value(after, "pg_once_shared_memory") == 1:
    for name, calls in [("pg_once_claims_total", 2), ("pg_once_completions_total", 2),
                        ("pg_once_hits_total", 1)]:
        check(value(after, name) >= value(before, name) + calls,
              f"{name} did not grow by the {calls} call(s) made")
else:
    for name in counters:
        check(math.isnan(value(after, name)), f"{name} is not NaN without preloading")

# The dashboard and the alerting rules ask only for metrics that exist. (The rules'
# expressions are one line each: read without a YAML parser, which Debian's python3 lacks.)
dashboard = json.loads((root / "monitoring/grafana-dashboard.json").read_text())
promql_words = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool",
                "and", "or", "unless", "offset", "inf", "nan"}
panel_exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
rule_exprs = re.findall(r"^\s+expr: (.+)$", (root / "monitoring/alerts.yml").read_text(),
                        flags=re.M)
check(panel_exprs, "the dashboard has no PromQL expressions")
check(rule_exprs, "monitoring/alerts.yml has no expressions")
exprs = panel_exprs + rule_exprs
for expr in exprs:
    bare = re.sub(r'\{[^}]*\}|\[[^\]]*\]|"[^"]*"|\b(by|without|on|ignoring)\s*\([^)]*\)', " ",
                  expr)
    for name in re.findall(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\b(?!\s*\()", bare):
        if name.lower() in promql_words or re.fullmatch(r"\d.*|e\d*", name):
            continue
        check(name in exported or name in documented,
              f"{expr!r} (dashboard or alerts.yml) names {name}, which the exporter does not produce")

# Prometheus itself parses every expression (the dashboard's as recording rules; JSON is
# YAML) and runs the alerting rules' unit tests, monitoring/alerts_test.yml.
with tempfile.TemporaryDirectory() as tmp:
    panels = Path(tmp) / "dashboard-rules.yml"
    panels.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": [
        {"record": f"pg_once_dashboard_panel_{i}", "expr": e} for i, e in enumerate(panel_exprs)]}]}))
    for args in [["check", "rules", str(root / "monitoring/alerts.yml"), str(panels)],
                 ["test", "rules", str(root / "monitoring/alerts_test.yml")]]:
        run = subprocess.run(["promtool", *args], capture_output=True, text=True)
        check(run.returncode == 0, f"promtool {' '.join(args[:2])}:\n{run.stdout}{run.stderr}")

for f in failures:
    print("check-monitoring:", f)
if failures:
    sys.exit(1)
print(f"check-monitoring: {len(exported)} metrics exported and documented, "
      f"{len(panel_exprs)} dashboard queries and {len(rule_exprs)} alerting rules checked")
