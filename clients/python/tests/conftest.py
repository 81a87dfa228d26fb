"""Fixtures: every test that can runs twice, against PG_ONCE_DSN (direct connections) and
PG_ONCE_BOUNCER_DSN (the same server through PgBouncer in transaction mode, with the
LISTEN connection direct), and a third time against PG_ONCE_TLS_DSN (a server that takes
TCP only over TLS) when that is set. Tests that need a server skip, with a message, when
the variable of their setup is not set; tests that need none (the offline vectors) always
run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import psycopg
import pytest

from pg_once import AsyncClient, Client

DIRECT = os.environ.get("PG_ONCE_DSN")
BOUNCER = os.environ.get("PG_ONCE_BOUNCER_DSN")
TLS = os.environ.get("PG_ONCE_TLS_DSN")
CHILD = str(Path(__file__).with_name("child.py"))


@dataclass
class Setup:
    name: str
    dsn: str          # what the pool connects to
    listen_dsn: str   # the LISTEN connection: always direct
    admin_dsn: str    # the server itself, for looking at and poking it

    def client(self, **kw) -> Client:
        if "pool" in kw:
            return Client(listen_conninfo=self.listen_dsn, **kw)
        return Client(self.dsn, listen_conninfo=self.listen_dsn, **kw)

    def async_client(self, **kw) -> AsyncClient:
        if "pool" in kw:
            return AsyncClient(listen_conninfo=self.listen_dsn, **kw)
        return AsyncClient(self.dsn, listen_conninfo=self.listen_dsn, **kw)


def need_server() -> None:
    if not DIRECT:
        pytest.skip("set PG_ONCE_DSN (and PG_ONCE_BOUNCER_DSN) to run the tests against a server")


@pytest.fixture(scope="session")
def extension():
    need_server()
    with psycopg.connect(DIRECT, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS pg_once")
    if TLS:
        with psycopg.connect(TLS, autocommit=True) as conn:
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_once")


def make_setup(name: str) -> Setup:
    need_server()
    if name == "direct":
        return Setup("direct", DIRECT, DIRECT, DIRECT)
    if name == "bouncer":
        if not BOUNCER:
            pytest.skip("PG_ONCE_BOUNCER_DSN is not set")
        return Setup("bouncer", BOUNCER, DIRECT, DIRECT)
    if not TLS:
        pytest.skip("PG_ONCE_TLS_DSN is not set")
    return Setup("tls", TLS, TLS, TLS)


@pytest.fixture(params=["direct", "bouncer"])
def setup(request, extension) -> Setup:
    return make_setup(request.param)


@pytest.fixture
def clients(setup):
    """Make clients of the test's setup; all are closed after the test."""
    made: List[Client] = []

    def make(**kw) -> Client:
        c = setup.client(**kw)
        made.append(c)
        return c
    yield make
    for c in made:
        c.close()


@pytest.fixture
def key(request) -> str:
    """A key no other test (or earlier run) uses."""
    return f"py-test/{request.node.name}/{uuid.uuid4().hex[:8]}"


@pytest.fixture
def admin(extension):
    """A direct autocommit connection for looking at and poking the server."""
    with psycopg.connect(DIRECT, autocommit=True) as conn:
        yield conn


def state(admin, key: str) -> Optional[str]:
    row = admin.execute("SELECT state FROM once.entries WHERE key_hash = once.key_hash(%s)",
                        (key,)).fetchone()
    return row and row[0]


class Child:
    """A client in another OS process (tests/child.py), speaking JSON lines on stdout."""

    def __init__(self, mode: str, setup: Setup, **args):
        args.update(dsn=setup.dsn, listen_dsn=setup.listen_dsn)
        self.proc = subprocess.Popen([sys.executable, CHILD, mode, json.dumps(args)],
                                     stdout=subprocess.PIPE, text=True)

    def line(self) -> dict:
        text = self.proc.stdout.readline()
        if not text:
            raise AssertionError(f"child exited (code {self.proc.wait()}) without reporting")
        return json.loads(text)

    def finish(self, timeout: float = 30) -> dict:
        out, _ = self.proc.communicate(timeout=timeout)
        assert self.proc.returncode == 0, f"child exited with {self.proc.returncode}"
        return json.loads(out.strip().splitlines()[-1])
