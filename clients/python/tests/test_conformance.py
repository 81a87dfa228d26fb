"""clients/conformance: the offline vectors (no server needed, always run) and the
scenarios (against each setup, with the sync and the async client)."""

from __future__ import annotations

import asyncio
import json

import pytest

from pg_once import _common as C
from pg_once._keys import CacheKeys, derive_key

from conformance import ROOT, cases, load, same, value
from conftest import make_setup


# -- offline vectors ----------------------------------------------------------------------

@pytest.mark.parametrize("case", cases("vectors", "keys.json"))
def test_default_key(case):
    def derive():
        if "python_params" not in case:
            return derive_key(case["function"], value(case["args"]))
        namespace: dict = {}
        exec(f"def report({case['python_params']}): pass", namespace)
        keys = CacheKeys(namespace["report"], None, case["function"])
        return keys(tuple(value(case["args"])), value(case.get("kwargs", {})))
    if "error" in case:
        with pytest.raises(TypeError, match="key="):
            derive()
    else:
        assert derive() == case["key"]


@pytest.mark.parametrize("case", cases("vectors", "values.json"))
def test_default_serializer(case):
    v = value(case["value"])
    if "error" in case:
        with pytest.raises(C.NotSerializable, match="serializer="):
            C.dump_value("k", C.JSON, v)
        return
    text = C.dump_value("k", C.JSON, v)
    assert same(json.loads(text), value(case["stored"]))
    assert same(C.JSON.loads(text), value(case["returns"]))


@pytest.mark.parametrize("case", cases("vectors", "options.json"))
def test_options(case):
    options = value(case["options"])
    if "error" in case:
        with pytest.raises((ValueError, TypeError)):
            C.call_options(case["key"], **options)
    else:
        C.call_options(case["key"], **options)


@pytest.mark.parametrize("case", cases("vectors", "retry.json"))
def test_retry(case):
    assert C.retryable(case["sqlstate"], case["connection_lost"]) is case["retry"]


# -- scenarios ------------------------------------------------------------------------------

SCENARIOS = [param for name in sorted(p.name for p in (ROOT / "scenarios").glob("*.json"))
             for param in cases("scenarios", name)]


@pytest.mark.parametrize("flavor", ["sync", "async"])
@pytest.mark.parametrize("where", ["direct", "bouncer", "tls", "standby_first_kv",
                                   "standby_first_url"])
@pytest.mark.parametrize("case", SCENARIOS)
def test_scenario(case, where, flavor, extension):
    from conformance import Scenario
    # A file that names its setups runs only there; the others run everywhere but there.
    kind = {"bouncer": "pgbouncer"}.get(where, where)
    kind = "standby_first" if where.startswith("standby_first") else kind
    if kind not in case.get("setups", ["direct", "pgbouncer", "tls"]):
        pytest.skip(f"not a scenario of the {where} setup")
    asyncio.run(Scenario(case, make_setup(where), flavor).run())
