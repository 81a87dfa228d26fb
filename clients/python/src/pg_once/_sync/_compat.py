"""What the threads flavour runs on: the same names as `_async/_compat.py` (read its
docstring), for threads. Written by hand; the rest of `pg_once._sync` is generated."""

from __future__ import annotations

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
    """A thread running fn(*args), stoppable at its next sleep() by cancel()."""

    def __init__(self, fn: Callable[..., Any], args: tuple, name: str) -> None:
        self._fn, self._args = fn, args
        self._cancelled = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
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


def join(tasks: Iterable[Task], timeout: Optional[float]) -> List[Task]:
    deadline = None if timeout is None else time.monotonic() + timeout
    tasks = list(tasks)
    for task in tasks:
        task._thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
    return [task for task in tasks if not task.done()]


def settle(tasks: Iterable[Task]) -> None:
    """Cancelled threads stop at their next sleep; nothing to wait for here."""


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
