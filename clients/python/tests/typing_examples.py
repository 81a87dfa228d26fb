"""Checked by mypy in test_generated.py, never run: what the types promise a caller (the
compute function's type comes back; cached keeps the signature)."""

from typing import assert_type

from pg_once import AsyncClient, Client


def sync_client(c: Client) -> None:
    def compute() -> dict[str, int]:
        return {"a": 1}
    assert_type(c.get_or_compute("k", compute), dict[str, int])

    @c.cached(ttl=60)
    def report(n: int, region: str = "eu") -> list[str]:
        return [region]
    assert_type(report(1), list[str])
    report("x")  # type: ignore[arg-type]  # the signature is kept: a str is refused

    @c.cached
    def bare(n: int) -> int:
        return n
    assert_type(bare(1), int)


async def async_client(a: AsyncClient) -> None:
    async def compute() -> int:
        return 1
    assert_type(await a.get_or_compute("k", compute), int)

    @a.cached(ttl=60)
    async def report(n: int) -> str:
        return str(n)
    assert_type(await report(1), str)
