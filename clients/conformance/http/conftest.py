"""Fixtures of the shared HTTP scenarios: one session per example service (set up once,
two instances started, stopped at the end), the database, and a client that spreads
requests over both instances. How to run: README.md, "Running the scenarios"."""

from __future__ import annotations

import atexit
import os
import signal

import psycopg
import pytest

from services import BASELINE, Running, ServiceError, discover, load
from support import Api, Db, create_schema

DSN = os.environ.get("PG_ONCE_DSN")

_running: list[Running] = []  # stopped at exit too, should pytest itself be stopped


def pytest_generate_tests(metafunc):
    if "service" not in metafunc.fixturenames:
        return
    try:
        found = discover()
    except ServiceError as e:
        found = [pytest.param(e, id="service.json")]  # the fixture raises it: one clear error
    if not found:
        found = [pytest.param(None, marks=pytest.mark.skip(
            reason="no service: none under examples/idempotency/*/service.json, and PG_ONCE_HTTP_SERVICES unset"))]
    metafunc.parametrize("service", found, indirect=True, scope="session",
                         ids=lambda s: getattr(s, "name", None))


@pytest.fixture(scope="session")
def db():
    """An autocommit connection to PG_ONCE_DSN, with schema idem_demo's tables made."""
    if not DSN:
        pytest.skip("PG_ONCE_DSN is not set: the HTTP scenarios need a database with pg_once")
    with psycopg.connect(DSN, autocommit=True) as conn:
        create_schema(conn)
        yield Db(conn)


@pytest.fixture(scope="session")
def service(request, db, tmp_path_factory):
    """The service of this parametrization, running as two healthy instances."""
    if isinstance(request.param, ServiceError):
        raise request.param
    db.conn.execute("TRUNCATE idem_demo.started, idem_demo.orders")
    yield from run(request.param, tmp_path_factory)


@pytest.fixture(scope="session")
def baseline(db, tmp_path_factory):
    """The check-then-set baseline of bench/idempotency/naive, two instances."""
    yield from run(load(BASELINE), tmp_path_factory)


def run(service, tmp_path_factory):
    running = Running(service, DSN, log_dir=tmp_path_factory.mktemp(service.name))
    _running.append(running)
    with running:
        yield running
    _running.remove(running)


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture
async def api(service, db):
    """The two instances as one client; an instance a scenario killed is restarted first."""
    async with Api.open(service, db) as api:
        yield api


@pytest.fixture
async def baseline_api(baseline, db):
    async with Api.open(baseline, db) as api:
        yield api


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed scenario's report ends with the last lines of the instances' logs."""
    outcome = yield
    report = outcome.get_result()
    funcargs = getattr(item, "funcargs", {})
    running = funcargs.get("service") or funcargs.get("baseline")
    if report.failed and isinstance(running, Running):
        report.sections.append(("service logs", running.tails()))


def stop_all():
    for running in list(_running):
        running.stop()


def interrupted(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")  # pytest then runs the fixtures' teardown


atexit.register(stop_all)
signal.signal(signal.SIGTERM, interrupted)
