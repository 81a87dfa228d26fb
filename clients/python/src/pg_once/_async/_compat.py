"""What the asyncio flavour runs on. The client is written once, for asyncio, in this
package; `pg_once._sync` is generated from it by `tools/generate_sync.py` (unasync: drop
`async`/`await`, rename `Async*`), and `_sync/_compat.py`, written by hand like this file,
gives the same names for threads. Anything that differs between the two flavours lives
in these two files and nowhere else."""

from __future__ import annotations

import asyncio
import inspect
import signal
from typing import Any, Awaitable, Callable, Iterable, List, Optional, Set, Tuple

Event = asyncio.Event
CancelledError = asyncio.CancelledError
Task = asyncio.Task
Await = Awaitable   # what compute() returns: Await[T]; generate_sync.py writes it T for threads
sleep = asyncio.sleep


async def call(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args), awaited if it returned an awaitable (a coroutine function's result)."""
    result = fn(*args)
    if inspect.isawaitable(result):
        result = await result
    return result


async def wait_event(event: asyncio.Event, timeout: float) -> bool:
    """Whether `event` was set within `timeout` seconds."""
    try:
        await asyncio.wait_for(event.wait(), timeout)
    except asyncio.TimeoutError:
        pass
    return event.is_set()


def spawn(fn: Callable[..., Awaitable[Any]], *args: Any, name: str) -> asyncio.Task:
    """Run fn(*args) beside the caller: a task of this event loop."""
    return asyncio.create_task(fn(*args), name=name)


def spawn_after(delay: float, fn: Callable[..., Awaitable[Any]], *args: Any,
                name: str) -> asyncio.Task:
    """Run fn(*args) beside the caller from `delay` seconds on, unless cancelled first."""
    async def later() -> None:
        await asyncio.sleep(delay)
        await fn(*args)
    return asyncio.create_task(later(), name=name)


async def join(tasks: Iterable[asyncio.Task], timeout: Optional[float]) -> List[asyncio.Task]:
    """Wait up to `timeout` for `tasks` to end; the ones still running."""
    tasks = list(tasks)
    if not tasks:
        return []
    _, running = await asyncio.wait(tasks, timeout=timeout)
    return list(running)


async def settle(tasks: Iterable[asyncio.Task]) -> None:
    """Wait for cancelled tasks to end, whatever they raise."""
    await asyncio.gather(*tasks, return_exceptions=True)


# run_detachable's tasks whose caller left: the event loop keeps only weak references to
# tasks, and these must run to their end.
_detached: Set["asyncio.Task[Any]"] = set()


def _keep(task: "asyncio.Task[Any]") -> None:
    _detached.add(task)
    task.add_done_callback(_detached.discard)


async def run_detachable(fn: Callable[..., Awaitable[Any]], *args: Any,
                         timeout: Optional[float],
                         orphaned: Callable[[Any], Awaitable[None]]) -> Tuple[bool, Any]:
    """(True, fn(*args)), or (False, None) once `timeout` seconds (None: no bound) have
    passed without its answer. fn, a statement already sent, is never abandoned (rule R2):
    it runs as a task of its own that neither the timeout nor the caller's cancellation
    stops (psycopg, cancelled inside a statement, would cancel it on the server and wait
    for its answer all the same), and when the caller has left before its answer,
    `orphaned(answer)` gets it, in that task: a claim the server made is given back."""
    caller_left = False

    async def run() -> Any:
        try:
            answer = await fn(*args)
        except Exception:
            if caller_left:
                return None   # nobody to tell; the client logged its retries
            raise
        if caller_left:
            await orphaned(answer)
        return answer

    def leave(task: "asyncio.Task[Any]") -> None:
        nonlocal caller_left
        if not task.done():
            caller_left = True   # run() hands its answer to orphaned()
            _keep(task)
        elif not task.cancelled() and task.exception() is None:
            _keep(asyncio.ensure_future(orphaned(task.result())))   # answered as it left

    task = asyncio.ensure_future(run())
    try:
        await asyncio.wait({task}, timeout=timeout)
    except BaseException:   # the caller cancelled: it goes now, the statement goes on
        leave(task)
        raise
    if task.done():
        return True, task.result()
    leave(task)
    return False, None


class Stopped(Exception):
    """run_unless: the stop event came first."""


async def run_unless(fn: Callable[..., Any], stop: asyncio.Event, *args: Any) -> Any:
    """fn(*args), cancelled (Stopped) if `stop` is set before it ends: a computation whose
    claim was lost stops at once (rule L3). Threads cannot be interrupted: the sync
    flavour runs fn to its end and the caller checks `stop` afterwards."""
    work = asyncio.ensure_future(call(fn, *args))
    stopper = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({work, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopper.cancel()
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
    if work.cancelled():
        raise Stopped()
    return work.result()


class Flight:
    """One in-process computation of a key that concurrent callers share (rule C1). The
    leader's call runs as its own task, so that cancelling one caller does not cancel
    what the others wait for; when every caller has left, it is cancelled (rule X2)."""

    def __init__(self) -> None:
        self.callers = 0
        self.span_context: Any = None   # the leader's span, which the others link to (O2)
        self._task: Optional[asyncio.Task] = None
        self._started = asyncio.Event()

    async def lead(self, fn: Callable[..., Awaitable[Any]], *args: Any,
                   landed: Callable[[], None]) -> Any:
        self._task = asyncio.create_task(fn(*args))
        self._task.add_done_callback(lambda task: (landed(), task.cancelled() or task.exception()))
        self._started.set()
        self.callers += 1
        try:
            return await asyncio.shield(self._task)
        finally:
            self._leave()

    async def follow(self, wait: float) -> Tuple[bool, Any]:
        """(True, the leader's answer) or (False, None) if `wait` ran out first."""
        self.callers += 1
        try:
            await self._started.wait()
            try:
                return True, await asyncio.wait_for(asyncio.shield(self._task), wait)
            except asyncio.TimeoutError:
                if self._task.done() and not self._task.cancelled():
                    return True, self._task.result()
                return False, None
        finally:
            self._leave()

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def _leave(self) -> None:
        self.callers -= 1
        if self.callers == 0 and self._task is not None and not self._task.done():
            self._task.cancel()   # nobody waits for it any more: give the claim back


def install_signals(on_signal: Callable[[], None]) -> Callable[[], None]:
    """Call on_signal() on SIGTERM and SIGINT; returns what puts the previous handling back."""
    loop = asyncio.get_running_loop()
    installed = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, on_signal)
            installed.append(sig)
        except (NotImplementedError, RuntimeError, ValueError):
            pass   # not the main thread, or no signals on this platform
    return lambda: [loop.remove_signal_handler(s) for s in installed]


def open_at_once(client: Any) -> None:
    """An AsyncClient opens on `await open()` or its first call (a constructor cannot await)."""


Lock = asyncio.Lock   # `async with` it; held across awaits (the sync flavour: a threading.Lock)
