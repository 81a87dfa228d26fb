"""What the sync and async clients share: SQL text, argument conversion, JSON encoding,
back-off timing and call counting. Nothing here does I/O."""

from __future__ import annotations

import hashlib
import json
import math
import random
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, Optional, Protocol, Union

from ._keys import check_key
from .errors import NotSerializable

Duration = Union[int, float, timedelta]

log = logging.getLogger("pg_once")

# Every call is one statement in autocommit, sent unprepared (prepare=False at the call
# sites): through PgBouncer in transaction mode a named prepared statement could land on a
# server connection that never saw it. Intervals travel as float seconds through
# make_interval, which is exact and keeps NULL (ttl => NULL: no expiry) NULL.
SECS = "make_interval(secs => %s::float8)"

# owner_pid names the backend whose exit ends the claim: the process's LISTEN connection
# (its pid P comes from once.owner_session()), or 0 for "the lease alone" (listen=False).
CLAIM_KEY = (
    "SELECT outcome, token, result::text, error, lease_expires_at, retry_at"
    f" FROM once.claim_key(%s, lease => {SECS}, wait => '0', owner_pid => %s::integer)")
# A caller that asked for stale/beta also takes the outcomes 'refresh' (ours to recompute,
# with the previous result to serve meanwhile) and 'stale' (the previous result, at once).
# Without them it sends exactly what pre-0.2 clients send, so nothing changes for it.
CLAIM_KEY_SERVE_STALE = (
    "SELECT outcome, token, result::text, error, lease_expires_at, retry_at"
    f" FROM once.claim_key(%s, lease => {SECS}, wait => '0', owner_pid => %s::integer,"
    " serve_stale => true)")
# For servers that predate owner_pid (no once.owner_session()): the claim then belongs to
# the pooled server connection that made it, as before.
CLAIM_KEY_LEGACY = (
    "SELECT outcome, token, result::text, error, lease_expires_at, retry_at"
    f" FROM once.claim_key(%s, lease => {SECS}, wait => '0')")
# A claim for a request (rule I3, pg_once 0.3.0): a fingerprint of what the key stands for;
# a different request under the same key is answered 'mismatch' and changes nothing.
CLAIM_KEY_FINGERPRINT = (
    "SELECT outcome, token, result::text, error, lease_expires_at, retry_at"
    f" FROM once.claim_key(%s, lease => {SECS}, wait => '0', owner_pid => %s::integer,"
    " fingerprint => %s::bytea)")
NO_FINGERPRINT_SERVER = (
    "fingerprints (the idempotency middleware) need pg_once 0.3.0 or later on the server "
    "(ALTER EXTENSION pg_once UPDATE)")
NO_FRESHNESS_SERVER = (
    "stale, beta and jitter need pg_once 0.2.0 or later on the server "
    "(ALTER EXTENSION pg_once UPDATE)")
# complete_key also answers with the result as the server keeps it (jsonb normalises
# numbers: 1e+16 reads back as 10000000000000000), so that the computing caller returns
# exactly what every other caller reads (rule V1). The text is sent once.
COMPLETE_KEY = ("SELECT once.complete_key(%s, %s, r, ttl => make_interval(secs => %s::float8)),"
                " r::text FROM (SELECT %s::jsonb AS r) AS v")
# With any of stale/beta/jitter (pg_once 0.2.0): the plain form stays for the others, so that
# a caller without them still works with a pre-0.2 server.
COMPLETE_KEY_FRESHNESS = (
    f"SELECT once.complete_key(%s, %s, r, ttl => {SECS}, stale => {SECS},"
    " beta => %s::float8, jitter => %s::float8), r::text FROM (SELECT %s::jsonb AS r) AS v")
FAIL_KEY = f"SELECT once.fail_key(%s, %s, %s, retry_after => {SECS})"
HEARTBEAT_KEY = f"SELECT once.heartbeat_key(%s, %s, lease => {SECS})"
RELEASE_KEY = "SELECT once.release_key(%s, %s)"
CLAIM_NEXT = (
    "SELECT key, token, payload::text, attempt FROM once.claim_next(%s, lease => "
    f"{SECS}, worker => %s, n => %s, wait => {SECS}, owner_pid => %s::integer)")
# Without owner_pid and server-side waiting (older servers): the worker polls.
CLAIM_NEXT_LEGACY = (
    "SELECT key, token, payload::text, attempt FROM once.claim_next(%s, lease => "
    f"{SECS}, worker => %s, n => %s)")
INVALIDATE_KEY = "SELECT once.invalidate_key(%s)"
REFRESH_KEY = f"SELECT once.refresh_key(%s, stale => {SECS})"
ENQUEUE_KEY = ("SELECT once.enqueue_key(%s, payload => %s::jsonb, queue => %s, priority => %s,"
               " run_at => %s, refresh => %s, max_attempts => %s)")
# payloads: a list of JSON texts (None for none), as text[], each element cast to jsonb.
ENQUEUE_KEYS = ("SELECT key, outcome FROM once.enqueue_keys(%s::text[], payloads => %s::text[]::jsonb[],"
                " queue => %s, priority => %s, run_at => %s, refresh => %s, max_attempts => %s)")
LISTEN = "LISTEN once"
OWNER_SESSION = "SELECT once.owner_session()"
BACKEND_PID = "SELECT pg_backend_pid()"


def notified_names(key: str) -> tuple:
    """What channel "once" may carry when `key` resolves: the key itself, or, for a key in
    a namespace created with notify => 'digest' (the default there), its hex SHA-256,
    encode(once.key_hash(key), 'hex'). A waiter listens for both."""
    return (key, hashlib.sha256(key.encode("utf-8")).hexdigest())


CHANNEL = "once"
# Rule N5: a LISTEN connection behind a proxy is tested with a notification sent through
# the pool; a transaction pooler never delivers it (the LISTEN went to a server connection
# that is no longer this client's), a session pooler does at once.
PROBE_PAYLOAD = "pg_once-probe:"
PROBE_SECONDS = 2.0
NOTIFY = "SELECT pg_notify('once', %s)"
TRANSACTION_POOLER = (
    "the LISTEN connection goes through a transaction pooler (its server connection "
    "changes between transactions), so notifications would never reach it and every "
    "waiter would fall back to its 1 s recheck: pass listen_conninfo= a direct or "
    "session-pooled connection string (docs/clients.md, rule N5)")
# A transaction that resolves very many keys announces them all as one notification with
# an empty payload (keys are never empty): every waiter of the process asks again (C3).
WAKE_EVERYONE = ""

# How long a waiter sleeps between two looks at a key when no notification comes: about a
# second, jittered so that many waiters do not ask in lockstep. A dead owner is noticed by
# the server on the next look, so this bounds the takeover time of a killed process.
RECHECK_SECONDS = 1.0
# What a claim answers when the caller's wait ran out before claim_key's answer came: as
# 'wait', no token of ours (the late answer is given back, rule X2).
WAITED_OUT = ("wait", None, None, None, None, None)
# listen=False: poll with jittered back-off from 50 ms doubling to 1 s.
POLL_FIRST, POLL_MAX = 0.05, 1.0


# Rule R1: what is sent again on another connection. Class 08 and 57P01-57P03 say the
# connection is gone (terminated, recycled, server restarting); 57014 (a statement timeout
# or a cancel) and every other error is the server's answer, and repeating it would only
# repeat the answer, or run a cancelled statement again.
RETRYABLE_SQLSTATES = ("57P01", "57P02", "57P03")


def retryable(sqlstate: Optional[str], connection_lost: bool) -> bool:
    """Whether a failed call is repeated: a connection failure, by SQLSTATE or, for the
    driver's own errors that carry none, by the driver saying the connection is gone."""
    if sqlstate:
        return sqlstate.startswith("08") or sqlstate in RETRYABLE_SQLSTATES
    return connection_lost


def retry_pauses():
    """Pauses before the 2nd, 3rd, ... attempt (R2): none, then 50 ms doubling to 1 s,
    jittered; the call's budget (its wait, or connect_timeout) says when to stop."""
    yield 0.0
    delay = POLL_FIRST
    while True:
        yield jittered(delay)
        delay = min(POLL_MAX, delay * 2)


def seconds(value: Optional[Duration], name: str, *, positive: bool = False) -> Optional[float]:
    """A duration argument in seconds: int/float seconds or a timedelta, finite and not
    negative (above 0 if `positive`); None stays None. Rule F1."""
    if value is None:
        return None
    if isinstance(value, timedelta):
        secs = value.total_seconds()
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be seconds (int or float) or a timedelta, got {value!r}")
    else:
        secs = float(value)
    if not math.isfinite(secs) or secs < 0 or (positive and secs == 0):
        bound = "above 0" if positive else "at least 0"
        raise ValueError(f"{name} must be a finite number of seconds {bound}, got {value!r}")
    return secs


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


@dataclass(frozen=True)
class CallOptions:
    """The checked options of one get_or_compute call (rule F1): every check runs before
    anything is claimed, so a mistake costs no computation and changes nothing."""

    key: str
    ttl: Optional[float]
    lease: float
    wait: float
    retry_after: float
    fresh: Freshness
    serializer: "Serializer"


def call_options(key: Any, *, ttl: Optional[Duration] = None, lease: Duration = 30,
                 wait: Duration = 30, retry_after: Duration = 5, stale: Optional[Duration] = None,
                 beta: Optional[float] = None, jitter: Optional[float] = None,
                 serializer: Optional["Serializer"] = None) -> CallOptions:
    ttl_s = seconds(ttl, "ttl")
    return CallOptions(
        check_key(key), ttl_s, seconds(lease, "lease", positive=True), seconds(wait, "wait"),
        seconds(retry_after, "retry_after"), freshness(ttl_s, stale, beta, jitter),
        check_serializer(serializer or JSON))


@dataclass(frozen=True)
class Answer:
    """What AsyncClient.claim / Client.claim got from claim_key: `outcome` (hit, claimed,
    failed, mismatch, wait), the stored `result` as JSON text (hit), the failure's `error`
    and `retry_at` (failed), and the `claim` to store or release (claimed)."""

    outcome: str
    result: Optional[str] = None
    error: Optional[str] = None
    retry_at: Optional[datetime] = None
    claim: Any = None


MAX_FINGERPRINT_BYTES = 64   # the server's bound: a digest, never the request itself


def check_fingerprint(fingerprint: Any) -> Optional[bytes]:
    """None, or 1 to 64 bytes (a SHA-512 digest is 64), checked before any call (F1)."""
    if fingerprint is None:
        return None
    if not isinstance(fingerprint, (bytes, bytearray, memoryview)):
        raise TypeError(f"fingerprint must be bytes (a digest of the request) or None, "
                        f"got {type(fingerprint).__name__}")
    fingerprint = bytes(fingerprint)
    if not 1 <= len(fingerprint) <= MAX_FINGERPRINT_BYTES:
        raise ValueError(f"fingerprint must be 1 to {MAX_FINGERPRINT_BYTES} bytes (a digest such "
                         f"as SHA-256's 32), got {len(fingerprint)}")
    return fingerprint


def jittered(base: float) -> float:
    """base ± 20%."""
    return base * random.uniform(0.8, 1.2)


def poll_delays():
    """listen=False back-off: 50 ms doubling to 1 s, each jittered."""
    delay = POLL_FIRST
    while True:
        yield jittered(delay)
        delay = min(POLL_MAX, delay * 2)


class Serializer(Protocol):
    """How results are stored (rule V2): `dumps` turns a value into JSON text, `loads` turns
    the stored JSON text back into a value. Every caller, the computing one included,
    returns loads(stored text) (V1)."""

    def dumps(self, value: Any) -> str: ...

    def loads(self, text: str) -> Any: ...


class JSONSerializer:
    """The default (V3): plain JSON, refusing what would not read back equal, a tuple (a
    list), a set, a datetime, a Decimal, bytes, any other class, a map with keys that are
    not str, NaN and infinities, rather than store something else than was returned."""

    def dumps(self, value: Any) -> str:
        problem = _json_problem(value)
        if problem is not None:
            raise TypeError(problem)
        return json.dumps(value, allow_nan=False, ensure_ascii=False, separators=(",", ":"))

    def loads(self, text: str) -> Any:
        return json.loads(text)


JSON = JSONSerializer()

_JSON_SCALARS = (type(None), bool, int, str)


def _json_problem(value: Any) -> Optional[str]:
    """Why `value` would not read back equal through JSON, or None. Iterative, so that a
    deep value is refused by json.dumps's own recursion check, never by ours."""
    stack = [value]
    while stack:
        item = stack.pop()
        kind = type(item)
        if kind in _JSON_SCALARS:
            continue
        if kind is float:
            if not math.isfinite(item):
                return f"float {item!r} has no JSON form"
        elif kind is list:
            stack.extend(item)
        elif kind is dict:
            for k in item:
                if type(k) is not str:
                    return (f"a dict key {k!r} ({type(k).__name__}) would read back as a str")
            stack.extend(item.values())
        elif kind is tuple:
            return "a tuple would read back as a list"
        else:
            name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
            return f"{name} has no JSON form"
    return None


def check_serializer(serializer: Any) -> "Serializer":
    if not (callable(getattr(serializer, "dumps", None)) and callable(getattr(serializer, "loads", None))):
        raise TypeError(f"serializer must have dumps(value) -> str and loads(str) -> value, "
                        f"got {serializer!r}")
    return serializer


def dump_value(key: str, serializer: "Serializer", value: Any) -> str:
    """The text to store for a computed value, or NotSerializable (V3, V4)."""
    try:
        text = serializer.dumps(value)
    except Exception as exc:
        raise NotSerializable(key, value, exc, default=serializer is JSON) from exc
    if not isinstance(text, str):
        raise NotSerializable(key, value, TypeError(
            f"serializer.dumps returned a {type(text).__name__}, not str"), default=False)
    return text


def refusal_text(exc: BaseException) -> str:
    """What fail_key records for a statement the server refused (F3): its SQLSTATE and
    message, the same text in every client."""
    diag = getattr(exc, "diag", None)
    message = (diag.message_primary if diag is not None else None) or str(exc)
    return f"{getattr(exc, 'sqlstate', None) or 'XX000'}: {message}"


def error_text(exc: BaseException) -> str:
    """What fail_key records: the exception's type and message."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def until(moment: Optional[datetime]) -> float:
    """Seconds from now until a server timestamp (0 if past or unknown)."""
    if moment is None:
        return 0.0
    return max(0.0, (moment - datetime.now(timezone.utc)).total_seconds())


OUTCOMES = ("hit", "stale", "refresh", "claimed", "waited", "coalesced", "failed")


@dataclass(frozen=True)
class Outcome:
    """What one finished call did (rule O1), handed to the client's on_outcome hook.
    `kind`: hit, stale, refresh, claimed (computed here), waited (for another process),
    coalesced (shared a call of this client) or failed (it raised: `error`)."""

    kind: str
    key: str
    duration: float                      # seconds, from the call to its answer
    error: Optional[BaseException] = None


def report(hook, kind: str, key: str, started: float,
           error: Optional[BaseException] = None) -> None:
    """Call the outcome hook, if any; a hook that raises is logged, never the caller's problem."""
    if hook is None:
        return
    try:
        hook(Outcome(kind if error is None else "failed", key, time.monotonic() - started, error))
    except Exception:
        log.exception("pg_once: the on_outcome hook raised; ignored")


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
