"""The process's one LISTEN connection (sync flavour), run by a daemon thread.

It does two jobs:
- names the owner of this process's claims: `SELECT once.owner_session()` on this
  connection returns its backend pid P, passed as claim_key(owner_pid => P). When the
  process dies its sockets close, this backend exits and the server ends the claims at
  once, however the pool's connections are shared or recycled;
- multiplexes the completions of every key on channel "once" (payload = key) to the
  waiters that registered interest in that key.

If the connection drops it reconnects, LISTENs again, gets the new P, and wakes every
waiter: notifications sent in the gap are lost, so everyone must look again.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Dict, Optional, Set

import psycopg

from ._common import (CHANNEL, LISTEN, OWNER_SESSION, TRANSACTION_POOLER, WAKE_EVERYONE,
                      notified_names)
from .errors import ConfigurationError

log = logging.getLogger("pg_once")

HEALTH_CHECK_SECONDS = 5.0   # an idle LISTEN socket cut by the network is noticed by a query
RECONNECT_MAX_SECONDS = 2.0


class Listener:
    def __init__(self, conninfo: str, connect_timeout: float = 10.0):
        self._conninfo = conninfo
        self._connect_timeout = connect_timeout
        self._cond = threading.Condition()
        self._interest: Dict[str, Set[threading.Event]] = {}
        self._pid: Optional[int] = None      # P while connected
        self._connected = False
        self.legacy = False                  # the server has no once.owner_session()
        self.behind_proxy = False            # a proxy sits between (rule N5): probe it
        self.reconnects = 0
        self._closed = False
        self._conn: Optional[psycopg.Connection] = None
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        # The first connection is made in the caller's thread so that a wrong conninfo
        # fails the Client's constructor instead of a background thread.
        self._connect()
        self._thread = threading.Thread(target=self._run, name="pg_once-listener", daemon=True)
        self._thread.start()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=3)
        self._wake_all()

    # -- owner identity ---------------------------------------------------------------

    def owner_pid(self) -> Optional[int]:
        """P, waiting for a reconnect if the connection is down; None on a server
        without owner_session() (claims then belong to the pooled connection)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._connected or self._closed,
                                       timeout=self._connect_timeout):
                raise psycopg.OperationalError(
                    f"pg_once: the LISTEN connection has been down for {self._connect_timeout:g} s")
            if self._closed:
                raise psycopg.OperationalError("pg_once: the client is closed")
            return self._pid

    # -- interest in keys ---------------------------------------------------------------

    def watch(self, key: str) -> threading.Event:
        """Register interest in `key` BEFORE asking the server about it, so that a
        completion arriving between the answer and the sleep still wakes the caller."""
        event = threading.Event()
        with self._cond:
            for name in notified_names(key):
                self._interest.setdefault(name, set()).add(event)
        return event

    def unwatch(self, key: str, event: threading.Event) -> None:
        with self._cond:
            for name in notified_names(key):
                events = self._interest.get(name)
                if events is not None:
                    events.discard(event)
                    if not events:
                        del self._interest[name]

    def _wake(self, payload: str) -> None:
        if payload == WAKE_EVERYONE:
            self._wake_all()
            return
        with self._cond:
            events = list(self._interest.get(payload, ()))
        for event in events:
            event.set()

    def _wake_all(self) -> None:
        with self._cond:
            events = [e for events in self._interest.values() for e in events]
        for event in events:
            event.set()

    # -- the connection -------------------------------------------------------------------

    def _connect(self) -> None:
        conn = psycopg.connect(self._conninfo, autocommit=True, prepare_threshold=None,
                               connect_timeout=max(1, int(self._connect_timeout)))
        try:
            conn.execute(LISTEN)
            try:
                pid = conn.execute(OWNER_SESSION).fetchone()[0]
                legacy = False
            except psycopg.errors.UndefinedFunction:
                pid, legacy = conn.execute("SELECT pg_backend_pid()").fetchone()[0], True
                log.warning("pg_once: the server has no once.owner_session(); claims belong "
                            "to the pooled connection that made them (upgrade the extension)")
            # Rule N5: the pid the protocol reported is a proxy's own when one sits between.
            behind_proxy = conn.info.backend_pid != pid
            if behind_proxy and conn.execute("SELECT pg_backend_pid()").fetchone()[0] != pid:
                raise ConfigurationError(TRANSACTION_POOLER)
        except BaseException:
            conn.close()
            raise
        self.behind_proxy = behind_proxy
        if legacy:
            pid = None
        with self._cond:
            self._conn, self._pid, self.legacy, self._connected = conn, pid, legacy, True
            self._cond.notify_all()

    def _run(self) -> None:
        last_check = time.monotonic()
        while not self._closed:
            conn = self._conn
            try:
                for note in conn.notifies(timeout=0.5):
                    if note.channel == CHANNEL:
                        self._wake(note.payload)
                if time.monotonic() - last_check > HEALTH_CHECK_SECONDS:
                    conn.execute("SELECT 1")
                    last_check = time.monotonic()
            except Exception as exc:  # the connection is gone (or broken): start over
                if self._closed:
                    break
                log.warning("pg_once: LISTEN connection lost (%s); reconnecting", exc)
                self._reconnect()
                last_check = time.monotonic()
        if self._conn is not None:
            self._conn.close()

    def _reconnect(self) -> None:
        with self._cond:
            self._connected, self._pid = False, None
        try:
            self._conn.close()
        except Exception:
            pass
        # Notifications sent while we were away are lost: every waiter looks again.
        self._wake_all()
        delay = 0.05
        while not self._closed:
            try:
                self._connect()
                self.reconnects += 1
                self._wake_all()
                return
            except Exception as exc:
                log.warning("pg_once: LISTEN reconnect failed (%s); retrying in %.2f s", exc, delay)
                with self._cond:
                    self._cond.wait(delay)
                delay = min(RECONNECT_MAX_SECONDS, delay * 2)
