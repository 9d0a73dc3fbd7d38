import hashlib
import json

import pytest

from modelops import PackageError, get_settings, parse_manifest
from tasks.package import build_package

from tests.conftest import write_fake_model


def test_vllm_backend_package(home, tmp_path):
    weights = tmp_path / "w"
    write_fake_model(weights)
    m = parse_manifest({"model_id": "mini", "version": "3", "source": str(weights), "task": "embed",
                        "engine_args": {"dtype": "float32", "max_model_len": 256}})
    pkg = build_package(m, weights, "abc123")
    assert pkg.path == get_settings().packages_dir / "mini" / "3"
    cfg = (pkg.path / "model_repository/mini/config.pbtxt").read_text()
    assert 'backend: "vllm"' in cfg and 'string_value: "embed"' in cfg and "input" not in cfg
    args = json.loads((pkg.path / "model_repository/mini/1/model.json").read_text())
    assert args == {"dtype": "float32", "max_model_len": 256, "model": str(weights), "tokenizer": str(weights),
                    "runner": "pooling", "disable_log_stats": True}
    meta = json.loads((pkg.path / "package.json").read_text())
    assert meta["runtime_lock_hash"] == "abc123" and meta["triton_model"] == "mini"
    for rel, digest in meta["files"].items():
        assert hashlib.sha256((pkg.path / rel).read_bytes()).hexdigest() == digest
    mtime = (pkg.path / "package.json").stat().st_mtime_ns
    assert build_package(m, weights, "abc123") == pkg
    assert (pkg.path / "package.json").stat().st_mtime_ns == mtime  # sealed package reused


def test_package_needs_materialized_weights(home, tmp_path):
    m = parse_manifest({"model_id": "mini", "version": "1", "source": str(tmp_path), "task": "generate"})
    with pytest.raises(PackageError, match="has no config.json; materialize it first"):
        build_package(m, tmp_path / "absent", "abc")
