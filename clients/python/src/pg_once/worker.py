"""The queue worker loop (sync): claim keys from a queue in batches, run the handler on
each in a thread, heartbeat, complete or fail each, stop gracefully on a signal."""

from __future__ import annotations

import logging
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, Optional

import psycopg

from . import _common as C
from ._common import Duration, Job, seconds
from .errors import NotSerializable

log = logging.getLogger("pg_once")


class Worker:
    """Runs `handler(job)` for the keys of `queue`, at most `concurrency` at once.

    handler gets a Job (key, token, payload, attempt) and returns the key's result (JSON);
    if it raises, the key is failed with the error text and the queue retries it after its
    backoff. Options:
      concurrency  handler threads, and the most keys held at once (default 1)
      lease        seconds a claim lives without a heartbeat (heartbeats every lease/3)
      ttl          how long each result is served (None: until invalidated)
      retry_after  minimum time before a failed key is retried (the queue's backoff applies)
      name         the worker name recorded in once.attempts (default "host:pid")
      idle_wait    how long one claim_next waits on the server for work when none is due
      grace        on stop, how long to let running handlers finish before releasing their
                   keys back to the queue (a second signal releases at once)
      signals      install SIGTERM/SIGINT handlers (only possible in the main thread)
    """

    def __init__(self, client, queue: str, handler: Callable[[Job], Any], *,
                 concurrency: int = 1, lease: Duration = 30, ttl: Optional[Duration] = None,
                 retry_after: Duration = 0, name: Optional[str] = None,
                 idle_wait: Duration = 1.0, grace: Duration = 30, signals: bool = True):
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self.client, self.queue, self.handler = client, queue, handler
        self.concurrency = concurrency
        self.lease, self.ttl = seconds(lease, "lease"), seconds(ttl, "ttl")
        self.retry_after = seconds(retry_after, "retry_after")
        self.idle_wait, self.grace = seconds(idle_wait, "idle_wait"), seconds(grace, "grace")
        self.name = name or _default_name()
        self.signals = signals
        self.completed = 0   # jobs whose result was stored
        self.failed = 0      # jobs whose handler raised (or returned something unstorable)
        self.released = 0    # jobs given back on stop
        self._stop = threading.Event()
        self._stop_now = threading.Event()
        self._cond = threading.Condition()
        self._held: Dict[int, Job] = {}   # token -> job being handled

    def stop(self, now: bool = False) -> None:
        """Stop claiming; running handlers get `grace` seconds (none if now) to finish,
        then their keys are released back to the queue."""
        self._stop.set()
        if now:
            self._stop_now.set()
        with self._cond:
            self._cond.notify_all()

    def run(self) -> int:
        restore = self._install_signals()
        pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix=f"pg_once-{self.queue}")
        try:
            try:
                self._loop(pool)
            finally:
                self._drain()   # also when claiming raised: settle what we hold
        finally:
            pool.shutdown(wait=False)
            restore()
        return self.completed

    # -- claiming ---------------------------------------------------------------------------

    def _loop(self, pool: ThreadPoolExecutor) -> None:
        delays = None
        while not self._stop.is_set():
            with self._cond:
                self._cond.wait_for(lambda: len(self._held) < self.concurrency or self._stop.is_set())
                free = self.concurrency - len(self._held)
            if self._stop.is_set():
                return
            try:
                jobs = self._claim(free)
            except (psycopg.OperationalError, psycopg.errors.InvalidParameterValue) as exc:
                # Server restart, pool exhausted, listener reconnecting: try again shortly.
                log.warning("pg_once: claim_next on %r failed (%s); retrying", self.queue, exc)
                self._stop.wait(C.jittered(1.0))
                continue
            if jobs is None:   # an old server without server-side waiting: poll
                delays = delays or C.poll_delays()
                self._stop.wait(next(delays))
                continue
            delays = None
            for job in jobs:
                with self._cond:
                    self._held[job.token] = job
                pool.submit(self._process, job)

    def _claim(self, n: int):
        """Up to n jobs; waits on the server up to idle_wait when none is due. None from a
        server that cannot wait (and returned nothing)."""
        client = self.client
        owner = client.owner_pid
        if owner is None:   # server predates owner_pid and claim_next(wait => ...)
            rows = client._execute("claim_next", C.CLAIM_NEXT_LEGACY,
                                   (self.queue, self.lease, self.name, n), many=True)
            if not rows:
                return None
        else:
            rows = client._execute("claim_next", C.CLAIM_NEXT,
                                   (self.queue, self.lease, self.name, n, self.idle_wait, owner),
                                   many=True)
        return [Job(key, token, client.load_payload(payload), attempt, self.queue)
                for key, token, payload, attempt in rows]

    # -- handling one job -------------------------------------------------------------------

    def _process(self, job: Job) -> None:
        client = self.client
        beat = client._heartbeats.add(job.key, job.token, self.lease,
                                      on_lost=lambda: setattr(job, "lost", True))
        try:
            try:
                value = self.handler(job)
                text = C.dump_value(job.key, client.serializer, value)
            except Exception as exc:
                if self._finished(job):
                    return
                error = str(exc) if isinstance(exc, NotSerializable) else C.error_text(exc)
                log.warning("pg_once: job %r failed: %s", job.key, error)
                client._quietly(client._fail, job.key, job.token, error, self.retry_after)
                with self._cond:
                    self.failed += 1
                return
            if self._finished(job):
                return
            client._heartbeats.remove(beat)
            if client._complete(job.key, job.token, text, self.ttl)[0]:
                with self._cond:
                    self.completed += 1
            else:
                log.warning("pg_once: job %r lost its claim; its result was not stored", job.key)
        except BaseException as exc:
            log.error("pg_once: job %r: %s", job.key, exc)
            if not self._finished(job):
                client._quietly(client._release, job.key, job.token)
        finally:
            client._heartbeats.remove(beat)
            with self._cond:
                self._held.pop(job.token, None)
                self._cond.notify_all()

    def _finished(self, job: Job) -> bool:
        """True if the job's claim is no longer ours to settle (lost, or released on stop)."""
        with self._cond:
            return job.lost or job.token not in self._held

    # -- stopping ---------------------------------------------------------------------------

    def _drain(self) -> None:
        deadline = time.monotonic() + self.grace
        with self._cond:
            while self._held and not self._stop_now.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(min(left, 0.2))
            leftovers = list(self._held.values())
            self._held.clear()   # their handlers, if they ever return, settle nothing
        for job in leftovers:
            # Give the key back now instead of letting it sit until its lease runs out;
            # a queued key released goes back due at once and the attempt does not count.
            self.client._quietly(self.client._release, job.key, job.token)
            self.released += 1

    def _install_signals(self) -> Callable[[], None]:
        if not self.signals or threading.current_thread() is not threading.main_thread():
            return lambda: None

        def on_signal(signum, frame):
            # First signal: finish what is running. Second: release it and go.
            self.stop(now=self._stop.is_set())

        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        return lambda: [signal.signal(s, h) for s, h in previous.items()]


def _default_name() -> str:
    import os
    import socket
    return f"{socket.gethostname()}:{os.getpid()}"
