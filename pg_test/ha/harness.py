#!/usr/bin/env python3
"""pg_once under a real HA manager: Patroni (etcd) with three PostgreSQL nodes, pg_once
preloaded, on loopback ports (issue 37; scripts/ha-test.sh runs it, README.md here says
what it proves).

Per replication mode (synchronous, then asynchronous, on one cluster: Patroni's dynamic
`synchronous_mode` is switched with PATCH /config between them):

  1. the three client load programs (pg_test/ha/load.py, load.mjs, tools' ha_load) and
     this checker's own raw-SQL load run against the multi-host connection string users
     would write (target_session_attrs=read-write);
  2. the checker leaves claims owned by its backends on the leader ("orphans");
  3. kill -9 of the leader's postmaster; Patroni promotes a replica; the load goes on;
  4. a planned switchover (REST POST /switchover); the load goes on; it stops;
  5. what every program recorded (JSON lines) is checked against the final leader.

Then, asynchronous only, with no load: the zombie scenario. The replicas' walreceivers
are stopped (SIGSTOP) while the leader hands out more tokens than a sequence pre-logs
(32), a zombie claims `zk` and keeps its token T, the leader is killed, a replica that
missed all of it is promoted, tokens are drawn on it until they reach T, `zk` is claimed
again: the zombie's complete_key(zk, T) must be refused and no token seen on the old
leader may come back.

Every wait is for a condition, polled with a bound. Exit status 0 only if every assertion
held; the figures are printed and written to <work>/figures.json.
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import psycopg

SLACK = 2.0
TIMEOUT = 60.0          # bound of any one awaited condition (promotion, replication)
CLIENTS = ("python", "node", "rust")
LOADS = {}              # every load program started, stopped at the end whatever happened
SUCCESSES = 15          # successful calls each load program makes in each stage


def log(msg):
    print(f"[ha {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Failed(Exception):
    pass


def wait_for(what, cond, timeout=TIMEOUT, every=0.1):
    """Poll cond() until it returns something truthy (returned), or fail after timeout."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            got = cond()
            if got:
                return got
        except Exception as exc:   # the condition's server may be down meanwhile
            last = exc
        time.sleep(every)
    raise Failed(f"timed out after {timeout:.0f} s waiting for {what}" +
                 (f" (last error: {last})" if last else ""))


class Cluster:
    def __init__(self, args):
        self.bin = args.bin
        self.work = args.work
        base = args.port
        self.etcd_port, self.etcd_peer = base, base + 1
        self.pg_ports = [base + 10 + i for i in range(3)]
        self.rest_ports = [base + 15 + i for i in range(3)]
        self.procs = {}
        self.names = [f"node{i}" for i in range(3)]

    # -- connection strings ---------------------------------------------------------------

    def dsn_all(self, attrs="read-write"):
        """The multi-host string an application would be given."""
        hosts = ",".join("127.0.0.1" for _ in self.pg_ports)
        ports = ",".join(map(str, self.pg_ports))
        return (f"host={hosts} port={ports} user=postgres dbname=postgres "
                f"target_session_attrs={attrs} connect_timeout=2")

    def url_all(self):
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.pg_ports)
        return f"postgres://postgres@{hosts}/postgres?target_session_attrs=read-write"

    def dsn(self, i):
        return f"host=127.0.0.1 port={self.pg_ports[i]} user=postgres dbname=postgres connect_timeout=2"

    def connect(self, i=None):
        return psycopg.connect(self.dsn_all() if i is None else self.dsn(i), autocommit=True)

    def sql(self, i, query, params=None):
        with self.connect(i) as c:
            return c.execute(query, params).fetchall()

    # -- Patroni's REST API ----------------------------------------------------------------

    def rest(self, i, path, method="GET", body=None, timeout=2):
        req = urllib.request.Request(f"http://127.0.0.1:{self.rest_ports[i]}{path}",
                                     method=method,
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                text = r.read().decode()
                return r.status, (json.loads(text) if text.startswith(("{", "[")) else text)
        except urllib.error.HTTPError as e:
            text = e.read().decode()
            return e.code, (json.loads(text) if text.startswith(("{", "[")) else text)

    def leader(self):
        """The node whose Patroni says it runs the primary with the leader lock, and whose
        server has left recovery (Patroni says so as soon as it asked for the promotion),
        or None."""
        for i in range(3):
            try:
                if self.rest(i, "/primary")[0] == 200 and \
                        not self.sql(i, "SELECT pg_is_in_recovery()")[0][0]:
                    return i
            except (OSError, psycopg.Error):
                pass
        return None

    def streaming(self, leader):
        """Replicas streaming from the leader: [(application_name, sync_state)]."""
        return self.sql(leader, "SELECT application_name, sync_state FROM pg_stat_replication"
                                " WHERE state = 'streaming'")

    def healthy(self, sync):
        """Leader index once it has both replicas streaming (one synchronous if sync)."""
        lead = self.leader()
        if lead is None:
            return None
        rows = self.streaming(lead)
        if len(rows) < 2:
            return None
        if sync and not any(s in ("sync", "quorum") for _, s in rows):
            return None
        if not sync and any(s == "sync" for _, s in rows):
            return None
        # Patroni's own view: it fails over only to the member it recorded as synchronous
        # (in the DCS, some time after the server itself reports the standby as sync).
        roles = [m.get("role") for m in self.rest(lead, "/cluster")[1].get("members", [])]
        if sync != ("sync_standby" in roles):
            return None
        return lead + 1   # truthy for wait_for

    # -- processes -------------------------------------------------------------------------

    def start(self):
        if os.path.exists(self.work):
            shutil.rmtree(self.work)
        os.makedirs(self.work)
        shutil.chown(self.work, "postgres", "postgres")
        etcd_dir = os.path.join(self.work, "etcd")
        self.procs["etcd"] = subprocess.Popen(
            ["etcd", "--name", "ha", "--data-dir", etcd_dir,
             "--listen-client-urls", f"http://127.0.0.1:{self.etcd_port}",
             "--advertise-client-urls", f"http://127.0.0.1:{self.etcd_port}",
             "--listen-peer-urls", f"http://127.0.0.1:{self.etcd_peer}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.etcd_peer}",
             "--initial-cluster", f"ha=http://127.0.0.1:{self.etcd_peer}",
             "--enable-v2=true", "--log-level", "warn"],
            stdout=open(os.path.join(self.work, "etcd.log"), "w"), stderr=subprocess.STDOUT,
            start_new_session=True)
        wait_for("etcd", lambda: urllib.request.urlopen(
            f"http://127.0.0.1:{self.etcd_port}/health", timeout=1).status == 200)
        post_init = os.path.join(self.work, "post_init.sh")
        with open(post_init, "w") as f:
            # What a user's bootstrap does: the extension in the database the apps use.
            f.write(f"#!/bin/sh\nexec '{self.bin}/psql' \"$1\" -Xq -v ON_ERROR_STOP=1"
                    " -c 'CREATE EXTENSION pg_once'\n")
        os.chmod(post_init, 0o755)
        for i in range(3):
            self.start_node(i, post_init)

    def config(self, i, post_init):
        node_dir = os.path.join(self.work, self.names[i])
        return {
            "scope": "pg_once_ha",
            "name": self.names[i],
            "log": {"level": "INFO"},
            "restapi": {"listen": f"127.0.0.1:{self.rest_ports[i]}",
                        "connect_address": f"127.0.0.1:{self.rest_ports[i]}"},
            "etcd": {"host": f"127.0.0.1:{self.etcd_port}"},
            "bootstrap": {
                "dcs": {
                    # Short, so that the test is quick: ttl >= loop_wait + 2 * retry_timeout.
                    "ttl": 10, "loop_wait": 1, "retry_timeout": 4,
                    # The zombie scenario promotes a replica that missed the leader's last
                    # WAL on purpose: any lag may fail over.
                    "maximum_lag_on_failover": 1 << 40,
                    # A crashed primary is failed over at once rather than restarted in
                    # place (Patroni's default waits 300 s for it to come back).
                    "primary_start_timeout": 0,
                    "synchronous_mode": False,
                    "postgresql": {
                        "use_pg_rewind": True,
                        "use_slots": True,
                        "parameters": {
                            "shared_preload_libraries": "pg_once",
                            "max_connections": 100,
                            "fsync": "off",   # throwaway cluster, as lib.sh's
                            "wal_keep_size": "64MB",
                            "synchronous_commit": "on",
                            "log_min_messages": "warning",
                            "log_line_prefix": "%m [%p] ",
                        },
                    },
                },
                "initdb": [{"encoding": "UTF8"}, {"locale": "C.UTF-8"}, "no-sync"],
                "pg_hba": ["local all all trust",
                           "local replication all trust",
                           "host all all 127.0.0.1/32 trust",
                           "host replication all 127.0.0.1/32 trust"],
                "post_init": post_init,
            },
            "postgresql": {
                "listen": f"127.0.0.1:{self.pg_ports[i]}",
                "connect_address": f"127.0.0.1:{self.pg_ports[i]}",
                "data_dir": os.path.join(node_dir, "data"),
                "bin_dir": self.bin,
                "pgpass": os.path.join(node_dir, "pgpass"),
                "authentication": {
                    "superuser": {"username": "postgres", "password": "postgres"},
                    "replication": {"username": "postgres", "password": "postgres"},
                    "rewind": {"username": "postgres", "password": "postgres"},
                },
                "basebackup": [{"checkpoint": "fast"}],
                "parameters": {"unix_socket_directories": node_dir},
                "pg_hba": ["local all all trust",
                           "local replication all trust",
                           "host all all 127.0.0.1/32 trust",
                           "host replication all 127.0.0.1/32 trust"],
            },
            "tags": {},
        }

    def start_node(self, i, post_init):
        node_dir = os.path.join(self.work, self.names[i])
        os.makedirs(node_dir, exist_ok=True)
        shutil.chown(node_dir, "postgres", "postgres")
        cfg = os.path.join(node_dir, "patroni.yml")
        with open(cfg, "w") as f:
            json.dump(self.config(i, post_init), f, indent=1)   # JSON is YAML
        shutil.chown(cfg, "postgres", "postgres")
        env = {"PATH": os.environ["PATH"], "HOME": node_dir, "LANG": "C.UTF-8"}
        self.procs[self.names[i]] = subprocess.Popen(
            ["patroni", cfg], user="postgres", group="postgres", env=env, cwd=node_dir,
            stdout=open(os.path.join(node_dir, "patroni.log"), "a"), stderr=subprocess.STDOUT,
            start_new_session=True)

    def postmaster_pid(self, i):
        with open(os.path.join(self.work, self.names[i], "data", "postmaster.pid")) as f:
            return int(f.readline())

    def stop(self):
        for name, proc in self.procs.items():
            if proc.poll() is None and name != "etcd":
                proc.terminate()
        for name, proc in self.procs.items():
            if name == "etcd":
                continue
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        # Whatever postmaster Patroni left behind (a crashed node's orphans).
        for i in range(3):
            try:
                os.kill(self.postmaster_pid(i), signal.SIGKILL)
            except (OSError, ValueError):
                pass
        etcd = self.procs.get("etcd")
        if etcd and etcd.poll() is None:
            etcd.terminate()
            etcd.wait(timeout=10)


# -- the checker's own load: raw SQL, so that every acknowledgement is known exactly ------

class RawLoad(threading.Thread):
    """Claims, completes and enqueues with plain SQL over the multi-host string, recording
    each acknowledged completion and enqueue and every token it was handed."""

    def __init__(self, cluster, mode, out):
        super().__init__(daemon=True)
        self.cluster, self.mode = cluster, mode
        self.out = open(out, "w")
        self.stop = threading.Event()
        self.ok = 0

    def record(self, **rec):
        rec["t"] = time.time()
        self.out.write(json.dumps(rec) + "\n")
        self.out.flush()

    def run(self):
        conn = None
        n = 0
        while not self.stop.is_set():
            try:
                if conn is None:
                    conn = self.cluster.connect()
                n += 1
                key = f"raw:{self.mode}:{n}"
                outcome, token = conn.execute(
                    "SELECT outcome, token FROM once.claim_key(%s, lease => '20 s')",
                    (key,)).fetchone()
                if outcome != "claimed":
                    raise Failed(f"raw claim of a new key {key} answered {outcome}")
                self.record(op="claim", key=key, token=token)
                done = conn.execute("SELECT once.complete_key(%s, %s, %s)",
                                    (key, token, json.dumps({"n": n}))).fetchone()[0]
                self.record(op="complete", key=key, token=token, ack=done, n=n)
                job = f"job:{self.mode}:{n}"
                got = conn.execute("SELECT once.enqueue_key(%s, NULL, %s)",
                                   (job, f"ha_{self.mode}")).fetchone()[0]
                self.record(op="enqueue", key=job, outcome=got)
                self.ok += 1
            except psycopg.OperationalError as exc:
                self.record(op="error", error=str(exc).splitlines()[0] if str(exc) else "")
                try:
                    conn and conn.close()
                except Exception:
                    pass
                conn = None
                time.sleep(0.05)
            time.sleep(0.02)
        self.record(op="end", pending=0)
        self.out.close()


def read_jsonl(path):
    out = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line:
                    out.append(json.loads(line))
    return out


def successes_since(path, since):
    n = 0
    for r in read_jsonl(path):
        if r["t"] >= since and succeeded(r):
            n += 1
    return n


def failed(r):
    return r["op"] == "error" or (r["op"] == "get" and not r["ok"])


def succeeded(r):
    return r["op"] in ("get", "job", "complete") and r.get("ok", True) and r.get("ack", True)


def first_success_after(records, since, promoted):
    """Seconds from `since` (the kill) to the client's first successful call on the new
    leader: the first success after its first failure since the kill, or after the
    promotion if that came first (a client whose calls just waited through the failover
    fails nothing). A call may still succeed just after the kill, on a backend of the old
    leader that has not yet noticed that its postmaster is gone: not counted."""
    fails = [r["t"] for r in records if r["t"] >= since and failed(r)]
    start = min(fails + [promoted])
    ts = [r["t"] for r in records if r["t"] >= start and succeeded(r)]
    return min(ts) - since if ts else None


def longest_pause(records, start, end):
    """The longest time between two successful calls around [start, end]."""
    ts = sorted(r["t"] for r in records if succeeded(r))
    before = [t for t in ts if t < start]
    after = [t for t in ts if t > end]
    inside = [t for t in ts if start <= t <= end]
    seq = before[-1:] + inside + after[:1]
    gaps = [b - a for a, b in zip(seq, seq[1:])]
    return max(gaps) if gaps else None


# -- one replication mode under load ------------------------------------------------------

def loaded_failover(cluster, args, mode, figures, problems):
    sync = mode == "sync"
    log(f"{mode}: setting synchronous_mode = {sync}")
    status, body = cluster.rest(cluster.leader() or 0, "/config", "PATCH",
                                {"synchronous_mode": sync})
    if status != 200:
        raise Failed(f"PATCH /config: {status} {body}")
    lead = wait_for(f"a leader with two streaming replicas ({mode})",
                    lambda: cluster.healthy(sync), timeout=90) - 1
    queue = f"ha_{mode}"
    cluster.sql(lead, "SELECT once.create_queue(%s, max_attempts => 100, backoff => '100 ms')",
                (queue,))
    out_dir = os.path.join(cluster.work, mode)
    os.makedirs(out_dir, exist_ok=True)
    stop_file = os.path.join(out_dir, "stop")
    files = {c: os.path.join(out_dir, f"{c}.jsonl") for c in CLIENTS}
    files["checker"] = os.path.join(out_dir, "checker.jsonl")
    loads = {}
    common = ["--mode", mode, "--stop", stop_file]
    cmds = {
        "python": [args.python, os.path.join(args.repo, "pg_test/ha/load.py"),
                   "--dsn", cluster.dsn_all()],
        "node": ["node", os.path.join(args.repo, "pg_test/ha/load.mjs"),
                 "--url", cluster.url_all()],
        "rust": [args.rust_load, "--dsn", cluster.dsn_all()],
    }
    for c in CLIENTS:
        loads[c] = LOADS[f"{mode} {c}"] = subprocess.Popen(cmds[c] + common + ["--out", files[c]],
                                    stdout=open(files[c] + ".log", "w"),
                                    stderr=subprocess.STDOUT, cwd=args.repo,
                                    start_new_session=True)
    raw = RawLoad(cluster, mode, files["checker"])
    raw.start()

    def all_succeeded(since):
        for c, f in files.items():
            if c in loads and loads[c].poll() is not None:
                raise Failed(f"{mode}: the {c} load exited ({loads[c].returncode}); see {f}.log")
            if successes_since(f, since) < SUCCESSES:
                return False
        return True

    t0 = time.time()
    wait_for(f"{SUCCESSES} successful calls of each load before the kill",
             lambda: all_succeeded(t0), timeout=120, every=0.2)

    # Claims owned by backends of the leader about to die: their owner is gone after the
    # kill, and the new leader must take them over (the worker reaps them).
    orphan_conn = cluster.connect(lead)
    orphans = []
    for i in range(5):
        key = f"orphan:{mode}:{i}"
        outcome, token = orphan_conn.execute(
            "SELECT outcome, token FROM once.claim_key(%s, lease => '10 min')", (key,)).fetchone()
        orphans.append((key, token))
    # Replayed on every replica before the kill, also without synchronous replication.
    lsn = orphan_conn.execute("SELECT pg_current_wal_lsn()").fetchone()[0]
    wait_for("the orphan claims replayed on both replicas", lambda: cluster.sql(
        lead, "SELECT count(*) = 2 FROM pg_stat_replication WHERE replay_lsn >= %s::pg_lsn",
        (lsn,))[0][0])

    old = lead
    pid = cluster.postmaster_pid(old)
    log(f"{mode}: kill -9 of node{old}'s postmaster ({pid})")
    t_kill = time.time()
    os.kill(pid, signal.SIGKILL)
    new = wait_for("Patroni to promote a replica",
                   lambda: (lambda l: l is not None and l != old and l + 1)(cluster.leader()),
                   timeout=TIMEOUT) - 1
    t_promoted = time.time()
    log(f"{mode}: node{new} promoted after {t_promoted - t_kill:.1f} s")
    wait_for("pg_once's worker on the new leader", lambda: cluster.sql(
        new, "SELECT workers > 0 FROM once.stats")[0][0], every=0.05)
    t_worker = time.time()
    wait_for("the dead primary's claims taken over", lambda: cluster.sql(
        new, "SELECT count(*) = 0 FROM once.entries WHERE key LIKE %s AND state = 'running'",
        (f"orphan:{mode}:%",))[0][0], every=0.05)
    t_takeover = time.time()
    states = cluster.sql(new, "SELECT key, state, error FROM once.entries WHERE key LIKE %s",
                         (f"orphan:{mode}:%",))
    try:
        orphan_conn.close()
    except Exception:
        pass
    wait_for(f"{SUCCESSES} successful calls of each load after the kill",
             lambda: all_succeeded(t_kill), timeout=120, every=0.2)

    # A planned switchover, to a replica streaming from the new leader, once the killed
    # node is back as a replica (pg_rewind): switching over while it rejoins left it, in
    # Patroni 3.0.2, started with no primary_conninfo and never streaming.
    wait_for(f"the killed node back as a replica ({mode})",
             lambda: cluster.healthy(sync) == new + 1, timeout=90)
    def candidate():
        streaming = {n for n, _ in cluster.streaming(new)}
        members = cluster.rest(new, "/cluster")[1].get("members", [])
        # With synchronous_mode Patroni switches over only to its synchronous standby.
        names = [m["name"] for m in members if m["name"] in streaming
                 and m.get("role") == ("sync_standby" if sync else "replica")]
        return names[0] if names else None
    target = wait_for("a replica of the new leader to switch over to", candidate, timeout=90)
    log(f"{mode}: switchover node{new} -> {target}")
    t_switch = time.time()
    # Patroni answers once the switchover is done.
    status, body = cluster.rest(new, "/switchover", "POST",
                                {"leader": cluster.names[new], "candidate": target},
                                timeout=TIMEOUT)
    if status != 200:
        raise Failed(f"POST /switchover: {status} {body}")
    wait_for("the switchover", lambda: cluster.leader() == cluster.names.index(target))
    t_switched = time.time()
    wait_for(f"{SUCCESSES} successful calls of each load after the switchover",
             lambda: all_succeeded(t_switch), timeout=120, every=0.2)

    log(f"{mode}: stopping the loads")
    open(stop_file, "w").close()
    raw.stop.set()
    raw.join(timeout=30)
    for c, p in loads.items():
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            problems.append(f"{mode}: the {c} load did not stop within 60 s")
        if p.returncode not in (0, None):
            problems.append(f"{mode}: the {c} load exited with {p.returncode}; see {files[c]}.log")
    final = cluster.names.index(target)
    f = check_mode(cluster, final, mode, files, orphans, problems)
    f.update({
        "promoted_s": round(t_promoted - t_kill, 2),
        "worker_s": round(t_worker - t_kill, 2),
        "orphans_taken_over_s": round(t_takeover - t_kill, 2),
        "orphan_states": sorted({s for _, s, _ in states}),
        "switchover_s": round(t_switched - t_switch, 2),
        "first_success_after_kill_s": {},
    })
    f["longest_pause_around_switchover_s"] = {}
    for c, path in files.items():
        recs = read_jsonl(path)
        v = first_success_after(recs, t_kill, t_promoted)
        f["first_success_after_kill_s"][c] = None if v is None else round(v, 2)
        # A switchover is announced: calls go on succeeding until the leader stops, so
        # what a client sees is the pause between two successful calls.
        v = longest_pause(recs, t_switch, t_switched + 1)
        f["longest_pause_around_switchover_s"][c] = None if v is None else round(v, 2)
    figures[mode] = f


def check_mode(cluster, leader, mode, files, orphans, problems):
    """The assertions of one mode, against the final leader; returns its figures."""
    sync = mode == "sync"
    entries = {k: (s, t, r) for k, s, t, r in cluster.sql(
        leader, "SELECT key, state::text, token, result FROM once.entries"
                " WHERE key LIKE %s OR key LIKE %s OR key LIKE %s",
        (f"raw:{mode}:%", f"ha:{mode}:%", f"job:{mode}:%"))}
    recs = {c: read_jsonl(p) for c, p in files.items()}
    f = {}

    # Every program ended its calls: no waiter left unanswered.
    for c, rs in recs.items():
        ends = [r for r in rs if r["op"] == "end"]
        if not ends:
            problems.append(f"{mode}: the {c} load wrote no end record")
        elif ends[-1].get("pending", 0):
            problems.append(f"{mode}: the {c} load ended with {ends[-1]['pending']} calls unanswered")
        unanswered = [r for r in rs if r["op"] == "get" and r.get("slow")]
        if unanswered:
            problems.append(f"{mode}: {c}: {len(unanswered)} calls answered after their wait bound")

    # Acknowledged completions: the checker's (raw) and the clients' (a get_or_compute
    # whose compute ran in that process and returned: complete_key said true).
    acked, lost, lost_keys = 0, 0, []
    for r in recs["checker"]:
        if r["op"] == "complete" and r["ack"]:
            acked += 1
            e = entries.get(r["key"])
            if not e or e[0] != "done" or e[1] != r["token"]:
                lost += 1
                lost_keys.append(r["key"])
    values = {}
    computed = {}
    for c in CLIENTS:
        for r in recs[c]:
            if r["op"] == "get" and r.get("ok"):
                values.setdefault(r["key"], set()).add(json.dumps(r["value"], sort_keys=True))
                if r.get("computed"):
                    computed.setdefault(r["key"], []).append(r["value"])
    for key, vs in computed.items():
        for v in vs:
            acked += 1
            e = entries.get(key)
            if not e or e[0] != "done" or e[2] != v:
                lost += 1
                lost_keys.append(key)
    # Answers that waited for another caller's computation: not computed here, and
    # slower than a hit could be (the computations take 100 ms).
    waited = sum(1 for c in CLIENTS for r in recs[c]
                 if r["op"] == "get" and r.get("ok") and not r.get("computed")
                 and r.get("ms", 0) >= 50)
    if not waited:
        problems.append(f"{mode}: no call waited for another's computation: the load "
                        "proves nothing about waiters")
    twice = sorted(k for k, vs in computed.items() if len(vs) > 1)
    differing = sorted(k for k, vs in values.items() if len(vs) > 1)
    enq_acked = sum(1 for r in recs["checker"] if r["op"] == "enqueue")
    enq_lost = sum(1 for r in recs["checker"] if r["op"] == "enqueue" and r["key"] not in entries)
    double_jobs = cluster.sql(
        leader, "SELECT count(*) FROM (SELECT key FROM once.attempts WHERE queue = %s"
                " AND outcome = 'completed' GROUP BY key HAVING count(*) > 1) d",
        (f"ha_{mode}",))[0][0]
    jobs_run = {}
    for c in CLIENTS:
        for r in recs[c]:
            if r["op"] == "job":
                jobs_run.setdefault(r["key"], set()).add(r["token"])
    f.update({
        "acknowledged_completions": acked,
        "acknowledged_completions_lost": lost,
        "answers_after_waiting": waited,
        "keys_computed_twice": len(twice),
        "keys_answered_two_values": len(differing),
        "enqueues_acknowledged": enq_acked,
        "enqueues_lost": enq_lost,
        "jobs_run": len(jobs_run),
        "jobs_run_more_than_once": sum(1 for ts in jobs_run.values() if len(ts) > 1),
        "jobs_completed_twice": double_jobs,
    })
    if sync:
        if lost:
            problems.append(f"sync: {lost} acknowledged completions lost: {lost_keys[:5]}")
        if twice:
            problems.append(f"sync: keys computed twice after an acknowledged completion: {twice[:5]}")
        if differing:
            problems.append(f"sync: keys answered with two values: {differing[:5]}")
        if enq_lost:
            problems.append(f"sync: {enq_lost} acknowledged enqueues lost")
        if double_jobs:
            problems.append(f"sync: {double_jobs} jobs completed twice")

    # Tokens: one claim, one token, across both leaders' timelines.
    owners = {}
    for c, rs in recs.items():
        for r in rs:
            if r["op"] in ("claim", "job") and r.get("token") is not None:
                owners.setdefault(r["token"], set()).add(r["key"])
    repeated = {t: ks for t, ks in owners.items() if len(ks) > 1}
    f["tokens_seen"] = len(owners)
    f["tokens_repeated"] = len(repeated)
    if repeated:
        problems.append(f"{mode}: tokens handed out twice: "
                        f"{sorted((t, sorted(ks)) for t, ks in repeated.items())[:5]}")
    taken = [k for k, _ in orphans if k in entries and entries[k][0] == "running"]
    if taken:
        problems.append(f"{mode}: claims of the dead primary still running: {taken}")
    return f


# -- the zombie scenario (asynchronous replication, no load) -------------------------------

def zombie(cluster, figures, problems):
    lead = wait_for("a leader with two streaming replicas (async)",
                    lambda: cluster.healthy(False), timeout=90) - 1
    old = cluster.connect(lead)
    # What the replicas have replayed: everything up to now.
    lsn = old.execute("SELECT pg_current_wal_lsn()").fetchone()[0]
    wait_for("the replicas to replay the leader's WAL so far", lambda: cluster.sql(
        lead, "SELECT count(*) = 2 FROM pg_stat_replication WHERE replay_lsn >= %s::pg_lsn",
        (lsn,))[0][0])
    # Replication cut on the leader's side: its walsenders stopped. (Stopping the
    # replicas' walreceivers instead is not enough: what the walsenders go on sending
    # waits in the sockets' buffers, and a walreceiver continued after the kill reads it.)
    senders = [pid for (pid,) in old.execute("SELECT pid FROM pg_stat_replication")]
    for pid in senders:
        os.kill(pid, signal.SIGSTOP)
    log(f"zombie: node{lead}'s walsenders {senders} stopped; drawing tokens there")
    t_kill = None
    try:
        old_tokens = []
        # More than the 32 values a sequence logs ahead, so that the gap is real.
        for n in range(100):
            old_tokens.append(old.execute(
                "SELECT token FROM once.claim_key(%s, lease => '1 min')",
                (f"zombie:before:{n}",)).fetchone()[0])
        zc = cluster.connect(lead)
        outcome, t = zc.execute(
            "SELECT outcome, token FROM once.claim_key('zk', lease => '10 min')").fetchone()
        if outcome != "claimed":
            raise Failed(f"the zombie's claim of zk answered {outcome}")
        log(f"zombie: the old leader drew tokens {old_tokens[0]} to {old_tokens[-1]}")
        old_tokens.append(t)
        log(f"zombie: holds zk with token {t}; kill -9 of node{lead}'s postmaster")
        t_kill = time.time()
        os.kill(cluster.postmaster_pid(lead), signal.SIGKILL)
    finally:
        # The leader's machine is gone: its walsenders with it, before they send anything.
        for pid in senders:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    new = wait_for("Patroni to promote a replica",
                   lambda: (lambda l: l is not None and l != lead and l + 1)(cluster.leader()),
                   timeout=TIMEOUT) - 1
    log(f"zombie: node{new} promoted after {time.time() - t_kill:.1f} s")
    owner = cluster.connect(new)
    new_tokens = []
    # Draw until the new leader's tokens reach T (at most a few hundred draws: the sequence
    # can be behind by what the old leader drew since the replicas stopped, plus 32).
    while len(new_tokens) < 5000:
        tok = owner.execute("SELECT token FROM once.claim_key(%s, lease => '1 min')",
                            (f"zombie:after:{len(new_tokens)}",)).fetchone()[0]
        new_tokens.append(tok)
        if tok >= t - 1:
            break
    outcome, t2 = owner.execute(
        "SELECT outcome, token FROM once.claim_key('zk', lease => '10 min')").fetchone()
    new_tokens.append(t2)
    # The zombie finds the new leader as its application would, and completes late.
    with cluster.connect() as z:
        zombie_ok = z.execute("SELECT once.complete_key('zk', %s, '{\"by\": \"zombie\"}')",
                              (t,)).fetchone()[0]
    owner_ok = owner.execute("SELECT once.complete_key('zk', %s, '{\"by\": \"owner\"}')",
                             (t2,)).fetchone()[0]
    stored = owner.execute("SELECT result FROM once.entries WHERE key = 'zk'").fetchone()
    repeated = sorted(set(old_tokens) & set(new_tokens))
    # The claims the old leader made after replication was cut, zk's included: gone.
    lost = 100 - owner.execute("SELECT count(*) FROM once.entries WHERE key LIKE 'zombie:before:%'"
                               ).fetchone()[0]
    figures["zombie"] = {
        "zombie_token": t, "new_owner_outcome": outcome, "new_owner_token": t2,
        "draws_on_new_leader": len(new_tokens) - 1,
        "zombie_completion_accepted": zombie_ok, "owner_completion_accepted": owner_ok,
        "stored": stored[0] if stored else None,
        "tokens_of_old_leader_handed_out_again": len(repeated),
        "claims_lost_with_the_old_leader": lost + 1,
    }
    log("zombie: " + json.dumps(figures["zombie"]))
    if zombie_ok:
        problems.append(f"async zombie: complete_key('zk', {t}) of the zombie on the old "
                        f"leader was ACCEPTED on the new leader (the new owner drew the same "
                        f"token {t2})")
    if not owner_ok:
        problems.append("async zombie: the new owner's complete_key was refused")
    if repeated:
        problems.append(f"async zombie: {len(repeated)} tokens of the old leader handed out "
                        f"again on the new one (e.g. {repeated[:3]})")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bin", required=True, help="PostgreSQL 15's bin directory (pg_once installed)")
    p.add_argument("--work", required=True)
    p.add_argument("--port", type=int, required=True, help="first of 20 ports")
    p.add_argument("--repo", required=True)
    p.add_argument("--python", required=True, help="python with pg_once and psycopg")
    p.add_argument("--rust-load", required=True)
    p.add_argument("--modes", default="sync async")
    p.add_argument("--zombie", default="1")
    args = p.parse_args()
    # SIGTERM (test.sh interrupted, a CI timeout) stops the nodes and loads as a failure
    # does, through the finally below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.monotonic()
    cluster = Cluster(args)
    figures, problems = {}, []
    try:
        cluster.start()
        lead = wait_for("Patroni to bootstrap a leader with two streaming replicas",
                        lambda: cluster.healthy(False), timeout=180) - 1
        wait_for("the extension (post_init)", lambda: cluster.sql(
            lead, "SELECT count(*) FROM pg_extension WHERE extname = 'pg_once'")[0][0])
        log(f"bootstrapped in {time.monotonic() - started:.0f} s; leader node{lead}")
        for mode in args.modes.split():
            loaded_failover(cluster, args, mode, figures, problems)
            log(f"{mode}: " + json.dumps(figures[mode]))
        if args.zombie == "1":
            cluster.rest(cluster.leader(), "/config", "PATCH", {"synchronous_mode": False})
            zombie(cluster, figures, problems)
    except Failed as exc:
        problems.append(str(exc))
    except Exception as exc:
        problems.append(f"{type(exc).__name__}: {exc}")
        import traceback
        traceback.print_exc()
    finally:
        for p in LOADS.values():
            if p.poll() is None:
                p.kill()
        figures["seconds"] = round(time.monotonic() - started, 1)
        with open(os.path.join(args.work, "figures.json"), "w") as f:
            json.dump(figures, f, indent=1)
        cluster.stop()
    print(json.dumps(figures, indent=1))
    if problems:
        print("HA test FAILED:", file=sys.stderr)
        for pr in problems:
            print(f"  - {pr}", file=sys.stderr)
        sys.exit(1)
    print(f"HA test passed in {figures['seconds']} s", file=sys.stderr)


if __name__ == "__main__":
    main()
