"""The middlewares attacked from the database (issue 36, items 5 and 6; docs/security.md,
"The HTTP edge"). The attacker is a role with pg_once's grants in the services' key space:
it LISTENs on channel `once` (any role with CONNECT may), and it plants entries with
claim_key + complete_key, as the middlewares themselves write them or not. Same driver as
test_http.py; each scenario runs against every example service."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import socket
import time
from urllib.parse import urlsplit

import h11
import psycopg
import pytest

from support import fresh_key
from test_http import assert_problem

pytestmark = pytest.mark.anyio

NOTIFIED_WITHIN_S = 10   # a completion's notification, relayed by the worker when preloaded
# A five-word dictionary and the password it holds: what the attacker tried.
DICTIONARY = ["password", "123456", "letmein", "sunshine", "qwerty"]


class Attacker:
    """A session of a role with pg_once's grants: it listens on channel `once`, reads what
    it may, and writes entries of the services' key space."""

    def __init__(self, conninfo: str):
        self.conn = psycopg.connect(conninfo, autocommit=True)
        self.conn.execute("LISTEN once")

    def close(self):
        self.conn.close()

    def announced(self, sku: str) -> str:
        """The entry key the `once` channel announced for the completed request whose
        order has `sku` (the first announcement whose stored body names it)."""
        deadline = time.monotonic() + NOTIFIED_WITHIN_S
        seen = []
        while time.monotonic() < deadline:
            # Listed first: the generator holds the connection until it ends.
            for payload in [n.payload for n in self.conn.notifies(timeout=0.2, stop_after=1)]:
                seen.append(payload)
                result = self.conn.execute("SELECT once.get(%s)", (payload,)).fetchone()[0]
                body = (result or {}).get("body") if isinstance(result, dict) else None
                if body and sku.encode() in base64.b64decode(body):
                    return payload
        raise AssertionError(f"no announcement on channel once for the order {sku} within "
                             f"{NOTIFIED_WITHIN_S} s (heard: {seen})")

    def stored(self, entry: str) -> dict:
        return self.conn.execute("SELECT once.get(%s)", (entry,)).fetchone()[0]

    def plant(self, entry: str, result: dict | str, fingerprint: bytes | None = None):
        """Replace entry's stored response with `result` (or the JSON text `result`): forget
        it, claim it (without a fingerprint unless given: it then matches every request)
        and complete it."""
        self.conn.execute("SELECT once.invalidate_key(%s)", (entry,))
        outcome, token = self.conn.execute(
            "SELECT outcome, token FROM once.claim_key(%s, fingerprint => %s)",
            (entry, fingerprint)).fetchone()
        assert outcome == "claimed", f"the attacker could not claim {entry}: {outcome}"
        done = self.conn.execute("SELECT once.complete_key(%s, %s, %s::jsonb, '1 hour')",
                                 (entry, token, result if isinstance(result, str) else json.dumps(result))).fetchone()[0]
        assert done, f"the attacker could not complete {entry}"


# The attacker's role: README's "Granting access", nothing more (not a superuser, no
# membership, no read on once.entries).
ATTACKER_ROLE = "once_http_attacker"
ATTACKER_PASSWORD = "attacker"


def granted_role(db):
    """ATTACKER_ROLE, made (again) with the README's grants only; its conninfo."""
    conn = db.conn
    if not conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (ATTACKER_ROLE,)).fetchone():
        conn.execute(f"CREATE ROLE {ATTACKER_ROLE} LOGIN PASSWORD '{ATTACKER_PASSWORD}'")
    conn.execute(f"GRANT USAGE ON SCHEMA once TO {ATTACKER_ROLE}")
    conn.execute(f"GRANT EXECUTE ON ALL ROUTINES IN SCHEMA once TO {ATTACKER_ROLE}")
    conn.execute(f"GRANT SELECT ON once.stats, once.queue_stats, once.dead_letters TO {ATTACKER_ROLE}")
    return psycopg.conninfo.make_conninfo(os.environ["PG_ONCE_DSN"], user=ATTACKER_ROLE,
                                          password=ATTACKER_PASSWORD)


@pytest.fixture
def attacker(db):
    a = Attacker(granted_role(db))
    super_, reads = a.conn.execute(
        "SELECT rolsuper, has_table_privilege(current_user, 'once.entries', 'SELECT') "
        "FROM pg_roles WHERE rolname = current_user").fetchone()
    assert not super_ and not reads, "the attacker must hold the README's grants only"
    yield a
    a.close()


async def first_order(api, attacker, headers=None) -> tuple[str, str, dict, str]:
    """A victim's request answered 201: (its key, the entry key announced, its body, sku)."""
    key, sku = fresh_key(), f"victim-{fresh_key()[:8]}"
    body = {"sku": sku}
    first = await api.post("/orders", body, key, headers=headers)
    assert first.status_code == 201, first.text
    return key, attacker.announced(sku), body, sku


def form(status: int, headers: list, body: bytes) -> dict:
    """A stored response as the issue's attacker wrote it (rule I5's form, before 0.4)."""
    return {"status": status, "headers": headers, "body": base64.b64encode(body).decode()}


def exchange(url: str, requests: list[tuple[str, str, list, bytes]]) -> list:
    """The requests sent one after the other on ONE keep-alive connection, each answer read
    with h11 as a client would: [(status, headers, body)], or the h11 error that ended it."""
    host, port = urlsplit(url).hostname, urlsplit(url).port
    answers = []
    with socket.create_connection((host, port), timeout=30) as sock:
        conn = h11.Connection(h11.CLIENT)
        for method, path, headers, body in requests:
            if conn.our_state is h11.DONE:
                conn.start_next_cycle()
            head = [("host", f"{host}:{port}"), ("content-length", str(len(body))), *headers]
            sock.sendall(conn.send(h11.Request(method=method, target=path, headers=head)))
            sock.sendall(conn.send(h11.Data(data=body)) if body else b"")
            sock.sendall(conn.send(h11.EndOfMessage()))
            status, got, chunks = None, None, []
            try:
                while True:
                    event = conn.next_event()
                    if event is h11.NEED_DATA:
                        conn.receive_data(sock.recv(65536))
                    elif isinstance(event, h11.Response):
                        status = event.status_code
                        got = [(n.decode(), v.decode("latin-1")) for n, v in event.headers]
                    elif isinstance(event, h11.Data):
                        chunks.append(bytes(event.data))
                    elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                        break
            except h11.RemoteProtocolError as e:
                answers.append(e)
                return answers
            answers.append((status, got, b"".join(chunks)))
            if conn.their_state is not h11.DONE:
                return answers
    return answers


def assert_untrusted(answer, what: str):
    """The replay of an entry the middleware did not write: 409 untrusted_entry (I6)."""
    assert not isinstance(answer, Exception), f"{what}: the replay broke HTTP: {answer!r}"
    status, headers, body = answer
    names = [n.lower() for n, _ in headers]
    assert "set-cookie" not in names, f"{what}: replayed a planted set-cookie: {headers}"
    assert names.count("content-length") <= 1, f"{what}: two content-lengths: {headers}"
    assert status == 409, f"{what}: want 409 untrusted_entry, got {status} {headers} {body[:300]!r}"
    problem = json.loads(body)
    assert problem.get("code") == "untrusted_entry", f"{what}: {problem}"


# -- item 5: the credential is not announced ---------------------------------------------------

async def test_a_listener_cannot_crack_the_callers_credentials(api, attacker):
    # A Basic credential's digest in the announced key falls to a five-word dictionary
    # when it is unkeyed; keyed (I2) nothing of it can be checked without the secret.
    credential = "Basic " + base64.b64encode(b"alice:sunshine").decode()
    key, entry, _, _ = await first_order(api, attacker, headers={"authorization": credential})
    cracked = [w for w in DICTIONARY
               if hashlib.sha256(("Basic " + base64.b64encode(f"alice:{w}".encode()).decode())
                                 .encode()).hexdigest() in entry]
    assert not cracked, f"channel once announced {entry}: alice's password is {cracked[0]!r}"
    assert credential.split()[1] not in entry, f"channel once announced the credential: {entry}"
    assert key not in entry, f"channel once announced the key itself: {entry}"
    digest = hashlib.sha256(credential.encode()).hexdigest()
    # once.entries as its dumps hold it: read by the driver's (administrator's) session.
    assert digest not in entry and api.db.value(
        "SELECT count(*) FROM once.entries WHERE key LIKE %s OR key LIKE %s",
        f"%{digest}%", f"%{key}%") == 0, \
        "once.entries (and so every dump) holds the credential's unkeyed digest"


# -- item 6: a replay serves only what the middleware wrote -----------------------------------

async def test_a_planted_set_cookie_is_not_replayed(api, attacker):
    key, entry, body, _ = await first_order(api, attacker)
    attacker.plant(entry, form(201, [["content-type", "application/json"],
                                     ["set-cookie", "session=attacker; Path=/; HttpOnly"]],
                               b'{"order_id": 1}'))
    retry = await api.post("/orders", body, key)
    assert_untrusted((retry.status_code, list(retry.headers.multi_items()), retry.content),
                     "a planted set-cookie")


async def test_a_planted_content_length_smuggles_no_second_response(api, attacker):
    # The planted body holds a whole second response after the 2 bytes its content-length
    # announces: on a keep-alive connection the caller's next request would read it.
    key, entry, body, _ = await first_order(api, attacker)
    smuggled = b"HTTP/1.1 299 Smuggled\r\ncontent-length: 0\r\nx-smuggled: 1\r\n\r\n"
    attacker.plant(entry, form(200, [["content-type", "text/plain"], ["content-length", "2"]],
                               b"ok" + smuggled))
    answers = exchange(api.url(None), [
        ("POST", "/orders", [("content-type", "application/json"), ("idempotency-key", key)],
         json.dumps(body).encode()),
        ("GET", "/health", [], b"")])
    assert_untrusted(answers[0], "a planted short content-length")
    assert len(answers) == 2 and not isinstance(answers[1], Exception), \
        f"the connection did not serve the next request: {answers}"
    status, headers, _ = answers[1]
    assert (status, dict(headers).get("x-smuggled")) == (200, None), \
        f"the next request on the connection read the smuggled response: {status} {headers}"


async def test_a_planted_content_length_is_not_sent_twice(api, attacker):
    key, entry, body, _ = await first_order(api, attacker)
    attacker.plant(entry, form(200, [["content-type", "text/plain"], ["content-length", "5"]],
                               b"hello, world"))
    answers = exchange(api.url(None), [
        ("POST", "/orders", [("content-type", "application/json"), ("idempotency-key", key)],
         json.dumps(body).encode())])
    assert_untrusted(answers[0], "a planted content-length")


async def test_an_entry_planted_without_fingerprint_is_not_served(api, attacker):
    # The middleware's own stored response, copied and planted back without a fingerprint:
    # it then matches every request under the key, another body's too.
    key, entry, body, sku = await first_order(api, attacker)
    attacker.plant(entry, attacker.stored(entry))
    other = await api.post("/orders", {"sku": sku + "-other"}, key)
    assert other.headers.get("idempotent-replayed") != "true", \
        f"another request was served the planted entry: {other.status_code} {other.text}"
    assert_problem(other, 409, "untrusted_entry")


# -- the review of the change (attack-http): findings as tests ---------------------------------

def planted_back(stored: dict, **changes) -> tuple[dict, bytes | None]:
    """The middleware's own stored response with `changes`, and the fingerprint to claim it
    with: the victim's, read from the stored form (any role in the key space reads it with
    once.get), so that the entry matches the victim's retry and only its form is judged."""
    held = stored.get("fingerprint")
    return {**stored, **changes}, (bytes.fromhex(held) if held else None)


async def test_a_planted_mac_that_is_not_ascii_is_untrusted_not_a_500(api, attacker):
    # Finding 2: the right fingerprint, a MAC of 64 non-ASCII characters. Python's
    # hmac.compare_digest raises TypeError on such a str: the replay path raised (a 500
    # and a traceback) instead of answering 409 untrusted_entry.
    key, entry, body, _ = await first_order(api, attacker)
    planted, fingerprint = planted_back(attacker.stored(entry), mac="\u00e9" * 64)
    attacker.plant(entry, planted, fingerprint)
    retry = await api.post("/orders", body, key)
    assert_problem(retry, 409, "untrusted_entry")


async def test_a_deeply_nested_planted_entry_is_untrusted(api, attacker):
    # Finding 5: jsonb takes thousands of nesting levels; the middleware parses the entry
    # before it judges it. Python's json.loads raised RecursionError (a 500 and a
    # traceback), Rust's serde_json refused past 128 levels (a 503 `unavailable`, which
    # clients retry forever): it is an entry the middleware did not write, 409.
    key, entry, body, _ = await first_order(api, attacker)
    depth = 5000   # built as text: no Python JSON parser reads it back
    planted, fingerprint = planted_back(attacker.stored(entry), headers="NESTED")
    attacker.plant(entry, json.dumps(planted).replace('"NESTED"', "[" * depth + "]" * depth),
                   fingerprint)
    retry = await api.post("/orders", body, key)
    assert_problem(retry, 409, "untrusted_entry")


@pytest.mark.xfail(reason="finding 3: a stored response is readable by any role with the "
                          "README's grants that hears its key on channel once (once.get)",
                   strict=True)
async def test_a_listener_cannot_read_the_stored_response(api, attacker):
    # The entry key is announced when the response is stored; once.get(key) is open to
    # every role granted pg_once, so the victim's response (an order here; an API key or a
    # session token as often) is read by a role that only LISTENs. docs/security.md says
    # only a role that can read once.entries (an administrator) reads stored bodies.
    key, sku = fresh_key(), f"victim-{fresh_key()[:8]}"
    first = await api.post("/orders", {"sku": sku}, key)
    assert first.status_code == 201, first.text
    deadline = time.monotonic() + NOTIFIED_WITHIN_S
    read = []
    while time.monotonic() < deadline and not any(sku.encode() in r for r in read):
        # Listed first: the generator holds the connection until it ends.
        for payload in [n.payload for n in attacker.conn.notifies(timeout=0.2, stop_after=1)]:
            stored = attacker.stored(payload)
            if isinstance(stored, dict) and isinstance(stored.get("body"), str):
                read.append(base64.b64decode(stored["body"]))
    assert not any(sku.encode() in r for r in read), \
        "a role with the README's grants read the victim's response through once.get"


async def test_the_stored_fingerprint_is_no_crackable_digest_of_the_request(api, attacker):
    # Finding 4: a token in the query string (or a password in the body) enters the
    # default fingerprint; the fingerprint is stored in the result (once.get, any granted
    # role) and in once.entries (dumps). It was an unkeyed SHA-256 even when the middleware
    # had a secret; now it is keyed by the secret (I3).
    key, sku = fresh_key(), f"victim-{fresh_key()[:8]}"
    body = json.dumps({"sku": sku}).encode()
    first = await api.post("/orders?access_token=sunshine", body, key)
    assert first.status_code == 201, first.text
    entry = attacker.announced(sku)
    held = attacker.stored(entry)["fingerprint"]
    cracked = [w for w in DICTIONARY if hashlib.sha256(
        f"POST\n/orders\naccess_token={w}\n".encode() + body).hexdigest() == held]
    assert not cracked, f"the stored fingerprint gives the access token away: {cracked[0]!r}"
    # What I3 says every middleware stores: the default fingerprint keyed by the secret
    # (the run's secret is the driver's; an attacker has no such thing).
    from pg_once import _idempotency as I
    from services import SECRET
    plain = I.default_fingerprint("POST", "/orders", "access_token=sunshine", body)
    assert held == I.keyed_fingerprint(SECRET.encode(), plain).hex()


async def test_framing_headers_are_refused_even_under_the_secrets_mac(api, attacker):
    # The planted forms above lack the fingerprint and MAC members, so they are refused
    # before their headers are looked at: with the header checks of I6 removed they still
    # passed (attack-http review, finding 6). Here the form is whole, with the victim's
    # fingerprint and the MAC of the run's secret (a leaked secret, another version of the
    # middleware): only the header rules stand between it and the connection.
    from pg_once import _idempotency as I
    from services import SECRET
    key, entry, body, _ = await first_order(api, attacker)
    smuggled = b"HTTP/1.1 299 Smuggled\r\ncontent-length: 0\r\nx-smuggled: 1\r\n\r\n"
    stored = attacker.stored(entry)
    for headers in ([["content-type", "text/plain"], ["content-length", "2"]],
                    [["content-type", "text/plain"], ["set-cookie", "session=attacker"]]):
        planted = {"status": 200, "headers": headers,
                   "body": base64.b64encode(b"ok" + smuggled).decode(),
                   "fingerprint": stored["fingerprint"]}
        planted["mac"] = I.response_mac(SECRET.encode(), entry, planted)
        attacker.plant(entry, planted, bytes.fromhex(stored["fingerprint"]))
        answers = exchange(api.url(None), [
            ("POST", "/orders", [("content-type", "application/json"), ("idempotency-key", key)],
             json.dumps(body).encode()),
            ("GET", "/health", [], b"")])
        assert_untrusted(answers[0], f"a planted {headers[1][0]} under the secret's MAC")
        assert len(answers) == 2 and not isinstance(answers[1], Exception) and \
            dict(answers[1][1]).get("x-smuggled") is None, f"smuggled: {answers}"
