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

    def close(self) -> None:
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
                       retry_after: Duration = 5) -> Any:
        """The cached result of `key`; computes it with `compute()` if no one has, once
        across every process. `ttl`: how long the result is served (None: until
        invalidated). `lease`: how long a claim lives without a heartbeat (heartbeats come
        every lease/3). `wait`: how long to wait for someone else's computation before
        OnceTimeout. `retry_after`: how long a failure is shared before the key is computed
        again. Raises OnceFailed for a shared failure, ClaimLost, NotSerializable, or
        whatever compute() raised (after recording it with fail_key)."""
        if not isinstance(key, str):
            raise TypeError(f"key must be a str, got {type(key).__name__}")
        opts = (seconds(ttl, "ttl"), seconds(lease, "lease"), seconds(wait, "wait"),
                seconds(retry_after, "retry_after"))
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
               lease: Duration = 30, wait: Duration = 30, retry_after: Duration = 5):
        """Decorator: cache a function's result under key(*args, **kwargs) (default: the
        function's qualified name and the repr of its arguments)."""
        def decorate(fn):
            @functools.wraps(fn)
            def wrapper(*args, **kwargs):
                k = key(*args, **kwargs) if key else f"{fn.__module__}.{fn.__qualname__}:{args!r}:{kwargs!r}"
                return self.get_or_compute(k, lambda: fn(*args, **kwargs), ttl=ttl, lease=lease,
                                           wait=wait, retry_after=retry_after)
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

    def _resolve(self, key, compute, ttl, lease, wait, retry_after):
        deadline = time.monotonic() + wait
        delays = C.poll_delays()
        listener = self._listener
        while True:
            # Interest first, then the question: a completion in between still wakes us.
            event = listener.watch(key) if listener is not None else None
            try:
                owner = self.owner_pid
                try:
                    row = self._claim(key, lease, owner)
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
        return self._compute(key, token, compute, ttl, lease, retry_after)

    def _compute(self, key, token, compute, ttl, lease, retry_after):
        beat = self._heartbeats.add(key, token, lease)
        try:
            try:
                value = compute()
            except Exception as exc:
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
            if beat.lost or not self._complete(key, token, text, ttl):
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

    def _claim(self, key, lease, owner):
        if owner is None:
            return self._execute("claim_key", C.CLAIM_KEY_LEGACY, (key, lease))
        return self._execute("claim_key", C.CLAIM_KEY, (key, lease, owner))

    def _complete(self, key, token, text, ttl) -> bool:
        return self._execute("complete_key", C.COMPLETE_KEY, (key, token, text, ttl))[0]

    def _fail(self, key, token, error, retry_after) -> bool:
        return self._execute("fail_key", C.FAIL_KEY, (key, token, error, retry_after))[0]

    def _release(self, key, token) -> bool:
        return self._execute("release_key", C.RELEASE_KEY, (key, token))[0]

    def _heartbeat(self, key, token, lease):
        return self._execute("heartbeat_key", C.HEARTBEAT_KEY, (key, token, lease))[0]
