"""Default cache keys of `cached` (docs/clients.md, rule K): NAME + ":" + ENCODE(args),
the same bytes in Python, Node and Rust, so processes in any of them share one entry.
Pure functions; clients/conformance/vectors/keys.json is what they must produce."""

from __future__ import annotations

import base64
import datetime as _dt
import decimal
import hashlib
import inspect
import math
from typing import Any, Callable, List, Optional

MAX_KEY_BYTES = 7500   # the server's limit on a key (K3)


class CacheKeys:
    """The key of each call of a `cached` function: the caller's key(*args, **kwargs), or
    the default key of rule K from `name` (default: the function's own) and the arguments."""

    def __init__(self, func: Callable[..., Any], key: Optional[Callable[..., str]],
                 name: Optional[str]) -> None:
        if key is not None and name is not None:
            raise TypeError("pass key= (the whole key) or name= (its first part), not both")
        if key is not None and not callable(key):
            raise TypeError(f"key= must be a function of the arguments returning the key, got {key!r}")
        if name is not None and (not isinstance(name, str) or not name):
            raise TypeError(f"name= must be a non-empty str, got {name!r}")
        self._key = key
        self.name = None if key is not None else (name or default_name(func))
        self._signature = inspect.signature(func)

    def __call__(self, args: tuple, kwargs: dict) -> str:
        if self._key is not None:
            return check_key(self._key(*args, **kwargs))
        return derive_key(self.name, call_arguments(self._signature, args, kwargs))


def check_key(key: Any) -> str:
    """A key the server takes: a non-empty str of at most 7,500 UTF-8 bytes (F1, K3)."""
    if not isinstance(key, str):
        raise TypeError(f"key must be a str, got {type(key).__name__}")
    if not key:
        raise ValueError("key must not be empty")
    size = len(key.encode("utf-8", "surrogatepass"))
    if size > MAX_KEY_BYTES:
        raise ValueError(f"key is {size} bytes long; the server takes at most {MAX_KEY_BYTES} "
                         "(hash the variable part, e.g. with hashlib.sha256)")
    return key


def default_name(fn: Callable[..., Any]) -> str:
    """`module.qualname`, refused where it is not the same in every process (K1)."""
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not module or not qualname or module == "__main__" or "<" in qualname:
        raise TypeError(
            f"{qualname or fn!r} has no name that is the same in every process (a lambda, a "
            "function defined inside a function, or one in __main__): pass name= or key=")
    return f"{module}.{qualname}"


def call_arguments(signature: inspect.Signature, args: tuple, kwargs: dict) -> List[Any]:
    """The call bound to the signature with defaults applied, as one list (K1): f(1, b=2),
    f(1, 2) and f(b=2, a=1) give the same list; *args are spread, **kwargs are one map."""
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    values: List[Any] = []
    for name, param in signature.parameters.items():
        value = bound.arguments[name]
        if param.kind is inspect.Parameter.VAR_POSITIONAL:
            values.extend(value)
        else:
            values.append(value)
    return values


def derive_key(name: str, args: List[Any]) -> str:
    """NAME:ENCODE(args), or NAME:#sha256:<hex> when that is longer than the server takes."""
    encoded = encode_args(args)
    key = f"{name}:{encoded}"
    if len(key.encode("utf-8")) <= MAX_KEY_BYTES:
        return key
    return f"{name}:#sha256:{hashlib.sha256(encoded.encode('utf-8')).hexdigest()}"


def encode_args(args: List[Any]) -> str:
    return _encode(list(args))


def _encode(value: Any) -> str:
    # Exact types, not isinstance: bool is an int, and a subclass (an IntEnum, a str
    # subclass) may mean something its base type does not.
    kind = type(value)
    if value is None:
        return "null"
    if kind is bool:
        return "true" if value else "false"
    if kind is int:
        return str(value)
    if kind is float:
        return _number(value)
    if kind is str:
        return _string(value)
    if kind in (list, tuple):
        return "[" + ",".join(_encode(v) for v in value) + "]"
    if kind is dict:
        if all(type(k) is str for k in value):
            members = sorted(value.items(), key=lambda kv: kv[0].encode("utf-8", "surrogatepass"))
            return "{" + ",".join(f"{_string(k)}:{_encode(v)}" for k, v in members) + "}"
        pairs = sorted(([_encode(k), _encode(v)] for k, v in value.items()),
                       key=lambda kv: kv[0].encode("utf-8", "surrogatepass"))
        return "map([" + ",".join(f"[{k},{v}]" for k, v in pairs) + "])"
    if kind in (set, frozenset):
        members = sorted((_encode(v) for v in value), key=lambda e: e.encode("utf-8", "surrogatepass"))
        return "set([" + ",".join(members) + "])"
    if kind is bytes:
        return f'bytes("{base64.b64encode(value).decode("ascii")}")'
    if kind is _dt.datetime:
        return f'datetime("{_datetime(value)}")'
    if kind is decimal.Decimal:
        if not value.is_finite():
            raise TypeError(f"cannot make a cache key of {value!r}: pass key=")
        return f'decimal("{value}")'
    raise TypeError(
        f"cannot make a cache key of a {kind.__module__}.{kind.__qualname__} argument: "
        "pass key= (a function of the arguments that returns the key)")


def _string(text: str) -> str:
    out = ['"']
    for ch in text:
        code = ord(ch)
        if ch == '"':
            out.append('\\"')
        elif ch == "\\":
            out.append("\\\\")
        elif code < 0x20:
            out.append(_CONTROL.get(ch) or f"\\u{code:04x}")
        elif 0xD800 <= code <= 0xDFFF:   # a lone surrogate: as JSON.stringify writes it
            out.append(f"\\u{code:04x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


_CONTROL = {"\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _number(x: float) -> str:
    """ECMAScript's Number.prototype.toString: the shortest digits that read back as x
    (Python's repr finds the same digits), laid out as JavaScript lays them out."""
    if not math.isfinite(x):
        raise TypeError(f"cannot make a cache key of {x!r}: pass key=")
    if x == 0:
        return "0"
    sign = "-" if x < 0 else ""
    digits, exponent = _shortest(abs(x))
    k, n = len(digits), exponent   # x = 0.DIGITS × 10^n
    if k <= n <= 21:
        body = digits + "0" * (n - k)
    elif 0 < n <= 21:
        body = digits[:n] + "." + digits[n:]
    elif -6 < n <= 0:
        body = "0." + "0" * (-n) + digits
    else:
        e = n - 1
        mantissa = digits if k == 1 else digits[0] + "." + digits[1:]
        body = f"{mantissa}e{'+' if e >= 0 else '-'}{abs(e)}"
    return sign + body


def _shortest(x: float):
    """(digits, n) with x = 0.digits × 10^n, digits the shortest round-trip ones."""
    mantissa, _, exp = repr(x).partition("e")
    whole, _, frac = mantissa.partition(".")
    digits = (whole + frac).lstrip("0")
    n = len(whole.lstrip("0")) if whole.strip("0") else -(len(frac) - len(frac.lstrip("0")))
    n += int(exp or 0)
    return digits.rstrip("0") or "0", n


def _datetime(value: _dt.datetime) -> str:
    if value.tzinfo is None or value.utcoffset() is None:
        raise TypeError(f"cannot make a cache key of a naive datetime ({value.isoformat()}): "
                        "give it a time zone, or pass key=")
    utc = value.astimezone(_dt.timezone.utc)
    text = utc.strftime("%Y-%m-%dT%H:%M:%S")
    if utc.microsecond:
        text += "." + f"{utc.microsecond:06d}".rstrip("0")
    return text + "+00:00"
