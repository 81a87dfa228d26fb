# Generated from pg_once/_async/client.py by tools/generate_sync.py: edit that file,
# not this one, then run the tool again.
"""The pg_once client, by the rules of docs/clients.md. Written once, for asyncio, in
pg_once/_async/client.py; pg_once/_sync/client.py, for threads, is generated from it by
tools/generate_sync.py, and each flavour's `_compat.py` holds what differs. The asyncio
client opens on `await open()`, `async with`, or its first call; the threads one in its
constructor, so that a wrong conninfo fails there."""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
import uuid
from collections.abc import Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, overload

import psycopg
from psycopg_pool import ConnectionPool, PoolTimeout

from .. import _common as C
from .. import _tracing
from .._common import Duration, Outcome, Serializer, seconds
from .._keys import CacheKeys
from .._typing import CachedFunction, P, T
from ..errors import ClaimLost, ConfigurationError, NotSerializable, OnceFailed, OnceTimeout
from . import _compat as A
from .listener import Listener

if TYPE_CHECKING:
    from .worker import Worker

log = logging.getLogger("pg_once")


def check_connection(conn: psycopg.Connection) -> None:
    """pg_once calls must commit on their own (rule N2): a claim is only visible to other
    callers once committed, and a transaction block would hold it back and keep its row
    locked."""
    if not conn.autocommit:
        raise ConfigurationError(
            "pg_once needs connections in autocommit: create the pool with "
            "kwargs={'autocommit': True, 'prepare_threshold': None}")
    if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
        raise ConfigurationError("pg_once was handed a connection inside a transaction block")


class _Refresh:
    """A refresh this process runs in the background (outcome 'refresh'): computing under
    `token` while callers are served the previous result."""

    __slots__ = ("key", "token", "task")

    def __init__(self, key: str, token: int) -> None:
        self.key, self.token, self.task = key, token, None


class Claim:
    """A claim this process holds on a key (claim_key answered `claimed`; Client.claim
    makes it), heartbeated every lease/3 (rule H1) until it ends with store() or release().
    `lost` is set when a heartbeat found the claim gone (H3)."""

    def __init__(self, client: "Client", key: str, token: int, lease: float,
                 ttl: Optional[float]) -> None:
        self.key, self.token, self.ttl = key, token, ttl
        self._client = client
        self.lost = A.Event()
        self.ended = False
        self._beat = A.spawn_after(lease / 3, client._beat, key, token, lease, self.lost,
                             name=f"pg_once-heartbeat {key}")

    def store(self, text: str, conn: Optional[psycopg.Connection] = None) -> None:
        """Store `text` (JSON) as the key's result with complete_key, fresh for the claim's
        ttl: on `conn`, the caller's connection, inside the caller's transaction (so that
        the result commits with the caller's own writes, or not at all), or through the
        pool. Raises ClaimLost when the claim is no longer current (taken over, or
        invalidated): then nothing was stored, and the caller's transaction should roll
        back. Raises the server's error (e.g. 54000: over once.max_result_size)."""
        self._beat.cancel()   # a heartbeat behind the caller's uncommitted completion would wait for it
        if conn is None:
            stored, _ = self._client._complete(self.key, self.token, text, self.ttl)
        else:
            cur = conn.execute(C.COMPLETE_KEY, (self.key, self.token, self.ttl, text),
                                     prepare=False)
            stored, _ = cur.fetchone()
        if not stored:
            self.ended = True
            raise ClaimLost(self.key)
        # On the caller's connection the completion commits (or rolls back) with the
        # caller's transaction: until then, release() may still give the claim back.
        self.ended = conn is None

    def release(self) -> bool:
        """Give the claim back (release_key): the key is free at once for the next caller.
        False if it was no longer ours."""
        self._beat.cancel()
        self.ended = True
        return self._client._release(self.key, self.token)


class Client:
    """A pg_once client.

    Client("host=db dbname=app")                     # its own pool and LISTEN connection
    Client("host=pgbouncer ...", listen_conninfo="host=db ...")   # PgBouncer transaction mode
    Client(pool=my_pool)                             # an existing psycopg_pool pool
    Client(..., listen=False)                        # no LISTEN: poll, lease-only claims
    Client()                                         # libpq's PG* environment variables
    """

    def __init__(self, conninfo: Optional[str] = None, *, pool: Optional[ConnectionPool] = None,
                 listen_conninfo: Optional[str] = None, listen: bool = True,
                 pool_size: int = 10, connect_timeout: float = 10.0,
                 serializer: Optional[Serializer] = None,
                 on_outcome: Optional[Callable[[Outcome], None]] = None):
        if conninfo is not None and pool is not None:
            raise ConfigurationError("pass either a conninfo string or pool=, not both")
        if pool is None and conninfo is None:
            conninfo = ""   # libpq's PG* environment variables (rule N1)
        self.serializer = C.check_serializer(serializer or C.JSON)
        self.on_outcome = on_outcome
        self._conninfo, self.pool = conninfo, pool
        self._own_pool = pool is None
        self._pool_size, self._connect_timeout = pool_size, connect_timeout
        self._listener: Optional[Listener] = None
        if listen:
            self._listener = Listener(
                listen_conninfo if listen_conninfo is not None else
                conninfo if conninfo is not None else pool.conninfo, connect_timeout)
        self.calls = C.Calls()   # database calls through the pool, by function
        # A plain lock, held only between awaits: the sync flavour's callers are threads.
        self._flights_lock = threading.Lock()
        self._flights: Dict[str, A.Flight] = {}
        # Background refreshes (outcome 'refresh'), at most one per key; under _flights_lock.
        self._refreshes: Dict[str, _Refresh] = {}
        self._closing = False
        self._opened = False
        self._opening = A.Event()
        A.open_at_once(self)

    def open(self) -> "Client":
        """Open the pool (if the client made it) and the LISTEN connection."""
        if self._opened:
            return self
        if self._opening.is_set():   # another caller is opening it: wait for it
            while not self._opened:
                A.sleep(0.01)
            return self
        self._opening.set()
        try:
            if self.pool is None:
                # Waiters hold no connection, so a small pool serves many callers.
                self.pool = ConnectionPool(
                    self._conninfo, min_size=1, max_size=self._pool_size, open=False,
                    name="pg_once", timeout=self._connect_timeout,
                    kwargs={"autocommit": True, "prepare_threshold": None})
                self.pool.open()
            self._opened = True   # from here on, _execute may run
            if self._listener is not None:
                self._listener.start()
                if self._listener.behind_proxy:
                    self._probe_listener()
        except BaseException:
            self._opened = False
            self._opening.clear()
            if self._listener is not None:
                self._listener.close()
            if self._own_pool and self.pool is not None:
                self.pool.close()
                self.pool = None
            raise
        return self

    def _probe_listener(self) -> None:
        """The LISTEN connection goes through a proxy: send a notification through the pool
        and refuse, naming listen_conninfo, if it does not arrive (rule N5)."""
        payload = C.PROBE_PAYLOAD + uuid.uuid4().hex
        event = self._listener.watch(payload)
        try:
            self._execute("notify", C.NOTIFY, (payload,))
            if not A.wait_event(event, C.PROBE_SECONDS):
                raise ConfigurationError(C.TRANSACTION_POOLER)
        finally:
            self._listener.unwatch(payload, event)

    def close(self, refresh_timeout: Duration = 10) -> None:
        """Wait up to `refresh_timeout` seconds for background refreshes to store their
        results, give back the claims of those still running (another caller refreshes at
        once), then close the LISTEN connection and the pool if it is the client's."""
        timeout = seconds(refresh_timeout, "refresh_timeout")
        with self._flights_lock:
            self._closing = True
            refreshes = list(self._refreshes.values())
        running = A.join([r.task for r in refreshes if r.task is not None], timeout)
        for refresh in refreshes:
            if refresh.task in running:
                log.warning("pg_once: closing: the refresh of %r is still running after %g s; "
                            "its claim is given back", refresh.key, timeout)
                refresh.task.cancel()
                self._quietly(self._release, refresh.key, refresh.token)
        A.settle(running)
        for flight in list(self._flights.values()):
            flight.cancel()
        if self._listener is not None:
            self._listener.close()
        if self._own_pool and self.pool is not None:
            self.pool.close()

    def __enter__(self) -> "Client":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    def owner_pid(self) -> Optional[int]:
        """The pid of the LISTEN connection's backend that owns this client's claims
        (0 with listen=False: the lease alone ends them; None: an old server)."""
        if not self._opened:
            self.open()
        return 0 if self._listener is None else self._listener.owner_pid()

    # -- the public calls ---------------------------------------------------------------

    def get_or_compute(self, key: str, compute: Callable[[], T], *,
                             ttl: Optional[Duration] = None, lease: Duration = 30,
                             wait: Duration = 30, retry_after: Duration = 5,
                             stale: Optional[Duration] = None, beta: Optional[float] = None,
                             jitter: Optional[float] = None,
                             serializer: Optional[Serializer] = None) -> T:
        """The cached result of `key`; computes it with `compute()` if no one has, once
        across every process. `ttl`: how long the result is served (None: until
        invalidated). `lease`: how long a claim lives without a heartbeat (heartbeats come
        every lease/3). `wait`: how long to wait for someone else's computation before
        OnceTimeout. `retry_after`: how long a failure is shared before the key is computed
        again. `serializer`: how the result is stored (the client's, JSON by default).
        Every caller, this one included, returns what the serializer reads back from the
        server (rule V1). Raises OnceFailed for a shared failure, ClaimLost,
        NotSerializable, or whatever compute() raised (after recording it with fail_key).

        Freshness (pg_once 0.2.0; each needs a ttl): `stale`: for this long after ttl the
        old result is still returned at once while one caller refreshes it in the
        background; `beta`: XFetch early refresh (1.0 is the usual value): a hit may draw
        a background refresh before expiry; `jitter`: the ttl actually used is
        ttl * (1 - jitter * random()), so that keys filled together expire apart.

        Concurrent calls for one key share one computation (rule C1). With asyncio,
        cancelling a call (or asyncio.timeout) ends its own wait; when every caller of a
        computation has left, it is cancelled and its claim given back (rule X2)."""
        opts = C.call_options(key, ttl=ttl, lease=lease, wait=wait, retry_after=retry_after,
                              stale=stale, beta=beta, jitter=jitter,
                              serializer=serializer or self.serializer)
        started = time.monotonic()
        deadline, wait = started + opts.wait, opts.wait
        if not self._opened:
            self.open()
        flight, leader = self._join(key)
        with _tracing.span(key, None if leader else flight.span_context) as span:
            try:
                while True:
                    if leader:
                        flight.span_context = span.context
                        value, kind = flight.lead(
                            self._resolve, compute, opts,
                            landed=functools.partial(self._landed, key, flight))
                        break
                    kind = "coalesced"
                    try:
                        answered, answer = flight.follow(max(0.0, deadline - time.monotonic()))
                    except OnceTimeout:
                        if time.monotonic() >= deadline:
                            raise
                        # The leader's wait ran out, not this caller's (X1): go on for the
                        # rest of its own, leading a call of its own or following another.
                        opts = dataclasses.replace(opts, wait=deadline - time.monotonic())
                        flight, leader = self._join(key)
                        continue
                    if not answered:
                        raise OnceTimeout(key, wait)
                    value = answer[0]
                    break
            except BaseException as exc:
                span.outcome("failed")
                C.report(self.on_outcome, "failed", key, started, exc)
                raise
            span.outcome(kind)
        C.report(self.on_outcome, kind, key, started)
        return value

    def _join(self, key: str):
        """(the call of `key` under way in this client, False) to follow, or (a new one,
        True) to lead (rule C1)."""
        with self._flights_lock:   # never held across an await
            flight = self._flights.get(key)
            if flight is not None:
                return flight, False
            flight = self._flights[key] = A.Flight()
            return flight, True

    def _landed(self, key: str, flight: A.Flight) -> None:
        with self._flights_lock:
            if self._flights.get(key) is flight:
                del self._flights[key]

    @overload
    def cached(self, fn: Callable[P, T], /) -> CachedFunction[P, T]: ...

    @overload
    def cached(self, fn: None = None, /, **options: Any
               ) -> Callable[[Callable[P, T]], CachedFunction[P, T]]: ...

    def cached(self, fn: Optional[Callable[P, T]] = None, /, *,
               key: Optional[Callable[..., str]] = None, name: Optional[str] = None,
               ttl: Optional[Duration] = None, lease: Duration = 30, wait: Duration = 30,
               retry_after: Duration = 5, stale: Optional[Duration] = None,
               beta: Optional[float] = None, jitter: Optional[float] = None,
               serializer: Optional[Serializer] = None):
        """Decorator, with or without parentheses: cache a function's result, one entry per
        distinct arguments. The key is key(*args, **kwargs) if given, else the default
        key of docs/clients.md rule K: `name` (default `module.qualname`) and a canonical
        encoding of the arguments, the same in every process and in the Node and Rust
        clients. The wrapper has .invalidate(*args, **kwargs), .refresh(*args, **kwargs)
        and .cache_key(*args, **kwargs) for the entry of those arguments. Options as for
        get_or_compute."""
        options = dict(ttl=ttl, lease=lease, wait=wait, retry_after=retry_after, stale=stale,
                       beta=beta, jitter=jitter, serializer=serializer)
        C.call_options("k", **options)   # refuse bad options at decoration time

        def decorate(func: Callable[P, T]) -> "CachedFunction[P, T]":
            keys = CacheKeys(func, key, name)

            @functools.wraps(func)
            def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
                return self.get_or_compute(keys(args, kwargs),
                                                 lambda: func(*args, **kwargs), **options)
            wrapper.invalidate = lambda *a, **kw: self.invalidate(keys(a, kw))
            wrapper.refresh = lambda *a, **kw: self.refresh(keys(a, kw))
            wrapper.cache_key = lambda *a, **kw: keys(a, kw)
            return wrapper
        return decorate if fn is None else decorate(fn)

    def invalidate(self, key: str) -> bool:
        """Forget `key`'s result (once.invalidate_key); a running key is computed once more
        when its run ends. False if there was nothing to forget."""
        return (self._execute("invalidate_key", C.INVALIDATE_KEY, (C.check_key(key),)))[0]

    def refresh(self, key: str, stale: Optional[Duration] = None) -> str:
        """Have `key` computed again (once.refresh_key), its current result served as stale
        for `stale` meanwhile; returns the server's answer (expired, rerun, pending, absent)."""
        return (self._execute("refresh_key", C.REFRESH_KEY,
                                    (C.check_key(key), seconds(stale, "stale"))))[0]

    def enqueue(self, key: str, payload: Any = None, *, queue: str = "default",
                      priority: int = 0, run_at: Optional[datetime] = None,
                      refresh: bool = False, max_attempts: Optional[int] = None) -> str:
        """Ask for `key` to be computed by `queue`'s workers (once.enqueue_key); returns the
        server's answer (queued, requeued, duplicate, cached). The payload is written by the
        client's serializer."""
        text = None if payload is None else C.dump_value(key, self.serializer, payload)
        return (self._execute("enqueue_key", C.ENQUEUE_KEY,
                                    (C.check_key(key), text, queue, priority, run_at, refresh,
                                     max_attempts)))[0]

    def enqueue_many(self, jobs: Any, *, queue: str = "default", priority: int = 0,
                           run_at: Optional[datetime] = None, refresh: bool = False,
                           max_attempts: Optional[int] = None) -> Dict[str, str]:
        """enqueue for many keys in one statement (once.enqueue_keys): `jobs` maps each key
        to its payload (None: no payload), or is an iterable of keys without payloads.
        Returns {key: outcome} in the order given, each outcome what enqueue would have
        answered. Every key is checked, every payload written, before anything is sent; at
        most 1,000 distinct keys a call (the server refuses more, or a repeated key, with
        22023, and the whole batch when one key is not the caller's, 42501)."""
        if isinstance(jobs, (str, bytes)):
            raise TypeError("enqueue_many takes a mapping of keys to payloads, or keys; "
                            "for one key call enqueue")
        pairs = list(jobs.items()) if isinstance(jobs, Mapping) else [(k, None) for k in jobs]
        if not pairs:
            return {}
        keys = [C.check_key(k) for k, _ in pairs]
        payloads = [None if p is None else C.dump_value(k, self.serializer, p) for k, p in pairs]
        rows = self._execute(
            "enqueue_keys", C.ENQUEUE_KEYS,
            (keys, payloads if any(p is not None for p in payloads) else None, queue, priority,
             run_at, refresh, max_attempts), many=True)
        return {key: outcome for key, outcome in rows}

    def load_payload(self, text: Optional[str]) -> Any:
        """A queued key's payload, read back through the client's serializer."""
        return None if text is None else self.serializer.loads(text)

    def worker(self, queue: str, handler: Callable, **options) -> "Worker":
        """A queue worker loop (not started): .run() it, .stop() it. See Worker."""
        from .worker import Worker
        return Worker(self, queue, handler, **options)

    def work(self, queue: str, handler: Callable, **options) -> int:
        """Run a queue worker loop until SIGTERM/SIGINT (or the worker's stop()); returns
        how many jobs it completed. Options as for Worker."""
        return self.worker(queue, handler, **options).run()

    def claim(self, key: str, *, fingerprint: Optional[bytes] = None, lease: Duration = 30,
                    wait: Duration = 0, ttl: Optional[Duration] = None) -> C.Answer:
        """One claim_key for a caller that runs the work itself, such as the idempotency
        middleware (pg_once.asgi, pg_once.wsgi): an Answer whose `outcome` is `hit`
        (`result`: the stored JSON text), `claimed` (`claim`: an Claim, heartbeated
        until it is stored or released), `failed` (`error`, `retry_at`), `mismatch` (the
        key runs or is stored with another `fingerprint`, 1 to 64 bytes; pg_once 0.3.0) or
        `wait` (someone else runs it, still after `wait` seconds). While waiting it holds
        no connection and wakes on the key's notification (rule C2). `ttl` is how long a
        result stored with the claim is served. No in-process coalescing: a second caller
        of this process for a running key is answered `wait` like any other."""
        key = C.check_key(key)
        lease_s, wait_s = seconds(lease, "lease", positive=True), seconds(wait, "wait")
        ttl_s = seconds(ttl, "ttl", positive=True)
        fingerprint = C.check_fingerprint(fingerprint)
        if not self._opened:
            self.open()
        row, _ = self._ask(key, lease_s, wait_s, fingerprint=fingerprint)
        outcome, token, result, error, _, retry_at = row
        claim = Claim(self, key, token, lease_s, ttl_s) if outcome == "claimed" else None
        return C.Answer(outcome, result, error, retry_at, claim)

    # -- the protocol ---------------------------------------------------------------------

    def _resolve(self, compute, opts: C.CallOptions):
        """(value, outcome kind) of one call, asking the server until it answers."""
        key = opts.key
        row, waited = self._ask(key, opts.lease, opts.wait, opts.fresh.serve_stale)
        outcome, token, result, error, lease_expires_at, retry_at = row
        if outcome == "hit":
            return opts.serializer.loads(result), "waited" if waited else "hit"
        if outcome == "failed":
            raise OnceFailed(key, error, retry_at)
        if outcome == "stale":
            # Someone refreshes it (or its last refresh failed): the previous result, never
            # a wait. Its token is not ours (rule C5).
            return opts.serializer.loads(result), "stale"
        if outcome == "refresh":
            # Ours to recompute; the previous result is the answer meanwhile.
            self._refresh_in_background(key, token, compute, opts)
            return opts.serializer.loads(result), "refresh"
        if outcome == "wait":
            raise OnceTimeout(key, opts.wait)
        return self._compute(key, token, compute, opts), "claimed"

    def _ask(self, key: str, lease: float, wait: float, serve_stale: bool = False,
                   fingerprint: Optional[bytes] = None):
        """(claim_key's row, whether it waited): the first answer that is not 'wait', or
        a 'wait' once `wait` seconds have run out (at once for wait=0). While someone else
        computes the key it sleeps holding no connection until the key's notification,
        the owner's lease expiry, or a jittered recheck (C2). No answer is waited for past
        the wait (N6), nor abandoned (R2): one that comes after it, or after the caller
        was cancelled, is given back if it is a claim (X2). A claim sent with no wait
        left (a wait of 0, or a first ask after the deadline on a loaded machine) waits
        for its answer up to connect_timeout, R2's budget for every other statement."""
        deadline = time.monotonic() + wait
        delays = C.poll_delays()
        listener = self._listener
        waited = False
        while True:
            # Interest first, then the question: a completion in between still wakes us (C4).
            event = listener.watch(key) if listener is not None else None
            try:
                owner = self.owner_pid()
                try:
                    left = deadline - time.monotonic()
                    answered, row = A.run_detachable(
                        self._claim, key, lease, owner, serve_stale, fingerprint, deadline,
                        timeout=left if left > 0 else self._connect_timeout,
                        orphaned=functools.partial(self._give_back, key))
                except psycopg.errors.InvalidParameterValue:
                    # owner_pid refused (22023): our LISTEN backend went away between reading
                    # P and the claim (a failover: P was the old primary's). Ask again with
                    # the new P once the listener has noticed and is back (R3).
                    patience = min(5.0, max(0.0, deadline - time.monotonic()))
                    if listener is None or owner is None or not listener.replaced(owner, patience):
                        raise
                    continue
                if not answered:   # the wait ran out with the claim on its way
                    return C.WAITED_OUT, waited
                if row[0] != "wait":
                    return row, waited
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return row, waited
                waited = True
                lease_expires_at = row[4]
                pause = C.jittered(C.RECHECK_SECONDS) if event is not None else next(delays)
                pause = min(pause, remaining, max(0.02, C.until(lease_expires_at)))
                woken = False
                if event is not None:
                    woken = A.wait_event(event, pause)
                else:
                    A.sleep(pause)
                if (pause >= remaining and not woken) or time.monotonic() >= deadline:
                    # The wait is over: a claim sent now could not be answered within it,
                    # it would only be made and given back.
                    return row, waited
            finally:
                if event is not None:
                    listener.unwatch(key, event)

    def _give_back(self, key: str, row) -> None:
        """claim_key's answer after its caller left (cancelled, or its wait ran out): a
        claim it made is this process's alone to end, so it is released at once rather
        than left to its lease, and another caller computes the key (rule X2)."""
        outcome, token = row[0], row[1]
        if outcome in ("claimed", "refresh"):
            log.info("pg_once: the claim on %r was answered after its caller left; "
                     "giving it back", key)
            self._quietly(self._release, key, token)

    def _refresh_in_background(self, key, token, compute, opts) -> None:
        with self._flights_lock:
            # A refresh of this key still running here means the server no longer counts
            # its claim (it would have answered 'stale' otherwise): its result will be
            # refused. Starting a second one would break "one background refresh per key
            # per process", so this claim goes back; so does one drawn while closing.
            give_back = self._closing or key in self._refreshes
            if not give_back:
                refresh = self._refreshes[key] = _Refresh(key, token)
        if give_back:
            self._quietly(self._release, key, token)
            return
        refresh.task = A.spawn(self._run_refresh, refresh, compute, opts,
                               name=f"pg_once-refresh {key}")

    def _run_refresh(self, refresh: "_Refresh", compute, opts) -> None:
        key = refresh.key
        try:
            self._compute(key, refresh.token, compute, opts)
        except ClaimLost:
            log.warning("pg_once: the refresh of %r lost its claim; its result was not stored", key)
        except Exception as exc:
            log.warning("pg_once: refreshing %r failed (%s); the previous result is still "
                        "served until its stale window ends", key, C.error_text(exc))
        finally:
            with self._flights_lock:
                if self._refreshes.get(key) is refresh:
                    del self._refreshes[key]

    def _compute(self, key, token, compute, opts):
        """Run compute() under our claim, heartbeating it, and store its result; what the
        server stored, read back through the serializer, is the answer (V1)."""
        retry_after = opts.retry_after
        lost = A.Event()
        beat = A.spawn_after(opts.lease / 3, self._beat, key, token, opts.lease, lost,
                             name=f"pg_once-heartbeat {key}")
        try:
            try:
                value = A.run_unless(compute, lost)
            except A.Stopped:   # a heartbeat said the claim is gone: stop, store nothing
                raise ClaimLost(key) from None
            except Exception as exc:
                self._quietly(self._fail, key, token, C.error_text(exc), retry_after)
                raise
            except BaseException:
                # Cancelled, KeyboardInterrupt, SystemExit: not the computation's fault; give
                # the claim back so that another caller computes at once (rule X2).
                self._quietly(self._release, key, token)
                raise
            try:
                text = C.dump_value(key, opts.serializer, value)
            except NotSerializable as exc:
                self._quietly(self._fail, key, token, str(exc), retry_after)   # V4
                raise
            beat.cancel()
            if lost.is_set():
                raise ClaimLost(key, value)
            try:
                stored, text = self._complete(key, token, text, opts.ttl, opts.fresh)
            except psycopg.Error as exc:
                if C.retryable(exc.sqlstate, True):
                    raise   # nothing can be written: the claim ends with its owner or lease
                # The server refused the result (54000: over once.max_result_size): fail the
                # key with the reason, so that its waiters share the refusal rather than
                # compute a result that would be refused again (F3).
                self._quietly(self._fail, key, token, C.refusal_text(exc), retry_after)
                raise
            if not stored:
                raise ClaimLost(key, value)
            return opts.serializer.loads(text)
        finally:
            beat.cancel()

    def _beat(self, key, token, lease, lost: A.Event) -> None:
        """Extend the claim now and every lease/3 until cancelled (H1): started lease/3
        after the claim, with A.spawn_after. A failed heartbeat is tried again within a
        second (H2); NULL means the claim is lost: set `lost` (H3)."""
        while True:
            try:
                expiry = self._heartbeat(key, token, lease)
            except Exception as exc:
                # The claim may still be fine (a pooled connection broke, the pool was busy):
                # try again soon, well before the lease can run out.
                log.warning("pg_once: heartbeat of %r failed (%s); retrying", key, exc)
                A.sleep(min(1.0, lease / 6))
                continue
            if expiry is None:
                log.warning("pg_once: the claim on %r was lost; its result will not be stored", key)
                lost.set()
                return
            A.sleep(lease / 3)

    def _quietly(self, call, *args) -> None:
        """Record a failure or release without masking the error being raised (rule F4)."""
        try:
            call(*args)
        except Exception as exc:
            log.warning("pg_once: could not record the outcome of %r (%s); the claim ends "
                        "with its owner or lease", args[0], exc)

    # -- one database call each, through the pool ------------------------------------------

    def _execute(self, name: str, sql: str, params: tuple, many: bool = False,
                       deadline: Optional[float] = None):
        """One statement on a pooled connection. A connection failure (rule R1) is tried
        again on another connection, at once and then after jittered pauses (R2), until
        `deadline` (time.monotonic(): a claim's wait) or, without one, connect_timeout
        from now: long enough for a failover to another host of the conninfo (N7)."""
        if not self._opened:
            self.open()
        self.calls.add(name)
        if deadline is None:
            deadline = time.monotonic() + self._connect_timeout
        pauses = C.retry_pauses()
        attempt = 0
        while True:
            attempt += 1
            if attempt > 1:   # the first attempt goes at once: no sleep(0), no thread switch
                pause = next(pauses)
                if attempt > 2 and time.monotonic() + pause >= deadline:
                    raise failed
                A.sleep(pause)
            try:
                # A retry waits for a pooled connection no longer than the budget lasts
                # (a new one goes through the host list to the server that is writable now).
                timeout = None if attempt == 1 else max(0.05, deadline - time.monotonic())
                with self.pool.connection(timeout=timeout) as conn:
                    check_connection(conn)
                    try:
                        cur = conn.execute(sql, params, prepare=False)
                        return (cur.fetchall() if many else cur.fetchone())
                    except psycopg.Error as exc:
                        # Only a lost connection is tried again, on another one (rule R1).
                        # Every call is safe to repeat: if the first one did commit, a
                        # repeated complete_key/fail_key returns false and heartbeat_key
                        # NULL (reported as a lost claim, L4), and a repeated claim_key
                        # finds our own claim and waits for its lease: rare, slower, never
                        # wrong.
                        if not C.retryable(exc.sqlstate, conn.broken):
                            raise
                        conn.close()   # so that the pool drops it rather than lend it again
                        failed = exc
                        if attempt == 2 and hasattr(self.pool, "drain"):
                            # Two in a row: the server went away, not one connection (a
                            # failover, N7). psycopg notices a closed socket only when it
                            # uses it, so every idle connection to the old server would
                            # fail a retry in turn: replace them all (psycopg_pool >= 3.3).
                            self.pool.drain()
            except PoolTimeout as exc:
                # No connection within the pool's timeout: the servers are unreachable or
                # none qualifies yet (a standby being promoted), a connection failure too.
                failed = exc
            log.info("pg_once: %s failed on its connection (%s); retrying", name, failed)

    def _claim(self, key, lease, owner, serve_stale=False, fingerprint=None,
                     deadline=None):
        """claim_key, its connection failures retried until `deadline`, the caller's wait (R2)."""
        if fingerprint is not None:
            try:
                return self._execute("claim_key", C.CLAIM_KEY_FINGERPRINT,
                                           (key, lease, owner, fingerprint), deadline=deadline)
            except psycopg.errors.UndefinedFunction as exc:   # no fingerprint argument
                raise ConfigurationError(C.NO_FINGERPRINT_SERVER) from exc
        if serve_stale:
            if owner is None:
                raise ConfigurationError(C.NO_FRESHNESS_SERVER)
            try:
                return self._execute("claim_key", C.CLAIM_KEY_SERVE_STALE, (key, lease, owner),
                                           deadline=deadline)
            except psycopg.errors.UndefinedFunction as exc:   # no serve_stale argument
                raise ConfigurationError(C.NO_FRESHNESS_SERVER) from exc
        if owner is None:
            return self._execute("claim_key", C.CLAIM_KEY_LEGACY, (key, lease),
                                       deadline=deadline)
        return self._execute("claim_key", C.CLAIM_KEY, (key, lease, owner),
                                   deadline=deadline)

    def _complete(self, key, token, text, ttl, fresh=C.NO_FRESHNESS):
        """(stored, the result's text as the server keeps it)."""
        if not fresh.given:
            return self._execute("complete_key", C.COMPLETE_KEY, (key, token, ttl, text))
        return self._execute("complete_key", C.COMPLETE_KEY_FRESHNESS,
                                   (key, token, ttl, fresh.stale, fresh.beta, fresh.jitter, text))

    def _fail(self, key, token, error, retry_after) -> bool:
        return (self._execute("fail_key", C.FAIL_KEY, (key, token, error, retry_after)))[0]

    def _release(self, key, token) -> bool:
        return (self._execute("release_key", C.RELEASE_KEY, (key, token)))[0]

    def _heartbeat(self, key, token, lease):
        return (self._execute("heartbeat_key", C.HEARTBEAT_KEY, (key, token, lease)))[0]
