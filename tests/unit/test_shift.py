"""tasks/traffic/shift.py: I/O schema differences, the strategy and the weight plan, on a real
SQLite registry."""

import pytest

from modelops import Registry
from modelops.errors import TrafficError
from tasks.traffic.shift import choose_strategy, plan_weights, resolve_strategy, schema_diff
from tests.conftest import parsed_manifest


def _m(version: str, **fields):
    return parsed_manifest(version=version, **fields)


@pytest.fixture
def registry(tmp_path):
    return Registry(f"sqlite:///{tmp_path / 'r.db'}")


def _serve(registry, manifest, weight=100):
    registry.record_announcement(manifest)
    registry.set_state(manifest.model_id, manifest.version, "serving")
    registry.set_weights(manifest.model_id, {manifest.version: weight})


PY = {"packaging": "python-backend", "io_schema": {
    "inputs": [{"name": "text_input", "datatype": "BYTES", "dims": [1]}],
    "outputs": [{"name": "embedding", "datatype": "FP32", "dims": [-1]},
                {"name": "num_input_tokens", "datatype": "INT32", "dims": [1]}]}}


def test_first_version_takes_all_traffic(registry):
    assert resolve_strategy(_m("1"), registry) == "first"
    assert plan_weights(_m("1"), registry, "first") == {"1": 100}


def test_same_schema_is_red_black_changed_schema_is_versioned(registry):
    _serve(registry, _m("1"))
    assert resolve_strategy(_m("2"), registry) == "red-black"
    assert plan_weights(_m("2"), registry, "red-black") == {"2": 100, "1": 0}
    assert resolve_strategy(_m("3", task="generate"), registry) == "versioned"
    assert plan_weights(_m("3", task="generate"), registry, "versioned") == {"3": 0}
    assert resolve_strategy(_m("4", strategy="versioned"), registry) == "versioned"


def test_schema_diff_and_strategy(registry):
    assert schema_diff(_m("1"), _m("2", **PY)) == []  # same tensors, different packaging
    changed = {**PY, "io_schema": {**PY["io_schema"], "inputs": [{"name": "text_input", "datatype": "BYTES",
                                                                   "dims": [1]},
                                                                  {"name": "lang", "datatype": "BYTES", "dims": [1],
                                                                   "optional": True}]}}
    assert schema_diff(_m("1"), _m("3", **changed)) == ["input lang: added (BYTES [1])"]
    assert choose_strategy(_m("1"), registry)[0] == "first"
    registry.record_announcement(_m("1"))
    registry.set_state("m", "1", "serving")
    assert choose_strategy(_m("2"), registry) == ("red-black", "the I/O schema equals the serving version (1)")
    strategy, why = choose_strategy(_m("3", **changed), registry)
    assert strategy == "versioned" and "input lang: added (BYTES [1])" in why
    with pytest.raises(TrafficError, match="strategy red-black needs an unchanged I/O schema.*input lang: added"):
        choose_strategy(_m("4", strategy="red-black", **changed), registry)
