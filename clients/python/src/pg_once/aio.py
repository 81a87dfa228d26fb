"""The asyncio client: AsyncClient(conninfo) or AsyncClient(pool=...), and AsyncWorker.

Same protocol as the sync client (see client.py); computations, heartbeats, the listener
and handlers are tasks instead of threads. Open it with `async with AsyncClient(...) as
once:` or `await once.open()` (the first call opens it too)."""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import signal
import time
import uuid
from typing import Any, Awaitable, Callable, Dict, Optional, Set

import psycopg
from psycopg_pool import AsyncConnectionPool

from datetime import datetime

from . import _common as C
from ._common import Duration, Job, Outcome, Serializer, seconds
from ._keys import CacheKeys
from ._typing import CachedFunction, P, T
from .errors import ClaimLost, ConfigurationError, NotSerializable, OnceFailed, OnceTimeout
from ._listener import HEALTH_CHECK_SECONDS, RECONNECT_MAX_SECONDS
from .client import check_connection

log = logging.getLogger("pg_once")


async def _call(fn: Callable[..., Any], *args) -> Any:
    """Call a coroutine function (or a plain function) and return its result."""
    result = fn(*args)
    if inspect.isawaitable(result):
        result = await result
    return result


class AsyncListener:
    """The process's one LISTEN connection (asyncio flavour); see _listener.Listener."""

    def __init__(self, conninfo: str, connect_timeout: float):
        self._conninfo, self._connect_timeout = conninfo, connect_timeout
        self._interest: Dict[str, Set[asyncio.Event]] = {}
        self._connected = asyncio.Event()
        self._pid: Optional[int] = None
        self.legacy = False
        self.behind_proxy = False   # see Listener
        self.reconnects = 0
        self._conn: Optional[psycopg.AsyncConnection] = None
        self._task: Optional[asyncio.Task] = None
        self._closed = False

    async def start(self) -> None:
        await self._connect()
        self._task = asyncio.create_task(self._run(), name="pg_once-listener")

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except BaseException:
                pass
        if self._conn is not None:
            await self._conn.close()
        self._wake_all()

    async def owner_pid(self) -> Optional[int]:
        if not self._connected.is_set():
            try:
                await asyncio.wait_for(self._connected.wait(), self._connect_timeout)
            except asyncio.TimeoutError:
                raise psycopg.OperationalError(
                    f"pg_once: the LISTEN connection has been down for {self._connect_timeout:g} s") from None
        return self._pid

    def watch(self, key: str) -> asyncio.Event:
        event = asyncio.Event()
        for name in C.notified_names(key):
            self._interest.setdefault(name, set()).add(event)
        return event

    def unwatch(self, key: str, event: asyncio.Event) -> None:
        for name in C.notified_names(key):
            events = self._interest.get(name)
            if events is not None:
                events.discard(event)
                if not events:
                    del self._interest[name]

    def _wake(self, payload: str) -> None:
        if payload == C.WAKE_EVERYONE:
            self._wake_all()
            return
        for event in self._interest.get(payload, ()):
            event.set()

    def _wake_all(self) -> None:
        for events in self._interest.values():
            for event in events:
                event.set()

    async def _connect(self) -> None:
        conn = await psycopg.AsyncConnection.connect(
            self._conninfo, autocommit=True, prepare_threshold=None,
            connect_timeout=max(1, int(self._connect_timeout)))
        try:
            await conn.execute(C.LISTEN)
            try:
                pid = (await (await conn.execute(C.OWNER_SESSION)).fetchone())[0]
                legacy = False
            except psycopg.errors.UndefinedFunction:
                pid, legacy = await self._backend_pid(conn), True
                log.warning("pg_once: the server has no once.owner_session(); claims belong "
                            "to the pooled connection that made them (upgrade the extension)")
            behind_proxy = conn.info.backend_pid != pid   # see Listener._connect (N5)
            if behind_proxy and await self._backend_pid(conn) != pid:
                raise ConfigurationError(C.TRANSACTION_POOLER)
        except BaseException:
            await conn.close()
            raise
        self.behind_proxy = behind_proxy
        if legacy:
            pid = None
        self._conn, self._pid, self.legacy = conn, pid, legacy
        self._connected.set()

    @staticmethod
    async def _backend_pid(conn) -> int:
        return (await (await conn.execute("SELECT pg_backend_pid()")).fetchone())[0]

    async def _run(self) -> None:
        last_check = time.monotonic()
        while not self._closed:
            try:
                async for note in self._conn.notifies(timeout=0.5):
                    if note.channel == C.CHANNEL:
                        self._wake(note.payload)
                if time.monotonic() - last_check > HEALTH_CHECK_SECONDS:
                    await self._conn.execute("SELECT 1")
                    last_check = time.monotonic()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if self._closed:
                    return
                log.warning("pg_once: LISTEN connection lost (%s); reconnecting", exc)
                await self._reconnect()
                last_check = time.monotonic()

    async def _reconnect(self) -> None:
        self._connected.clear()
        self._pid = None
        try:
            await self._conn.close()
        except Exception:
            pass
        self._wake_all()   # notifications in the gap are lost: everyone looks again
        delay = 0.05
        while not self._closed:
            try:
                await self._connect()
                self.reconnects += 1
                self._wake_all()
                return
            except Exception as exc:
                log.warning("pg_once: LISTEN reconnect failed (%s); retrying in %.2f s", exc, delay)
                await asyncio.sleep(delay)
                delay = min(RECONNECT_MAX_SECONDS, delay * 2)


class _AsyncFlight:
    """One in-process computation of a key and how many callers still wait for it."""

    __slots__ = ("task", "callers")

    def __init__(self, task: asyncio.Task) -> None:
        self.task, self.callers = task, 0


class AsyncClient:
    """A pg_once client for asyncio. Arguments as for Client; `pool` is a
    psycopg_pool.AsyncConnectionPool (opened by you)."""

    def __init__(self, conninfo: Optional[str] = None, *, pool: Optional[AsyncConnectionPool] = None,
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
        self._listen_conninfo = (listen_conninfo if listen_conninfo is not None else
                                 conninfo if conninfo is not None else pool.conninfo)
        self._listener: Optional[AsyncListener] = AsyncListener(
            self._listen_conninfo, connect_timeout) if listen else None
        self.calls = C.Calls()
        self._flights: Dict[str, _AsyncFlight] = {}
        # Background refreshes (outcome 'refresh'), at most one per key: key -> (task, token).
        self._refreshes: Dict[str, asyncio.Task] = {}
        self._closing = False
        self._opened = False
        self._open_lock: Optional[asyncio.Lock] = None

    async def open(self) -> "AsyncClient":
        if self._open_lock is None:
            self._open_lock = asyncio.Lock()
        async with self._open_lock:
            if self._opened:
                return self
            if self.pool is None:
                self.pool = AsyncConnectionPool(
                    self._conninfo, min_size=1, max_size=self._pool_size, open=False,
                    name="pg_once", timeout=self._connect_timeout,
                    kwargs={"autocommit": True, "prepare_threshold": None})
                await self.pool.open()
            if self._listener is not None:
                await self._listener.start()
                if self._listener.behind_proxy:
                    await self._probe_listener()
            self._opened = True
        return self

    async def _probe_listener(self) -> None:
        """See Client._probe_listener (rule N5)."""
        payload = C.PROBE_PAYLOAD + uuid.uuid4().hex
        event = self._listener.watch(payload)
        try:
            self._opened = True   # _execute may run now
            await self._execute("notify", C.NOTIFY, (payload,))
            try:
                await asyncio.wait_for(event.wait(), C.PROBE_SECONDS)
            except asyncio.TimeoutError:
                self._opened = False
                await self._listener.close()
                if self._own_pool:
                    await self.pool.close()
                raise ConfigurationError(C.TRANSACTION_POOLER) from None
        finally:
            self._listener.unwatch(payload, event)

    async def close(self, refresh_timeout: Duration = 10) -> None:
        """Wait up to `refresh_timeout` seconds for background refreshes to store their
        results, cancel those still running (each gives its claim back, so another caller
        refreshes at once), then close as before."""
        timeout = seconds(refresh_timeout, "refresh_timeout")
        self._closing = True
        refreshes = list(self._refreshes.values())
        if refreshes:
            _, running = await asyncio.wait(refreshes, timeout=timeout)
            for task in running:
                log.warning("pg_once: closing: a refresh is still running after %g s; its "
                            "claim is given back", timeout)
                task.cancel()
            if running:
                await asyncio.gather(*running, return_exceptions=True)
        for flight in list(self._flights.values()):
            flight.task.cancel()
        if self._listener is not None:
            await self._listener.close()
        if self._own_pool and self.pool is not None:
            await self.pool.close()

    async def __aenter__(self) -> "AsyncClient":
        return await self.open()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def owner_pid(self) -> Optional[int]:
        """See Client.owner_pid."""
        if not self._opened:
            await self.open()
        return 0 if self._listener is None else await self._listener.owner_pid()

    # -- the public calls ---------------------------------------------------------------

    async def get_or_compute(self, key: str, compute: Callable[[], Awaitable[T]], *,
                             ttl: Optional[Duration] = None, lease: Duration = 30,
                             wait: Duration = 30, retry_after: Duration = 5,
                             stale: Optional[Duration] = None, beta: Optional[float] = None,
                             jitter: Optional[float] = None,
                             serializer: Optional[Serializer] = None) -> T:
        """See Client.get_or_compute; `compute` is a coroutine function, and a background
        refresh is a task of this event loop. Cancelling the call (or asyncio.timeout)
        stops its wait; when every caller of a computation has left, the computation is
        cancelled and its claim given back (rule X2)."""
        opts = C.call_options(key, ttl=ttl, lease=lease, wait=wait, retry_after=retry_after,
                              stale=stale, beta=beta, jitter=jitter,
                              serializer=serializer or self.serializer)
        started = time.monotonic()
        if not self._opened:
            await self.open()
        flight = self._flights.get(key)
        leader = flight is None
        if leader:
            # The flight runs as its own task, so that a caller that is cancelled does not
            # cancel the computation the other callers of this key are waiting for.
            flight = self._flights[key] = _AsyncFlight(
                asyncio.create_task(self._resolve(compute, opts)))
            flight.task.add_done_callback(functools.partial(self._landed, key, flight))
        flight.callers += 1
        try:
            if leader:
                value, kind = await asyncio.shield(flight.task)
            else:
                kind = "coalesced"
                try:
                    value, _ = await asyncio.wait_for(asyncio.shield(flight.task), opts.wait)
                except asyncio.TimeoutError:
                    raise OnceTimeout(key, opts.wait) from None
        except BaseException as exc:
            C.report(self.on_outcome, "failed", key, started, exc)
            raise
        finally:
            flight.callers -= 1
            if flight.callers == 0 and not flight.task.done():
                flight.task.cancel()   # nobody waits for it any more: give the claim back
        C.report(self.on_outcome, kind, key, started)
        return value

    def _landed(self, key: str, flight: "_AsyncFlight", task: asyncio.Task) -> None:
        if self._flights.get(key) is flight:
            del self._flights[key]
        if not task.cancelled():
            task.exception()   # retrieved: no "never retrieved" warning if every caller left

    def cached(self, fn: Optional[Callable[P, Awaitable[T]]] = None, *,
               key: Optional[Callable[..., str]] = None, name: Optional[str] = None,
               ttl: Optional[Duration] = None, lease: Duration = 30, wait: Duration = 30,
               retry_after: Duration = 5, stale: Optional[Duration] = None,
               beta: Optional[float] = None, jitter: Optional[float] = None,
               serializer: Optional[Serializer] = None):
        """Decorator for coroutine functions, with or without parentheses; see Client.cached."""
        options = dict(ttl=ttl, lease=lease, wait=wait, retry_after=retry_after, stale=stale,
                       beta=beta, jitter=jitter, serializer=serializer)
        C.call_options("k", **options)   # refuse bad options at decoration time

        def decorate(func: Callable[P, Awaitable[T]]) -> "CachedFunction[P, Awaitable[T]]":
            keys = CacheKeys(func, key, name)

            @functools.wraps(func)
            async def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
                return await self.get_or_compute(keys(args, kwargs),
                                                 lambda: func(*args, **kwargs), **options)
            wrapper.invalidate = lambda *a, **kw: self.invalidate(keys(a, kw))
            wrapper.refresh = lambda *a, **kw: self.refresh(keys(a, kw))
            wrapper.cache_key = lambda *a, **kw: keys(a, kw)
            return wrapper
        return decorate if fn is None else decorate(fn)

    async def invalidate(self, key: str) -> bool:
        """See Client.invalidate."""
        return (await self._execute("invalidate_key", C.INVALIDATE_KEY, (C.check_key(key),)))[0]

    async def refresh(self, key: str, stale: Optional[Duration] = None) -> str:
        """See Client.refresh."""
        return (await self._execute("refresh_key", C.REFRESH_KEY,
                                    (C.check_key(key), seconds(stale, "stale"))))[0]

    async def enqueue(self, key: str, payload: Any = None, *, queue: str = "default",
                      priority: int = 0, run_at: Optional[datetime] = None,
                      refresh: bool = False, max_attempts: Optional[int] = None) -> str:
        """See Client.enqueue."""
        text = None if payload is None else C.dump_value(key, self.serializer, payload)
        return (await self._execute("enqueue_key", C.ENQUEUE_KEY,
                                    (C.check_key(key), text, queue, priority, run_at, refresh,
                                     max_attempts)))[0]

    def load_payload(self, text: Optional[str]) -> Any:
        """A queued key's payload, read back through the client's serializer."""
        return None if text is None else self.serializer.loads(text)

    def worker(self, queue: str, handler: Callable, **options) -> "AsyncWorker":
        return AsyncWorker(self, queue, handler, **options)

    async def work(self, queue: str, handler: Callable, **options) -> int:
        """Run a queue worker loop until SIGTERM/SIGINT or stop(); see Worker."""
        return await self.worker(queue, handler, **options).run()

    # -- the protocol ---------------------------------------------------------------------

    async def _resolve(self, compute, opts: C.CallOptions):
        """See Client._resolve."""
        key = opts.key
        deadline = time.monotonic() + opts.wait
        delays = C.poll_delays()
        listener = self._listener
        waited = False
        while True:
            event = listener.watch(key) if listener is not None else None   # before asking
            try:
                owner = await self.owner_pid()
                try:
                    row = await self._claim(key, opts.lease, owner, opts.fresh.serve_stale)
                except psycopg.errors.InvalidParameterValue:
                    if listener is None or await listener.owner_pid() == owner:
                        raise
                    continue
                outcome, token, result, error, lease_expires_at, retry_at = row
                if outcome == "hit":
                    return opts.serializer.loads(result), "waited" if waited else "hit"
                if outcome == "failed":
                    raise OnceFailed(key, error, retry_at)
                if outcome == "claimed":
                    break
                if outcome == "stale":   # see Client._resolve
                    return opts.serializer.loads(result), "stale"
                if outcome == "refresh":
                    await self._refresh_in_background(key, token, compute, opts)
                    return opts.serializer.loads(result), "refresh"
                waited = True
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise OnceTimeout(key, opts.wait)
                pause = C.jittered(C.RECHECK_SECONDS) if event is not None else next(delays)
                pause = min(pause, remaining, max(0.02, C.until(lease_expires_at)))
                if event is not None:
                    try:
                        await asyncio.wait_for(event.wait(), pause)
                    except asyncio.TimeoutError:
                        pass
                else:
                    await asyncio.sleep(pause)
            finally:
                if event is not None:
                    listener.unwatch(key, event)
        return await self._compute(key, token, compute, opts), "claimed"

    async def _refresh_in_background(self, key, token, compute, opts):
        running = self._refreshes.get(key)
        if self._closing or (running is not None and not running.done()):
            # See Client._refresh_in_background.
            await self._quietly(self._release, key, token)
            return
        task = asyncio.create_task(self._run_refresh(key, token, compute, opts),
                                   name=f"pg_once-refresh {key}")
        self._refreshes[key] = task
        task.add_done_callback(functools.partial(self._refreshed, key))

    def _refreshed(self, key: str, task: asyncio.Task) -> None:
        if self._refreshes.get(key) is task:
            del self._refreshes[key]

    async def _run_refresh(self, key, token, compute, opts) -> None:
        try:
            await self._compute(key, token, compute, opts)
        except ClaimLost:
            log.warning("pg_once: the refresh of %r lost its claim; its result was not stored", key)
        except Exception as exc:
            log.warning("pg_once: refreshing %r failed (%s); the previous result is still "
                        "served until its stale window ends", key, C.error_text(exc))

    async def _compute(self, key, token, compute, opts):
        """See Client._compute; a heartbeat that finds the claim lost cancels compute()."""
        retry_after = opts.retry_after
        work = asyncio.ensure_future(_call(compute))
        lost = []
        beat = asyncio.create_task(self._beat(key, token, opts.lease,
                                              lambda: (lost.append(1), work.cancel())))
        try:
            try:
                value = await work
            except asyncio.CancelledError:
                if lost:   # a heartbeat said the claim is gone: stop computing, store nothing
                    raise ClaimLost(key) from None
                work.cancel()
                await self._quietly(self._release, key, token)
                raise
            except Exception as exc:
                await self._quietly(self._fail, key, token, C.error_text(exc), retry_after)
                raise
            try:
                text = C.dump_value(key, opts.serializer, value)
            except NotSerializable as exc:
                await self._quietly(self._fail, key, token, str(exc), retry_after)   # V4
                raise
            beat.cancel()
            if lost:
                raise ClaimLost(key, value)
            try:
                stored, text = await self._complete(key, token, text, opts.ttl, opts.fresh)
            except psycopg.Error as exc:
                if C.retryable(exc.sqlstate, True):
                    raise
                # See Client._compute (F3).
                await self._quietly(self._fail, key, token, C.refusal_text(exc), retry_after)
                raise
            if not stored:
                raise ClaimLost(key, value)
            return opts.serializer.loads(text)
        finally:
            beat.cancel()

    async def _beat(self, key, token, lease, on_lost) -> None:
        """Extend the claim every lease/3 until cancelled; on_lost() if it was lost."""
        pause = lease / 3
        while True:
            await asyncio.sleep(pause)
            try:
                expiry = await self._heartbeat(key, token, lease)
            except Exception as exc:
                log.warning("pg_once: heartbeat of %r failed (%s); retrying", key, exc)
                pause = min(1.0, lease / 6)
                continue
            if expiry is None:
                log.warning("pg_once: the claim on %r was lost; its result will not be stored", key)
                on_lost()
                return
            pause = lease / 3

    async def _quietly(self, call, *args) -> None:
        try:
            await call(*args)
        except Exception as exc:
            log.warning("pg_once: could not record the outcome of %r (%s); the claim ends "
                        "with its owner or lease", args[0], exc)

    # -- one database call each, through the pool ------------------------------------------

    async def _execute(self, name: str, sql: str, params: tuple, many: bool = False):
        if not self._opened:
            await self.open()
        self.calls.add(name)
        pauses = C.retry_pauses()
        for attempt in range(1, C.RETRY_ATTEMPTS + 1):
            await asyncio.sleep(next(pauses))
            async with self.pool.connection() as conn:
                check_connection(conn)
                try:
                    cur = await conn.execute(sql, params, prepare=False)
                    return await (cur.fetchall() if many else cur.fetchone())
                except psycopg.Error as exc:
                    # See Client._execute (rule R1).
                    if attempt == C.RETRY_ATTEMPTS or not C.retryable(exc.sqlstate, conn.broken):
                        raise
                    await conn.close()
            log.info("pg_once: %s retried on a fresh connection", name)

    async def _claim(self, key, lease, owner, serve_stale=False):
        if serve_stale:
            if owner is None:
                raise ConfigurationError(C.NO_FRESHNESS_SERVER)
            try:
                return await self._execute("claim_key", C.CLAIM_KEY_SERVE_STALE, (key, lease, owner))
            except psycopg.errors.UndefinedFunction as exc:   # no serve_stale argument
                raise ConfigurationError(C.NO_FRESHNESS_SERVER) from exc
        if owner is None:
            return await self._execute("claim_key", C.CLAIM_KEY_LEGACY, (key, lease))
        return await self._execute("claim_key", C.CLAIM_KEY, (key, lease, owner))

    async def _complete(self, key, token, text, ttl, fresh=C.NO_FRESHNESS):
        """(stored, the result's text as the server keeps it)."""
        if not fresh.given:
            return await self._execute("complete_key", C.COMPLETE_KEY, (key, token, ttl, text))
        return await self._execute("complete_key", C.COMPLETE_KEY_FRESHNESS,
                                   (key, token, ttl, fresh.stale, fresh.beta, fresh.jitter, text))

    async def _fail(self, key, token, error, retry_after) -> bool:
        return (await self._execute("fail_key", C.FAIL_KEY, (key, token, error, retry_after)))[0]

    async def _release(self, key, token) -> bool:
        return (await self._execute("release_key", C.RELEASE_KEY, (key, token)))[0]

    async def _heartbeat(self, key, token, lease):
        return (await self._execute("heartbeat_key", C.HEARTBEAT_KEY, (key, token, lease)))[0]


class AsyncWorker:
    """The queue worker loop for asyncio: handler is a coroutine function taking a Job.
    Options and behaviour as for Worker (handlers run as tasks; a handler whose claim is
    lost is cancelled)."""

    def __init__(self, client: AsyncClient, queue: str, handler: Callable[[Job], Awaitable[Any]], *,
                 concurrency: int = 1, lease: Duration = 30, ttl: Optional[Duration] = None,
                 retry_after: Duration = 0, name: Optional[str] = None,
                 idle_wait: Duration = 1.0, grace: Duration = 30, signals: bool = True):
        from .worker import _default_name
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self.client, self.queue, self.handler = client, queue, handler
        self.concurrency = concurrency
        self.lease, self.ttl = seconds(lease, "lease"), seconds(ttl, "ttl")
        self.retry_after = seconds(retry_after, "retry_after")
        self.idle_wait, self.grace = seconds(idle_wait, "idle_wait"), seconds(grace, "grace")
        self.name = name or _default_name()
        self.signals = signals
        self.completed = self.failed = self.released = 0
        self._stop = asyncio.Event()
        self._stop_now = asyncio.Event()
        self._held: Dict[int, Job] = {}
        self._tasks: Dict[int, asyncio.Task] = {}
        self._slot_freed = asyncio.Event()

    def stop(self, now: bool = False) -> None:
        self._stop.set()
        if now:
            self._stop_now.set()
        self._slot_freed.set()

    async def run(self) -> int:
        restore = self._install_signals()
        try:
            try:
                await self._loop()
            finally:
                await self._drain()   # also when claiming raised: settle what we hold
        finally:
            restore()
        return self.completed

    async def _loop(self) -> None:
        delays = None
        while not self._stop.is_set():
            while len(self._held) >= self.concurrency and not self._stop.is_set():
                self._slot_freed.clear()
                await self._slot_freed.wait()
            if self._stop.is_set():
                return
            try:
                jobs = await self._claim(self.concurrency - len(self._held))
            except (psycopg.OperationalError, psycopg.errors.InvalidParameterValue) as exc:
                log.warning("pg_once: claim_next on %r failed (%s); retrying", self.queue, exc)
                await self._sleep(C.jittered(1.0))
                continue
            if jobs is None:
                delays = delays or C.poll_delays()
                await self._sleep(next(delays))
                continue
            delays = None
            for job in jobs:
                self._held[job.token] = job
                self._tasks[job.token] = asyncio.create_task(self._process(job))

    async def _sleep(self, pause: float) -> None:
        try:
            await asyncio.wait_for(self._stop.wait(), pause)
        except asyncio.TimeoutError:
            pass

    async def _claim(self, n: int):
        client = self.client
        owner = await client.owner_pid()
        if owner is None:
            rows = await client._execute("claim_next", C.CLAIM_NEXT_LEGACY,
                                         (self.queue, self.lease, self.name, n), many=True)
            if not rows:
                return None
        else:
            rows = await client._execute(
                "claim_next", C.CLAIM_NEXT,
                (self.queue, self.lease, self.name, n, self.idle_wait, owner), many=True)
        return [Job(key, token, client.load_payload(payload), attempt, self.queue)
                for key, token, payload, attempt in rows]

    async def _process(self, job: Job) -> None:
        client = self.client
        me = asyncio.current_task()

        def on_lost():
            job.lost = True
            me.cancel()

        beat = asyncio.create_task(client._beat(job.key, job.token, self.lease, on_lost))
        try:
            try:
                value = await _call(self.handler, job)
                text = C.dump_value(job.key, client.serializer, value)
            except asyncio.CancelledError:
                if not job.lost and job.token in self._held:
                    await client._quietly(client._release, job.key, job.token)
                    self.released += 1
                return
            except Exception as exc:
                if job.lost:
                    return
                error = str(exc) if isinstance(exc, NotSerializable) else C.error_text(exc)
                log.warning("pg_once: job %r failed: %s", job.key, error)
                await client._quietly(client._fail, job.key, job.token, error, self.retry_after)
                self.failed += 1
                return
            beat.cancel()
            if job.lost:
                return
            if (await client._complete(job.key, job.token, text, self.ttl))[0]:
                self.completed += 1
            else:
                log.warning("pg_once: job %r lost its claim; its result was not stored", job.key)
        finally:
            beat.cancel()
            self._held.pop(job.token, None)
            self._tasks.pop(job.token, None)
            self._slot_freed.set()

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.grace
        while self._held and not self._stop_now.is_set() and time.monotonic() < deadline:
            self._slot_freed.clear()
            try:
                await asyncio.wait_for(self._slot_freed.wait(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                break
        # Handlers still running: cancel them; each releases its key back to the queue.
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    def _install_signals(self) -> Callable[[], None]:
        if not self.signals:
            return lambda: None
        loop = asyncio.get_running_loop()
        installed = []
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, lambda: self.stop(now=self._stop.is_set()))
                installed.append(sig)
            except (NotImplementedError, RuntimeError, ValueError):
                pass   # not the main thread, or no signals on this platform
        return lambda: [loop.remove_signal_handler(s) for s in installed]
