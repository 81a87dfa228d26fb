"""pg_once: compute each expensive cacheable key once across processes, with PostgreSQL.

    from pg_once import Client
    once = Client("host=db dbname=app")
    page = once.get_or_compute("https://example.com/a", lambda: scrape(...), ttl=3600)

See README.md for AsyncClient, the cached decorator, the queue worker loop and
connection setups (direct, PgBouncer transaction mode, psycopg_pool).
"""

from ._common import Job
from .aio import AsyncClient, AsyncWorker
from .client import Client
from .errors import (ClaimLost, ConfigurationError, NotSerializable, OnceError, OnceFailed,
                     OnceTimeout)
from .worker import Worker

__all__ = ["Client", "AsyncClient", "Worker", "AsyncWorker", "Job", "OnceError", "OnceFailed",
           "OnceTimeout", "ClaimLost", "NotSerializable", "ConfigurationError"]
__version__ = "0.2.0"
