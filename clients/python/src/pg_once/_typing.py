"""Type variables and the type of a `cached` function, shared by both clients."""

from __future__ import annotations

from typing import Any, ParamSpec, Protocol, TypeVar

T = TypeVar("T")
P = ParamSpec("P")
R_co = TypeVar("R_co", covariant=True)


class CachedFunction(Protocol[P, R_co]):
    """A function decorated with `cached`: called as the function was, plus the entry of
    given arguments: `invalidate(*args)`, `refresh(*args)` and `cache_key(*args)`."""

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R_co: ...

    def invalidate(self, *args: P.args, **kwargs: P.kwargs) -> Any: ...

    def refresh(self, *args: P.args, **kwargs: P.kwargs) -> Any: ...

    def cache_key(self, *args: P.args, **kwargs: P.kwargs) -> str: ...
