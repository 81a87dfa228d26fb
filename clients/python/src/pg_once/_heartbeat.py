"""Heartbeats for the sync client: one thread extends every claim this client holds,
each every lease/3, through the pool (a heartbeat holds a connection for one statement)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Dict, Optional

log = logging.getLogger("pg_once")


class Beat:
    """One claim being kept alive. `lost` turns true when heartbeat_key returns NULL:
    the claim was taken over or invalidated, and the result must not be stored."""

    __slots__ = ("key", "token", "lease", "due", "lost", "on_lost")

    def __init__(self, key: str, token: int, lease: float, on_lost: Optional[Callable[[], None]]):
        self.key, self.token, self.lease, self.on_lost = key, token, lease, on_lost
        self.due = time.monotonic() + lease / 3
        self.lost = False


class Heartbeats:
    def __init__(self, heartbeat: Callable[[str, int, float], object]):
        self._heartbeat = heartbeat          # (key, token, lease) -> new expiry or None
        self._cond = threading.Condition()
        self._beats: Dict[int, Beat] = {}
        self._closed = False
        self._thread: Optional[threading.Thread] = None

    def add(self, key: str, token: int, lease: float,
            on_lost: Optional[Callable[[], None]] = None) -> Beat:
        beat = Beat(key, token, lease, on_lost)
        with self._cond:
            self._beats[id(beat)] = beat
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="pg_once-heartbeat",
                                                daemon=True)
                self._thread.start()
            self._cond.notify_all()
        return beat

    def remove(self, beat: Beat) -> None:
        with self._cond:
            self._beats.pop(id(beat), None)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=3)

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                now = time.monotonic()
                due = [b for b in self._beats.values() if b.due <= now]
                if not due:
                    next_due = min((b.due for b in self._beats.values()), default=now + 1.0)
                    self._cond.wait(max(0.01, next_due - now))
                    continue
            for beat in due:
                self._beat(beat)

    def _beat(self, beat: Beat) -> None:
        try:
            expiry = self._heartbeat(beat.key, beat.token, beat.lease)
        except Exception as exc:
            # The claim may still be fine (a pooled connection broke, the pool was busy):
            # try again soon, well before the lease can run out.
            log.warning("pg_once: heartbeat of %r failed (%s); retrying", beat.key, exc)
            beat.due = time.monotonic() + min(1.0, beat.lease / 6)
            return
        if expiry is None:
            log.warning("pg_once: the claim on %r was lost; its result will not be stored", beat.key)
            beat.lost = True
            self.remove(beat)
            if beat.on_lost is not None:
                beat.on_lost()
        else:
            beat.due = time.monotonic() + beat.lease / 3
