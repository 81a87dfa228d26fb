"""The pure parts of rule I (docs/clients.md, "Idempotent HTTP requests"), shared by the
ASGI and WSGI middlewares: which requests are covered, the header's value, the entry's key,
the default scope and fingerprint, the stored form of a response and its replay, the
problem+json answers, and the options. Nothing here does I/O;
clients/conformance/vectors/idempotency.json is what these functions must produce."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import math
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http import HTTPStatus
from typing import Any, Callable, Iterable, List, Optional, Tuple

from ._common import Duration, check_fingerprint, seconds
from ._keys import derive_key, encode_args
from .errors import ConfigurationError

Headers = List[Tuple[str, str]]
Scope = Callable[[Any], Optional[str]]          # the request (ASGI scope, WSGI environ) -> scope
Fingerprint = Callable[[str, str, str, bytes], Optional[bytes]]   # method, path, query, body

MiB = 1 << 20
# The stored form carries the body in base64 (4 bytes for 3) inside jsonb, which
# complete_key refuses past once.max_result_size (16MB by default): 12 MiB of body fits.
MAX_STORED_BODY = 12 * MiB
MAX_HEADER_KEY = 255
# Not stored (I5): hop-by-hop headers, and what the server writes again for each response.
NOT_STORED = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
                        "te", "trailer", "transfer-encoding", "upgrade", "content-length",
                        "date"})
REPLAYED = ("idempotent-replayed", "true")
# I2: the shortest secret taken: HMAC-SHA-256's output size, below which RFC 2104 says
# the key weakens the MAC.
MIN_SECRET_BYTES = 32
# I6: what a stored header may be. A name is a token in lower case (I5 writes them so); a
# value is a field value (RFC 9110 5.5) one character per byte: no CR, LF or NUL, no
# control character but tab, no whitespace at either end.
HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9a-z]+")
HEADER_VALUE = re.compile(r"(?:[\x21-\x7e\x80-\xff](?:[\t\x20-\x7e\x80-\xff]*[\x21-\x7e\x80-\xff])?)?")
HEX = re.compile(r"(?:[0-9a-f]{2}){1,64}")
MAC_HEX = re.compile(r"[0-9a-f]{64}")   # I5: a MAC is 64 lowercase hex digits, nothing else
PROBLEM_TYPE = "application/problem+json"
# RFC 9110's reason phrases: the same titles from every pg_once middleware, whatever the
# language's own table says (Python 3.11 still calls 422 "Unprocessable Entity").
TITLES = {400: "Bad Request", 409: "Conflict", 413: "Content Too Large",
          422: "Unprocessable Content", 500: "Internal Server Error", 503: "Service Unavailable"}


def store_below_500(status: int) -> bool:
    """The default `store`: every status below 500 is the request's answer; a 5xx is a
    failure worth retrying, so its claim is given back."""
    return status < 500


@dataclass(frozen=True)
class Options:
    """A middleware's options, checked when it is built (I9). Durations in seconds."""

    methods: frozenset = frozenset({"POST", "PATCH"})
    header: str = "Idempotency-Key"
    required: bool = False
    namespace: str = ""
    scope: Optional[Scope] = None           # None: the default scope (I2)
    fingerprint: Optional[Fingerprint] = None   # None: the default fingerprint (I3)
    ttl: Optional[float] = 24 * 3600.0
    lease: float = 30.0
    in_flight: str = "conflict"
    wait: float = 10.0
    store: Callable[[int], bool] = store_below_500
    store_cookies: bool = False
    max_body: int = MiB
    max_request_body: int = MiB
    secret: Optional[bytes] = None          # I2: keys the entry and authenticates its response
    header_lower: str = field(init=False, default="")

    def __post_init__(self) -> None:
        object.__setattr__(self, "header_lower", self.header.lower())

    @classmethod
    def build(cls, *, methods: Iterable[str] = ("POST", "PATCH"),
              header: str = "Idempotency-Key", required: bool = False, namespace: str = "",
              scope: Optional[Scope] = None, fingerprint: Optional[Fingerprint] = None,
              ttl: Optional[Duration] = 24 * 3600, lease: Duration = 30,
              in_flight: str = "conflict", wait: Duration = 10,
              store: Optional[Callable[[int], bool]] = None, store_cookies: bool = False,
              max_body: int = MiB, max_request_body: int = MiB,
              secret: Optional[Any] = None) -> "Options":
        if isinstance(methods, str):
            raise TypeError(f"methods must be a list of method names, got the string {methods!r}")
        names = frozenset(_method(m) for m in methods)
        if not names:
            raise ValueError("methods must name at least one HTTP method (default POST and PATCH)")
        if not isinstance(header, str) or not header or not all(_token_char(c) for c in header):
            raise ValueError(f"header must be an HTTP header name, got {header!r}")
        if not isinstance(namespace, str):
            raise TypeError(f"namespace must be a str (e.g. 'tenant2/'), got {namespace!r}")
        for name, fn in (("scope", scope), ("fingerprint", fingerprint), ("store", store)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{name} must be a function, got {fn!r}")
        if in_flight not in ("conflict", "wait"):
            raise ValueError(f"in_flight must be 'conflict' (answer 409 at once) or 'wait' "
                             f"(wait for the running request's response), got {in_flight!r}")
        for name, flag in (("required", required), ("store_cookies", store_cookies)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be True or False, got {flag!r}")
        _size("max_request_body", max_request_body)
        if _size("max_body", max_body) > MAX_STORED_BODY:
            raise ValueError(f"max_body must be at most {MAX_STORED_BODY} bytes: a stored response "
                             "must fit in the server's once.max_result_size (16MB by default), "
                             f"in base64; got {max_body}")
        return cls(names, header, required, namespace, scope, fingerprint,
                   seconds(ttl, "ttl", positive=True), seconds(lease, "lease", positive=True),
                   in_flight, seconds(wait, "wait"), store or store_below_500, store_cookies,
                   max_body, max_request_body, _secret(secret, scope))

    @property
    def claim_wait(self) -> float:
        """How long claim_key may wait for a running duplicate (I4)."""
        return self.wait if self.in_flight == "wait" else 0.0


def _method(name: Any) -> str:
    if not isinstance(name, str) or not name or not all(_token_char(c) for c in name):
        raise ValueError(f"methods must be HTTP method names, got {name!r}")
    return name.upper()


def _token_char(c: str) -> bool:
    return c.isascii() and (c.isalnum() or c in "!#$%&'*+-.^_`|~")


def _secret(secret: Any, scope: Optional[Scope]) -> Optional[bytes]:
    """The secret as bytes (I2): required with the default scope, which comes from the
    caller's credentials; at least MIN_SECRET_BYTES."""
    if secret is None:
        if scope is None:
            raise ConfigurationError(
                "secret is required with the default scope, which comes from the caller's "
                "Authorization header: pass secret= (at least 32 bytes, the same in every "
                "process of the service, e.g. os.environ['IDEMPOTENCY_SECRET'] made with "
                "`openssl rand -hex 32`), so that no digest of a credential a dictionary "
                "could crack is stored or announced; or pass scope= a function giving the "
                "authenticated principal")
        return None
    if isinstance(secret, str):
        secret = secret.encode("utf-8")
    if not isinstance(secret, (bytes, bytearray)):
        raise TypeError(f"secret must be bytes or a str, got {type(secret).__name__}")
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigurationError(f"secret must be at least {MIN_SECRET_BYTES} bytes (e.g. "
                                 f"`openssl rand -hex 32`), got {len(secret)}")
    return bytes(secret)


def _size(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive number of bytes, got {value!r}")
    return value


# -- the request ---------------------------------------------------------------------------

class Problem(Exception):
    """An answer the middleware makes itself (I7) instead of running the handler."""

    def __init__(self, status: int, code: str, detail: str, headers: Headers = ()) -> None:
        super().__init__(detail)
        self.status, self.code, self.detail, self.headers = status, code, detail, list(headers)

    def reply(self) -> "Reply":
        body = json.dumps({"type": "about:blank", "title": TITLES.get(self.status) or
                           HTTPStatus(self.status).phrase, "status": self.status,
                           "detail": self.detail, "code": self.code}).encode()
        return Reply(self.status, [("content-type", PROBLEM_TYPE), *self.headers,
                                   ("content-length", str(len(body)))], body)


@dataclass(frozen=True)
class Reply:
    """A response the middleware sends itself: a problem or a replay."""

    status: int
    headers: Headers
    body: bytes


def request_key(options: Options, values: List[str]) -> Optional[str]:
    """The request's idempotency key from its header lines (I1): None without the header
    (the request passes through), or Problem 400 when it is required and missing or when
    it is not 1 to 255 visible ASCII characters."""
    if not values:
        if options.required:
            raise Problem(400, "key_missing", f"This endpoint needs an {options.header} header: "
                          "send a unique value (a UUID) per operation, the same on its retries.")
        return None
    if len(values) > 1:
        raise _invalid(options, "it was sent more than once")
    return parse_key(options, values[0])


def parse_key(options: Options, value: str) -> str:
    """A header value as a key: a structured-field string ("...") is unquoted first."""
    if len(value) >= 2 and value[0] == value[-1] == '"':
        value = _unquote(options, value[1:-1])
    if not value:
        raise _invalid(options, "it is empty")
    if len(value) > MAX_HEADER_KEY:
        raise _invalid(options, f"it is {len(value)} characters long")
    if not all("\x21" <= c <= "\x7e" for c in value):
        raise _invalid(options, "it has characters other than visible ASCII")
    return value


def _unquote(options: Options, inner: str) -> str:
    out, escaped = [], False
    for c in inner:
        if escaped:
            if c not in '"\\':
                raise _invalid(options, "it is a quoted string with a bad escape")
            out.append(c)
            escaped = False
        elif c == "\\":
            escaped = True
        elif c == '"':
            raise _invalid(options, "it is a quoted string with an unescaped quote")
        else:
            out.append(c)
    if escaped:
        raise _invalid(options, "it is a quoted string ending in a backslash")
    return "".join(out)


def _invalid(options: Options, why: str) -> Problem:
    return Problem(400, "key_invalid", f"The {options.header} header is not a valid key: "
                   f"{why}. Send 1 to {MAX_HEADER_KEY} visible ASCII characters, e.g. a UUID.")


def body_too_large(options: Options) -> Problem:
    return Problem(413, "body_too_large", f"The request body is over "
                   f"{options.max_request_body} bytes, more than this endpoint reads to check "
                   f"that a retry under the same {options.header} is the same request.")


def default_scope(authorization: Optional[str]) -> Optional[str]:
    """The Authorization header as received, one character per byte, or None without one
    (I2): two callers' identical keys never meet. It only ever enters the entry's key
    keyed by the secret (entry_key), which the default scope requires."""
    return authorization


def _mac(secret: bytes, fields: list) -> str:
    return hmac.new(secret, encode_args(fields).encode("utf-8"), hashlib.sha256).hexdigest()


def entry_key(namespace: str, scope: Optional[str], key: str,
              secret: Optional[bytes] = None) -> str:
    """The pg_once key of a request (I2). With a secret: NAMESPACE +
    "idempotency:#hmac-sha256:" + hex(HMAC-SHA-256(secret, ENCODE(["idempotency-key", scope,
    key]))), so that neither scope nor key is stored or announced, nor can be checked
    against a guess without the secret. Without one (a scope that is a principal, not a
    credential): NAMESPACE + "idempotency:" + ENCODE([scope, key]), the default key of rule
    K (K2 keeps scope and key apart; K3 hashes one too long)."""
    if scope is not None and not isinstance(scope, str):
        raise TypeError(f"the scope function must return a str or None, got {scope!r}")
    if secret is not None:
        return f"{namespace}idempotency:#hmac-sha256:{_mac(secret, ['idempotency-key', scope, key])}"
    return derive_key(f"{namespace}idempotency", [scope, key])


def default_fingerprint(method: str, path: str, query: str, body: bytes) -> bytes:
    """SHA-256 of METHOD \\n PATH \\n QUERY \\n BODY (I3): the path as received, not decoded,
    the raw query without '?'. Stored as is only without a secret (keyed_fingerprint)."""
    head = f"{method.upper()}\n{path}\n{query}\n".encode("latin-1")
    return hashlib.sha256(head + body).digest()


def keyed_fingerprint(secret: bytes, fingerprint: bytes) -> bytes:
    """I3: a fingerprint as a middleware with a secret claims and stores it,
    HMAC-SHA-256(secret, ENCODE(["idempotency-fingerprint", hex(fingerprint)])), so that
    what is stored (once.get, once.entries and its dumps) is no digest of the request a
    dictionary could be tried against: a token in the query, a password in the body."""
    return bytes.fromhex(_mac(secret, ["idempotency-fingerprint", fingerprint.hex()]))


def fingerprint_of(options: Options, method: str, path: str, query: str,
                   body: bytes) -> Optional[bytes]:
    """The request's fingerprint as claimed and stored (I3): the default's or the
    `fingerprint` option's, keyed by the secret when the middleware has one."""
    if options.fingerprint is None:
        fingerprint = default_fingerprint(method, path, query, body)
    else:
        fingerprint = check_fingerprint(options.fingerprint(method, path, query, body))
    if fingerprint is None or options.secret is None:
        return fingerprint
    return keyed_fingerprint(options.secret, fingerprint)


# -- the response ----------------------------------------------------------------------------

def stored_headers(headers: Iterable[Tuple[Any, Any]], store_cookies: bool) -> Headers:
    """The headers kept with a response (I5): in order, names in lower case, without the
    hop-by-hop ones, content-length, date, and set-cookie unless store_cookies."""
    kept = []
    for name, value in headers:
        name, value = _text(name).lower(), _text(value)
        if name in NOT_STORED or (name == "set-cookie" and not store_cookies):
            continue
        kept.append((name, value))
    return kept


def stored_form(status: int, headers: Iterable[Tuple[Any, Any]], body: Optional[bytes],
                store_cookies: bool, entry: str, fingerprint: Optional[bytes],
                secret: Optional[bytes]) -> dict:
    """The entry's result (I2, I5): {"status", "headers", "body": base64, or None when the
    body was over max_body, "fingerprint": the request's, hex, or None; with a secret,
    "mac": what proves the middleware wrote it for this entry and request}."""
    form = {"status": status,
            "headers": [list(h) for h in stored_headers(headers, store_cookies)],
            "body": None if body is None else base64.b64encode(body).decode("ascii"),
            "fingerprint": None if fingerprint is None else fingerprint.hex()}
    if secret is not None:
        form["mac"] = response_mac(secret, entry, form)
    return form


def response_mac(secret: bytes, entry: str, form: dict) -> str:
    """I5: hex(HMAC-SHA-256(secret, ENCODE(["idempotency-response", entry, status, headers,
    body, fingerprint]))) of a stored form."""
    return _mac(secret, ["idempotency-response", entry, form["status"], form["headers"],
                         form["body"], form["fingerprint"]])


def stored_text(options: Options, entry: str, fingerprint: Optional[bytes], status: int,
                headers: Iterable[Tuple[Any, Any]], body: Optional[bytes]) -> str:
    if body is not None and len(body) > options.max_body:
        body = None
    return json.dumps(stored_form(status, headers, body, options.store_cookies, entry,
                                  fingerprint, options.secret), separators=(",", ":"))


def replay(options: Options, entry: str, fingerprint: Optional[bytes], result: Any) -> Reply:
    """A stored response as it is replayed (I6), marked Idempotent-Replayed; Problem 409
    `untrusted_entry` for an entry this middleware did not write (untrusted(): why)."""
    try:
        stored = json.loads(result) if isinstance(result, (str, bytes)) else result
    except (ValueError, RecursionError):
        # jsonb takes thousands of nesting levels, json.loads about a thousand: an entry
        # nested that deep is not one the middleware wrote.
        raise Untrusted(options, "it is JSON nested deeper than the middleware writes")
    why = untrusted(options, entry, fingerprint, stored)
    if why is not None:
        raise Untrusted(options, why)
    body = base64.b64decode(stored["body"]) if stored["body"] is not None else b""
    headers = [(name, value) for name, value in stored["headers"]]
    headers += [REPLAYED, ("content-length", str(len(body)))]
    return Reply(stored["status"], headers, body)


def untrusted(options: Options, entry: str, fingerprint: Optional[bytes],
              stored: Any) -> Optional[str]:
    """Why a stored entry is not one this middleware wrote for this request (I6), or None.
    Anyone with pg_once's rights in the key space can write an entry: only one in the
    middleware's form, holding this request's fingerprint and, with a secret, its MAC, is
    replayed, and none of its headers can frame the response (content-length,
    hop-by-hop headers) or set a cookie the middleware would not have stored."""
    members = {"status", "headers", "body", "fingerprint"} | (
        {"mac"} if options.secret is not None else set())
    if not isinstance(stored, dict) or set(stored) != members:
        return f"its members are not {sorted(members)}"
    status = stored["status"]
    if type(status) is not int or not 200 <= status <= 599:
        return f"its status {status!r} is not 200 to 599"
    headers = stored["headers"]
    if not isinstance(headers, list):
        return "its headers are not a list"
    for pair in headers:
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(p, str) for p in pair)):
            return f"a header is not a [name, value] pair of strings: {pair!r}"
        name, value = pair
        if not HEADER_NAME.fullmatch(name) or not HEADER_VALUE.fullmatch(value):
            return f"header {name!r} is not a lower-case token with a field value"
        if name in NOT_STORED or name == REPLAYED[0] or \
                (name == "set-cookie" and not options.store_cookies):
            return f"it holds a {name} header, which the middleware never stores"
    body = stored["body"]
    if body is not None:
        try:
            if not isinstance(body, str):
                raise ValueError
            base64.b64decode(body, validate=True)
        except (ValueError, binascii.Error):
            return "its body is not base64"
    held = stored["fingerprint"]
    if held is not None and (not isinstance(held, str) or not HEX.fullmatch(held)):
        return "its fingerprint is not hex"
    if held != (None if fingerprint is None else fingerprint.hex()):
        return "it was not stored for this request's fingerprint"
    if options.secret is None:
        if fingerprint is None:
            return "the request has no fingerprint and the middleware no secret to check"
        return None
    mac = stored["mac"]
    # Lowercase hex first: compare_digest raises TypeError on a str that is not ASCII.
    if not isinstance(mac, str) or not MAC_HEX.fullmatch(mac) or not hmac.compare_digest(
            mac, response_mac(options.secret, entry, stored)):
        return "its MAC is not the secret's"
    return None


def _text(value: Any) -> str:
    return value.decode("latin-1") if isinstance(value, (bytes, bytearray)) else str(value)


class Collected:
    """A response as the handler produces it, its body kept up to max_body (I5)."""

    def __init__(self, max_body: int) -> None:
        self.status: Optional[int] = None
        self.headers: list = []
        self._chunks: List[bytes] = []
        self._size = 0
        self._max = max_body

    def add(self, chunk: bytes) -> None:
        self._size += len(chunk)
        if self._size <= self._max:
            self._chunks.append(bytes(chunk))
        else:
            self._chunks = []

    def cut(self) -> None:
        """The stream broke after its head was sent: the handler ran, so the response is
        stored, but without the part of its body it got to (I5, as past max_body)."""
        self._size, self._chunks = self._max + 1, []

    @property
    def body(self) -> Optional[bytes]:
        """The whole body, or None when it was longer than max_body or cut."""
        return b"".join(self._chunks) if self._size <= self._max else None


# -- the middleware's own answers (I4, I7) ----------------------------------------------------

def in_flight(options: Options) -> Problem:
    waited = f" for {options.wait:g} s" if options.in_flight == "wait" else ""
    return Problem(409, "in_flight", f"A request with this {options.header} is still being "
                   f"processed{waited}; retry after a second to get its response.",
                   [("retry-after", "1")])


def failed(options: Options, retry_at: Optional[datetime]) -> Problem:
    wait = 1 if retry_at is None else max(
        1, math.ceil((retry_at - datetime.now(timezone.utc)).total_seconds()))
    return Problem(409, "in_flight", f"The operation under this {options.header} failed "
                   f"elsewhere and may be retried in {wait} s.", [("retry-after", str(wait))])


class Untrusted(Problem):
    """I6: the entry holds a response the middleware did not write (`why`, for the log)."""

    def __init__(self, options: Options, why: str) -> None:
        super().__init__(409, "untrusted_entry", f"The response stored under this "
                         f"{options.header} was not written by this service's idempotency "
                         "middleware, so it is not replayed and the request is not run: "
                         "send a new key.")
        self.why = why


def mismatch(options: Options) -> Problem:
    return Problem(422, "fingerprint_mismatch", f"This {options.header} was already used for "
                   "another request (a different method, path, query or body): send a new "
                   "key for a new operation, or the same request to get its response.")


def handler_failed() -> Problem:
    return Problem(500, "handler_failed", "The request failed before it completed; it was "
                   "not recorded, so retrying it with the same key runs it again.")


def unavailable() -> Problem:
    return Problem(503, "unavailable", "The idempotency store (PostgreSQL) cannot be reached, "
                   "so the request was not run; retry it with the same key.",
                   [("retry-after", "1")])
