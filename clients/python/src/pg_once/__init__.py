"""pg_once: compute each expensive cacheable key once across processes, with PostgreSQL.

    from pg_once import Client
    once = Client("host=db dbname=app")
    page = once.get_or_compute("https://example.com/a", lambda: scrape(...), ttl=3600)

See README.md for AsyncClient, the cached decorator, the queue worker loop and
connection setups (direct, PgBouncer transaction mode, psycopg_pool).
"""

from ._async.client import AsyncClient
from ._async.worker import AsyncWorker
from ._common import JSON, Job, JSONSerializer, Outcome, Serializer
from ._sync.client import Client
from ._sync.worker import Worker
from .errors import (ClaimLost, ConfigurationError, NotSerializable, OnceError, OnceFailed,
                     OnceTimeout)

__all__ = ["Client", "AsyncClient", "Worker", "AsyncWorker", "Job", "Outcome", "Serializer",
           "JSONSerializer", "JSON", "OnceError", "OnceFailed", "OnceTimeout", "ClaimLost",
           "NotSerializable", "ConfigurationError"]
__version__ = "0.2.0"
