"""What the threads flavour runs on: the same names as `_async/_compat.py` (read its
docstring), for threads. Written by hand; the rest of `pg_once._sync` is generated."""

from __future__ import annotations

import concurrent.futures
import contextvars
import heapq
import itertools
import os
import signal
import threading
import time
from typing import Any, Callable, Iterable, List, Optional, Tuple

Event = threading.Event


class CancelledError(BaseException):
    """Raised inside a spawned thread by sleep() once its Task was cancelled: threads
    cannot be interrupted, so they stop at their next sleep."""


_current = threading.local()


class Task:
    """A thread running fn(*args), stoppable at its next sleep() by cancel(). Made with
    started=False, it has no thread until start() (spawn_after's, when due)."""

    def __init__(self, fn: Callable[..., Any], args: tuple, name: str,
                 started: bool = True) -> None:
        self._fn, self._args, self._name = fn, args, name
        self._cancelled = threading.Event()
        self._thread: Optional[threading.Thread] = None
        if started:
            self.start()

    def start(self) -> None:
        """Start its thread, unless it was cancelled first."""
        if not self._cancelled.is_set():
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()

    def _run(self) -> None:
        _current.task = self
        try:
            self._fn(*self._args)
        except CancelledError:
            pass

    def cancel(self) -> None:
        self._cancelled.set()

    def done(self) -> bool:
        if self._thread is None:   # not started: done once cancelled
            return self._cancelled.is_set()
        return not self._thread.is_alive()


def sleep(seconds: float) -> None:
    task = getattr(_current, "task", None)
    if task is None:
        time.sleep(seconds)
    elif task._cancelled.wait(seconds):
        raise CancelledError()


def call(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


def wait_event(event: threading.Event, timeout: float) -> bool:
    return event.wait(timeout)


def spawn(fn: Callable[..., Any], *args: Any, name: str) -> Task:
    return Task(fn, args, name)


def spawn_after(delay: float, fn: Callable[..., Any], *args: Any, name: str) -> Task:
    """Run fn(*args) in a thread of its own from `delay` seconds on, unless cancelled
    first: a heartbeat (lease/3) of a claim that ends sooner, as most do, costs no thread."""
    global _later
    task = Task(fn, args, name, started=False)
    with _later_lock:
        if _later is None or _later.pid != os.getpid():   # none yet, or forked since
            _later = _Later()
    _later.add(time.monotonic() + delay, task)
    return task


class _Later:
    """The thread (one per process) that starts spawn_after()'s tasks when they are due."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._due: list = []   # heap of (when, n, task); cancelled ones dropped once first
        self._n = itertools.count()
        self._changed = threading.Condition()
        threading.Thread(target=self._run, name="pg_once-spawn_after", daemon=True).start()

    def add(self, when: float, task: Task) -> None:
        with self._changed:
            heapq.heappush(self._due, (when, next(self._n), task))
            if self._due[0][2] is task:
                self._changed.notify()

    def _run(self) -> None:
        with self._changed:
            while True:
                now = time.monotonic()
                while self._due and (self._due[0][0] <= now or self._due[0][2]._cancelled.is_set()):
                    heapq.heappop(self._due)[2].start()   # start() skips a cancelled task
                self._changed.wait(self._due[0][0] - now if self._due else None)


_later: Optional[_Later] = None
_later_lock = threading.Lock()


def join(tasks: Iterable[Task], timeout: Optional[float]) -> List[Task]:
    deadline = None if timeout is None else time.monotonic() + timeout
    tasks = list(tasks)
    for task in tasks:
        if task._thread is None:   # spawn_after's, not started
            continue
        task._thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
    return [task for task in tasks if not task.done()]


def settle(tasks: Iterable[Task]) -> None:
    """Cancelled threads stop at their next sleep; nothing to wait for here."""


def run_detachable(fn: Callable[..., Any], *args: Any, timeout: Optional[float],
                   orphaned: Callable[[Any], None]) -> Tuple[bool, Any]:
    """(True, fn(*args)), or (False, None) once `timeout` seconds have passed without its
    answer: then fn, a statement already sent, goes on in its thread (never abandoned,
    rule R2) and hands its answer to orphaned(). A thread blocked in a statement cannot
    stop at a deadline, so with a timeout fn runs in a thread of a shared pool while the
    caller waits for it; without one (nothing can make a thread's caller leave) in the
    caller's thread."""
    if timeout is None:
        return True, fn(*args)
    lock = threading.Lock()
    state = {"answered": False, "left": False}

    def run() -> Any:
        try:
            answer = fn(*args)
        except Exception:
            with lock:
                state["answered"] = True
                if state["left"]:
                    return None   # nobody to tell; the client logged its retries
            raise
        with lock:
            state["answered"] = True
            left = state["left"]
        if left:
            orphaned(answer)
        return answer

    try:
        future = _statements().submit(contextvars.copy_context().run, run)
    except RuntimeError:   # the interpreter is exiting and starts no threads: wait here
        return True, fn(*args)
    try:
        return True, future.result(timeout)
    except concurrent.futures.TimeoutError:
        with lock:
            if future.cancel():   # never started (every thread busy): nothing was sent
                return False, None
            if not state["answered"]:
                state["left"] = True   # run() hands its answer to orphaned()
                return False, None
        return True, future.result()   # answered as the caller was leaving: take it


_statement_threads: Optional[concurrent.futures.ThreadPoolExecutor] = None
_statement_threads_pid = 0


def _statements() -> concurrent.futures.ThreadPoolExecutor:
    """run_detachable's threads: one pool per process (a forked child has none of its
    parent's threads, and a pool copied with the fork would wait for them forever)."""
    global _statement_threads, _statement_threads_pid
    with _later_lock:
        if _statement_threads is None or _statement_threads_pid != os.getpid():
            _statement_threads = concurrent.futures.ThreadPoolExecutor(
                max_workers=64, thread_name_prefix="pg_once-statement")
            _statement_threads_pid = os.getpid()
        return _statement_threads


class Stopped(Exception):
    """Never raised in this flavour: see run_unless."""


def run_unless(fn: Callable[..., Any], stop: threading.Event, *args: Any) -> Any:
    """fn(*args) to its end (a thread cannot be interrupted); the caller checks `stop`."""
    return fn(*args)


class Flight:
    """One in-process computation of a key that concurrent callers share (rule C1): the
    leader computes in its own thread, the others wait for its answer."""

    def __init__(self) -> None:
        self.callers = 0
        self.span_context: Any = None   # the leader's span, which the others link to (O2)
        self._done = threading.Event()
        self._value: Any = None
        self._error: Optional[BaseException] = None

    def lead(self, fn: Callable[..., Any], *args: Any, landed: Callable[[], None]) -> Any:
        try:
            self._value = fn(*args)
            return self._value
        except BaseException as exc:
            self._error = exc
            raise
        finally:
            landed()
            self._done.set()

    def follow(self, wait: float) -> Tuple[bool, Any]:
        if not self._done.wait(wait):
            return False, None
        if self._error is not None:
            raise self._error
        return True, self._value

    def cancel(self) -> None:
        """A thread cannot be cancelled: the leader's call ends on its own."""


def install_signals(on_signal: Callable[[], None]) -> Callable[[], None]:
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {s: signal.signal(s, lambda signum, frame: on_signal())
                for s in (signal.SIGTERM, signal.SIGINT)}
    return lambda: [signal.signal(s, h) for s, h in previous.items()]


def open_at_once(client: Any) -> None:
    """A Client opens in its constructor, so that a wrong conninfo fails there."""
    client.open()


Lock = threading.Lock
