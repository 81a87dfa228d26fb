"""Generate the sync client, pg_once/_sync/{client,idempotency,listener,worker}.py, from the asyncio
one in pg_once/_async/, with unasync (drop async/await, rename the Async* names), the way
httpcore keeps its two flavours. Run it after changing anything in _async/ (except
_compat.py, which each flavour has by hand):

    python clients/python/tools/generate_sync.py

tests/test_generated.py fails while a generated file is out of date."""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Dict

import unasync

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "pg_once"
GENERATED = ("client.py", "idempotency.py", "listener.py", "worker.py")
RENAMES = {
    "AsyncClient": "Client",
    "AsyncClaim": "Claim",
    "AsyncIdempotency": "Idempotency",
    "AsyncRequestClaim": "RequestClaim",
    "AsyncWorker": "Worker",
    "AsyncListener": "Listener",
    "AsyncConnectionPool": "ConnectionPool",
    "AsyncConnection": "Connection",
}
HEADER = ("# Generated from pg_once/_async/{name} by tools/generate_sync.py: edit that file,\n"
          "# not this one, then run the tool again.\n")


def generate() -> Dict[str, str]:
    """The text of each generated file."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "_async"
        src.mkdir()
        for name in GENERATED:
            shutil.copy(PACKAGE / "_async" / name, src / name)
        unasync.unasync_files([str(src / name) for name in GENERATED],
                              [unasync.Rule("/_async/", "/_sync/", additional_replacements=RENAMES)])
        out = {}
        for name in GENERATED:
            text = (Path(tmp) / "_sync" / name).read_text()
            # unasync renames names, not words inside docstrings and comments.
            text = re.sub(r"\bAsync(Client|Claim|RequestClaim|Idempotency|Worker|Listener)\b", r"\1", text)
            # What compute returns: Await[T] (an awaitable of T) is T for threads.
            text = re.sub(r"\bA\.Await\[(\w+)\]", r"\1", text)
            out[name] = HEADER.format(name=name) + text
        return out


def main() -> int:
    for name, text in generate().items():
        (PACKAGE / "_sync" / name).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
