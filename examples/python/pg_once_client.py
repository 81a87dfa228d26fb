"""A small pg_once client for psycopg 3.

    client = OnceClient("host=... dbname=app")
    page = client.get("https://example.com/a", lambda: scrape("https://example.com/a"), ttl=3600)

    @client.cached(ttl=3600)
    def scrape(url): ...

Two ways to wait for someone else's computation, as the README describes:
- protocol="server" (default): claim_key(wait => ...) waits inside the server. One round
  trip; works behind PgBouncer in transaction mode.
- protocol="listen": LISTEN once first, then claim_key; on "wait", wait for the key's
  notification (or the owner's lease to run out) and ask again.

While computing, a background thread extends the lease with heartbeat_key (on its own
connection), so computations longer than the lease keep their claim.
"""

from __future__ import annotations

import functools
import threading
import time
from datetime import datetime, timezone
from typing import Any, Callable

import psycopg
from psycopg.types.json import Jsonb


class OnceFailed(Exception):
    """The key's last computation failed, and the failure is served until retry_at."""

    def __init__(self, key: str, error: str | None, retry_at: datetime | None):
        super().__init__(f"{key}: {error}")
        self.key, self.error, self.retry_at = key, error, retry_at


class ClaimLost(Exception):
    """Our claim was taken over or invalidated while we computed: the result was not stored."""


CLAIM = """SELECT outcome, token, result, error, lease_expires_at, retry_at
             FROM once.claim_key(%s, make_interval(secs => %s), make_interval(secs => %s))"""


class OnceClient:
    def __init__(self, conninfo: str, *, lease: float = 30.0, wait: float = 30.0,
                 protocol: str = "server"):
        if protocol not in ("server", "listen"):
            raise ValueError("protocol must be 'server' or 'listen'")
        self.conninfo, self.lease, self.wait, self.protocol = conninfo, lease, wait, protocol
        self.conn = psycopg.connect(conninfo, autocommit=True)
        if protocol == "listen":
            self.conn.execute("LISTEN once")

    def close(self) -> None:
        self.conn.close()

    def get(self, key: str, compute: Callable[[], Any], *, ttl: float | None = None,
            retry_after: float = 0.0) -> Any:
        """The cached result of `key`, computing it with `compute()` if nobody has."""
        deadline = time.monotonic() + self.wait
        server_wait = self.wait if self.protocol == "server" else 0.0
        while True:
            remaining = max(0.0, deadline - time.monotonic())
            outcome, token, result, error, lease_expires_at, retry_at = self.conn.execute(
                CLAIM, (key, self.lease, min(server_wait, remaining))).fetchone()
            if outcome == "hit":
                return result
            if outcome == "failed":
                raise OnceFailed(key, error, retry_at)
            if outcome == "claimed":
                return self._compute(key, token, compute, ttl, retry_after)
            # wait: someone else computes it.
            if remaining <= 0:
                raise TimeoutError(f"{key}: still being computed after {self.wait} s")
            if self.protocol == "listen":
                self._await_notification(key, lease_expires_at, deadline)

    def cached(self, key: Callable[..., str] | None = None, *, ttl: float | None = None,
               retry_after: float = 0.0):
        """Decorator: cache a function's result under key(*args) (default: str of the args)."""
        def decorate(fn):
            @functools.wraps(fn)
            def wrapper(*args, **kwargs):
                k = key(*args, **kwargs) if key else f"{fn.__qualname__}:{args!r}:{kwargs!r}"
                return self.get(k, lambda: fn(*args, **kwargs), ttl=ttl, retry_after=retry_after)
            return wrapper
        return decorate

    def _compute(self, key, token, compute, ttl, retry_after):
        stop = threading.Event()
        beat = threading.Thread(target=self._heartbeat, args=(key, token, stop), daemon=True)
        beat.start()
        try:
            value = compute()
        except Exception as exc:
            stop.set()
            self.conn.execute(
                "SELECT once.fail_key(%s, %s, %s, make_interval(secs => %s))",
                (key, token, f"{type(exc).__name__}: {exc}", retry_after))
            raise
        stop.set()
        stored = self.conn.execute(
            "SELECT once.complete_key(%s, %s, %s, make_interval(secs => %s))",
            (key, token, Jsonb(value), ttl)).fetchone()[0]
        if not stored:
            raise ClaimLost(key)
        return value

    def _heartbeat(self, key, token, stop: threading.Event):
        with psycopg.connect(self.conninfo, autocommit=True) as conn:
            while not stop.wait(self.lease / 3):
                extended = conn.execute(
                    "SELECT once.heartbeat_key(%s, %s, make_interval(secs => %s))",
                    (key, token, self.lease)).fetchone()[0]
                if extended is None:
                    return  # lost: complete_key will say so

    def _await_notification(self, key, lease_expires_at, deadline):
        # LISTEN ran before the claim, so a completion after it is queued for us.
        until = min(deadline, time.monotonic() + max(
            0.0, (lease_expires_at - datetime.now(timezone.utc)).total_seconds()))
        while time.monotonic() < until:
            for note in self.conn.notifies(timeout=until - time.monotonic(), stop_after=1):
                if note.channel == "once" and note.payload == key:
                    return
