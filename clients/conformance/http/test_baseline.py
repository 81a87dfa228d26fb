"""The scenarios against the check-then-set baseline of bench/idempotency/naive, which
answers the same routes without pg_once: "once, conflict" must catch its duplicates, or
passing it would prove nothing about the middlewares."""

import re

import pytest

import test_http

pytestmark = pytest.mark.anyio


async def test_conflict_catches_check_then_set(baseline_api):
    with pytest.raises(AssertionError, match=r"ran the handler \d+ times") as caught:
        await test_http.test_once_conflict(baseline_api)
    runs = int(re.search(r"ran the handler (\d+) times", str(caught.value)).group(1))
    assert runs > 1
    print(str(caught.value).splitlines()[0])
