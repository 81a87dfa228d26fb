"""The runner of the language-neutral conformance suite (clients/conformance/README.md):
reads its vector notation and plays its scenarios against a server, with the sync Client
or the AsyncClient (the same scenario, the same expectations)."""

from __future__ import annotations

import asyncio
import base64
import datetime
import decimal
import json
import re
import time
import uuid
from pathlib import Path
from typing import Any, Dict, List, Optional, Set

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from pg_once import (AsyncClient, ClaimLost, Client, ConfigurationError, NotSerializable,
                     OnceFailed, OnceTimeout)

ROOT = Path(__file__).resolve().parents[2] / "conformance"


def load(kind: str, name: str) -> dict:
    return json.loads((ROOT / kind / name).read_text())


def cases(kind: str, name: str, language: str = "python") -> List[Any]:
    """The cases of one file that this runner runs, as pytest params named by the case."""
    import pytest
    out = []
    suite = load(kind, name)
    for case in suite["cases"]:
        if "setups" in suite:   # a file run only in the setups it names (README, "Scenarios")
            case = {**case, "setups": suite["setups"]}
        marks = []
        if language not in case.get("languages", [language]):
            marks.append(pytest.mark.skip(reason=f"only for {', '.join(case['languages'])}"))
        out.append(pytest.param(case, id=case["name"], marks=marks))
    return out


class Unsupported:
    """`{"$unsupported": ...}`: an object of a class of the test's own."""


def value(v: Any) -> Any:
    """A Python value from the vector notation."""
    if isinstance(v, dict) and len(v) == 1 and next(iter(v)).startswith("$"):
        tag, x = next(iter(v.items()))
        return {
            "$int": lambda: int(x),
            "$float": lambda: float(x),
            "$bytes": lambda: base64.b64decode(x),
            "$tuple": lambda: tuple(value(i) for i in x),
            "$set": lambda: {value(i) for i in x},
            "$map": lambda: {value(a): value(b) for a, b in x},
            "$datetime": lambda: datetime.datetime.fromisoformat(x),
            "$decimal": lambda: decimal.Decimal(x),
            "$unsupported": Unsupported,
            "$repeat": lambda: x[0] * x[1],
        }[tag]()
    if isinstance(v, list):
        return [value(i) for i in v]
    if isinstance(v, dict):
        return {k: value(i) for k, i in v.items()}
    return v


def same(got: Any, want: Any) -> bool:
    """Equal, and of the same JSON kind all the way down (1 is not 1.0, nor True)."""
    if type(got) is not type(want):
        return False
    if isinstance(got, list):
        return len(got) == len(want) and all(same(a, b) for a, b in zip(got, want))
    if isinstance(got, dict):
        return got.keys() == want.keys() and all(same(got[k], want[k]) for k in got)
    return got == want


ERRORS = {
    "Failed": OnceFailed, "Timeout": OnceTimeout, "ClaimLost": ClaimLost,
    "NotSerializable": NotSerializable, "Configuration": ConfigurationError,
    "Invalid": (ValueError, TypeError), "Refused": psycopg.Error,
    "Cancelled": asyncio.CancelledError,
}


class HoldingProxy:
    """A TCP proxy of the runner's own between one client's pool and the server (a case's
    `"proxy": true`): while paused it holds every byte the server sends, on its connections
    open or new, and forwards them on resume; what the client sends always flows. So a
    statement sent while paused is run by the server, and its answer is on its way."""

    def __init__(self, dsn: str):
        target = conninfo_to_dict(dsn)
        if "," in target.get("host", "") or "," in str(target.get("port", "")):
            raise AssertionError(f"the proxy forwards to one server, not to {dsn!r}")
        self.target = dsn
        self.upstream = (target.get("hostaddr") or target.get("host") or "localhost",
                         int(target.get("port") or 5432))
        self.flowing = asyncio.Event()
        self.flowing.set()
        self.server: Optional[asyncio.AbstractServer] = None
        self.pumps: Set[asyncio.Task] = set()
        self.writers: List[asyncio.StreamWriter] = []

    async def start(self) -> "HoldingProxy":
        self.server = await asyncio.start_server(self.accept, "127.0.0.1", 0)
        return self

    def dsn(self) -> str:
        """The client's connection string: the server's, its host and port the proxy's
        (replaced, not appended: libpq would take the first of two host keywords)."""
        params = conninfo_to_dict(self.target)
        params.pop("hostaddr", None)
        params["host"], params["port"] = "127.0.0.1", str(self.server.sockets[0].getsockname()[1])
        return make_conninfo(**params)

    def pause(self) -> None:
        self.flowing.clear()

    def resume(self) -> None:
        self.flowing.set()

    async def accept(self, client_reader: asyncio.StreamReader,
                     client_writer: asyncio.StreamWriter) -> None:
        try:
            server_reader, server_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            client_writer.close()
            return
        self.writers += [client_writer, server_writer]
        for pump in (self.pump(client_reader, server_writer, held=False),
                     self.pump(server_reader, client_writer, held=True)):
            task = asyncio.create_task(pump)
            self.pumps.add(task)
            task.add_done_callback(self.pumps.discard)

    async def pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                   held: bool) -> None:
        """Copy one direction until its end, then close the other side's writer too: a
        connection either peer ends is ended for both."""
        try:
            while data := await reader.read(65536):
                if held:
                    await self.flowing.wait()
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def close(self) -> None:
        self.resume()   # what it still holds goes on, so that no client waits on it
        self.server.close()
        for task in list(self.pumps):
            task.cancel()
        await asyncio.gather(*self.pumps, return_exceptions=True)
        for writer in self.writers:
            writer.close()
        await self.server.wait_closed()


class Scenario:
    """One scenario case against one setup, with the sync or the async client."""

    def __init__(self, case: dict, setup, flavor: str):
        self.case, self.setup, self.flavor = case, setup, flavor
        self.prefix = f"conformance/{uuid.uuid4().hex[:10]}/"
        self.counters: Dict[str, int] = {}
        self.running: Dict[str, asyncio.Task] = {}
        self.workers: Dict[str, Any] = {}   # the workers of `work` steps, by their `as`
        self.killed: Dict[int, int] = {}   # client -> the LISTEN pid kill_listener ended
        self.proxies: List[HoldingProxy] = []   # `"proxy": true`: each client's, by number

    def key(self, k: str) -> str:
        return self.prefix + k

    def queue(self, q: str) -> str:
        """A queue of the run's own ({queue:q}): a queue name allows no '/'."""
        return f"{q}_{self.prefix.split('/')[1][:8]}"

    def sql_text(self, sql: str) -> str:
        sql = re.sub(r"\{queue:(\w+)\}", lambda m: self.queue(m.group(1)), sql)
        return re.sub(r"\{key:(.*?)\}", lambda m: self.prefix + m.group(1), sql)

    # -- compute functions -----------------------------------------------------------------

    def compute(self, spec: dict):
        def count(name):
            self.counters[name] = self.counters.get(name, 0) + 1

        def effect():
            if "raises" in spec:
                raise RuntimeError(spec["raises"])
            return value(spec.get("returns"))

        # `counts` when it starts, as the other runners count.
        if self.flavor == "async":
            async def acompute(*_args):
                if "counts" in spec:
                    count(spec["counts"])
                try:
                    await asyncio.sleep(spec.get("sleep_ms", 0) / 1000)
                except asyncio.CancelledError:
                    # `counts_stop`: counted when the call's cancellation stops it.
                    if "counts_stop" in spec:
                        count(spec["counts_stop"])
                    raise
                return effect()
            return acompute

        def compute(*_args):
            if "counts" in spec:
                count(spec["counts"])
            time.sleep(spec.get("sleep_ms", 0) / 1000)
            return effect()
        return compute

    # -- running ------------------------------------------------------------------------------

    async def run(self) -> None:
        if self.flavor == "sync" and any("cancel" in step or "counts_stop" in step.get("compute", {})
                                         or "counts_stop" in step.get("handler", {})
                                         for step in self.case["steps"]):
            pytest.skip("the sync client's calls and computations cannot be cancelled "
                        "(docs/clients.md, X2 and L3)")
        if self.case.get("proxy") and self.setup.name != "direct":
            pytest.skip("a case with a proxy of the runner's own runs in the direct setup only "
                        "(clients/conformance/README.md)")
        try:
            await self.play()
        finally:
            for proxy in self.proxies:
                await proxy.close()

    async def play(self) -> None:
        n = self.case.get("clients", 1)
        self.outcomes: List[list] = [[] for _ in range(n)]   # each client's Outcome events
        # `listen: "pool"`: the LISTEN connection goes where the pool does (README).
        listen = self.setup.dsn if self.case.get("listen") == "pool" else self.setup.listen_dsn
        # A client whose connection is refused (Client refuses in its constructor,
        # AsyncClient in open) answers every call of the scenario with that refusal.
        self.clients: List[Any] = []
        for i in range(n):
            dsn = self.setup.dsn
            if self.case.get("proxy"):   # the pool through a proxy, LISTEN directly
                self.proxies.append(await HoldingProxy(dsn).start())
                dsn = self.proxies[i].dsn()
            try:
                if self.flavor == "async":
                    c = AsyncClient(dsn, listen_conninfo=listen,
                                    on_outcome=self.outcomes[i].append)
                    await c.open()
                else:
                    c = await asyncio.to_thread(   # connects in its constructor: the
                        Client, dsn, listen_conninfo=listen,   # proxy needs the loop
                        on_outcome=self.outcomes[i].append)
            except ConfigurationError as refused:
                c = refused
            self.clients.append(c)
        self.admin = await psycopg.AsyncConnection.connect(self.setup.admin_dsn, autocommit=True)
        try:
            for number, step in enumerate(self.case["steps"]):
                try:
                    await self.step(step)
                except AssertionError as exc:
                    raise AssertionError(f"step {number} {json.dumps(step)[:200]}: {exc}") from None
        finally:
            for _started, task in self.running.values():
                task.cancel()
            await self.admin.close()
            for c in self.clients:
                if isinstance(c, Exception):
                    continue
                if self.flavor == "async":
                    await c.close()
                else:
                    await asyncio.to_thread(c.close)

    async def step(self, step: dict) -> None:
        expect = step.get("expect", {})
        if "sleep_ms" in step and len(step) == 1:
            await asyncio.sleep(step["sleep_ms"] / 1000)
        elif "sql" in step:
            await self.sql(step["sql"], expect)
        elif "until" in step and "sql" in step["until"]:
            # Waited for, up to 10 s: the SQL's rows, on the test's own connection.
            want, deadline = value(step["until"]["rows"]), time.monotonic() + 10
            rows = await self.rows(step["until"]["sql"])
            while rows != want and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
                rows = await self.rows(step["until"]["sql"])
            assert rows == want, f"rows {rows!r}, never {step['until']['rows']!r} within 10 s"
        elif "until" in step:
            # Waited for, up to 10 s: a counter reaching a count.
            name, n = step["until"]["counter"]
            deadline = time.monotonic() + 10
            while self.counters.get(name, 0) < n and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
            assert self.counters.get(name, 0) >= n, f"counter {name} never reached {n}"
        elif "kill_listener" in step:
            n = step["kill_listener"]
            self.killed[n] = await self.owner_pid(n)
            # Waiting (up to 5 s) until the backend has exited: a claim naming an owner
            # that is still exiting is made, and then ended by the reaper (ClaimLost),
            # where the case means a dead owner, refused with 22023 (R3).
            await self.admin.execute("SELECT pg_terminate_backend(%s, 5000)", (self.killed[n],))
        elif "new_listener" in expect:
            # The client listens again, on another backend: waited for, up to 10 s.
            n, deadline = expect["new_listener"], time.monotonic() + 10
            pid = await self.owner_pid(n)
            while pid == self.killed[n] and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
                pid = await self.owner_pid(n)
            assert pid and pid != self.killed[n], f"client {n} listens as {pid}, killed {self.killed[n]}"
        elif "cancel" in step:
            self.running[step["cancel"]][1].cancel()
        elif "stop" in step:
            self.workers[step["stop"]].stop()   # gracefully: its grace, then cancel (W3)
        elif "pause" in step:
            self.proxies[step["pause"]].pause()
        elif "resume" in step:
            self.proxies[step["resume"]].resume()
        elif "await" in step:
            started, task = self.running.pop(step["await"])
            if "within_ms" in step:
                # Bounded: a call that overstays fails here rather than hang the case (the
                # answer it waits for may come only at a later step, a proxy's resume).
                left = started + step["within_ms"] / 1000 - time.monotonic()
                await asyncio.wait({task}, timeout=max(0.0, left))
                if not task.done():
                    self.running[step["await"]] = started, task   # cancelled at the end
                    raise AssertionError(f"still running after {step['within_ms']} ms")
            try:
                outcome = await task
            except asyncio.CancelledError:   # a `cancel` step's: the error kind Cancelled
                outcome = None, asyncio.CancelledError(), None
            self.check(outcome, expect, step, started)
        elif "call" in step:
            started = time.monotonic()
            if step.get("background"):
                self.running[step["as"]] = (started, asyncio.create_task(self.call(step)))
                await asyncio.sleep(0.02)   # let it reach the server before the next step
            else:
                # In this task, at once: a step right after another (a call just after
                # kill_listener, R3) meets the client as the previous step left it.
                self.check(await self.call(step), expect, step, started)
        elif "outcomes" in expect:
            number, kinds = expect["outcomes"]
            got = sorted(o.kind for o in self.outcomes[number])
            assert got == sorted(kinds), f"client {number}'s outcomes {got} != {sorted(kinds)}"
            # `at_least_ms`: every call of that kind took at least that long.
            for kind, ms in expect.get("at_least_ms", {}).items():
                for o in self.outcomes[number]:
                    if o.kind == kind:
                        assert o.duration * 1000 >= ms, f"a {kind} call took {o.duration * 1000:.0f} ms"
        elif "counter" in expect:
            name, count = expect["counter"]
            assert self.counters.get(name, 0) == count, f"counter {name}: {self.counters.get(name, 0)} != {count}"
        else:
            raise AssertionError(f"a step this runner does not know: {step}")

    async def owner_pid(self, n: int) -> int:
        client = self.clients[n]
        if self.flavor == "async":
            return await client.owner_pid()
        return await asyncio.to_thread(client.owner_pid)

    async def sql(self, sql: str, expect: dict) -> None:
        rows = await self.rows(sql)
        if "rows" in expect:
            assert rows == value(expect["rows"]), f"rows {rows!r} != {expect['rows']!r}"

    async def rows(self, sql: str) -> Optional[List[list]]:
        """The last statement's rows of `sql` (several statements: one simple query),
        run on the test's own connection; None if it returns none."""
        cur = await self.admin.execute(self.sql_text(sql).encode())
        while cur.nextset():
            pass
        return [list(r) for r in await cur.fetchall()] if cur.description else None

    async def call(self, step: dict):
        """(value, None) or (None, exception) of one client call."""
        client = self.clients[step.get("client", 0)]
        if isinstance(client, Exception):
            return None, client, None
        options = dict(step.get("options", {}))
        fn = self.compute(step["compute"]) if "compute" in step else None
        what = step["call"]

        def do():
            if what == "ready":   # made ready by its constructor or open()
                if self.flavor == "async":
                    async def ready():
                        return True
                    return ready()
                return True
            if what == "get_or_compute":
                return client.get_or_compute(self.key(step["key"]), fn, **options)
            if what == "cached":
                wrapped = client.cached(name=self.key(step["name"]), **options)(fn)
                return wrapped(*value(step["args"]))
            if what in ("invalidate", "refresh"):
                if "name" not in step:
                    return getattr(client, what)(self.key(step["key"]), **options)
                wrapped = client.cached(name=self.key(step["name"]))(self.compute({}))
                return getattr(wrapped, what)(*value(step["args"]))
            if what == "work":
                return self.work(client, step)
            if what == "enqueue_many":
                jobs = {self.key(j["key"]): value(j.get("payload")) for j in step["jobs"]}
                answered = client.enqueue_many(jobs, **options)
                if self.flavor == "async":
                    async def outcomes():
                        return list((await answered).values())
                    return outcomes()
                return list(answered.values())
            raise AssertionError(f"a call this runner does not know: {what}")
        try:
            if self.flavor == "async":
                answer = await do(), None
            else:
                answer = await asyncio.to_thread(do), None
        except AssertionError:
            raise
        except Exception as exc:
            answer = None, exc
        kinds = [o.kind for o in self.outcomes[step.get("client", 0)]
                 if "key" in step and o.key == self.key(step["key"])]
        return answer + (kinds[-1] if kinds else None,)

    def work(self, client, step: dict):
        """A worker on the run's queue, with the step's `options`, whose handler sleeps the
        job's payload's `sleep_ms`, then returns the payload or raises its `raises`; it
        stops once it has run `max_jobs` handlers, or at a `stop` step naming it (`as`).
        Answers how many ran."""
        spec, handled, workers = step.get("handler", {}), [], []

        def count(name):
            self.counters[name] = self.counters.get(name, 0) + 1

        def started(job):
            if "counts" in spec:
                count(spec["counts"])
            handled.append(job.key)
            if len(handled) >= step.get("max_jobs", float("inf")):
                workers[0].stop()
            payload = job.payload if isinstance(job.payload, dict) else {}
            return payload.get("sleep_ms", 0) / 1000

        def result(job):
            if isinstance(job.payload, dict) and "raises" in job.payload:
                raise RuntimeError(job.payload["raises"])
            return job.payload

        if self.flavor == "async":
            async def handler(job):
                pause = started(job)
                try:
                    await asyncio.sleep(pause)
                except asyncio.CancelledError:
                    if "counts_stop" in spec:   # the worker's stop cancelled it (W3)
                        count(spec["counts_stop"])
                    raise
                return result(job)
        else:
            def handler(job):
                time.sleep(started(job))
                return result(job)
        options = {"idle_wait": 0.2, **step.get("options", {})}
        workers.append(client.worker(self.queue(step["queue"]), handler, signals=False, **options))
        if "as" in step:
            self.workers[step["as"]] = workers[0]
        if self.flavor == "async":
            async def run():
                await workers[0].run()
                return len(handled)
            return run()
        workers[0].run()
        return len(handled)

    def check(self, outcome, expect: dict, step: dict, started: float) -> None:
        got, error, kind = outcome
        if "outcome" in expect:
            assert kind == expect["outcome"], \
                f"outcome {kind!r}, not {expect['outcome']!r} (it answered {error or got!r})"
        elapsed_ms = (time.monotonic() - started) * 1000
        if "within_ms" in step:
            assert elapsed_ms <= step["within_ms"], f"took {elapsed_ms:.0f} ms, more than {step['within_ms']}"
        if "value" in expect:
            assert error is None, f"raised {error!r}"
            assert same(got, value(expect["value"])), f"{got!r} is not {expect['value']!r}"
        if "raised" in expect:
            assert isinstance(error, RuntimeError) and str(error) == expect["raised"], \
                f"expected the compute's own error {expect['raised']!r}, got {error!r}"
        if "error" in expect:
            assert isinstance(error, ERRORS[expect["error"]]), f"expected {expect['error']}, got {error!r} ({got!r})"
            if "message_names_option" in expect:   # this client's name of the option
                assert expect["message_names_option"] in str(error), f"{error} does not name {expect['message_names_option']}"
            if "message_contains" in expect:
                text = error.error if isinstance(error, OnceFailed) else str(error)
                assert expect["message_contains"] in (text or ""), f"{text!r} lacks {expect['message_contains']!r}"
            if "sqlstate" in expect:
                assert error.sqlstate == expect["sqlstate"], f"sqlstate {error.sqlstate}"
