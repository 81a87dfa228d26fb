"""The exceptions pg_once raises. All derive from OnceError."""

from __future__ import annotations

from datetime import datetime


class OnceError(Exception):
    """Base class of every pg_once client error."""


class OnceFailed(OnceError):
    """The key's last computation failed (here or in another process); the failure is
    shared with every caller until `retry_at`, after which the next caller computes anew."""

    def __init__(self, key: str, error: str | None, retry_at: datetime | None):
        super().__init__(f"computing {key!r} failed: {error} (shared until {retry_at})")
        self.key, self.error, self.retry_at = key, error, retry_at


class OnceTimeout(OnceError, TimeoutError):
    """The caller's `wait` ran out while someone else was still computing the key."""

    def __init__(self, key: str, wait: float):
        super().__init__(f"{key!r} is still being computed by another caller after waiting {wait:g} s")
        self.key, self.wait = key, wait


class ClaimLost(OnceError):
    """Our claim ended while we computed (taken over after the lease ran out, or
    invalidated): the result was NOT stored. The computed value is in `.value`."""

    def __init__(self, key: str, value: object = None):
        super().__init__(f"the claim on {key!r} was lost while computing: the result was not stored")
        self.key, self.value = key, value


class NotSerializable(OnceError, TypeError):
    """compute() returned a value the serializer cannot store so that it reads back equal
    (rule V3). The claim was failed with this message (V4), so the callers waiting for it
    get OnceFailed rather than computing again."""

    def __init__(self, key: str, value: object, cause: Exception, *, default: bool = True):
        hint = ("pass serializer= (an object with dumps(value) -> str and loads(str) -> value) "
                "to store it, or return dicts, lists, str, int, float, bool or None"
                if default else "the serializer= given refused it")
        super().__init__(f"the result of computing {key!r} (a {type(value).__name__}) cannot "
                         f"be stored: {cause}; {hint}")
        self.key, self.value = key, value


class ConfigurationError(OnceError, ValueError):
    """The client was handed something it cannot work with, e.g. a pool whose
    connections are not in autocommit."""
