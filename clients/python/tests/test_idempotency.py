"""The idempotency middlewares (docs/clients.md, rule I): the offline vectors of
clients/conformance/vectors/idempotency.json, then pg_once.asgi (a Starlette app through
httpx's ASGITransport) and pg_once.wsgi (a Flask app through httpx's WSGITransport) against
the server, each test run with both. The shared HTTP scenarios (clients/conformance/http)
run the example services under uvicorn and gunicorn."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
import time
import uuid

import psycopg
import pytest
from psycopg.types.json import Jsonb

from pg_once import _idempotency as I
from conformance import load, value
from conftest import DIRECT, need_server

httpx = pytest.importorskip("httpx", reason="pip install the [test] extra to test the middlewares")

VECTORS = load("vectors", "idempotency.json")
SECRET = VECTORS["secret"]   # what the tests' middlewares are keyed with (rule I2)


def vector_cases(section):
    return [pytest.param(case, id=case["name"]) for case in VECTORS[section]]


# -- offline vectors --------------------------------------------------------------------------

def secret_of(case):
    return None if case.get("secret") is None else case["secret"].encode()


@pytest.mark.parametrize("case", vector_cases("keys"))
def test_entry_key(case):
    if "authorization" in case:
        assert I.default_scope(case["authorization"]) == case["scope"]
    assert I.entry_key(case["namespace"], case["scope"], case["header"],
                       secret_of(case)) == case["key"]


@pytest.mark.parametrize("case", vector_cases("fingerprints"))
def test_default_fingerprint(case):
    got = I.default_fingerprint(case["method"], case["path"], case["query"], value(case["body"]))
    assert got.hex() == case["fingerprint"]
    assert I.keyed_fingerprint(SECRET.encode(), got).hex() == case["keyed"]
    # What the middleware claims and stores (I3): keyed with a secret, as is without one.
    keyed = I.Options.build(secret=SECRET)
    plain = I.Options.build(scope=lambda request: None)
    request = (case["method"], case["path"], case["query"], value(case["body"]))
    assert I.fingerprint_of(keyed, *request).hex() == case["keyed"]
    assert I.fingerprint_of(plain, *request).hex() == case["fingerprint"]


def test_a_custom_fingerprint_is_keyed_too():
    # I3: with a secret, nothing request-derived is stored unkeyed, the application's own
    # digest included; None stays none, and a bad one is refused before it is keyed.
    own = I.Options.build(secret=SECRET, fingerprint=lambda m, p, q, b: b"\x01")
    assert I.fingerprint_of(own, "POST", "/", "", b"") == \
        I.keyed_fingerprint(SECRET.encode(), b"\x01")
    none = I.Options.build(secret=SECRET, fingerprint=lambda m, p, q, b: None)
    assert I.fingerprint_of(none, "POST", "/", "", b"") is None
    bad = I.Options.build(secret=SECRET, fingerprint=lambda m, p, q, b: b"")
    with pytest.raises(ValueError):
        I.fingerprint_of(bad, "POST", "/", "", b"")


@pytest.mark.parametrize("case", vector_cases("headers"))
def test_header_value(case):
    options = I.Options.build(secret=SECRET)
    if "error" in case:
        with pytest.raises(I.Problem) as refused:
            I.request_key(options, [value(case["value"])])
        assert (refused.value.status, refused.value.code) == (400, case["error"])
    else:
        assert I.request_key(options, [value(case["value"])]) == value(case["key"])


def vector_options(case) -> I.Options:
    secret = secret_of(case)
    return I.Options.build(secret=secret, store_cookies=case["store_cookies"],
                           scope=None if secret else (lambda request: None))


@pytest.mark.parametrize("case", vector_cases("stored"))
def test_stored_form(case):
    fingerprint = case["fingerprint"] and bytes.fromhex(case["fingerprint"])
    body = value(case["body"]) if case["body"] is not None else None
    form = I.stored_form(case["status"], case["response_headers"], body,
                         case["store_cookies"], case["entry"], fingerprint, secret_of(case))
    assert form == case["stored"]
    if fingerprint is None and secret_of(case) is None:
        return   # nothing proves who wrote it: never replayed (the replays' vectors)
    replayed = I.replay(vector_options(case), case["entry"], fingerprint, json.dumps(form))
    assert replayed.body == (body or b"")
    assert ("idempotent-replayed", "true") in replayed.headers
    names = [n for n, _ in replayed.headers]
    assert names.count("content-length") == 1 and "set-cookie" not in names or case["store_cookies"]


@pytest.mark.parametrize("case", vector_cases("replays"))
def test_replays_serve_only_what_the_middleware_wrote(case):
    # I6: a planted entry (anyone with pg_once's rights in the key space can write one) is
    # refused, 409 untrusted_entry; what the middleware stored is replayed.
    fingerprint = case["fingerprint"] and bytes.fromhex(case["fingerprint"])
    options = vector_options(case)
    if case["verdict"] == "replayed":
        reply = I.replay(options, case["entry"], fingerprint, json.dumps(case["stored"]))
        assert reply.status == case["stored"]["status"]
    else:
        with pytest.raises(I.Untrusted) as refused:
            I.replay(options, case["entry"], fingerprint, json.dumps(case["stored"]))
        reply = refused.value.reply()
        assert (reply.status, json.loads(reply.body)["code"]) == (409, "untrusted_entry")


@pytest.mark.parametrize("case", [pytest.param(c, id=c["name"]) for c in VECTORS["options"]])
def test_secret_options(case):
    # I2, I9: the default scope comes from a credential, so it needs the secret.
    from pg_once import ConfigurationError
    options = dict(case["options"])
    if "scope" in options:
        options["scope"] = lambda request, principal=options["scope"]: principal
    if case.get("error"):
        with pytest.raises(ConfigurationError):
            I.Options.build(**options)
    else:
        I.Options.build(**options)


def test_header_missing_passes_or_is_required():
    assert I.request_key(I.Options.build(secret=SECRET), []) is None
    with pytest.raises(I.Problem) as refused:
        I.request_key(I.Options.build(required=True, secret=SECRET), [])
    assert refused.value.code == "key_missing"
    with pytest.raises(I.Problem, match="more than once"):
        I.request_key(I.Options.build(secret=SECRET), ["a", "b"])


def test_problem_body():
    reply = I.mismatch(I.Options.build(secret=SECRET)).reply()
    assert reply.status == 422 and ("content-type", "application/problem+json") in reply.headers
    body = json.loads(reply.body)
    assert body["type"] == "about:blank" and body["title"] == "Unprocessable Content"
    assert body["status"] == 422 and body["code"] == "fingerprint_mismatch" and body["detail"]


@pytest.mark.parametrize("options, error", [
    ({"in_flight": "maybe"}, ValueError), ({"methods": []}, ValueError),
    ({"methods": "POST"}, TypeError), ({"ttl": -1}, ValueError), ({"lease": 0}, ValueError),
    ({"wait": "10"}, TypeError), ({"max_body": 0}, ValueError),
    ({"max_request_body": 1.5}, ValueError), ({"max_body": 13 << 20}, ValueError),
    ({"header": "Idempotency Key"}, ValueError), ({"required": "yes"}, TypeError),
    ({"scope": "tenant"}, TypeError), ({"store": 500}, TypeError),
])
def test_options_refused_when_built(options, error):
    from pg_once.asgi import IdempotencyMiddleware as Asgi
    from pg_once.wsgi import IdempotencyMiddleware as Wsgi
    for middleware in (Asgi, Wsgi):
        with pytest.raises(error):
            middleware(lambda *a: None, conninfo="dbname=none", **{"secret": SECRET, **options})


def test_a_client_and_a_conninfo_are_refused():
    from pg_once import ConfigurationError
    from pg_once.asgi import IdempotencyMiddleware
    with pytest.raises(ConfigurationError, match="not both"):
        IdempotencyMiddleware(lambda *a: None, conninfo="dbname=x", client=object(),
                              secret=SECRET)


def test_the_default_scope_without_a_secret_is_refused_when_built():
    # I2: the default scope is the caller's credential; unkeyed, its digest goes out on
    # channel once to any role that may LISTEN, and a dictionary cracks it.
    from pg_once import ConfigurationError
    from pg_once.asgi import IdempotencyMiddleware as Asgi
    from pg_once.wsgi import IdempotencyMiddleware as Wsgi
    for middleware in (Asgi, Wsgi):
        with pytest.raises(ConfigurationError, match="secret is required"):
            middleware(lambda *a: None, conninfo="dbname=none")
        middleware(lambda *a: None, conninfo="dbname=none", scope=lambda request: "user:7")


def test_the_library_imports_no_framework():
    import subprocess
    import sys
    code = ("import sys, pg_once.asgi, pg_once.wsgi; "
            "print([m for m in ('starlette', 'flask', 'werkzeug', 'django') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# -- two services, one handler ------------------------------------------------------------------
#
# The handler takes a JSON body: {"sleep": s, "status": 201, "raise": false, "chunks": 0,
# "size": 0, "broken": false (the stream raises after its first chunk), "complete": false (store the response itself, rule I8), "steal": false (take
# the claim away before that), "raise_after_complete": false, "sku": ...}, records each run in `runs`, and answers its run
# number and the body it read.

STEAL = "SELECT once.release_key(key, token) FROM once.entries WHERE key = %s"
ORDERS = "SELECT count(*) FROM idem_demo.orders WHERE idempotency_key = %s"


class HandledRollback(Exception):
    """A handler's own reason to roll its transaction back and answer anyway."""


def plan(body: bytes) -> dict:
    return json.loads(body or b"{}")


def answer_of(runs: list, body: bytes) -> tuple:
    return ({"set-cookie": "s=1", "x-run": str(len(runs)), "content-type": "application/json"},
            json.dumps({"run": len(runs), "echo": body.decode()}).encode())


class AsgiService:
    """A Starlette app behind pg_once.asgi, called through httpx on an event loop of its own."""

    flavour = "asgi"

    def __init__(self, **options):
        from starlette.responses import Response, StreamingResponse
        from starlette.routing import Route, Router

        from pg_once.asgi import IdempotencyMiddleware

        self.runs: list = []

        async def orders(request):
            body = await request.body()
            spec = plan(body)
            self.runs.append(request.headers.get("idempotency-key"))
            await asyncio.sleep(spec.get("sleep", 0))
            if spec.get("raise"):
                raise RuntimeError("asked to raise")
            if spec.get("chunks"):
                async def chunks():
                    for i in range(spec["chunks"]):
                        if spec.get("broken") and i == 1:
                            raise RuntimeError("the stream broke")
                        yield bytes([65 + i]) * spec["size"]
                        await asyncio.sleep(0.01)
                return StreamingResponse(chunks(), status_code=201, media_type="text/plain")
            headers, payload = answer_of(self.runs, body)
            status = spec.get("status", 201)
            if spec.get("complete"):
                claim = request.scope["pg_once.claim"]
                async with await psycopg.AsyncConnection.connect(DIRECT) as conn:
                    try:
                        await complete_async(conn, claim, spec, status, headers, payload)
                    except HandledRollback:
                        return Response(b"rolled back", status_code=200)
            return Response(payload, status_code=status, headers=headers)

        async def complete_async(conn, claim, spec, status, headers, payload):
            async with conn.transaction():
                await conn.execute("INSERT INTO idem_demo.orders (idempotency_key, sku)"
                                   " VALUES (%s, %s)", (claim.key, Jsonb(spec.get("sku"))))
                if spec.get("steal"):
                    with psycopg.connect(DIRECT, autocommit=True) as admin:
                        admin.execute(STEAL, (claim.key,))
                await claim.complete(conn, status, headers, payload)
                if spec.get("raise_after_complete"):
                    raise RuntimeError("asked to raise after completing")
                if spec.get("roll_back_after_complete"):
                    raise HandledRollback()

        # Where Starlette puts it (add_middleware, or Mount(..., middleware=)): around the
        # routes, inside the application's ServerErrorMiddleware.
        app = Router(routes=[Route("/orders", orders, methods=["GET", "POST", "PATCH"])])
        self.middleware = IdempotencyMiddleware(
            app, **{"conninfo": DIRECT, "secret": SECRET, **options})
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.http = httpx.AsyncClient(transport=httpx.ASGITransport(self.middleware),
                                      base_url="http://service")

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(60)

    def post(self, path="/orders", **kw) -> httpx.Response:
        return self._run(self.http.request(kw.pop("method", "POST"), path, **kw))

    def burst(self, n, path="/orders", **kw) -> list:
        async def all_of():
            return await asyncio.gather(*(self.http.post(path, **kw) for _ in range(n)))
        return self._run(all_of())

    def close(self):
        try:
            self._run(self.http.aclose())
            self._run(self.middleware.close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)


class WsgiService:
    """A Flask app behind pg_once.wsgi, called through httpx, concurrently from threads."""

    flavour = "wsgi"

    def __init__(self, **options):
        from flask import Flask, Response, request

        from pg_once.wsgi import IdempotencyMiddleware

        self.runs: list = []
        app = Flask("wsgi-service")
        app.config["PROPAGATE_EXCEPTIONS"] = options.pop("propagate", True)
        lock = threading.Lock()

        @app.route("/orders", methods=["GET", "POST", "PATCH"])
        def orders():
            body = request.get_data()
            spec = plan(body)
            with lock:
                self.runs.append(request.headers.get("idempotency-key"))
            time.sleep(spec.get("sleep", 0))
            if spec.get("raise"):
                raise RuntimeError("asked to raise")
            if spec.get("chunks"):
                def chunks():
                    for i in range(spec["chunks"]):
                        if spec.get("broken") and i == 1:
                            raise RuntimeError("the stream broke")
                        yield bytes([65 + i]) * spec["size"]
                        time.sleep(0.01)
                return Response(chunks(), status=201, content_type="text/plain")
            headers, payload = answer_of(self.runs, body)
            status = spec.get("status", 201)
            if spec.get("complete"):
                claim = request.environ["pg_once.claim"]
                try:
                    with psycopg.connect(DIRECT) as conn:
                        with conn.transaction():
                            conn.execute("INSERT INTO idem_demo.orders (idempotency_key, sku)"
                                         " VALUES (%s, %s)", (claim.key, Jsonb(spec.get("sku"))))
                            if spec.get("steal"):
                                with psycopg.connect(DIRECT, autocommit=True) as admin:
                                    admin.execute(STEAL, (claim.key,))
                            claim.complete(conn, status, headers, payload)
                            if spec.get("raise_after_complete"):
                                raise RuntimeError("asked to raise after completing")
                            if spec.get("roll_back_after_complete"):
                                raise HandledRollback()
                except HandledRollback:
                    return Response(b"rolled back", status=200)
            return Response(payload, status=status, headers=headers)

        self.middleware = IdempotencyMiddleware(
            app.wsgi_app, **{"conninfo": DIRECT, "secret": SECRET, **options})
        self.http = httpx.Client(transport=httpx.WSGITransport(self.middleware),
                                 base_url="http://service")

    def post(self, path="/orders", **kw) -> httpx.Response:
        return self.http.request(kw.pop("method", "POST"), path, **kw)

    def burst(self, n, path="/orders", **kw) -> list:
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            return list(pool.map(lambda _: self.http.post(path, **kw), range(n)))

    def close(self):
        self.http.close()
        self.middleware.close()


@pytest.fixture(scope="session")
def demo_tables(extension):
    """The orders table of clients/conformance/http/README.md, which the handler writes."""
    with psycopg.connect(DIRECT, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA IF NOT EXISTS idem_demo")
        conn.execute("CREATE TABLE IF NOT EXISTS idem_demo.orders (id bigserial PRIMARY KEY,"
                     " idempotency_key text, sku jsonb, pid int,"
                     " at timestamptz NOT NULL DEFAULT clock_timestamp())")


@pytest.fixture(params=["asgi", "wsgi"])
def service(request, demo_tables):
    """service(**middleware options): a service of the test's flavour, closed after it."""
    pytest.importorskip("starlette" if request.param == "asgi" else "flask")
    made = []

    def make(**options):
        made.append((AsgiService if request.param == "asgi" else WsgiService)(**options))
        return made[-1]
    yield make
    for s in made:
        s.close()


@pytest.fixture
def new_key():
    return lambda: str(uuid.uuid4())


def problem(response, status, code):
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    body = response.json()
    assert (body["status"], body["code"], body["type"]) == (status, code, "about:blank")
    return body


# -- behaviour against the server ----------------------------------------------------------------

def test_claimed_stored_replayed(service, new_key):
    s = service()
    key, body = new_key(), {"sku": 1}
    first = s.post(headers={"Idempotency-Key": key}, json=body)
    again = s.post(headers={"Idempotency-Key": key}, json=body)
    assert first.status_code == 201 and again.status_code == 201
    assert first.json()["run"] == 1 and json.loads(first.json()["echo"]) == body
    assert again.content == first.content
    assert "idempotent-replayed" not in first.headers
    assert again.headers["idempotent-replayed"] == "true"
    assert first.headers["set-cookie"] == "s=1" and "set-cookie" not in again.headers
    assert again.headers["x-run"] == "1" and again.headers["content-type"] == "application/json"
    assert s.runs == [key]


def test_a_quoted_key_is_the_same_key(service, new_key):
    s = service()
    key = new_key()
    s.post(headers={"Idempotency-Key": key}, json={})
    assert s.post(headers={"Idempotency-Key": f'"{key}"'}, json={}).headers["idempotent-replayed"]
    assert len(s.runs) == 1


def test_concurrent_duplicates_conflict(service, new_key):
    s = service()
    responses = s.burst(8, headers={"Idempotency-Key": new_key()}, json={"sleep": 0.5})
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [201] + [409] * 7
    for r in responses:
        if r.status_code == 409:
            problem(r, 409, "in_flight")
            assert r.headers["retry-after"] == "1"
    assert len(s.runs) == 1


def test_concurrent_duplicates_wait(service, new_key):
    s = service(in_flight="wait", wait=10)
    responses = s.burst(8, headers={"Idempotency-Key": new_key()}, json={"sleep": 0.5})
    assert [r.status_code for r in responses] == [201] * 8
    assert len({r.content for r in responses}) == 1
    assert sum(r.headers.get("idempotent-replayed") == "true" for r in responses) == 7
    assert len(s.runs) == 1


def test_wait_runs_out(service, new_key):
    s = service(in_flight="wait", wait=0.3)
    responses = s.burst(2, headers={"Idempotency-Key": new_key()}, json={"sleep": 1.5})
    assert sorted(r.status_code for r in responses) == [201, 409]


def test_another_request_under_the_key_is_a_mismatch(service, new_key):
    s = service()
    key = new_key()
    assert s.post(headers={"Idempotency-Key": key}, json={"sku": 1}).status_code == 201
    problem(s.post(headers={"Idempotency-Key": key}, json={"sku": 2}), 422, "fingerprint_mismatch")
    problem(s.post(headers={"Idempotency-Key": key}, json={"sku": 1}, params={"a": "1"}), 422,
            "fingerprint_mismatch")
    problem(s.post(headers={"Idempotency-Key": key}, json={"sku": 1}, method="PATCH"), 422,
            "fingerprint_mismatch")
    assert len(s.runs) == 1


def test_missing_and_invalid_keys(service, new_key):
    s = service()
    assert s.post(json={}).status_code == 201 and s.post(json={}).status_code == 201
    problem(s.post(headers={"Idempotency-Key": "a b"}, json={}), 400, "key_invalid")
    problem(s.post(headers={"Idempotency-Key": "k" * 256}, json={}), 400, "key_invalid")
    assert s.post(headers={"Idempotency-Key": new_key()}, method="GET").status_code == 201
    assert len(s.runs) == 3   # two without a key, the GET
    strict = service(required=True)
    problem(strict.post(json={}), 400, "key_missing")
    assert strict.runs == []


def test_scopes_keep_callers_apart(service, new_key):
    s = service()
    key = new_key()
    for token in ("Bearer a", "Bearer b", "Bearer a"):
        assert s.post(headers={"Idempotency-Key": key, "Authorization": token},
                      json={}).status_code == 201
    assert len(s.runs) == 2
    mine = service(scope=lambda request: "tenant-1")
    other = new_key()
    mine.post(headers={"Idempotency-Key": other, "Authorization": "a"}, json={})
    assert mine.post(headers={"Idempotency-Key": other, "Authorization": "b"},
                     json={}).headers["idempotent-replayed"] == "true"


def test_5xx_and_exceptions_release(service, new_key):
    s = service()
    key = new_key()
    assert s.post(headers={"Idempotency-Key": key}, json={"status": 503}).status_code == 503
    assert s.post(headers={"Idempotency-Key": key}, json={"status": 503}).status_code == 503
    assert len(s.runs) == 2
    key = new_key()
    problem(s.post(headers={"Idempotency-Key": key}, json={"raise": True}), 500, "handler_failed")
    problem(s.post(headers={"Idempotency-Key": key}, json={"raise": True}), 500, "handler_failed")
    assert len(s.runs) == 4
    keep = service(store=lambda status: True)
    key = new_key()
    keep.post(headers={"Idempotency-Key": key}, json={"status": 503})
    assert keep.post(headers={"Idempotency-Key": key}, json={"status": 503}).headers[
        "idempotent-replayed"] == "true"


def test_complete_in_the_handlers_transaction(service, new_key, admin):
    s = service()
    key = new_key()
    first = s.post(headers={"Idempotency-Key": key}, json={"complete": True, "sku": 7})
    assert first.status_code == 201
    entry = I.entry_key("", None, key, SECRET.encode())
    assert admin.execute(ORDERS, (entry,)).fetchone()[0] == 1
    again = s.post(headers={"Idempotency-Key": key}, json={"complete": True, "sku": 7})
    assert again.headers["idempotent-replayed"] == "true" and again.content == first.content
    # Stored by the handler, on its own connection: the middleware did not store it again.
    assert s.middleware._gate._client.calls["complete_key"] == 0
    assert len(s.runs) == 1


def test_a_completion_rolled_back_with_the_handler_is_released(service, new_key, admin):
    s = service()
    key = new_key()
    problem(s.post(headers={"Idempotency-Key": key},
                   json={"complete": True, "raise_after_complete": True}), 500, "handler_failed")
    assert admin.execute(ORDERS, (I.entry_key("", None, key, SECRET.encode()),)).fetchone()[0] == 0
    retry = s.post(headers={"Idempotency-Key": key}, json={"complete": True})   # at once, not 409
    assert retry.status_code == 201 and retry.json()["run"] == 2
    assert admin.execute(ORDERS, (I.entry_key("", None, key, SECRET.encode()),)).fetchone()[0] == 1


def test_a_completion_rolled_back_by_a_handler_that_answers_is_released(service, new_key, admin):
    # The handler completes in its transaction, then rolls it back for a reason of its own
    # and answers: nothing was stored, so the claim must go back (as Node does), not stay
    # held without heartbeats until its lease runs out while retries get 409.
    s = service()
    key = new_key()
    first = s.post(headers={"Idempotency-Key": key},
                   json={"complete": True, "roll_back_after_complete": True})
    assert first.status_code == 200 and first.content == b"rolled back"
    retry = s.post(headers={"Idempotency-Key": key},
                   json={"complete": True, "roll_back_after_complete": True})
    assert retry.status_code == 200 and len(s.runs) == 2, \
        f"the retry of a rolled-back completion: {retry.status_code} {retry.text}"


def test_a_lost_claim_rolls_the_handler_back(service, new_key, admin):
    s = service()
    key = new_key()
    problem(s.post(headers={"Idempotency-Key": key}, json={"complete": True, "steal": True}),
            409, "in_flight")
    assert admin.execute(ORDERS, (I.entry_key("", None, key, SECRET.encode()),)).fetchone()[0] == 0


def test_a_lost_claim_made_into_an_error_page_is_a_conflict(new_key, admin, demo_tables):
    """Flask's own 500 page for the ClaimLost (without PROPAGATE_EXCEPTIONS) is replaced."""
    pytest.importorskip("flask")
    need_server()
    s = WsgiService(propagate=False)
    try:
        key = new_key()
        problem(s.post(headers={"Idempotency-Key": key}, json={"complete": True, "steal": True}),
                409, "in_flight")
        assert admin.execute(ORDERS, (I.entry_key("", None, key, SECRET.encode()),)).fetchone()[0] == 0
        assert s.post(headers={"Idempotency-Key": key}, json={"raise": True}).status_code == 500
        assert s.post(headers={"Idempotency-Key": key}, json={}).status_code == 201   # released
    finally:
        s.close()


def test_streaming_responses_are_collected(service, new_key):
    s = service()
    key, body = new_key(), {"chunks": 5, "size": 1000}
    first = s.post(headers={"Idempotency-Key": key}, json=body)
    again = s.post(headers={"Idempotency-Key": key}, json=body)
    assert first.content == b"".join(bytes([65 + i]) * 1000 for i in range(5))
    assert again.content == first.content and again.headers["idempotent-replayed"] == "true"
    assert len(s.runs) == 1


def test_a_stream_broken_after_its_head_is_stored_without_its_body(service, new_key):
    # I5: the head went out, so the handler ran (and may have committed): the claim is kept,
    # and the retry is replayed its status and headers, not run again.
    s = service()
    key, body = new_key(), {"chunks": 3, "size": 1000, "broken": True}
    with pytest.raises(Exception):
        s.post(headers={"Idempotency-Key": key}, json=body).read()
    again = s.post(headers={"Idempotency-Key": key}, json=body)
    assert (again.status_code, again.content, again.headers.get("idempotent-replayed")) == \
        (201, b"", "true"), f"the retry of a broken stream: {again.status_code} {again.text}"
    assert again.headers["content-type"].startswith("text/plain")
    assert len(s.runs) == 1


def test_a_body_over_max_body_is_stored_without_it(service, new_key):
    s = service(max_body=3000)
    key, body = new_key(), {"chunks": 4, "size": 1000}
    first = s.post(headers={"Idempotency-Key": key}, json=body)
    assert len(first.content) == 4000
    again = s.post(headers={"Idempotency-Key": key}, json=body)
    assert (again.status_code, again.content) == (201, b"")
    assert again.headers["content-type"].startswith("text/plain")
    assert len(s.runs) == 1


def test_request_body_read_once_bounded(service, new_key):
    s = service(max_request_body=100)
    problem(s.post(headers={"Idempotency-Key": new_key()}, content=b"{}" + b" " * 200), 413,
            "body_too_large")
    assert s.runs == []
    key, raw = new_key(), b'{"sku": "abc"}   '
    assert json.loads(s.post(headers={"Idempotency-Key": key}, content=raw).json()["echo"]) == {
        "sku": "abc"}
    assert s.post(headers={"Idempotency-Key": key}, content=raw).headers["idempotent-replayed"]


def test_unreachable_store_runs_nothing(service, new_key):
    s = service(conninfo="host=127.0.0.1 port=1 dbname=none connect_timeout=1")
    r = s.post(headers={"Idempotency-Key": new_key()}, json={})
    problem(r, 503, "unavailable")
    assert r.headers["retry-after"] == "1" and s.runs == []
    assert s.post(json={}).status_code == 201   # without a key: passes through


def test_starlette_add_middleware_owns_its_client(new_key, extension):
    """app.add_middleware(IdempotencyMiddleware, conninfo=...): opened at lifespan startup,
    closed at shutdown."""
    pytest.importorskip("starlette")
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    from pg_once.asgi import IdempotencyMiddleware

    async def hello(request):
        return PlainTextResponse("hello", status_code=201)
    app = Starlette(routes=[Route("/", hello, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, conninfo=DIRECT, secret=SECRET)

    async def serve():
        inbox, outbox = asyncio.Queue(), asyncio.Queue()
        lifespan = asyncio.create_task(app({"type": "lifespan", "asgi": {"version": "3.0"}},
                                           inbox.get, outbox.put))
        await inbox.put({"type": "lifespan.startup"})
        assert (await outbox.get())["type"] == "lifespan.startup.complete"
        middleware = app.middleware_stack.app
        assert isinstance(middleware, IdempotencyMiddleware)
        assert middleware._gate._client is not None   # opened at startup
        key = new_key()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app),
                                     base_url="http://service") as http:
            assert (await http.post("/", headers={"Idempotency-Key": key})).status_code == 201
            again = await http.post("/", headers={"Idempotency-Key": key})
            assert again.headers["idempotent-replayed"] == "true"
        await inbox.put({"type": "lifespan.shutdown"})
        assert (await outbox.get())["type"] == "lifespan.shutdown.complete"
        await lifespan
        assert middleware._gate._client is None       # closed at shutdown
    asyncio.run(serve())


def test_the_response_is_stored_before_its_end_reaches_the_caller(new_key, admin):
    """A retry sent the moment the caller has the whole response must be replayed, not
    told it still runs: the entry is done when the last bytes are handed to the server."""
    need_server()
    from pg_once.asgi import IdempotencyMiddleware as Asgi
    from pg_once.wsgi import IdempotencyMiddleware as Wsgi
    key = new_key()
    entry_state = lambda k: admin.execute(
        "SELECT state::text FROM once.entries WHERE key = %s",
        (I.entry_key("", None, k, SECRET.encode()),)).fetchone()[0]

    async def asgi_app(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 201, "headers": []})
        for part in (b"a", b"b"):
            await send({"type": "http.response.body", "body": part, "more_body": part == b"a"})

    async def asgi_request():
        middleware = Asgi(asgi_app, conninfo=DIRECT, secret=SECRET)
        states = []

        async def receive():
            return {"type": "http.request", "body": b"{}", "more_body": False}

        async def send(message):
            if message["type"] == "http.response.body":
                states.append(entry_state(key))
        scope = {"type": "http", "method": "POST", "path": "/", "raw_path": b"/",
                 "query_string": b"", "headers": [(b"idempotency-key", key.encode())]}
        try:
            await middleware(scope, receive, send)
        finally:
            await middleware.close()
        return states
    assert asyncio.run(asgi_request()) == ["running", "done"]

    def wsgi_app(environ, start_response):
        start_response("201 Created", [("Content-Length", "2")])
        return [b"a", b"b"]
    key = new_key()
    middleware = Wsgi(wsgi_app, conninfo=DIRECT, secret=SECRET)
    try:
        environ = {"REQUEST_METHOD": "POST", "PATH_INFO": "/", "QUERY_STRING": "",
                   "HTTP_IDEMPOTENCY_KEY": key, "CONTENT_LENGTH": "0", "wsgi.input": None}
        states = [entry_state(key) for _ in middleware(environ, lambda *a: None)]
    finally:
        middleware.close()
    assert states == ["running", "done"]


def test_a_key_failed_elsewhere_is_a_conflict_until_retry_at(service, new_key, admin):
    s = service()
    key = new_key()
    entry = I.entry_key("", None, key, SECRET.encode())
    admin.execute("SELECT once.fail_key(%s, token, 'failed elsewhere', retry_after => '30 s')"
                  " FROM once.claim_key(%s)", (entry, entry))
    r = s.post(headers={"Idempotency-Key": key}, json={})
    problem(r, 409, "in_flight")
    assert 29 <= int(r.headers["retry-after"]) <= 30
    assert s.runs == []


@pytest.mark.parametrize("planted", [
    {"status": 200, "headers": [["set-cookie", "session=attacker"]], "body": ""},
    {"status": 200, "headers": [["content-length", "2"]],
     "body": "b2tIVFRQLzEuMSAyOTkgU211Z2dsZWQNCg0K"},
], ids=["set-cookie", "content-length"])
def test_an_entry_planted_by_another_role_is_not_replayed(service, new_key, admin, planted):
    # I6: any role with pg_once's rights in the key space can claim and complete the
    # entry itself (no fingerprint: it matches every request); it is refused, never run.
    s = service()
    key = new_key()
    entry = I.entry_key("", None, key, SECRET.encode())
    admin.execute("SELECT once.complete_key(%s, token, %s::jsonb) FROM once.claim_key(%s)",
                  (entry, json.dumps(planted), entry))
    r = s.post(headers={"Idempotency-Key": key}, json={})
    problem(r, 409, "untrusted_entry")
    assert "set-cookie" not in r.headers and "idempotent-replayed" not in r.headers
    assert s.runs == []


def test_a_stored_entry_nested_deeper_than_json_loads_reads_is_untrusted():
    # Finding 5 of the attack-http review: jsonb takes thousands of nesting levels; a
    # planted entry that deep made json.loads raise RecursionError (a 500), not a 409.
    options = I.Options.build(secret=b"s" * 32)
    planted = '{"status": 201, "headers": ' + "[" * 5000 + "]" * 5000 + \
        ', "body": null, "fingerprint": null, "mac": "' + "0" * 64 + '"}'
    with pytest.raises(I.Untrusted):
        I.replay(options, "idempotency:#hmac-sha256:00", None, planted)
