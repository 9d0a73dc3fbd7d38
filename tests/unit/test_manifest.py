from pathlib import Path

import pytest

from modelops import ManifestError, load_manifest, parse_manifest

REPO = Path(__file__).resolve().parents[2]
GOOD = {"model_id": "all-minilm-l6-v2", "version": "1", "source": "s3://models/m/1/", "task": "embed"}


def test_example_manifest_loads():
    m = load_manifest(REPO / "deployments/models/all-minilm-l6-v2.yaml")
    assert (m.model_id, m.version, m.task, m.packaging, m.strategy) == ("all-minilm-l6-v2", "1", "embed", "vllm-backend", "auto")
    assert m.engine_args == {"dtype": "float32", "max_model_len": 256}
    assert m.is_s3


def test_integer_version_becomes_text():
    assert parse_manifest({**GOOD, "version": 2}).version == "2"


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"model_id": None}, "model_id: required field is missing"),
        ({"colour": "blue"}, "colour: unknown field"),
        ({"model_id": "All_MiniLM"}, "model_id:"),
        ({"version": "../1"}, "version:"),
        ({"task": "classify"}, "task:"),
        ({"packaging": "tensorrt-llm"}, "packaging:"),
        ({"packaging": "python-backend"}, "io_schema: required with packaging python-backend"),
        ({"strategy": "canary"}, "strategy:"),
        ({"source": "http://example.com/m"}, "source: unsupported scheme"),
        ({"source": "s3://"}, "source:"),
        ({"source": "file://tmp/model"}, "source: 'file://tmp/model' names a host: a local directory needs three"),
        ({"engine_args": {"model": "/elsewhere"}}, "engine_args.model is not allowed"),
        ({"engine_args": {"disable_log_stats": True}}, "engine_args.disable_log_stats is not allowed: kept False"),
        ({"engine_args": "fast"}, "engine_args:"),
        ({"routing": {"policy": "random"}}, "routing.policy: Input should be 'prefix-affinity', 'least-request' or"),
        ({"routing": {"prefix_bytes": 8}}, "routing.prefix_bytes: Input should be greater than or equal to 16"),
        ({"routing": {"load_bound": 1}}, "routing.load_bound: Input should be greater than or equal to 1.01"),
        ({"routing": {"polcy": "round-robin"}}, "routing.polcy: unknown field; allowed: policy, prefix_bytes, load_bound"),
        ({"routing": {"policy": "round-robin", "prefix_bytes": 512}},
         "routing: prefix_bytes is a setting of policy prefix-affinity; policy round-robin has none (remove it)"),
        ({"routing": {"policy": "least-request", "load_bound": 3}}, "routing: load_bound is a setting of policy"),
        ({"routing": {"prefix_bytes": "1024"}}, "routing.prefix_bytes: Input should be a valid integer"),
        ({"routing": {"prefix_bytes": True}}, "routing.prefix_bytes: Input should be a valid integer"),
        ({"routing": {"load_bound": "2"}}, "routing.load_bound: Input should be a valid number"),
        ({"routing": {"load_bound": float("nan")}}, "routing.load_bound: Input should be a finite number"),
        ({"routing": "rr"}, "routing.policy: Input should be 'prefix-affinity', 'least-request' or 'round-robin'"),
        ({"limits": {"max_request_tokens": 0}}, "limits.max_request_tokens: Input should be greater than or equal to 1"),
        ({"limits": {"max_request_tokens": "8k"}}, "limits.max_request_tokens: Input should be a valid integer"),
        ({"limits": {"max_request_share": 1.5}}, "limits.max_request_share: Input should be less than or equal to 1"),
        ({"limits": {"max_request_share": 0}}, "limits.max_request_share: Input should be greater than 0"),
        ({"limits": {"max_tokens": 5}}, "limits.max_tokens: unknown field; allowed: max_request_tokens, max_request_"),
        ({"limits": {"max_request_tokens": 9000}}, "limits: only for task generate"),  # GOOD is an embed model
    ],
)
def test_bad_fields_are_named(change, expected):
    data = {**GOOD, **change}
    data = {k: v for k, v in data.items() if v is not None}
    with pytest.raises(ManifestError) as e:
        parse_manifest(data)
    assert expected in str(e.value)


def test_unknown_field_lists_allowed_fields():
    with pytest.raises(ManifestError, match="allowed: model_id, version, source"):
        parse_manifest({**GOOD, "sorce": "x"})


def test_not_a_mapping(tmp_path):
    p = tmp_path / "m.yaml"
    p.write_text("- a\n- b\n")
    with pytest.raises(ManifestError, match="expected a mapping"):
        load_manifest(p)


def test_invalid_yaml_and_missing_file(tmp_path):
    p = tmp_path / "m.yaml"
    p.write_text("model_id: [unclosed\n")
    with pytest.raises(ManifestError, match="not valid YAML") as e:
        load_manifest(p)
    assert f'in "{p}", line 2' in str(e.value)  # the file, not "<unicode string>"
    with pytest.raises(ManifestError, match="cannot read manifest"):
        load_manifest(tmp_path / "absent.yaml")


def test_io_schema_hash_depends_on_task_only():
    a = parse_manifest(GOOD)
    b = parse_manifest({**GOOD, "version": "2", "engine_args": {"dtype": "float32"}})
    c = parse_manifest({**GOOD, "task": "generate"})
    assert a.io_schema_hash() == b.io_schema_hash() != c.io_schema_hash()


def test_relative_local_source_is_relative_to_the_manifest(tmp_path):
    (tmp_path / "sub").mkdir()
    p = tmp_path / "sub" / "m.yaml"
    p.write_text("model_id: m\nversion: 1\nsource: weights/here\ntask: embed\n")
    assert load_manifest(p).source == str(tmp_path / "sub" / "weights" / "here")


def test_missing_field_gets_a_fix():
    with pytest.raises(ManifestError, match=r"task: required field is missing \(use embed or generate \(or tabular"):
        parse_manifest({k: v for k, v in GOOD.items() if k != "task"})


def test_an_unquoted_integer_version_is_kept_as_written(tmp_path):
    for written in ("010", "0x1F", "4"):  # YAML 1.1 alone would give 8, 31 and 4
        p = tmp_path / f"v{written}.yaml"
        p.write_text(f"model_id: m\nversion: {written}\nsource: s3://b/m/\ntask: embed\n")
        assert load_manifest(p).version == written


XGB = {"model_id": "fraud", "version": "1", "source": "s3://models/fraud/1/", "framework": "xgboost",
       "io_schema": {"inputs": [{"name": "input__0", "datatype": "FP32", "dims": [8]}],
                     "outputs": [{"name": "output__0", "datatype": "FP32", "dims": [1]}]}}


def test_framework_decides_the_defaults():
    m = parse_manifest(XGB)
    assert (m.framework, m.task, m.packaging, m.execution_mode) == ("xgboost", "tabular", "python-backend", "separate")
    assert parse_manifest({**XGB, "execution_mode": "embedded"}).execution_mode == "embedded"
    llm = parse_manifest(GOOD)
    assert (llm.framework, llm.packaging, llm.execution_mode) == ("vllm", "vllm-backend", "embedded")
    # One more feature is another I/O schema (a versioned rollout), the same one is not.
    wider = {**XGB, "io_schema": {**XGB["io_schema"], "inputs": [{"name": "input__0", "datatype": "FP32", "dims": [9]}]}}
    assert parse_manifest(wider).io_schema_hash() != m.io_schema_hash() == parse_manifest({**XGB, "version": "2"}).io_schema_hash()


@pytest.mark.parametrize(("change", "expected"), [
    ({"task": "embed"}, "task: 'embed' is not served for framework xgboost; use task: tabular"),
    ({"packaging": "vllm-backend"}, "packaging: 'vllm-backend' is not served for framework xgboost"),
    ({"engine_args": {"dtype": "float32"}}, "engine_args: vLLM settings; framework xgboost runs no vLLM engine"),
    ({"io_schema": None}, "io_schema: required with packaging python-backend"),
    ({"framework": "tensorflow"}, "framework:"),
    ({"framework": None}, "task: tabular is served for framework xgboost only"),
])
def test_xgboost_manifest_refusals_name_the_field(change, expected):
    data = {k: v for k, v in {**XGB, **change}.items() if v is not None}
    if "framework" in change and change["framework"] is None:
        data["task"] = "tabular"
    with pytest.raises(ManifestError) as e:
        parse_manifest(data)
    assert expected in str(e.value)


def test_the_lifecycle_deployment_schema_takes_what_the_manifest_takes():
    """Prefect's server checks an event's payload against the flow's parameter schema before it makes a run."""
    from prefect.utilities.callables import parameter_schema
    from prefect.utilities.schema_tools.validation import validate

    from flows.lifecycle import model_lifecycle

    schema = parameter_schema(model_lifecycle.fn).model_dump()
    without_task = {k: v for k, v in GOOD.items() if k != "task"}
    for payload in (GOOD, XGB, {**XGB, "execution_mode": "embedded"}, without_task):
        assert validate({"manifest": payload}, schema) == [], payload
    # A payload without task reaches the flow, whose validation names the field.
    with pytest.raises(ManifestError, match="task: required field is missing"):
        parse_manifest(without_task)
    wrong = validate({"manifest": {**GOOD, "model_id": "Bad_ID"}}, schema)
    assert [e.json_path for e in wrong] == ["$.manifest.model_id"]


def test_routing_defaults_to_prefix_affinity_and_is_not_part_of_the_io_schema():
    from modelops.routing import Routing

    m = parse_manifest(GOOD)
    assert m.routing == Routing(policy="prefix-affinity", prefix_bytes=1024, load_bound=2.0)
    other = parse_manifest({**GOOD, "routing": {"policy": "round-robin"}})
    assert other.routing.policy == "round-robin" and other.io_schema_hash() == m.io_schema_hash()  # red-black still
    assert parse_manifest({**GOOD, "routing": "least-request"}).routing == Routing(policy="least-request")
    # What the registry stores comes back the same (strict types through JSON).
    tuned = parse_manifest({**GOOD, "routing": {"prefix_bytes": 100, "load_bound": 3}})
    assert type(tuned).model_validate_json(tuned.model_dump_json()).routing == tuned.routing
    for wrong in (None, 5, [], ["round-robin"]):  # neither a policy nor a mapping: both forms are named
        with pytest.raises(ManifestError, match=r"routing: got .*routing: prefix-affinity \| least-request"):
            parse_manifest({**GOOD, "routing": wrong})


def test_request_limits_are_generate_only_and_survive_the_registry_round_trip():
    from modelops.limits import RequestLimits

    m = parse_manifest({**GOOD, "task": "generate", "limits": {"max_request_tokens": 8192}})
    assert m.limits == RequestLimits(max_request_tokens=8192) and m.limits.max_request_share is None
    assert type(m).model_validate_json(m.model_dump_json()).limits == m.limits
    assert parse_manifest(GOOD).limits == RequestLimits()  # embed: no limits, defaults untouched


@pytest.mark.parametrize("routing", ["least-request", "round-robin", {"prefix_bytes": 64}])
def test_every_routing_policy_survives_the_registry_round_trip(routing):
    """The registry stores the manifest as JSON and `modelops up` validates it again: another
    policy's dump must not carry prefix-affinity's settings back in (it did, and `up` crashed)."""
    m = parse_manifest({**GOOD, "routing": routing})
    again = type(m).model_validate_json(m.model_dump_json())
    assert again.routing == m.routing and again == m
    # What an earlier modelops stored (every field, defaults included) still loads.
    stored = {**m.model_dump(mode="json"), "routing": {"policy": m.routing.policy, "prefix_bytes": 1024,
                                                       "load_bound": 2.0}}
    assert type(m).model_validate(stored).routing.policy == m.routing.policy


@pytest.mark.parametrize("path", sorted((REPO / "deployments" / "models").glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_manifest_is_valid(path):
    m = load_manifest(path)
    assert m.model_id and m.source.startswith("s3://") and m.task in ("embed", "generate")


@pytest.mark.parametrize("cpus", [float("inf"), float("nan"), 0, -1, 4096])
def test_resources_cpus_must_be_a_finite_count_of_cores(cpus):
    with pytest.raises(ManifestError, match=r"resources\.cpus"):
        parse_manifest({**GOOD, "resources": {"cpus": cpus}})


@pytest.mark.parametrize("memory_gb", [float("inf"), float("nan"), 0, 10**6])
def test_resources_memory_must_be_a_finite_size(memory_gb):
    # An infinity would reach Prefect's event as null and fail the trigger with no flow run.
    with pytest.raises(ManifestError, match=r"resources\.memory_gb"):
        parse_manifest({**GOOD, "resources": {"memory_gb": memory_gb}})
