# Generated from pg_once/_async/listener.py by tools/generate_sync.py: edit that file,
# not this one, then run the tool again.
"""The process's one LISTEN connection (rule N4), run beside the callers.

It does two jobs:
- names the owner of this process's claims: `SELECT once.owner_session()` on this
  connection returns its backend pid P, passed as claim_key(owner_pid => P). When the
  process dies its sockets close, this backend exits and the server ends the claims at
  once, however the pool's connections are shared or recycled;
- multiplexes the completions of every key on channel "once" (payload = key, its digest,
  or empty for "everyone look again", rule C3) to the waiters that registered interest.

If the connection drops it reconnects, LISTENs again, gets the new P, and wakes every
waiter: notifications sent in the gap are lost, so everyone must look again.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Dict, Optional, Set

import psycopg

from .. import _common as C
from ..errors import ConfigurationError
from . import _compat as A

log = logging.getLogger("pg_once")

HEALTH_CHECK_SECONDS = 5.0   # an idle LISTEN socket cut by the network is noticed by a query
RECONNECT_MAX_SECONDS = 2.0


class Listener:
    def __init__(self, conninfo: str, connect_timeout: float = 10.0):
        self._conninfo, self._connect_timeout = conninfo, connect_timeout
        # Interest in keys. A plain lock: the sync flavour registers from many threads.
        self._lock = threading.Lock()
        self._interest: Dict[str, Set[A.Event]] = {}
        self._connected = A.Event()
        self._pid: Optional[int] = None      # P while connected
        self.legacy = False                  # the server has no once.owner_session()
        self.behind_proxy = False            # a proxy sits between (rule N5): probe it
        self.reconnects = 0
        self._closed = False
        self._conn: Optional[psycopg.Connection] = None
        self._task: Optional[A.Task] = None

    def start(self) -> None:
        # The first connection is made by the caller, so that a wrong conninfo fails the
        # client's opening rather than a background task.
        self._connect()
        self._task = A.spawn(self._run, name="pg_once-listener")

    def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            A.join([self._task], 3)
        if self._conn is not None:
            self._conn.close()
        self._wake_all()

    # -- owner identity -----------------------------------------------------------------

    def owner_pid(self) -> Optional[int]:
        """P, waiting for a reconnect if the connection is down; None on a server
        without owner_session() (claims then belong to the pooled connection)."""
        # Looked at again after each wake-up: a reconnect may clear the event between its
        # being set and this caller running again, and the pid is never None while it is
        # set (but on a legacy server). The pid is read before the event, so that a
        # reconnect in between hands out the old, dead P (refused with 22023: R3), never
        # None, which would make the pooled connection the claim's owner.
        deadline = time.monotonic() + self._connect_timeout
        while True:
            if self._closed:
                raise psycopg.OperationalError("pg_once: the client is closed")
            pid = self._pid
            if self._connected.is_set() and (pid is not None or self.legacy):
                return pid
            left = deadline - time.monotonic()
            if left <= 0:
                raise psycopg.OperationalError(
                    f"pg_once: the LISTEN connection has been down for {self._connect_timeout:g} s")
            A.wait_event(self._connected, left)

    def replaced(self, pid: Optional[int], patience: float) -> bool:
        """Whether the LISTEN connection whose P was `pid` has been replaced (or is being
        replaced) within `patience` seconds: a claim refused with 22023 for that pid raced
        the connection's end, as after a failover, and is asked again with the new P (R3)."""
        deadline = time.monotonic() + patience
        while True:
            if self._pid != pid or not self._connected.is_set():
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            A.sleep(min(0.05, left))

    # -- interest in keys ---------------------------------------------------------------

    def watch(self, key: str) -> A.Event:
        """Register interest in `key` BEFORE asking the server about it, so that a
        completion arriving between the answer and the sleep still wakes the caller (C4)."""
        event = A.Event()
        with self._lock:
            for name in C.notified_names(key):
                self._interest.setdefault(name, set()).add(event)
        return event

    def unwatch(self, key: str, event: A.Event) -> None:
        with self._lock:
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
        with self._lock:
            events = list(self._interest.get(payload, ()))
        for event in events:
            event.set()

    def _wake_all(self) -> None:
        with self._lock:
            events = [e for events in self._interest.values() for e in events]
        for event in events:
            event.set()

    # -- the connection -------------------------------------------------------------------

    def _connect(self) -> None:
        conn = psycopg.Connection.connect(
            self._conninfo, autocommit=True, prepare_threshold=None,
            connect_timeout=max(1, int(self._connect_timeout)))
        try:
            conn.execute(C.LISTEN)
            try:
                pid = _one(conn, C.OWNER_SESSION)
                legacy = False
            except psycopg.errors.UndefinedFunction:
                pid, legacy = _one(conn, C.BACKEND_PID), True
                log.warning("pg_once: the server has no once.owner_session(); claims belong "
                            "to the pooled connection that made them (upgrade the extension)")
            # Rule N5: the pid the protocol reported is a proxy's own when one sits between;
            # a second transaction on another server connection is a transaction pooler.
            behind_proxy = conn.info.backend_pid != pid
            if behind_proxy and _one(conn, C.BACKEND_PID) != pid:
                raise ConfigurationError(C.TRANSACTION_POOLER)
        except BaseException:
            conn.close()
            raise
        self._conn, self.legacy, self.behind_proxy = conn, legacy, behind_proxy
        self._pid = None if legacy else pid
        self._connected.set()

    def _run(self) -> None:
        last_check = time.monotonic()
        while not self._closed:
            try:
                for note in self._conn.notifies(timeout=0.5):
                    if note.channel == C.CHANNEL:
                        self._wake(note.payload)
                if time.monotonic() - last_check > HEALTH_CHECK_SECONDS:
                    self._conn.execute("SELECT 1")
                    last_check = time.monotonic()
            except Exception as exc:  # the connection is gone (or broken): start over
                if self._closed:
                    return
                log.warning("pg_once: LISTEN connection lost (%s); reconnecting", exc)
                self._reconnect()
                last_check = time.monotonic()

    def _reconnect(self) -> None:
        self._connected.clear()
        self._pid = None
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
                A.sleep(delay)
                delay = min(RECONNECT_MAX_SECONDS, delay * 2)


def _one(conn: psycopg.Connection, sql: str):
    """The one value of a one-row, one-column statement."""
    return ((conn.execute(sql)).fetchone())[0]
