"""Server weights give every version exactly its share (tasks/traffic/weights.py), through the
registry (routes_from_registry), HAProxy's limits and the Gateway API's default rule."""

from hypothesis import given, settings
from hypothesis import strategies as st

from modelops import parse_manifest
from modelops.registry import Registry
from tasks.traffic.interface import routes_from_registry
from tasks.traffic.weights import MAX_SERVER_WEIGHT, server_weights


def shares(split: dict[str, list[int]]) -> dict[str, float]:
    total = sum(sum(w) for w in split.values())
    return {v: 100 * sum(w) / total for v, w in split.items()}


@settings(max_examples=400, deadline=None)
@given(st.sampled_from([10, 25, 50, 75, 90, 100]), st.integers(1, 64), st.integers(1, 64),
       st.lists(st.integers(1, 64), max_size=2))
def test_every_version_gets_its_step_within_one_point(step, n_new, n_old, n_drained):
    # A red-black step: new at `step`, old at the rest, other versions draining at 0.
    versions = {"new": (step, n_new), "old": (100 - step, n_old),
                **{f"d{i}": (0, n) for i, n in enumerate(n_drained)}}
    split = server_weights(versions)
    assert {v: len(w) for v, w in split.items()} == {v: n for v, (_, n) in versions.items()}
    assert all(0 <= w <= MAX_SERVER_WEIGHT for ws in split.values() for w in ws)
    got = shares(split)
    assert abs(got["new"] - step) <= 1 and abs(got["old"] - (100 - step)) <= 1
    assert all(got[f"d{i}"] == 0 for i in range(len(n_drained)))
    for v, (w, n) in versions.items():
        # Spread as evenly as integers allow; every server weighted where the share has room.
        assert max(split[v]) - min(split[v]) <= 1
        if w and sum(split[v]) >= n:
            assert min(split[v]) >= 1


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.from_regex(r"v[0-9]{1,2}", fullmatch=True),
                       st.tuples(st.integers(0, 100), st.integers(1, 64)), min_size=1, max_size=5))
def test_any_weights_are_exact_shares(versions):
    split = server_weights(versions)
    total_w = sum(w for w, _ in versions.values())
    if total_w == 0:
        assert all(w == 0 for ws in split.values() for w in ws)
        return
    got = shares(split)
    for v, (w, _) in versions.items():
        assert abs(got[v] - 100 * w / total_w) < 1e-9  # exact, not only within a point


def test_twenty_old_instances_at_the_fifty_percent_step():
    # round(50 / 20) = 3 per old server gave v2 50 / 110 = 45.5 % before.
    split = server_weights({"1": (50, 20), "2": (50, 1)})
    assert split == {"1": [5] * 20, "2": [100]}
    assert shares(split) == {"1": 50.0, "2": 50.0}


def test_thirty_old_instances_at_the_twenty_five_percent_step():
    # round(75 / 30) = 2 per old server gave v2 25 / 85 = 29.4 % before.
    split = server_weights({"1": (75, 30), "2": (25, 1)})
    assert split == {"1": [5] * 30, "2": [50]}
    assert shares(split) == {"1": 75.0, "2": 25.0}


def test_one_instance_each_keeps_the_registry_weights():
    assert server_weights({"1": (75, 1), "2": (25, 1)}) == {"1": [75], "2": [25]}
    assert server_weights({"1": (0, 2), "2": (100, 1)}) == {"1": [0, 0], "2": [100]}
    assert server_weights({"1": (0, 1)}) == {"1": [0]}


def test_more_servers_than_units_leaves_some_at_zero_and_the_share_exact():
    # v1 at 90 on one server caps the multiplier at 2: v2's 20 units over 64 servers.
    split = server_weights({"1": (90, 1), "2": (10, 64)})
    assert split["1"] == [180] and sorted(split["2"], reverse=True) == [1] * 20 + [0] * 44
    assert shares(split) == {"1": 90.0, "2": 10.0}


def _registry(path, layout: dict[str, tuple[int, int]]) -> Registry:
    reg = Registry(f"sqlite:///{path}")
    for version, (_, n) in layout.items():
        reg.record_announcement(parse_manifest({"model_id": "m", "version": version, "source": "s3://models/m/",
                                                "task": "embed"}))
        reg.set_state("m", version, "serving")
        for i in range(n):
            name = f"m-{version}-{i + 1}"
            reg.add_instance("m", version, name, "")
            reg.update_instance(name, state="running", endpoints={"openai": f"http://127.0.0.1:{9000 + i}"})
    reg.set_weights("m", {v: w for v, (w, _) in layout.items()})
    return reg


def test_routes_from_registry_weigh_twenty_old_instances_exactly(tmp_path):
    [route] = routes_from_registry(_registry(tmp_path / "r.db", {"1": (50, 20), "2": (50, 1)}))
    totals = {v: sum(s.weight for s in servers) for v, servers in route.versions.items()}
    assert totals == {"1": 100, "2": 100} and len(route.versions["1"]) == 20


def test_gateway_route_without_routable_version_has_no_zero_weight_rule(tmp_path):
    from tasks.kube.manifests import VERSION_HEADER, render_httproute
    from tests.unit.test_kubernetes import gateway_validate, make_settings

    route = render_httproute("m", {"1": ("m-v1", 0), "2": ("m-v2", 0)}, make_settings())
    rules = route["spec"]["rules"]
    assert len(rules) == 2  # the two version pins, no default rule
    for rule in rules:
        assert VERSION_HEADER in [h["name"] for h in rule["matches"][0]["headers"]]
        assert sum(ref["weight"] for ref in rule["backendRefs"]) > 0
    with_default = render_httproute("m", {"1": ("m-v1", 0), "2": ("m-v2", 100)}, make_settings())
    assert len(with_default["spec"]["rules"]) == 3
    assert all(r["ok"] for r in gateway_validate([route, with_default]))  # the Gateway API's own schema
