"""Shadow traffic (modelops/shadow.py, runtime/frontend/shadow.py, tasks/traffic/shadow.py): the
comparisons, the router's marks (real HAProxy, stand-in instances of versions 1 and 2 of model
m), a copy's whole path from the frontend's mirror through the router's internal socket to the
shadow version, the refusals, the Gateway API's RequestMirror, and the manifest's shadow step."""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from modelops.shadow import (ShadowSpec, answer_texts, cosine, first_difference, parse_header, shadow_stats,
                             stream_texts)
from runtime.frontend.shadow import ShadowMirror
from tests.conftest import parsed_manifest

haproxy = pytest.mark.skipif(not __import__("shutil").which("haproxy"), reason="haproxy is not installed")


@given(st.lists(st.text(min_size=1, max_size=4), max_size=12), st.text(max_size=40))
def test_first_difference_is_the_first_token_that_leaves_the_served_text(tokens, served):
    i = first_difference(served, tokens)
    shadow = "".join(tokens)
    # Every token before i continues the served text; token i (if any) does not.
    assert served.startswith("".join(tokens[:i]))
    if i < len(tokens):
        assert not served.startswith("".join(tokens[:i + 1]))
    else:
        assert served.startswith(shadow)


def test_answers_are_read_per_choice_from_documents_and_streams():
    chat = {"choices": [{"index": 1, "message": {"content": "b"}}, {"index": 0, "message": {"content": "a"}}]}
    assert answer_texts("chat", chat) == ["a", "b"]
    assert answer_texts("completions", {"choices": [{"index": 0, "text": "x"}]}) == ["x"]
    events = ['data: {"choices":[{"index":0,"delta":{"role":"assistant"}}]}\n\n',
              'data: {"choices":[{"index":0,"delta":{"content":"Hel"}}]}\n\ndata: {"choices":[{"index":0,'
              '"delta":{"content":"lo"}}]}\n\n', "data: [DONE]\n\n"]
    assert stream_texts("chat", events) == ["Hello"]
    assert stream_texts("completions", ['data: {"choices":[{"index":0,"text":"a"}]}\n\n',
                                        'data: {"choices":[{"index":0,"text":"b"}]}\n\n']) == ["ab"]


def test_cosine_and_the_routers_mark():
    assert cosine([1, 0], [1, 0]) == pytest.approx(1.0) and cosine([1, 0], [0, 1]) == pytest.approx(0.0)
    assert cosine([1, 2], [1, 2, 3]) == 0.0 and cosine([0, 0], [1, 1]) == 0.0
    assert parse_header(ShadowSpec(7, "2.0-rc", 10).header()) == ("7", "2.0-rc")
    for bad in (None, "", "7", "x/2", "7/", "7/a b", "7/" + "v" * 65):
        assert parse_header(bad) is None


class _Target:
    """An OpenAI-shaped stand-in for the shadow side: chat answers ``text`` (as tokens, with
    logprobs), embeddings ``vector``, ``status`` otherwise; each answer waits for ``release``."""

    def __init__(self, text: str = "same answer", vector=(1.0, 0.0), status: int = 200) -> None:
        target = self
        self.text, self.vector, self.status, self.bodies = text, list(vector), status, []
        self.release = threading.Event()
        self.release.set()

        class H(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                target.bodies.append((self.path, dict(self.headers), body))
                target.release.wait(30)
                if target.status != 200:
                    data = b'{"error": {"message": "no"}}'
                elif self.path.endswith("/embeddings"):
                    data = json.dumps({"data": [{"index": 0, "embedding": target.vector}]}).encode()
                else:
                    tokens = [target.text[i:i + 3] for i in range(0, len(target.text), 3)]
                    data = json.dumps({"choices": [{"index": 0, "message": {"content": target.text},
                                                    "logprobs": {"content": [{"token": t} for t in tokens]}}]}).encode()
                self.send_response(target.status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}"


def _mirror_run(mirror: ShadowMirror, offers: list[tuple], then=None) -> str:
    """Offer each ``(api, body, primary)`` as shadow 3 → version 2, wait for the copies; the
    mirror's exposition."""
    async def go():
        for api, body, primary in offers:
            mirror.offer("3/2", api, body, primary, time.monotonic() - 0.05)
        if then is not None:
            then()
        await asyncio.gather(*mirror._tasks)
        text = mirror.exposition()
        await mirror.close()
        return text

    return asyncio.run(go())


def test_greedy_answers_compare_by_text_and_first_differing_token():
    target = _Target(text="same answer")
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "stream": True}
    sampled = {**chat, "temperature": 0.7}
    text = _mirror_run(ShadowMirror(target.url, "m"), [("chat", chat, ["same answer"]), ("chat", chat, ["same other"]),
                                                        ("chat", sampled, ["anything"])])
    stats = shadow_stats([text], 3)
    assert (stats.compared, stats.shadow_failed, stats.greedy, stats.equal) == (3, 0, 2, 1)
    # "same answer" as the shadow's tokens "sam", "e a", "nsw", "er": "same other" leaves at token 1.
    assert stats.first_diff[1.0] - stats.first_diff[0.0] == 1 and stats.first_diff[0.0] == 0
    greedy = [b for _, _, b in target.bodies if b["temperature"] == 0]
    (sampled_copy,) = [b for _, _, b in target.bodies if b["temperature"] != 0]
    assert {(p, h["X-Model-Version"]) for p, h, _ in target.bodies} == {("/v1/chat/completions", "2")}
    # Its tokens are asked for, the client's stream is not.
    assert all("stream" not in b and b["logprobs"] is True for b in greedy) and len(greedy) == 2
    assert "logprobs" not in sampled_copy  # a sampled answer is compared by latency only
    assert set(stats.latency) == {"primary", "shadow"} and stats.latency["shadow"][math.inf] == 3


def test_embeddings_compare_by_cosine_and_failures_are_counted():
    target = _Target(vector=(1.0, 1.0))
    text = _mirror_run(ShadowMirror(target.url, "m"), [("embeddings", {"model": "m", "input": "a"}, [[1.0, 0.0]])])
    stats = shadow_stats([text], 3)
    assert stats.cosines == 1 and stats.cosine_min == pytest.approx(math.sqrt(0.5))
    assert target.bodies[0][2]["encoding_format"] == "float"
    failing = _Target(status=500)
    stats = shadow_stats([_mirror_run(ShadowMirror(failing.url, "m"), [("embeddings", {"model": "m", "input": "a"},
                                                                        [[1.0]])])], 3)
    assert (stats.compared, stats.shadow_failed, stats.failure_rate) == (0, 1, 1.0)
    dead = ShadowMirror("http://127.0.0.1:9", "m", timeout_s=2)  # nothing listens: refused at once
    stats = shadow_stats([_mirror_run(dead, [("embeddings", {"model": "m", "input": "a"}, [[1.0]])])], 3)
    assert stats.shadow_failed == 1


def test_an_offer_returns_before_the_shadow_answers_and_a_full_bound_drops():
    target = _Target()
    target.release.clear()  # the shadow hangs until released
    mirror = ShadowMirror(target.url, "m", max_inflight=2)
    body = {"model": "m", "input": "a"}
    seen = {}

    def while_hanging():
        seen["answered"] = len(target.bodies)  # none may have been answered: offer() never waited
        target.release.set()

    text = _mirror_run(mirror, [("embeddings", body, [[1.0, 0.0]])] * 3, then=while_hanging)
    stats = shadow_stats([text], 3)
    assert seen["answered"] == 0
    assert (stats.compared, stats.dropped) == (2, 1)
    # Unmarked requests and a mirror without a target copy nothing.
    quiet = ShadowMirror("", "m")
    quiet.offer("3/2", "embeddings", body, [[1.0]], 0.0)
    quiet.offer(None, "embeddings", body, [[1.0]], 0.0)
    assert quiet.exposition() == "" and not quiet._tasks


@haproxy
def test_the_router_marks_its_share_of_unpinned_requests_and_only_those(two_versions):
    from tasks.traffic.shadow import start_shadow, stop_shadow

    registry, router, settings, instances = two_versions
    row = start_shadow(registry, router, "m", "2", 30)
    url = f"http://127.0.0.1:{settings.router_port}/v1/embeddings"
    with httpx.Client(timeout=10) as client:
        for i in range(300):  # a client's own mark is replaced (or removed) by the router's
            assert client.post(url, json={"model": "m", "input": f"x{i}"},
                               headers={"x-modelops-shadow": "99/1"}).status_code == 200
        pinned = client.post(url, json={"model": "m", "input": "p"}, headers={"X-Model-Version": "1"})
        assert pinned.status_code == 200
    marks = instances["1"].shadow_marks
    assert set(marks) == {None, f"{row.id}/2"}
    assert 45 <= marks.count(f"{row.id}/2") <= 135 and marks[-1] is None  # 30 % of 300: binomial, ±5.5 sd; pin: none
    assert instances["2"].shadow_marks == []  # the shadow itself served nothing
    stop_shadow(registry, router, "m")
    with httpx.Client(timeout=10) as client:
        for i in range(20):
            client.post(url, json={"model": "m", "input": f"y{i}"})
    assert instances["1"].shadow_marks[-20:] == [None] * 20


@haproxy
def test_a_copy_goes_through_the_routers_internal_socket_to_the_shadow_version(two_versions):
    registry, router, settings, instances = two_versions
    mirror = ShadowMirror(f"unix:{settings.router_internal_socket}", "m")
    text = _mirror_run(mirror, [("embeddings", {"model": "m", "input": "abc"}, [[3.0]])])
    stats = shadow_stats([text], 3)
    assert instances["2"].answered == ["abc"] and instances["1"].answered == []  # pinned to the shadow version
    assert (stats.compared, stats.cosines, stats.cosine_min) == (1, 1, pytest.approx(1.0))


@haproxy
def test_shadows_that_cannot_run_are_refused_before_anything_changes(two_versions):
    from tasks.traffic.shadow import check_shadow, start_shadow

    registry, router, settings, instances = two_versions
    cfg = router.cfg.read_text()
    for model, version, percent, says in (("m", "2", 0, "--percent: 0 is outside 1..100"),
                                          ("nope", "2", 10, "unknown model 'nope'"),
                                          ("m", "9", 10, "version '9' of m was never announced"),
                                          ("m", "1", 10, "takes 100 % of its traffic already.*strategy: versioned")):
        with pytest.raises(ValueError, match=says):
            start_shadow(registry, router, model, version, percent)
    # Another I/O schema: its requests cannot be replayed on it.
    schema = {"inputs": [{"name": "text_input", "datatype": "BYTES", "dims": [1]},
                         {"name": "lang", "datatype": "BYTES", "dims": [1], "optional": True}],
              "outputs": [{"name": "embedding", "datatype": "FP32", "dims": [-1]}]}
    registry.record_announcement(parsed_manifest(version="3", packaging="python-backend", io_schema=schema))
    registry.set_state("m", "3", "serving")
    with pytest.raises(ValueError, match="another I/O schema than the default 1.*input lang: added"):
        check_shadow(registry, "m", "3", 10)
    start_shadow(registry, router, "m", "2", 10)
    with pytest.raises(ValueError, match="a shadow of m runs already"):
        start_shadow(registry, router, "m", "2", 10)
    assert [s.version for s in registry.shadows()] == ["2"]
    assert "x-modelops-shadow" in router.cfg.read_text() and "x-modelops-shadow 1/2" not in cfg


def test_the_gateway_mirrors_its_share_with_the_standard_filter():
    from tasks.kube.manifests import PORTS, object_name, render_httproute
    from tests.unit.test_kubernetes import gateway_validate, make_settings

    s = make_settings()
    backends = {"1": (object_name("m", "1"), 100), "2": (object_name("m", "2"), 0)}
    route = render_httproute("m", backends, s, mirror=("2", 10))
    default = route["spec"]["rules"][-1]
    assert default["filters"] == [{"type": "RequestMirror", "requestMirror": {
        "backendRef": {"group": "", "kind": "Service", "name": object_name("m", "2"), "port": PORTS["openai"]},
        "percent": 10}}]
    assert all("filters" not in rule for rule in route["spec"]["rules"][:-1])  # pins are not mirrored
    assert "filters" not in render_httproute("m", backends, s, "kserve-http", mirror=("2", 10))["spec"]["rules"][-1]
    assert gateway_validate([route])[0]["ok"], gateway_validate([route])


def test_a_manifests_shadow_step_is_checked_where_it_is_read():
    from modelops.errors import ManifestError
    from modelops.manifest import parse_manifest

    base = {"model_id": "m", "version": "1", "source": "s3://b/m/", "task": "embed"}
    assert parse_manifest({**base, "shadow": {"percent": 50, "window_s": 5}}).shadow.percent == 50
    for shadow, says in (({"percent": 0}, "shadow.percent"), ({"window_s": 0.5}, "shadow.window_s"),
                         ({"min_greedy_equal": 2}, "shadow.min_greedy_equal"), ({"every": 1}, "shadow.every")):
        with pytest.raises(ManifestError, match=says):
            parse_manifest({**base, "shadow": shadow})
    with pytest.raises(ManifestError, match="with strategy versioned"):
        parse_manifest({**base, "strategy": "versioned", "shadow": {}})


@haproxy
def test_a_shadow_keeps_clear_of_experiments_and_ends_with_its_version(two_versions):
    from modelops.experiments import Arm, ExperimentSpec
    from tasks.traffic.experiment import start_experiment, stop_experiment
    from tasks.traffic.shadow import start_shadow, stop_shadow

    registry, router, settings, instances = two_versions
    spec = ExperimentSpec((Arm("1", 50), Arm("2", 50)), "user", "1")
    start_experiment(registry, router, "m", spec)
    with pytest.raises(ValueError, match="an experiment runs on m .*its arms serve clients"):
        start_shadow(registry, router, "m", "2", 10)  # arm 2 serves clients, whatever its weight
    stop_experiment(registry, router, "m", "1")  # 2 drains
    with pytest.raises(ValueError, match="version 2 of m is draining \\(the experiment on m ended keeping 1\\)"):
        start_shadow(registry, router, "m", "2", 10)

    registry.set_state("m", "2", "serving")
    start_shadow(registry, router, "m", "2", 10)
    with pytest.raises(ValueError, match="version 2 of m is a shadow"):
        start_experiment(registry, router, "m", spec)
    registry.set_state("m", "2", "draining", "retired by hand")  # its shadow ends with it
    assert registry.shadow("m") is None
    with pytest.raises(KeyError, match="no shadow runs on m"):
        stop_shadow(registry, router, "m")
    with pytest.raises(ValueError, match="unknown model 'nope'"):
        stop_shadow(registry, router, "nope")


@haproxy
def test_a_rollouts_shadow_step_is_stopped_by_the_rollout_only(two_versions):
    from tasks.traffic.shadow import start_shadow, stop_shadow

    registry, router, settings, instances = two_versions
    start_shadow(registry, router, "m", "2", 10, origin="red-black")
    for attempt in (lambda: start_shadow(registry, router, "m", "2", 10), lambda: stop_shadow(registry, router, "m")):
        with pytest.raises(ValueError, match="the shadow step of the red-black rollout of version 2; it ends with "
                                             "that step"):
            attempt()
    stop_shadow(registry, router, "m", lock=False)  # the rollout's own call
    assert registry.shadow("m") is None
