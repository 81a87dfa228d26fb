"""The asyncio client under its earlier module name: `from pg_once.aio import AsyncClient`."""

from ._async.client import AsyncClient
from ._async.worker import AsyncWorker

__all__ = ["AsyncClient", "AsyncWorker"]
