import hashlib
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from modelops import PackageError, get_settings, parse_manifest
from modelops.manifest import VERSION_PATTERN, triton_version
from tasks.package import build_package

from tests.conftest import write_fake_model


def test_vllm_backend_package(home, tmp_path):
    from modelops.archive import unpack

    weights = tmp_path / "w"
    write_fake_model(weights)
    m = parse_manifest({"model_id": "mini", "version": "3", "source": str(weights), "task": "embed",
                        "engine_args": {"dtype": "float32", "max_model_len": 256}})
    pkg = build_package(m, weights, "abc123")
    assert pkg.path == get_settings().packages_dir / "mini" / "3"
    assert sorted(p.name for p in pkg.path.iterdir()) == ["package.json", "package.tar.gz"]
    meta = unpack(pkg.path, tmp_path / "out")
    out = tmp_path / "out"
    cfg = (out / "model_repository/mini/config.pbtxt").read_text()
    assert 'backend: "vllm"' in cfg and 'string_value: "embed"' in cfg and "input" not in cfg
    # Version 3 is a Triton version: its folder, so KServe's model_version, is "3".
    args = json.loads((out / "model_repository/mini/3/model.json").read_text())
    assert args == {"dtype": "float32", "max_model_len": 256, "model": str(weights), "tokenizer": str(weights),
                    "runner": "pooling", "disable_log_stats": False, "served_model_name": "mini"}
    deployment = json.loads((out / "deployment.json").read_text())
    assert deployment == {"execution_mode": "embedded", "plugins": [], "strategy": "auto",
                          "resources": {"cpus": 2.0, "memory_gb": 8.0, "gpus": 0}}
    assert meta["runtime_lock_hash"] == "abc123" and meta["triton_model"] == "mini"
    assert meta["archive_sha256"] == hashlib.sha256((pkg.path / "package.tar.gz").read_bytes()).hexdigest()
    assert sorted(meta["files"]) == ["deployment.json", "model_repository/mini/3/model.json",
                                     "model_repository/mini/config.pbtxt"]
    for rel, digest in meta["files"].items():
        assert hashlib.sha256((out / rel).read_bytes()).hexdigest() == digest
    mtime = (pkg.path / "package.json").stat().st_mtime_ns
    assert build_package(m, weights, "abc123") == pkg
    assert (pkg.path / "package.json").stat().st_mtime_ns == mtime  # sealed package reused
    # Same inputs elsewhere give the same archive bytes (deterministic sealing).
    again = build_package(m, weights, "abc123", settings=get_settings().model_copy(update={"home": tmp_path / "h2"}))
    assert (again.path / "package.tar.gz").read_bytes() == (pkg.path / "package.tar.gz").read_bytes()


def test_package_needs_materialized_weights(home, tmp_path):
    m = parse_manifest({"model_id": "mini", "version": "1", "source": str(tmp_path), "task": "generate"})
    with pytest.raises(PackageError, match="has no config.json; materialize it first"):
        build_package(m, tmp_path / "absent", "abc")


SCHEMA = {
    "max_model_len": {"type": "int", "nullable": False},
    "max_num_seqs": {"type": "int", "nullable": True},
    "dtype": {"type": "choice", "nullable": False, "choices": ["auto", "float32"]},
    "enforce_eager": {"type": "bool", "nullable": False},
    "gpu_memory_utilization": {"type": "float", "nullable": False},
    "hf_overrides": {"type": "other", "nullable": True},
}


def test_engine_args_checked_against_the_runtime_schema():
    from modelops import ManifestError
    from tasks.package import check_engine_args

    check_engine_args({"max_model_len": 256, "dtype": "float32", "gpu_memory_utilization": 1, "max_num_seqs": None,
                       "hf_overrides": {"x": 1}, "enforce_eager": True}, SCHEMA, "0.32.0")
    with pytest.raises(ManifestError) as e:
        check_engine_args({"max_model_length": 256, "max_model_len": "big", "dtype": "fp8", "enforce_eager": 1},
                          SCHEMA, "0.32.0")
    msg = str(e.value)
    assert "engine_args.max_model_length: not an engine arg of vLLM 0.32.0 (did you mean max_model_len" in msg
    assert "engine_args.max_model_len: expected int, got 'big'" in msg
    assert "engine_args.dtype: 'fp8' is not one of ['auto', 'float32']" in msg
    assert "engine_args.enforce_eager: expected bool, got 1" in msg


def test_bad_engine_args_fail_before_writing(home, tmp_path):
    import json as _json

    from modelops import ManifestError

    weights = tmp_path / "w"
    write_fake_model(weights)
    schema = tmp_path / "engine_args.json"
    schema.write_text(_json.dumps(SCHEMA))
    m = parse_manifest({"model_id": "mini", "version": "1", "source": str(weights), "task": "embed",
                        "engine_args": {"max_model_len": "big"}})
    with pytest.raises(ManifestError, match="engine_args.max_model_len"):
        build_package(m, weights, "abc", engine_args_schema=schema, vllm_version="0.32.0")
    assert not (get_settings().packages_dir / "mini").exists()


def _python_backend(weights, **change):
    return parse_manifest({
        "model_id": "mini-py", "version": "1", "source": str(weights), "task": "embed",
        "packaging": "python-backend",
        "io_schema": {"inputs": [{"name": "text_input", "datatype": "BYTES", "dims": [1]}],
                      "outputs": [{"name": "embedding", "datatype": "FP32", "dims": [-1]},
                                  {"name": "num_input_tokens", "datatype": "INT32", "dims": [1]}]},
        **change})


def test_python_backend_package_has_explicit_io_and_the_template(home, tmp_path):
    from modelops.archive import unpack
    from tasks.package import PYTHON_BACKEND_TEMPLATE

    weights = tmp_path / "w"
    write_fake_model(weights)
    pkg = build_package(_python_backend(weights), weights, "abc")
    assert pkg.packaging == "python-backend"
    out = tmp_path / "out"
    unpack(pkg.path, out)
    cfg = (out / "model_repository/mini-py/config.pbtxt").read_text()
    assert 'backend: "python"' in cfg and "max_batch_size: 64" in cfg and "dynamic_batching { }" in cfg
    assert '{ name: "text_input" data_type: TYPE_STRING dims: [ 1 ] }' in cfg
    assert '{ name: "embedding" data_type: TYPE_FP32 dims: [ -1 ] }' in cfg
    assert (out / "model_repository/mini-py/1/model.py").read_text() == PYTHON_BACKEND_TEMPLATE.read_text()


@pytest.mark.parametrize("io_schema, expected", [
    # the frontend sends BYTES text_input; FP32 would fail every request at runtime
    ({"inputs": [{"name": "text_input", "datatype": "FP32", "dims": [1]}]},
     "io_schema.inputs.text_input: declared FP32 [1], the frontend sends BYTES [1]"),
    ({"inputs": [{"name": "prompt", "datatype": "BYTES", "dims": [-1]}]},
     "io_schema.inputs.text_input: missing; the frontend sends it for task embed"),
    ({"outputs": [{"name": "embedding", "datatype": "FP32", "dims": [-1, -1]},
                  {"name": "num_input_tokens", "datatype": "INT32", "dims": [1]}]},
     "io_schema.outputs.embedding: declared FP32 [-1, -1], the frontend reads FP32 [-1]"),
    ({"inputs": [{"name": "text_input", "datatype": "BYTES", "dims": [-1]},
                 {"name": "temperature", "datatype": "FP32", "dims": [1]}]},
     "io_schema.inputs.temperature: required by the model but the frontend never sends it"),
])
def test_python_backend_spec_mismatch_fails_the_package_step(home, tmp_path, io_schema, expected):
    from modelops import ManifestError

    weights = tmp_path / "w"
    write_fake_model(weights)
    base = _python_backend(weights).io_schema.model_dump()
    m = _python_backend(weights, io_schema={**base, **io_schema})
    with pytest.raises(ManifestError) as e:
        build_package(m, weights, "abc")
    assert expected in str(e.value)
    assert not (get_settings().packages_dir / "mini-py").exists()


def test_python_backend_model_py_is_checked(home, tmp_path):
    from modelops import ManifestError

    weights = tmp_path / "w"
    write_fake_model(weights)
    bad = tmp_path / "model.py"
    bad.write_text("class Model:\n    pass\n")
    with pytest.raises(ManifestError, match="defines no class TritonPythonModel"):
        build_package(_python_backend(weights, model_py=str(bad)), weights, "abc")


def test_runtime_override_refused_before_anything_is_written(home, tmp_path):
    from modelops import ManifestError

    weights = tmp_path / "w"
    write_fake_model(weights)
    m = parse_manifest({"model_id": "mini", "version": "1", "source": str(weights), "task": "embed",
                        "runtime": {"vllm": "0.11.0"}})
    with pytest.raises(ManifestError, match="runtime.vllm: '0.11.0' asked, but vllm is pinned to 0.32.0"):
        build_package(m, weights, "abc")
    assert not (get_settings().packages_dir / "mini").exists()


XGB_SCHEMA = {"inputs": [{"name": "input__0", "datatype": "FP32", "dims": [6]}],
              "outputs": [{"name": "output__0", "datatype": "FP32", "dims": [3]}]}


def test_xgboost_package_is_a_python_backend_model_in_separate_mode(home, tmp_path):
    from modelops import ManifestError
    from modelops.archive import unpack
    from tasks.package import XGBOOST_TEMPLATE

    weights = tmp_path / "w"
    weights.mkdir()
    (weights / "model.ubj").write_bytes(b"{not read here: the runtime probe reads it}")
    m = parse_manifest({"model_id": "fraud", "version": "1", "source": str(weights), "framework": "xgboost",
                        "io_schema": XGB_SCHEMA, "resources": {"cpus": 3}})
    assert (m.task, m.packaging, m.execution_mode) == ("tabular", "python-backend", "separate")
    facts = {"num_features": 6, "num_outputs": 3, "objective": "multi:softprob", "xgboost": "3.2.0"}
    pkg = build_package(m, weights, "abc", model_facts=facts)
    assert (pkg.task, pkg.execution_mode) == ("tabular", "separate")
    meta = unpack(pkg.path, tmp_path / "out")
    repo = tmp_path / "out" / "model_repository" / "fraud"
    cfg = (repo / "config.pbtxt").read_text()
    assert 'backend: "python"' in cfg and "max_batch_size: 4096" in cfg and "dynamic_batching { }" in cfg
    assert '{ name: "input__0" data_type: TYPE_FP32 dims: [ 6 ] }' in cfg
    assert '{ name: "output__0" data_type: TYPE_FP32 dims: [ 3 ] }' in cfg and "decoupled" not in cfg
    assert json.loads((repo / "1" / "model.json").read_text()) == {"model_file": str(weights / "model.ubj"), "nthread": 3}
    assert (repo / "1" / "model.py").read_bytes() == XGBOOST_TEMPLATE.read_bytes()
    assert json.loads((tmp_path / "out" / "deployment.json").read_text())["execution_mode"] == "separate"
    assert meta["framework"] == "xgboost"
    # The model file's facts decide: a schema off them fails before anything is written.
    with pytest.raises(ManifestError, match=r"io_schema.outputs.output__0: declares 3 prediction values per row, "
                                            r"the model file has 1"):
        build_package(m.model_copy(update={"version": "2"}), weights, "abc", model_facts={**facts, "num_outputs": 1})
    assert not (get_settings().packages_dir / "fraud" / "2").exists()
    (weights / "model.ubj").rename(weights / "other.bin")
    with pytest.raises(PackageError, match="holds no XGBoost model file"):
        build_package(m.model_copy(update={"version": "3"}), weights, "abc", model_facts=facts)


@pytest.mark.parametrize(("io_schema", "expected"), [
    ({**XGB_SCHEMA, "inputs": [{"name": "input__0", "datatype": "FP32", "dims": [-1, 6]}]},
     r"io_schema.inputs.input__0: dims \[-1, 6\].*dims exclude the batch dimension: write \[6\]"),
    ({**XGB_SCHEMA, "inputs": [{"name": "input__0", "datatype": "FP64", "dims": [6]}]},
     "io_schema.inputs.input__0: datatype FP64; the XGBoost template uses FP32"),
    ({**XGB_SCHEMA, "outputs": [{"name": n, "datatype": "FP32", "dims": [1]} for n in ("a", "b")]},
     "io_schema.outputs: declare exactly one tensor"),
    ({**XGB_SCHEMA, "outputs": [{"name": "o", "datatype": "FP32", "dims": [-1]}]}, "declare the prediction values"),
])
def test_xgboost_io_schema_is_checked_before_anything_is_written(home, tmp_path, io_schema, expected):
    from modelops import ManifestError
    from tasks.package import preflight

    m = parse_manifest({"model_id": "fraud", "version": "1", "source": str(tmp_path), "framework": "xgboost",
                        "io_schema": io_schema})
    with pytest.raises(ManifestError, match=expected):
        preflight(m)  # what `modelops announce` runs before emitting the event


def test_python_backend_generate_must_declare_all_frontend_inputs_and_bring_model_py(home, tmp_path):
    from modelops import ManifestError

    weights = tmp_path / "w"
    write_fake_model(weights)
    model_py = tmp_path / "model.py"
    model_py.write_text("class TritonPythonModel:\n    pass\n")
    outputs = [{"name": "openai_response", "datatype": "BYTES", "dims": [1]},
               {"name": "openai_status", "datatype": "INT32", "dims": [1]},
               {"name": "openai_final", "datatype": "BOOL", "dims": [1]}]
    only_text = {"inputs": [{"name": "text_input", "datatype": "BYTES", "dims": [1]}], "outputs": outputs[:2]}
    m = _python_backend(weights, task="generate", io_schema=only_text)
    with pytest.raises(ManifestError) as e:
        build_package(m, weights, "abc")
    assert "io_schema.inputs.openai_request: missing; the frontend sends it" in str(e.value)
    assert "io_schema.inputs.text_input: required by the model but the frontend never sends it" in str(e.value)
    assert "io_schema.outputs.openai_final: missing; the frontend reads it" in str(e.value)
    assert "model_py: required for task generate" in str(e.value)
    full = {"inputs": [{"name": "openai_request", "datatype": "BYTES", "dims": [1]},
                       {"name": "text_input", "datatype": "BYTES", "dims": [1], "optional": True}], "outputs": outputs}
    pkg = build_package(_python_backend(weights, task="generate", io_schema=full, model_py=str(model_py)), weights,
                        "abc")
    from modelops.archive import unpack

    unpack(pkg.path, tmp_path / "out")
    assert "model_transaction_policy { decoupled: true }" in (
        tmp_path / "out/model_repository/mini-py/config.pbtxt").read_text()


def test_generate_package_carries_serving_options_and_the_manifest_chat_template(home, tmp_path):
    from modelops import ManifestError
    from modelops.archive import unpack

    weights = tmp_path / "w"
    write_fake_model(weights)
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    m = parse_manifest({"model_id": "chatty", "version": "1", "source": str(weights), "task": "generate",
                        "chat_template": str(template), "tool_parser": "hermes"})
    pkg = build_package(m, weights, "abc", tool_parsers=["hermes", "llama3_json"])
    unpack(pkg.path, tmp_path / "out")
    version_dir = tmp_path / "out/model_repository/chatty/1"
    serving = json.loads((version_dir / "serving.json").read_text())
    # Only what the runtime reads (runtime/engine/openai_engine.py: ServingOptions); the structured-outputs
    # backend is in model.json's engine args.
    assert serving == {"served_model_name": "chatty", "tool_parser": "hermes", "chat_template": "chat_template.jinja",
                       "max_request_tokens": None, "max_request_share": 0.5}  # modelops.limits: the settings' defaults
    assert (version_dir / "chat_template.jinja").read_text() == template.read_text()
    engine_args = json.loads((version_dir / "model.json").read_text())
    assert engine_args["served_model_name"] == "chatty"
    assert engine_args["structured_outputs_config"] == {"backend": "guidance", "disable_any_whitespace": True}
    with pytest.raises(ManifestError, match="engine_args.structured_outputs_config is not allowed"):
        parse_manifest({"model_id": "chatty", "version": "1", "source": str(weights), "task": "generate",
                        "engine_args": {"structured_outputs_config": {"backend": "xgrammar"}}})
    # A parser the image's vLLM lacks, a template file that is not there, options on an embed model.
    bad = parse_manifest({"model_id": "chatty", "version": "2", "source": str(weights), "task": "generate",
                          "tool_parser": "hermez"})
    with pytest.raises(ManifestError, match=r"tool_parser: 'hermez' is not a tool-call parser.*use one of .*hermes"):
        build_package(bad, weights, "abc", tool_parsers=["hermes", "llama3_json"])
    gone = parse_manifest({"model_id": "chatty", "version": "3", "source": str(weights), "task": "generate",
                           "chat_template": str(tmp_path / "missing.jinja")})
    with pytest.raises(ManifestError, match="chat_template: .*missing.jinja is not a file"):
        build_package(gone, weights, "abc")
    with pytest.raises(ManifestError, match="chat_template: only for task generate"):
        parse_manifest({"model_id": "e", "version": "1", "source": str(weights), "task": "embed",
                        "chat_template": str(template)})
    with pytest.raises(ManifestError, match="served_model_name"):
        parse_manifest({"model_id": "e", "version": "1", "source": str(weights), "task": "generate",
                        "engine_args": {"served_model_name": "other"}})


def test_every_engine_arg_modelops_sets_is_refused_in_a_manifest(tmp_path):
    # One table (modelops.manifest.RESERVED_ENGINE_ARGS): what modelops sets, a manifest cannot,
    # so no user key is silently replaced.
    from modelops.manifest import RESERVED_ENGINE_ARGS
    from tasks.package import engine_args

    for task in ("embed", "generate"):
        manifest = parse_manifest({"model_id": "m", "version": "1", "source": str(tmp_path), "task": task,
                                   "engine_args": {"dtype": "float32"}})
        set_by_modelops = set(engine_args(manifest, tmp_path)) - {"dtype"}
        assert set_by_modelops <= set(RESERVED_ENGINE_ARGS), set_by_modelops - set(RESERVED_ENGINE_ARGS)



def test_request_limits_come_from_the_manifest_else_the_settings(home, tmp_path, monkeypatch):
    from modelops.archive import unpack

    weights = tmp_path / "w"
    write_fake_model(weights)
    monkeypatch.setenv("MODELOPS_MAX_REQUEST_TOKENS", "9000")
    for version, limits, expected in (("1", {}, (9000, 0.5)), ("2", {"max_request_share": 0.25}, (9000, 0.25)),
                                      ("3", {"max_request_tokens": 512}, (512, 0.5))):
        m = parse_manifest({"model_id": "limited", "version": version, "source": str(weights), "task": "generate",
                            "limits": limits})
        unpack(build_package(m, weights, "abc").path, tmp_path / version)
        serving = json.loads((tmp_path / version / f"model_repository/limited/{version}/serving.json").read_text())
        assert (serving["max_request_tokens"], serving["max_request_share"]) == expected


def test_engine_args_and_tool_parser_are_checked_against_the_pinned_image_before_any_download(home, tmp_path,
                                                                                            monkeypatch):
    """preflight (announce, validate) reads the pinned image's probe record; without a built
    image it has nothing to check against and says so (the package step checks after the build)."""
    from modelops import ManifestError
    from tasks.image import lock_hash
    from tasks.package import check_with_pinned_image, preflight

    monkeypatch.setenv("MODELOPS_RUNTIME_ROOT", str(tmp_path / "runtime"))
    m = parse_manifest({"model_id": "early", "version": "1", "source": "s3://models/early/1/", "task": "generate",
                        "engine_args": {"max_modl_len": 5}, "tool_parser": "hermez"})
    assert check_with_pinned_image(m) is False
    preflight(m)  # no image built here: nothing to refuse yet
    image = tmp_path / "runtime" / lock_hash()
    image.mkdir(parents=True)
    (image / "engine_args.json").write_text(json.dumps(SCHEMA))
    (image / "tool_parsers.json").write_text(json.dumps(["hermes"]))
    with pytest.raises(ManifestError, match=r"engine_args.max_modl_len: not an engine arg of vLLM 0.32.0 \(did you"):
        preflight(m)
    with pytest.raises(ManifestError, match=r"tool_parser: 'hermez' is not a tool-call parser of vLLM 0.32.0"):
        preflight(parse_manifest({**m.model_dump(), "engine_args": {"max_model_len": 5}}))
    # 20,000 made-up keys: one short error, at once (no suggestions past the first few).
    many = parse_manifest({**m.model_dump(), "tool_parser": None, "engine_args": {f"k{i}": 1 for i in range(20000)}})
    with pytest.raises(ManifestError) as e:
        preflight(many)
    assert str(e.value).count("\n") == 11 and str(e.value).endswith("... and 19990 more")


@given(st.one_of(st.from_regex(VERSION_PATTERN, fullmatch=True), st.integers(0, 10**20).map(str),
                 st.integers(0, 10**5).map(lambda n: f"0{n}")))
def test_a_version_folder_is_one_triton_loads_and_is_the_version_whenever_triton_can_say_it(version):
    """Triton loads a version folder named by a positive int64 without a leading zero (its model
    repository docs); every other modelops version (a label) is served as 1."""
    folder = triton_version(version)
    assert folder.isdigit() and str(int(folder)) == folder and 0 < int(folder) < 2**63
    assert (folder == version) == (version.isdigit() and str(int(version)) == version and 0 < int(version) < 10**18)
    if folder != version:
        assert folder == "1"


def test_a_labelled_version_is_packaged_as_triton_version_1(home, tmp_path):
    from modelops.archive import unpack

    weights = tmp_path / "w"
    write_fake_model(weights)
    m = parse_manifest({"model_id": "mini", "version": "2024-rc1", "source": str(weights), "task": "embed"})
    meta = unpack(build_package(m, weights, "abc").path, tmp_path / "out")
    assert "model_repository/mini/1/model.json" in meta["files"] and meta["version"] == "2024-rc1"
