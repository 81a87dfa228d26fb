"""The queue worker loop (rules W1 to W4): claim keys from a queue in batches, run the
handler on each (a task; a thread in the generated sync Worker), heartbeat, complete or
fail each, stop gracefully on a signal."""

from __future__ import annotations

import functools
import logging
import os
import socket
import threading
import time
from typing import Any, Callable, Dict, Optional

import psycopg

from .. import _common as C
from .._common import Duration, Job, seconds
from ..errors import NotSerializable
from . import _compat as A

log = logging.getLogger("pg_once")


class AsyncWorker:
    """Runs `handler(job)` for the keys of `queue`, at most `concurrency` at once.

    handler gets a Job (key, token, payload, attempt) and returns the key's result (written
    by the client's serializer); if it raises, the key is failed with the error text and the
    queue retries it after its backoff. Options (defaults: rule W2):
      concurrency  handlers at once, and the most keys held at once (default 1)
      lease        seconds a claim lives without a heartbeat (heartbeats every lease/3)
      ttl          how long each result is served (None: until invalidated)
      retry_after  minimum time before a failed key is retried (the queue's backoff applies)
      name         the worker name recorded in once.attempts (default "host:pid")
      idle_wait    how long one claim_next waits on the server for work when none is due
      grace        on stop, how long to let running handlers finish before releasing their
                   keys back to the queue (a second signal releases at once)
      signals      handle SIGTERM/SIGINT (only possible in the main thread)
    """

    def __init__(self, client, queue: str, handler: Callable[[Job], Any], *,
                 concurrency: int = 1, lease: Duration = 30, ttl: Optional[Duration] = None,
                 retry_after: Duration = 0, name: Optional[str] = None,
                 idle_wait: Duration = 1.0, grace: Duration = 30, signals: bool = True):
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise ValueError(f"concurrency must be an int of at least 1, got {concurrency!r}")
        self.client, self.queue, self.handler = client, queue, handler
        self.concurrency = concurrency
        self.lease, self.ttl = seconds(lease, "lease", positive=True), seconds(ttl, "ttl")
        self.retry_after = seconds(retry_after, "retry_after")
        self.idle_wait, self.grace = seconds(idle_wait, "idle_wait"), seconds(grace, "grace")
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        self.signals = signals
        self.completed = 0   # jobs whose result was stored
        self.failed = 0      # jobs whose handler raised (or returned something unstorable)
        self.released = 0    # jobs given back on stop
        self._stop = A.Event()
        self._stop_now = A.Event()
        self._changed = A.Event()   # a slot freed, or stop(): the loop looks again
        # token -> job being handled, and its task. A plain lock, never held across an
        # await: the sync flavour's handlers are threads.
        self._lock = threading.Lock()
        self._held: Dict[int, Job] = {}
        self._tasks: Dict[int, A.Task] = {}

    def stop(self, now: bool = False) -> None:
        """Stop claiming; running handlers get `grace` seconds (none if now) to finish,
        then their keys are released back to the queue."""
        self._stop.set()
        if now:
            self._stop_now.set()
        self._changed.set()

    async def run(self) -> int:
        # First signal: finish what is running. Second: release it and go (W3).
        restore = (A.install_signals(lambda: self.stop(now=self._stop.is_set()))
                   if self.signals else (lambda: None))
        try:
            try:
                await self._loop()
            finally:
                await self._drain()   # also when claiming raised: settle what we hold
        finally:
            restore()
        return self.completed

    # -- claiming ---------------------------------------------------------------------------

    async def _loop(self) -> None:
        delays = None
        while not self._stop.is_set():
            self._changed.clear()
            with self._lock:
                free = self.concurrency - len(self._held)
            if free <= 0:
                await A.wait_event(self._changed, 1.0)
                continue
            try:
                jobs = await self._claim(free)
            except (psycopg.OperationalError, psycopg.errors.InvalidParameterValue) as exc:
                # Server restart, pool exhausted, listener reconnecting (a just-dead owner
                # pid is 22023, R3): try again shortly (W4).
                log.warning("pg_once: claim_next on %r failed (%s); retrying", self.queue, exc)
                await A.wait_event(self._stop, C.jittered(1.0))
                continue
            if jobs is None:   # an old server without server-side waiting: poll
                delays = delays or C.poll_delays()
                await A.wait_event(self._stop, next(delays))
                continue
            delays = None
            for job in jobs:
                with self._lock:
                    self._held[job.token] = job
                    self._tasks[job.token] = A.spawn(self._process, job,
                                                     name=f"pg_once-{self.queue} {job.key}")

    async def _claim(self, n: int):
        """Up to n jobs; waits on the server up to idle_wait when none is due. None from a
        server too old to wait (the loop then polls)."""
        client = self.client
        owner = await client.owner_pid()
        if owner is None:
            statement = functools.partial(client._execute, "claim_next", C.CLAIM_NEXT_LEGACY,
                                          (self.queue, self.lease, self.name, n), many=True)
        else:
            statement = functools.partial(
                client._execute, "claim_next", C.CLAIM_NEXT,
                (self.queue, self.lease, self.name, n, self.idle_wait, owner), many=True)
        # The worker cancelled (its task, with asyncio) while claim_next is on its way: the
        # statement is not abandoned (R2), and the keys it claims go back (X2).
        _, rows = await A.run_detachable(statement, timeout=None, orphaned=self._give_back)
        if owner is None and not rows:
            return None
        return [Job(key, token, client.load_payload(payload), attempt, self.queue)
                for key, token, payload, attempt in rows]

    async def _give_back(self, rows) -> None:
        """claim_next's answer after the worker was cancelled: release what it claimed."""
        for key, token, _payload, _attempt in rows:
            await self.client._quietly(self.client._release, key, token)

    # -- handling one job -------------------------------------------------------------------

    async def _process(self, job: Job) -> None:
        client = self.client
        lost = A.Event()
        beat = A.spawn_after(self.lease / 3, client._beat, job.key, job.token, self.lease, lost,
                             name=f"pg_once-heartbeat {job.key}")
        try:
            try:
                value = await A.run_unless(self.handler, lost, job)
                text = C.dump_value(job.key, client.serializer, value)
            except A.Stopped:
                job.lost = True
                return
            except Exception as exc:
                job.lost = lost.is_set()
                if self._finished(job):
                    return
                error = str(exc) if isinstance(exc, NotSerializable) else C.error_text(exc)
                log.warning("pg_once: job %r failed: %s", job.key, error)
                await client._quietly(client._fail, job.key, job.token, error, self.retry_after)
                with self._lock:
                    self.failed += 1
                return
            beat.cancel()
            job.lost = lost.is_set()
            if self._finished(job):
                return
            if (await client._complete(job.key, job.token, text, self.ttl))[0]:
                with self._lock:
                    self.completed += 1
            else:
                log.warning("pg_once: job %r lost its claim; its result was not stored", job.key)
        finally:
            beat.cancel()
            with self._lock:
                self._held.pop(job.token, None)
                self._tasks.pop(job.token, None)
            self._changed.set()

    def _finished(self, job: Job) -> bool:
        """True if the job's claim is no longer ours to settle (lost, or released on stop)."""
        with self._lock:
            return job.lost or job.token not in self._held

    # -- stopping ---------------------------------------------------------------------------

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.grace
        while not self._stop_now.is_set():
            with self._lock:
                if not self._held:
                    break
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._changed.clear()
            await A.wait_event(self._changed, min(left, 0.2))
        with self._lock:
            leftovers = list(self._held.values())
            tasks = list(self._tasks.values())
            self._held.clear()   # their handlers, if they ever return, settle nothing
        for task in tasks:
            task.cancel()
        await A.settle(tasks)
        for job in leftovers:
            # Give the key back now instead of letting it sit until its lease runs out;
            # a queued key released goes back due at once and the attempt does not count.
            await self.client._quietly(self.client._release, job.key, job.token)
            self.released += 1
