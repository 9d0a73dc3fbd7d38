"""The regions file (modelops/regions.py), the regional deployments (tasks/regions.py) and the
local regions file `modelops up --regions N` writes (modelops_cli/regions.py)."""

from __future__ import annotations

import pytest
import yaml
from hypothesis import given, settings as hsettings, strategies as st

from modelops.errors import ModelopsError
from modelops.regions import RegionsError, load_regions, region_env, region_settings
from modelops.settings import Settings


def _write(home, data) -> Settings:
    home.mkdir(parents=True, exist_ok=True)
    (home / "regions.yaml").write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return Settings()


def _two(home, **more) -> dict:
    return {"regions": [{"name": "r1", "work_pool": "modelops-local"},
                        {"name": "r2", "work_pool": "p2",
                         "settings": {"home": str(home / "r2"), "router_port": 8180, "router_grpc_port": 8181}}],
            **more}


def test_no_regions_file_is_one_region(home):
    assert load_regions(Settings()) is None


def test_default_waves_are_the_first_region_then_the_rest(home):
    data = _two(home)
    data["regions"].append({"name": "r3", "work_pool": "p3", "settings": {
        "home": str(home / "r3"), "router_port": 8280, "router_grpc_port": 8281}})
    plan = load_regions(_write(home, data))
    assert [[r.name for r in wave] for wave in plan.wave_plan()] == [["r1"], ["r2", "r3"]]
    explicit = load_regions(_write(home, {**data, "waves": [["r2"], ["r1", "r3"]]}))
    assert [[r.name for r in wave] for wave in explicit.wave_plan()] == [["r2"], ["r1", "r3"]]


def test_a_region_gets_the_stack_settings_with_its_overrides(home):
    plan = load_regions(_write(home, _two(home)))
    base = Settings()
    r2 = region_settings(plan.regions[1], base)
    assert (r2.router_port, r2.home_dir, r2.region, r2.work_pool) == (8180, home / "r2", "r2", "p2")
    assert r2.fsx_dir == home / "r2" / "fsx" and r2.registry.endswith("r2/registry.db")
    assert r2.prefect_port == base.prefect_port  # one Prefect server for every region
    env = region_env(plan.regions[1])
    assert env["MODELOPS_ROUTER_PORT"] == "8180" and env["MODELOPS_WORK_POOL"] == "p2"
    assert Settings(**{k.removeprefix("MODELOPS_").lower(): v for k, v in env.items()}).router_port == 8180


@pytest.mark.parametrize("change, named", [
    (lambda d, h: d.update(regions=[]), "regions"),
    (lambda d, h: d["regions"][1].update(name="r1"), "named twice"),
    (lambda d, h: d["regions"][1].update(work_pool="modelops-local"), "is given to two regions"),
    (lambda d, h: d["regions"][1]["settings"].update(router_port=Settings().router_port), "share the router port"),
    (lambda d, h: d["regions"][1]["settings"].update(home=str(h)), "share the home"),
    (lambda d, h: d["regions"][1]["settings"].update(fsx_root=str(h / "fsx")), "share the fsx_root"),
    (lambda d, h: d.update(waves=[["r1"], []]), "waves: a wave names no region"),
    (lambda d, h: d.update(waves=[]), "waves: a wave names no region"),
    (lambda d, h: d.update(waves=[["r1"], ["r9"]]), "waves: unknown region(s) r9"),
    (lambda d, h: d.update(waves=[["r1"], ["r1", "r2"]]), "in more than one wave"),
    (lambda d, h: d.update(waves=[["r1"]]), "region(s) r2 in no wave"),
    (lambda d, h: d["regions"][1].update(name="Bad_Name"), "regions.1.name"),
    (lambda d, h: d["regions"][1]["settings"].update(routerport=1), "unknown setting(s) routerport"),
    (lambda d, h: d["regions"][1]["settings"].update(prefect_port=1), "prefect_port cannot differ per region"),
    (lambda d, h: d["regions"][1]["settings"].update(work_pool="x"), "give the region's work_pool field"),
    (lambda d, h: d["regions"][1]["settings"].update(router_port="abc"), "region r2: settings: router_port"),
    (lambda d, h: d.update(on_failure="maybe"), "on_failure"),
    (lambda d, h: d["regions"][1]["settings"].update(home="relative/dir"), "home must be absolute paths"),
    (lambda d, h: d["regions"][1]["settings"].update(router_port=Settings().prefect_port),
     "the stack (prefect_port) and region r2 share the router port"),
    (lambda d, h: d["regions"][1]["settings"].update(router_grpc_port=8180), "router_grpc_port are both 8180"),
    (lambda d, h: d["regions"][1].update(name="x" * 10_000), "... (10000 characters)"),
    (lambda d, h: d.update(colour="red"), "colour"),
    (lambda d, h: d.update(bake_s=True), "bake_s: Input should be a valid number"),  # not read as 1 s
    (lambda d, h: d["regions"][1]["settings"].update(router_port=True), "router_port: true or false where"),
    (lambda d, h: d["regions"][1]["settings"].update(redblack_steps=[True, 100]), "redblack_steps: true or false"),
    (lambda d, h: d.update(region_timeout_s="600"), "region_timeout_s: Input should be a valid number"),
    (lambda d, h: d.update(region_start_timeout_s=False), "region_start_timeout_s: Input should be a valid number"),
])
def test_a_bad_regions_file_is_refused_naming_the_field(home, change, named):
    data = _two(home)
    change(data, home)
    with pytest.raises(RegionsError) as e:
        load_regions(_write(home, data))
    assert named in str(e.value) and "regions.yaml" in str(e.value)


@pytest.mark.parametrize("text, named", [
    ("regions: [unclosed", "not a readable YAML (UTF-8) file"),
    (b"\xff\xfe\x00r", "not a readable YAML (UTF-8) file"),
    ("", "is empty"),
    ("- name: a\n  work_pool: p\n", "is not a mapping"),
    ("regions:\n- name: a\n  work_pool: p\n  work_pool: q\n", "duplicate key 'work_pool'"),  # not "the last wins"
])
def test_a_regions_file_that_is_not_a_yaml_mapping_is_refused(home, text, named):
    home.mkdir(parents=True)
    (home / "regions.yaml").write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(RegionsError) as e:
        load_regions(Settings())
    assert named in str(e.value)


def test_a_region_without_settings_is_the_stack_and_null_settings_are_none(home):
    plan = load_regions(_write(home, {"regions": [{"name": "r1", "work_pool": "p", "settings": None}]}))
    assert plan.regions[0].settings == {} and region_settings(plan.regions[0], Settings()).home_dir == home


@hsettings(max_examples=60, deadline=None)
@given(st.lists(st.text(alphabet="abz09-_A.", min_size=0, max_size=45), min_size=1, max_size=4))
def test_any_region_names_are_taken_or_refused_with_the_field(tmp_path_factory, names):
    """Names from a space with bad characters, lengths and duplicates: a plan, or RegionsError."""
    home = tmp_path_factory.mktemp("h")
    regions = [{"name": n, "work_pool": f"p{i}", "settings": {"home": str(home / str(i)), "router_port": 9000 + 2 * i,
                                                              "router_grpc_port": 9001 + 2 * i}}
               for i, n in enumerate(names)]
    (home / "regions.yaml").write_text(yaml.safe_dump({"regions": regions}))
    try:
        plan = load_regions(Settings(home=home, router_port=7000, router_grpc_port=7001))
    except RegionsError as e:
        assert "regions" in str(e)
        return
    assert [r.name for r in plan.regions] == names and len(set(names)) == len(names)
    assert all(n and n[0].isalnum() and n[-1].isalnum() and n == n.lower() for n in names)


def test_regional_deployments_give_each_region_its_pool_and_settings(home):
    from tasks.regions import REGIONAL_FLOWS, regional_deployments

    plan = load_regions(_write(home, _two(home)))
    spec = regional_deployments(plan)
    got = {(d["entrypoint"], d["name"]): d["work_pool"] for d in spec["deployments"]}
    assert len(got) == 2 * len(REGIONAL_FLOWS)
    r2 = got[(REGIONAL_FLOWS["model-lifecycle"], "r2")]
    assert r2["name"] == "p2" and r2["job_variables"]["env"]["MODELOPS_HOME"] == str(home / "r2")
    assert r2["job_variables"]["env"]["MODELOPS_REGION"] == "r2"
    assert got[(REGIONAL_FLOWS["rollback"], "r1")]["name"] == "modelops-local"
    assert spec["pull"][0]["prefect.deployments.steps.set_working_directory"]["directory"] == "{{ $MODELOPS_REPO }}"


def test_up_with_regions_writes_a_file_once_and_never_overwrites_another(home):
    from modelops_cli.regions import other_regions, write_local_regions

    settings = Settings()
    path = write_local_regions(settings, 3)
    assert write_local_regions(settings, 3) == path  # the same file again: fine
    plan = load_regions(settings)
    assert [r.name for r in plan.regions] == ["region-1", "region-2", "region-3"]
    others = other_regions(plan, settings)
    assert [(r.name, s.router_port, s.router_grpc_port) for r, s in others] == [
        ("region-2", settings.router_port + 100, settings.router_grpc_port + 100),
        ("region-3", settings.router_port + 200, settings.router_grpc_port + 200)]
    with pytest.raises(ModelopsError, match="exists and is not the 2-region file"):
        write_local_regions(settings, 2)


def test_a_kubernetes_region_renders_job_variables_its_pool_template_accepts(home):
    """One work pool per cluster: the rendered job variables (image, namespace, a kubeconfig block as
    cluster_config, the region's env) validate against the Kubernetes base job template's schema."""
    import json

    import jsonschema

    from modelops.settings import REPO_ROOT
    from tasks.regions import regional_deployments

    data = _two(home)
    data["regions"][1]["job_variables"] = {
        "image": "registry.example.com/modelops-control-plane:1", "namespace": "modelops-eu",
        "cluster_config": {"config": {"apiVersion": "v1", "kind": "Config"}, "context_name": "eu-west-1"},
        "env": {"EXTRA": "1"}}
    data["regions"][1]["settings"].update(provider="kubernetes", router="gateway-api", k8s_namespace="modelops-eu")
    spec = regional_deployments(load_regions(_write(home, data)), "/opt/modelops")
    schema = json.loads((REPO_ROOT / "deployments" / "kubernetes" / "base-job-template.json").read_text())["variables"]
    k8s = [d["work_pool"]["job_variables"] for d in spec["deployments"] if d["name"] == "r2"]
    assert len(k8s) == 4
    for variables in k8s:
        jsonschema.validate(variables, schema)
        assert variables["env"]["EXTRA"] == "1" and variables["env"]["MODELOPS_K8S_NAMESPACE"] == "modelops-eu"
        assert variables["env"]["MODELOPS_PROVIDER"] == "kubernetes" and variables["namespace"] == "modelops-eu"
    with pytest.raises(jsonschema.ValidationError):  # the check can fail: a variable of the wrong type
        jsonschema.validate({**k8s[0], "backoff_limit": "many"}, schema)


def test_yaml_merge_keys_work_and_a_regions_own_keys_win_over_the_merged_ones(home):
    plan = load_regions(_write(home, f"""
regions:
  - &base
    name: r1
    work_pool: modelops-local
  - <<: *base
    name: r2
    work_pool: p2
    settings: {{home: {home / "r2"}, router_port: 8180, router_grpc_port: 8181}}
"""))
    assert [(r.name, r.work_pool) for r in plan.regions] == [("r1", "modelops-local"), ("r2", "p2")]
