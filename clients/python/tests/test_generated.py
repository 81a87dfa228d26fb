"""The sync client is generated from the asyncio one (tools/generate_sync.py): a change
made to one flavour only, or to a generated file, fails here."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))


def test_the_sync_client_is_generated_from_the_async_one():
    pytest.importorskip("unasync", reason="pip install unasync (the [test] extra) to check")
    import generate_sync
    stale = [name for name, text in generate_sync.generate().items()
             if (generate_sync.PACKAGE / "_sync" / name).read_text() != text]
    assert not stale, (f"pg_once/_sync/{', '.join(stale)} out of date: run "
                       "python clients/python/tools/generate_sync.py")


def test_the_types_keep_what_callers_rely_on():
    """get_or_compute returns compute's type, cached keeps the signature (ParamSpec):
    tests/typing_examples.py type-checks, its deliberate mistake included."""
    api = pytest.importorskip("mypy.api", reason="pip install mypy (the [test] extra) to check")
    here = Path(__file__).resolve().parent
    out, err, status = api.run(["--python-version", "3.11", "--warn-unused-ignores",
                                "--no-incremental", str(here / "typing_examples.py")])
    assert status == 0, out + err
