"""The sync client: Client(conninfo) or Client(pool=...), for threads."""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional

import psycopg
from psycopg_pool import ConnectionPool

from . import _common as C
from ._common import Duration, seconds
from ._heartbeat import Heartbeats
from ._listener import Listener
from .errors import ClaimLost, ConfigurationError, NotSerializable, OnceFailed, OnceTimeout

if TYPE_CHECKING:
    from .worker import Worker

log = logging.getLogger("pg_once")


class _Flight:
    """One in-process computation of a key that concurrent callers share: the first caller
    (the leader) talks to the server; the others wait here for its result or exception."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: Any = None
        self.error: Optional[BaseException] = None

    def result(self, key: str, wait: float) -> Any:
        if not self.done.wait(wait):
            raise OnceTimeout(key, wait)
        if self.error is not None:
            raise self.error
        return self.value


class _Refresh:
    """A refresh this process runs in the background (outcome 'refresh'): a thread
    computing under `token` while callers are served the previous result."""

    def __init__(self, key: str, token: int) -> None:
        self.key, self.token = key, token
        self.done = threading.Event()
        # Set by close() when it gave the claim back: the thread then stores nothing.
        self.abandoned = False


def check_connection(conn: psycopg.Connection) -> None:
    """pg_once calls must commit on their own: a claim is only visible to other callers
    once committed, and a transaction block would hold it back and keep its row locked."""
    if not conn.autocommit:
        raise ConfigurationError(
            "pg_once needs connections in autocommit: create the pool with "
            "kwargs={'autocommit': True, 'prepare_threshold': None}")
    if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
        raise ConfigurationError("pg_once was handed a connection inside a transaction block")


class Client:
    """A pg_once client for threads.

    Client("host=db dbname=app")                          # its own pool and LISTEN connection
    Client("host=pgbouncer ...", listen_conninfo="host=db ...")   # PgBouncer transaction mode
    Client(pool=my_pool)                                  # an existing psycopg_pool pool
    Client(..., listen=False)                             # no LISTEN: poll, lease-only claims
    """

    def __init__(self, conninfo: Optional[str] = None, *, pool: Optional[ConnectionPool] = None,
                 listen_conninfo: Optional[str] = None, listen: bool = True,
                 pool_size: int = 10, connect_timeout: float = 10.0):
        if (conninfo is None) == (pool is None):
            raise ConfigurationError("pass either a conninfo string or pool=, not both")
        self._own_pool = pool is None
        if pool is None:
            # Waiters hold no connection, so a small pool serves many callers.
            pool = ConnectionPool(
                conninfo, min_size=1, max_size=pool_size, open=True, name="pg_once",
                kwargs={"autocommit": True, "prepare_threshold": None},
                timeout=connect_timeout)
        self.pool = pool
        self.calls = C.Calls()   # database calls through the pool, by function
        self._flights: Dict[str, _Flight] = {}
        self._flights_lock = threading.Lock()
        self._refreshes: Dict[str, _Refresh] = {}   # at most one per key; under _flights_lock
        self._closing = False
        self._heartbeats = Heartbeats(self._heartbeat)
        self._listener: Optional[Listener] = None
        if listen:
            self._listener = Listener(listen_conninfo or conninfo or pool.conninfo, connect_timeout)
            try:
                self._listener.start()
            except BaseException:
                if self._own_pool:
                    pool.close()
                raise

    # -- lifecycle --------------------------------------------------------------------------

    def close(self, refresh_timeout: Duration = 10) -> None:
        """Wait up to `refresh_timeout` seconds for background refreshes to store their
        results, give back the claims of those still running (another caller refreshes
        at once), then close the LISTEN connection and the pool if it is the client's."""
        timeout = seconds(refresh_timeout, "refresh_timeout")
        with self._flights_lock:
            self._closing = True
            refreshes = list(self._refreshes.values())
        deadline = time.monotonic() + timeout
        for refresh in refreshes:
            refresh.done.wait(max(0.0, deadline - time.monotonic()))
        for refresh in refreshes:
            with self._flights_lock:
                if refresh.done.is_set():
                    continue
                refresh.abandoned = True
            log.warning("pg_once: closing: the refresh of %r is still running after %g s; "
                        "its claim is given back", refresh.key, timeout)
            self._quietly(self._release, refresh.key, refresh.token)
        self._heartbeats.close()
        if self._listener is not None:
            self._listener.close()
        if self._own_pool:
            self.pool.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def owner_pid(self) -> Optional[int]:
        """The pid of the LISTEN connection's backend that owns this client's claims
        (0 with listen=False: the lease alone ends them; None: an old server)."""
        return 0 if self._listener is None else self._listener.owner_pid()

    # -- the public calls ---------------------------------------------------------------

    def get_or_compute(self, key: str, compute: Callable[[], Any], *, ttl: Optional[Duration] = None,
                       lease: Duration = 30, wait: Duration = 30,
                       retry_after: Duration = 5, stale: Optional[Duration] = None,
                       beta: Optional[float] = None, jitter: Optional[float] = None) -> Any:
        """The cached result of `key`; computes it with `compute()` if no one has, once
        across every process. `ttl`: how long the result is served (None: until
        invalidated). `lease`: how long a claim lives without a heartbeat (heartbeats come
        every lease/3). `wait`: how long to wait for someone else's computation before
        OnceTimeout. `retry_after`: how long a failure is shared before the key is computed
        again. Raises OnceFailed for a shared failure, ClaimLost, NotSerializable, or
        whatever compute() raised (after recording it with fail_key).

        Freshness (pg_once 0.2.0; each needs a ttl): `stale`: for this long after ttl the
        old result is still returned at once while one caller refreshes it in a
        background thread; `beta`: XFetch early refresh (1.0 is the usual value): a hit
        may draw a background refresh before expiry; `jitter`: the ttl actually used is
        ttl * (1 - jitter * random()), so that keys filled together expire apart."""
        if not isinstance(key, str):
            raise TypeError(f"key must be a str, got {type(key).__name__}")
        opts = (seconds(ttl, "ttl"), seconds(lease, "lease"), seconds(wait, "wait"),
                seconds(retry_after, "retry_after"))
        opts += (C.freshness(opts[0], stale, beta, jitter),)
        with self._flights_lock:
            flight = self._flights.get(key)
            leader = flight is None
            if leader:
                flight = self._flights[key] = _Flight()
        if not leader:
            return flight.result(key, opts[2])
        try:
            flight.value = self._resolve(key, compute, *opts)
            return flight.value
        except BaseException as exc:
            flight.error = exc
            raise
        finally:
            with self._flights_lock:
                del self._flights[key]
            flight.done.set()

    def cached(self, key: Optional[Callable[..., str]] = None, *, ttl: Optional[Duration] = None,
               lease: Duration = 30, wait: Duration = 30, retry_after: Duration = 5,
               stale: Optional[Duration] = None, beta: Optional[float] = None,
               jitter: Optional[float] = None):
        """Decorator: cache a function's result under key(*args, **kwargs) (default: the
        function's qualified name and the repr of its arguments). Options as for
        get_or_compute."""
        C.freshness(seconds(ttl, "ttl"), stale, beta, jitter)   # refuse bad options now

        def decorate(fn):
            @functools.wraps(fn)
            def wrapper(*args, **kwargs):
                k = key(*args, **kwargs) if key else f"{fn.__module__}.{fn.__qualname__}:{args!r}:{kwargs!r}"
                return self.get_or_compute(k, lambda: fn(*args, **kwargs), ttl=ttl, lease=lease,
                                           wait=wait, retry_after=retry_after, stale=stale,
                                           beta=beta, jitter=jitter)
            return wrapper
        return decorate

    def worker(self, queue: str, handler: Callable, **options) -> "Worker":
        """A queue worker loop (not started): .run() it, .stop() it. See Worker."""
        from .worker import Worker
        return Worker(self, queue, handler, **options)

    def work(self, queue: str, handler: Callable, **options) -> int:
        """Run a queue worker loop until SIGTERM/SIGINT (or the worker's stop()); returns
        how many jobs it completed. Options as for Worker."""
        return self.worker(queue, handler, **options).run()

    # -- the protocol ---------------------------------------------------------------------

    def _resolve(self, key, compute, ttl, lease, wait, retry_after, fresh):
        deadline = time.monotonic() + wait
        delays = C.poll_delays()
        listener = self._listener
        while True:
            # Interest first, then the question: a completion in between still wakes us.
            event = listener.watch(key) if listener is not None else None
            try:
                owner = self.owner_pid
                try:
                    row = self._claim(key, lease, owner, fresh.serve_stale)
                except psycopg.errors.InvalidParameterValue:
                    # owner_pid refused (22023): our LISTEN backend went away between reading
                    # P and the claim. Ask again with the new P once the listener is back.
                    if listener is None or listener.owner_pid() == owner:
                        raise
                    continue
                outcome, token, result, error, lease_expires_at, retry_at = row
                if outcome == "hit":
                    return result
                if outcome == "failed":
                    raise OnceFailed(key, error, retry_at)
                if outcome == "claimed":
                    break
                if outcome == "stale":
                    # Someone refreshes it (or its last refresh failed): the previous result,
                    # never a wait.
                    return result
                if outcome == "refresh":
                    # Ours to recompute; the previous result is the answer meanwhile.
                    self._refresh_in_background(key, token, compute, ttl, lease, retry_after, fresh)
                    return result
                # "wait": someone else computes it. Sleep holding no connection until the
                # key's notification, the owner's lease expiry, or a jittered recheck.
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise OnceTimeout(key, wait)
                pause = C.jittered(C.RECHECK_SECONDS) if event is not None else next(delays)
                pause = min(pause, remaining, max(0.02, C.until(lease_expires_at)))
                if event is not None:
                    event.wait(pause)
                else:
                    time.sleep(pause)
            finally:
                if event is not None:
                    listener.unwatch(key, event)
        return self._compute(key, token, compute, ttl, lease, retry_after, fresh)

    def _refresh_in_background(self, key, token, compute, ttl, lease, retry_after, fresh) -> None:
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
        threading.Thread(target=self._run_refresh, name=f"pg_once-refresh {key}", daemon=True,
                         args=(refresh, compute, ttl, lease, retry_after, fresh)).start()

    def _run_refresh(self, refresh, compute, ttl, lease, retry_after, fresh) -> None:
        key = refresh.key
        try:
            self._compute(key, refresh.token, compute, ttl, lease, retry_after, fresh, refresh)
        except ClaimLost:
            if not refresh.abandoned:
                log.warning("pg_once: the refresh of %r lost its claim; its result was not stored", key)
        except Exception as exc:
            if not refresh.abandoned:
                log.warning("pg_once: refreshing %r failed (%s); the previous result is still "
                            "served until its stale window ends", key, C.error_text(exc))
        finally:
            with self._flights_lock:
                if self._refreshes.get(key) is refresh:
                    del self._refreshes[key]
            refresh.done.set()

    def _compute(self, key, token, compute, ttl, lease, retry_after, fresh, refresh=None):
        beat = self._heartbeats.add(key, token, lease)
        try:
            try:
                value = compute()
            except Exception as exc:
                if refresh is None or not refresh.abandoned:
                    self._quietly(self._fail, key, token, C.error_text(exc), retry_after)
                raise
            except BaseException:
                # KeyboardInterrupt, SystemExit: not the computation's fault; give the
                # claim back so that another caller computes at once.
                self._quietly(self._release, key, token)
                raise
            try:
                text = C.encode(key, value)
            except NotSerializable as exc:
                self._quietly(self._fail, key, token, str(exc), retry_after)
                raise
            self._heartbeats.remove(beat)
            if beat.lost or (refresh is not None and refresh.abandoned):
                raise ClaimLost(key, value)
            try:
                stored = self._complete(key, token, text, ttl, fresh)
            except psycopg.Error as exc:
                if isinstance(exc, psycopg.OperationalError):
                    raise   # nothing can be written: the claim ends with its owner or lease
                # The server refused the result (54000: over once.max_result_size): fail
                # the key with the reason, rather than leave it claimed until the lease ends.
                self._quietly(self._fail, key, token, C.error_text(exc), retry_after)
                raise
            if not stored:
                raise ClaimLost(key, value)
            return value
        finally:
            self._heartbeats.remove(beat)

    def _quietly(self, call, *args) -> None:
        """Record a failure or release without masking the exception being raised."""
        try:
            call(*args)
        except Exception as exc:
            log.warning("pg_once: could not record the outcome of %r (%s); the claim ends "
                        "with its owner or lease", args[0], exc)

    # -- one database call each, through the pool ------------------------------------------

    def _execute(self, name: str, sql: str, params: tuple, many: bool = False):
        self.calls.add(name)
        for attempt in range(4):
            with self.pool.connection() as conn:
                check_connection(conn)
                try:
                    cur = conn.execute(sql, params, prepare=False)
                    return cur.fetchall() if many else cur.fetchone()
                except psycopg.OperationalError as exc:
                    # A pooled server connection closed under us (recycled, terminated):
                    # the pool drops it when it comes back; try on another one. Every call
                    # is safe to repeat: if the first one did commit, a repeated
                    # complete_key/fail_key returns false and heartbeat_key NULL (reported
                    # as a lost claim), and a repeated claim_key finds our own claim and
                    # waits for its lease: rare, slower, never wrong.
                    if not C.connection_lost(conn, exc) or attempt == 3:
                        raise
                    conn.close()   # so that the pool drops it rather than lend it again
            log.info("pg_once: %s retried on a fresh connection", name)

    def _claim(self, key, lease, owner, serve_stale=False):
        if serve_stale:
            if owner is None:
                raise ConfigurationError(C.NO_FRESHNESS_SERVER)
            try:
                return self._execute("claim_key", C.CLAIM_KEY_SERVE_STALE, (key, lease, owner))
            except psycopg.errors.UndefinedFunction as exc:   # no serve_stale argument
                raise ConfigurationError(C.NO_FRESHNESS_SERVER) from exc
        if owner is None:
            return self._execute("claim_key", C.CLAIM_KEY_LEGACY, (key, lease))
        return self._execute("claim_key", C.CLAIM_KEY, (key, lease, owner))

    def _complete(self, key, token, text, ttl, fresh=C.NO_FRESHNESS) -> bool:
        if not fresh.given:
            return self._execute("complete_key", C.COMPLETE_KEY, (key, token, text, ttl))[0]
        return self._execute("complete_key", C.COMPLETE_KEY_FRESHNESS,
                             (key, token, text, ttl, fresh.stale, fresh.beta, fresh.jitter))[0]

    def _fail(self, key, token, error, retry_after) -> bool:
        return self._execute("fail_key", C.FAIL_KEY, (key, token, error, retry_after))[0]

    def _release(self, key, token) -> bool:
        return self._execute("release_key", C.RELEASE_KEY, (key, token))[0]

    def _heartbeat(self, key, token, lease):
        return self._execute("heartbeat_key", C.HEARTBEAT_KEY, (key, token, lease))[0]
