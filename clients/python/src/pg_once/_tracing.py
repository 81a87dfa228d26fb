"""OpenTelemetry spans (rule O2), when opentelemetry-api is installed (`pg_once[otel]`):
each get_or_compute is a span `pg_once.get_or_compute` with `pg_once.key` and
`pg_once.outcome`; a call coalesced on another of this process links to that call's span.
Without the package nothing is imported and a call costs one `is None` test."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional

try:
    from opentelemetry import trace
except ImportError:   # the optional extra is not installed
    trace = None

SPAN_NAME = "pg_once.get_or_compute"


class Span:
    """What the client records on a call's span: its outcome, and for the computing call
    its context, which the calls coalesced on it link to."""

    def __init__(self, span: Any = None) -> None:
        self._span = span

    @property
    def context(self) -> Optional[Any]:
        return None if self._span is None else self._span.get_span_context()

    def outcome(self, kind: str) -> None:
        if self._span is not None:
            self._span.set_attribute("pg_once.outcome", kind)


@contextmanager
def span(key: str, link_to: Optional[Any] = None) -> Iterator[Span]:
    """A span around one call (the current span in this context), linked to `link_to`."""
    if trace is None:
        yield Span()
        return
    links = [trace.Link(link_to)] if link_to is not None else None
    tracer = trace.get_tracer("pg_once")
    with tracer.start_as_current_span(SPAN_NAME, links=links,
                                      attributes={"pg_once.key": key}) as current:
        yield Span(current)
