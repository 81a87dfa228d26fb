"""What the sync and async clients share: SQL text, argument conversion, JSON encoding,
back-off timing and call counting. Nothing here does I/O."""

from __future__ import annotations

import hashlib
import json
import random
import threading
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, Optional, Union

from .errors import NotSerializable

Duration = Union[int, float, timedelta]

# Every call is one statement in autocommit, sent unprepared (prepare=False at the call
# sites): through PgBouncer in transaction mode a named prepared statement could land on a
# server connection that never saw it. Intervals travel as float seconds through
# make_interval, which is exact and keeps NULL (ttl => NULL: no expiry) NULL.
SECS = "make_interval(secs => %s::float8)"

# owner_pid names the backend whose exit ends the claim: the process's LISTEN connection
# (its pid P comes from once.owner_session()), or 0 for "the lease alone" (listen=False).
CLAIM_KEY = (
    "SELECT outcome, token, result, error, lease_expires_at, retry_at"
    f" FROM once.claim_key(%s, lease => {SECS}, wait => '0', owner_pid => %s::integer)")
# A caller that asked for stale/beta also takes the outcomes 'refresh' (ours to recompute,
# with the previous result to serve meanwhile) and 'stale' (the previous result, at once).
# Without them it sends exactly what pre-0.2 clients send, so nothing changes for it.
CLAIM_KEY_SERVE_STALE = (
    "SELECT outcome, token, result, error, lease_expires_at, retry_at"
    f" FROM once.claim_key(%s, lease => {SECS}, wait => '0', owner_pid => %s::integer,"
    " serve_stale => true)")
# For servers that predate owner_pid (no once.owner_session()): the claim then belongs to
# the pooled server connection that made it, as before.
CLAIM_KEY_LEGACY = (
    "SELECT outcome, token, result, error, lease_expires_at, retry_at"
    f" FROM once.claim_key(%s, lease => {SECS}, wait => '0')")
NO_FRESHNESS_SERVER = (
    "stale, beta and jitter need pg_once 0.2.0 or later on the server "
    "(ALTER EXTENSION pg_once UPDATE)")
COMPLETE_KEY = f"SELECT once.complete_key(%s, %s, %s::jsonb, ttl => {SECS})"
# With any of stale/beta/jitter (pg_once 0.2.0): the plain form stays for the others, so that
# a caller without them still works with a pre-0.2 server.
COMPLETE_KEY_FRESHNESS = (
    f"SELECT once.complete_key(%s, %s, %s::jsonb, ttl => {SECS}, stale => {SECS},"
    " beta => %s::float8, jitter => %s::float8)")
FAIL_KEY = f"SELECT once.fail_key(%s, %s, %s, retry_after => {SECS})"
HEARTBEAT_KEY = f"SELECT once.heartbeat_key(%s, %s, lease => {SECS})"
RELEASE_KEY = "SELECT once.release_key(%s, %s)"
CLAIM_NEXT = (
    "SELECT key, token, payload, attempt FROM once.claim_next(%s, lease => "
    f"{SECS}, worker => %s, n => %s, wait => {SECS}, owner_pid => %s::integer)")
# Without owner_pid and server-side waiting (older servers): the worker polls.
CLAIM_NEXT_LEGACY = (
    "SELECT key, token, payload, attempt FROM once.claim_next(%s, lease => "
    f"{SECS}, worker => %s, n => %s)")
LISTEN = "LISTEN once"
OWNER_SESSION = "SELECT once.owner_session()"


def notified_names(key: str) -> tuple:
    """What channel "once" may carry when `key` resolves: the key itself, or, for a key in
    a namespace created with notify => 'digest' (the default there), its hex SHA-256,
    encode(once.key_hash(key), 'hex'). A waiter listens for both."""
    return (key, hashlib.sha256(key.encode("utf-8")).hexdigest())


CHANNEL = "once"

# How long a waiter sleeps between two looks at a key when no notification comes: about a
# second, jittered so that many waiters do not ask in lockstep. A dead owner is noticed by
# the server on the next look, so this bounds the takeover time of a killed process.
RECHECK_SECONDS = 1.0
# listen=False: poll with jittered back-off from 50 ms doubling to 1 s.
POLL_FIRST, POLL_MAX = 0.05, 1.0


def connection_lost(conn, exc: Exception) -> bool:
    """Whether a failed call lost its connection (terminated, recycled, server restarting)
    rather than failing in the server: then the call is repeated on another connection."""
    state = getattr(exc, "sqlstate", None) or ""
    return conn.broken or state.startswith("08") or state in ("57P01", "57P02", "57P03")


def seconds(value: Optional[Duration], name: str) -> Optional[float]:
    """A duration argument in seconds: int/float seconds or a timedelta; None stays None."""
    if value is None:
        return None
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be seconds (int or float) or a timedelta, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Freshness:
    """How a result stays servable past its ttl (pg_once 0.2.0), passed to complete_key:
    `stale` seconds of stale-while-revalidate, XFetch's `beta`, ttl `jitter`."""

    stale: Optional[float] = None
    beta: Optional[float] = None
    jitter: Optional[float] = None

    @property
    def serve_stale(self) -> bool:
        """Whether the caller takes stale answers: it asked for a stale window or for early
        refreshes, both of which answer with the previous result while one caller refreshes."""
        return self.stale is not None or bool(self.beta)

    @property
    def given(self) -> bool:
        return self.stale is not None or self.beta is not None or self.jitter is not None


NO_FRESHNESS = Freshness()


def freshness(ttl: Optional[float], stale: Optional[Duration], beta: Optional[float],
              jitter: Optional[float]) -> Freshness:
    """The freshness options of a call, checked before anything is claimed. The server
    checks the same rules (22023) in complete_key, but only after the computation: a typo
    found there would cost a computation and leave the key failed for retry_after."""
    stale_s = seconds(stale, "stale")
    for name, value in (("beta", beta), ("jitter", jitter)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise TypeError(f"{name} must be a number, got {value!r}")
    if stale_s is not None and stale_s < 0:
        raise ValueError(f"stale must be at least 0 seconds, got {stale_s:g}")
    if beta is not None and not 0 <= beta <= 100:
        raise ValueError(f"beta must be between 0 (off) and 100, got {beta!r}; 1.0 is XFetch's usual value")
    if jitter is not None and not 0 <= jitter < 1:
        raise ValueError(f"jitter must be at least 0 and below 1 (a share of ttl), got {jitter!r}")
    fresh = Freshness(stale_s, None if beta is None else float(beta),
                      None if jitter is None else float(jitter))
    if fresh.given and ttl is None:
        raise ValueError("stale, beta and jitter need a ttl: they say what happens around the "
                         "result's expiry, and without a ttl it never expires")
    return fresh


def jittered(base: float) -> float:
    """base ± 20%."""
    return base * random.uniform(0.8, 1.2)


def poll_delays():
    """listen=False back-off: 50 ms doubling to 1 s, each jittered."""
    delay = POLL_FIRST
    while True:
        yield jittered(delay)
        delay = min(POLL_MAX, delay * 2)


def encode(key: str, value: Any) -> str:
    """value as JSON text, or NotSerializable. NaN and infinities are refused here, because
    PostgreSQL's jsonb would refuse them later with a less helpful message."""
    try:
        return json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise NotSerializable(key, value, exc) from exc


def error_text(exc: BaseException) -> str:
    """What fail_key records: the exception's type and message."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def until(moment: Optional[datetime]) -> float:
    """Seconds from now until a server timestamp (0 if past or unknown)."""
    if moment is None:
        return 0.0
    return max(0.0, (moment - datetime.now(timezone.utc)).total_seconds())


class Calls:
    """Counts the database calls a client made through its pool, by pg_once function
    (claim_key, complete_key, ...). Tests and the benchmark read it; `total` sums it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter = Counter()

    def add(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    def __getitem__(self, name: str) -> int:
        with self._lock:
            return self._counts[name]

    @property
    def total(self) -> int:
        with self._lock:
            return sum(self._counts.values())

    def as_dict(self) -> dict:
        with self._lock:
            return dict(self._counts)


@dataclass
class Job:
    """One key claimed from a queue by the worker loop; the handler gets it."""

    key: str
    token: int
    payload: Any
    attempt: int
    queue: str = ""
    lost: bool = field(default=False, repr=False)  # set when a heartbeat says the claim is gone
