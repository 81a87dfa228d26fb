"""The example services of README.md, as the scenarios and the benchmark run them: found
from their service.json, prepared once, started as two instances on free ports, and
stopped with everything they started.

    services = discover()                      # examples/idempotency/*/ or PG_ONCE_HTTP_SERVICES
    with Running(services[0], dsn, ports) as running:
        running.urls                           # ["http://127.0.0.1:18400", ...]

Each instance runs in a process group of its own (a new session), so that stopping it
reaches the workers its server forked; and every process started here carries
PG_ONCE_HTTP_RUN in its environment, so that one that left its group (a daemonizing
server) is still found in /proc and stopped. Nothing else is ever signalled.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote, urlencode

import httpx
from psycopg.conninfo import conninfo_to_dict

REPO = Path(__file__).resolve().parents[3]
# The check-then-set baseline: answers the same routes without pg_once (its README).
BASELINE = REPO / "bench" / "idempotency" / "naive"
DEFAULT_PORTS = "18400-18499"
HEALTH_TIMEOUT_S = float(os.environ.get("PG_ONCE_HTTP_HEALTH_TIMEOUT", "60"))
SETUP_TIMEOUT_S = 1800  # a first `cargo build` of a service on two shared cores
STOP_GRACE_S = 5
# Marks every process this run starts (see the module's docstring).
RUN_MARK = "PG_ONCE_HTTP_RUN"
# What every service's middlewares are keyed with (docs/clients.md, I2), given to them as
# IDEMPOTENCY_SECRET: one per run, the same for every instance, as a deployment shares it.
SECRET = os.environ.get("IDEMPOTENCY_SECRET") or secrets.token_hex(32)


class ServiceError(Exception):
    """A service that cannot be described, prepared or started; the message says which and why."""


@dataclass
class Service:
    name: str
    directory: Path
    command: list[str]
    setup: list[list[str]] = field(default_factory=list)
    processes: int = 1


def discover() -> list[Service]:
    """The services in PG_ONCE_HTTP_SERVICES (directories, colon-separated) or else every
    examples/idempotency/*/service.json of the repository, sorted by name."""
    listed = os.environ.get("PG_ONCE_HTTP_SERVICES")
    if listed:
        directories = [Path(d).resolve() for d in listed.split(":") if d]
    else:
        directories = sorted(p.parent for p in (REPO / "examples" / "idempotency").glob("*/service.json"))
    return sorted((load(d) for d in directories), key=lambda s: s.name)


def load(directory: Path) -> Service:
    path = directory / "service.json"
    try:
        spec = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ServiceError(f"{path}: {e}") from None
    command, setup = spec.get("command"), spec.get("setup", [])
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise ServiceError(f'{path}: "name" must be a non-empty string')
    if not is_argv(command):
        raise ServiceError(f'{path}: "command" must be a non-empty list of strings, got {command!r}')
    if not isinstance(setup, list) or not all(is_argv(c) for c in setup):
        raise ServiceError(f'{path}: "setup" must be a list of commands (lists of strings), got {setup!r}')
    return Service(spec["name"], directory, command, setup, int(spec.get("processes", 1)))


def is_argv(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(a, str) for a in value)


# -- placeholders --------------------------------------------------------------------------

def fill(argv: list[str], service: Service, port: int | None = None) -> list[str]:
    """argv with README.md's placeholders replaced; each is looked up only when used."""
    out = []
    for arg in argv:
        if "{port}" in arg:
            if port is None:
                raise ServiceError(f"{service.name}: {{port}} in a setup command: {argv}")
            arg = arg.replace("{port}", str(port))
        if "{python}" in arg:
            arg = arg.replace("{python}", sys.executable)
        if "{node}" in arg:
            arg = arg.replace("{node}", node_binary())
        if "{cargo_target}" in arg:
            arg = arg.replace("{cargo_target}", cargo_target(service.directory))
        out.append(arg)
    return out


def node_binary() -> str:
    found = shutil.which("node")
    if not found:
        raise ServiceError("{node}: no `node` on PATH")
    return found


_cargo_targets: dict[Path, str] = {}


def cargo_target(directory: Path) -> str:
    """CARGO_TARGET_DIR, or the target directory `cargo metadata` names for the workspace
    the service belongs to."""
    if os.environ.get("CARGO_TARGET_DIR"):
        return os.environ["CARGO_TARGET_DIR"]
    if directory not in _cargo_targets:
        done = subprocess.run(["cargo", "metadata", "--format-version", "1", "--no-deps"],
                              cwd=directory, capture_output=True, text=True)
        if done.returncode:
            raise ServiceError(f"{{cargo_target}}: `cargo metadata` in {directory} failed:\n{done.stderr}")
        _cargo_targets[directory] = json.loads(done.stdout)["target_directory"]
    return _cargo_targets[directory]


def url_dsn(dsn: str) -> str:
    """dsn (a URL or libpq's `key=value` form) as a postgresql:// URL, the one form that
    libpq, node-postgres and tokio-postgres all read."""
    params = conninfo_to_dict(dsn)
    host = params.pop("host", "")
    user = quote(params.pop("user", ""), safe="")
    password = params.pop("password", None)
    port = params.pop("port", None)
    dbname = quote(params.pop("dbname", ""), safe="")
    if host.startswith("/"):  # a socket directory: not a URL's host
        params["host"], host = host, ""
    auth = f"{user}{':' + quote(password, safe='') if password else ''}@" if user else ""
    query = f"?{urlencode(params)}" if params else ""
    return f"postgresql://{auth}{host}{':' + port if port else ''}/{dbname}{query}"


# -- ports -----------------------------------------------------------------------------------

def port_range() -> range:
    """PG_ONCE_HTTP_PORTS, `LOW-HIGH` inclusive (default 18400-18499)."""
    text = os.environ.get("PG_ONCE_HTTP_PORTS", DEFAULT_PORTS)
    try:
        low, high = (int(p) for p in text.split("-"))
    except ValueError:
        raise ServiceError(f"PG_ONCE_HTTP_PORTS must be LOW-HIGH, got {text!r}") from None
    return range(low, high + 1)


def free_ports(count: int, taken: set[int] = frozenset()) -> list[int]:
    found = []
    for port in port_range():
        if port in taken:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        found.append(port)
        if len(found) == count:
            return found
    raise ServiceError(f"fewer than {count} free ports in {port_range()}")


# -- processes -------------------------------------------------------------------------------

class Instance:
    """One instance of a service: its process group, its port and its log."""

    def __init__(self, service: Service, port: int, env: dict, log_dir: Path, number: int):
        self.service, self.port, self.number = service, port, number
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_dir / f"{service.name}-{number}-{port}.log"
        argv = fill(service.command, service, port)
        self.log = open(self.log_path, "ab")
        self.log.write(f"$ {' '.join(argv)}\n".encode())
        self.log.flush()
        try:
            self.process = subprocess.Popen(argv, cwd=service.directory, env={**env, "PORT": str(port)},
                                            stdin=subprocess.DEVNULL, stdout=self.log,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as e:
            raise ServiceError(f"{service.name}: cannot start {argv}: {e}") from None
        self.pgid = self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def owns(self, pid: int) -> bool:
        """Whether pid is a process of this instance (its group), e.g. the handler's."""
        try:
            return os.getpgid(pid) == self.pgid
        except ProcessLookupError:
            return False

    def wait_healthy(self, timeout: float = HEALTH_TIMEOUT_S):
        deadline = time.monotonic() + timeout
        last = "no answer"
        while time.monotonic() < deadline:
            if not self.alive():
                raise ServiceError(f"{self.service.name} instance {self.number} exited "
                                   f"({self.process.returncode}) before answering GET /health\n{self.tail()}")
            try:
                r = httpx.get(self.url + "/health", timeout=2)
                if r.status_code == 200:
                    return
                last = f"{r.status_code} {r.text[:200]}"
            except httpx.HTTPError as e:
                last = repr(e)
            time.sleep(0.1)
        raise ServiceError(f"{self.service.name} instance {self.number} on {self.url}: GET /health not 200 "
                           f"within {timeout:.0f} s (last: {last})\n{self.tail()}")

    def stop(self):
        """SIGTERM to the group (and SIGCONT, should a scenario have stopped one of its
        processes), SIGKILL after STOP_GRACE_S."""
        for sig in (signal.SIGTERM, signal.SIGCONT):
            signal_group(self.pgid, sig)
        try:
            self.process.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
        signal_group(self.pgid, signal.SIGKILL)
        try:
            self.process.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
        self.log.close()

    def tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return f"--- last lines of {self.log_path} ---\n" + "\n".join(text[-lines:])


def signal_group(pgid: int, sig: int):
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def marked_processes(mark: str) -> list[int]:
    """Processes whose environment carries RUN_MARK=mark (Linux /proc)."""
    needle = f"{RUN_MARK}={mark}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def run_setup(service: Service, env: dict):
    """Runs the service's `setup` commands in its directory; ServiceError with their
    output if one fails."""
    for argv in service.setup:
        argv = fill(argv, service)
        try:
            done = subprocess.run(argv, cwd=service.directory, env=env, stdin=subprocess.DEVNULL,
                                  capture_output=True, text=True, timeout=SETUP_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise ServiceError(f"{service.name}: setup {argv}: {e}") from None
        if done.returncode:
            raise ServiceError(f"{service.name}: setup {argv} exited {done.returncode}\n"
                               f"{done.stdout[-4000:]}{done.stderr[-4000:]}")


class Running:
    """Two (or `count`) instances of a service, healthy; a context manager that stops them
    and anything they left behind."""

    def __init__(self, service: Service, dsn: str, count: int = 2, log_dir: Path | None = None):
        self.service, self.dsn, self.count = service, dsn, count
        self.log_dir = log_dir or Path(tempfile.mkdtemp(prefix=f"idem-{service.name}-"))
        self.mark = uuid.uuid4().hex
        self.env = {**os.environ, "PG_ONCE_DSN": url_dsn(dsn), "IDEMPOTENCY_SECRET": SECRET,
                    RUN_MARK: self.mark}
        self.instances: list[Instance] = []

    def __enter__(self) -> "Running":
        try:
            run_setup(self.service, self.env)
            ports = free_ports(self.count)
            self.instances = [Instance(self.service, port, self.env, self.log_dir, i)
                              for i, port in enumerate(ports)]
            for instance in self.instances:
                instance.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc):
        self.stop()

    @property
    def urls(self) -> list[str]:
        return [i.url for i in self.instances]

    def revive(self):
        """Restarts instances whose server exited (a scenario killed it) on the same port,
        and waits until every instance answers GET /health."""
        for n, instance in enumerate(self.instances):
            if not instance.alive():
                instance.stop()
                self.instances[n] = Instance(self.service, instance.port, self.env, self.log_dir, n)
        for instance in self.instances:
            instance.wait_healthy()

    def instance_of(self, pid: int) -> Instance | None:
        return next((i for i in self.instances if i.owns(pid)), None)

    def stop(self) -> list[int]:
        """Stops every instance, then any process still carrying this run's mark; returns
        the pids of those stragglers (none, when the groups held everything)."""
        for instance in self.instances:
            instance.stop()
        stragglers = marked_processes(self.mark)
        for pid in stragglers:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        return stragglers

    def tails(self) -> str:
        return "\n".join(i.tail() for i in self.instances)
