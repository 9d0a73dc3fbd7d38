"""A classic model under the same lifecycle: XGBoost models trained here on generated data,
announced through the stack (moto S3 → FSx dir → Python-backend package → Triton in
``execution_mode: separate`` → HAProxy), predictions over KServe v2 HTTP and gRPC through the
router against ``Booster.predict`` on the same rows; v2 adds a feature (versioned), v3 keeps
v2's schema (red-black under KServe load through the router)."""

from __future__ import annotations

import json
import subprocess
import time

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests.conftest import manifest_file
from tests.integration.conftest import RouterLoad, Stack, runtime_python, upload_dir

pytestmark = pytest.mark.e2e

MODEL = "fraud-xgb"

# Runs in the runtime image's interpreter (xgboost lives there, not in the control plane).
TRAIN = r'''
import json, sys
import numpy as np, xgboost as xgb
out, features, seed, objective = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
rng = np.random.default_rng(seed)
x = rng.normal(size=(2000, features)).astype(np.float32)
if objective == "multi:softprob":
    y = (x[:, 0] > 0).astype(int) + (x[:, 1] > 0.5).astype(int)
    params = {"objective": objective, "num_class": 3}
else:
    y = (x[:, 0] + 0.5 * x[:, 1] - x[:, features - 1] > 0).astype(int)
    params = {"objective": objective}
booster = xgb.train({**params, "max_depth": 4, "eta": 0.3, "seed": seed}, xgb.DMatrix(x, label=y), num_boost_round=20)
booster.save_model(f"{out}/model.ubj")
rows = rng.normal(size=(64, features)).astype(np.float32)
rows[3, 1] = np.nan  # XGBoost's missing value
np.save(f"{out}/rows.npy", rows)
np.save(f"{out}/expected.npy", booster.predict(xgb.DMatrix(rows)).astype(np.float32))
'''


def _train(root, name: str, features: int, seed: int, objective: str = "binary:logistic") -> dict:
    """Train a model into ``root/name/model.ubj``; return its rows and Booster.predict on them."""
    out = root / name
    (out / "model").mkdir(parents=True)
    proc = subprocess.run([str(runtime_python()), "-c", TRAIN, str(out / "model"), str(features), str(seed), objective],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows, expected = np.load(out / "model" / "rows.npy"), np.load(out / "model" / "expected.npy")
    for extra in ("rows.npy", "expected.npy"):
        (out / "model" / extra).rename(out / extra)  # the source holds the model file only
    return {"dir": out / "model", "rows": rows, "expected": expected.reshape(len(rows), -1), "features": features}


def _manifest(tmp_path, version: str, features: int, **fields) -> str:
    return manifest_file(tmp_path, **{
        "model_id": MODEL, "version": version, "source": f"s3://models/{MODEL}/{version}/", "framework": "xgboost",
        "io_schema": {"inputs": [{"name": "input__0", "datatype": "FP32", "dims": [features]}],
                      "outputs": [{"name": "output__0", "datatype": "FP32", "dims": [1]}]},
        **fields})


def _status(stack: Stack) -> dict:
    status = json.loads(stack.modelops("status", "--json").stdout)
    (model,) = [m for m in status["models"] if m["model_id"] == MODEL]
    return {v["version"]: v for v in model["versions"]}


def _router_clients(stack: Stack):
    http = httpclient.InferenceServerClient(stack.router.removesuffix("/v1").removeprefix("http://"))
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{stack.env['MODELOPS_ROUTER_GRPC_PORT']}")
    return http, grpc


def _predict(http, grpc, rows: np.ndarray, version: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    pin = {"X-Model-Version": version} if version else {}
    inp = httpclient.InferInput("input__0", list(rows.shape), "FP32")
    inp.set_data_from_numpy(rows)
    via_http = http.infer(MODEL, [inp], headers=dict(pin)).as_numpy("output__0")  # it adds its own headers to the dict
    ginp = grpcclient.InferInput("input__0", list(rows.shape), "FP32")
    ginp.set_data_from_numpy(rows)
    via_grpc = grpc.infer(MODEL, [ginp], headers={"x-model-id": MODEL, **{k.lower(): v for k, v in pin.items()}})
    return via_http, via_grpc.as_numpy("output__0")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("xgb")
    return {"1": _train(root, "v1", 6, 1), "2": _train(root, "v2", 7, 2), "3": _train(root, "v3", 7, 3)}


@pytest.fixture(scope="module")
def v1(stack: Stack, models, tmp_path_factory) -> dict:
    for version, m in models.items():
        upload_dir(stack, m["dir"], "models", f"{MODEL}/{version}/")
    run = stack.modelops("announce", _manifest(tmp_path_factory.mktemp("xgbm"), "1", 6), "--wait")
    assert run.returncode == 0, run.stdout + run.stderr
    return _status(stack)["1"]


def test_xgboost_serves_in_separate_mode_and_equals_booster_predict(stack: Stack, models, v1):
    assert (v1["state"], v1["weight"], v1["framework"], v1["execution_mode"]) == ("serving", 100, "xgboost", "separate")
    shown = stack.modelops("status")
    assert shown.returncode == 0 and "separate" in shown.stdout and "xgboost" in shown.stdout, shown.stdout
    http, grpc = _router_clients(stack)
    m = models["1"]
    for rows, expected in ((m["rows"][:1], m["expected"][:1]), (m["rows"], m["expected"])):  # batch 1 and 64
        via_http, via_grpc = _predict(http, grpc, rows)
        assert via_http.shape == via_grpc.shape == (len(rows), 1)
        np.testing.assert_allclose(via_http, expected, rtol=0, atol=1e-6)
        np.testing.assert_allclose(via_grpc, expected, rtol=0, atol=1e-6)
    assert 0 < float(via_http.min()) and float(via_http.max()) < 1  # probabilities of binary:logistic
    # The router names the version that answered KServe calls too.
    r = httpx.post(f"{stack.router.removesuffix('/v1')}/v2/models/{MODEL}/infer", json={"inputs": [
        {"name": "input__0", "datatype": "FP32", "shape": [1, 6], "data": m["rows"][0].tolist()}]})
    assert r.status_code == 200 and r.headers["X-Model-Version"] == "1", r.text
    # A wrong width is Triton's 400, naming the shape; the instance has no OpenAI face.
    r = httpx.post(f"{stack.router.removesuffix('/v1')}/v2/models/{MODEL}/infer", json={"inputs": [
        {"name": "input__0", "datatype": "FP32", "shape": [1, 5], "data": [0.0] * 5}]})
    assert r.status_code == 400 and "shape" in r.text, r.text
    (endpoints,) = v1["endpoints"].values()
    r = httpx.post(f"{endpoints['openai']}/completions", json={"model": MODEL, "prompt": "x"},
                   headers=stack.instance_headers)
    assert r.status_code == 404 and "execution_mode separate" in r.json()["error"]["message"], r.text
    assert httpx.get(endpoints["openai"].removesuffix("/v1") + "/ready").status_code == 200
    metrics = httpx.get(endpoints["metrics"]).text
    assert f'nv_inference_request_success{{model="{MODEL}",version="1"}}' in metrics
    assert 'modelops_engine_up 1' in metrics
    # An answer counts for the API key the router names with its HMAC (sent here as the router would):
    # one request, no tokens; a client's own key among its parameters is refused.
    from modelops.tenancy import INSTANCE_SECRET_HEADER, KEY_HEADER, KEY_MAC_HEADER, key_mac

    secret = stack.instance_headers[INSTANCE_SECRET_HEADER]
    signed = {**stack.instance_headers, KEY_HEADER: "tab-key", KEY_MAC_HEADER: key_mac(secret, "tab-key")}
    body = {"inputs": [{"name": "input__0", "datatype": "FP32", "shape": [2, 6],
                        "data": m["rows"][:2].ravel().tolist()}]}
    for _ in range(2):
        r = httpx.post(f"{endpoints['kserve_http']}/v2/models/{MODEL}/infer", json=body, headers=signed)
        assert r.status_code == 200, r.text
    forged = httpx.post(f"{endpoints['kserve_http']}/v2/models/{MODEL}/infer", headers=stack.instance_headers,
                        json={**body, "parameters": {KEY_HEADER: "tab-key"}})
    assert forged.status_code == 400 and f"parameters.{KEY_HEADER}: the router sets it" in forged.text, forged.text
    usage = httpx.get(endpoints["metrics"]).text.splitlines()
    for name, value in (("requests", 2), ("prompt_tokens", 0)):
        line = f'modelops_key_{name}_total{{model_name="{MODEL}",key="tab-key"}} {value}'
        assert line in usage, (line, [x for x in usage if "tab-key" in x])
    log = next((stack.home / "logs").glob(f"{MODEL}-1-*.log")).read_text()
    assert "gate kserve-grpc open" in log and "warm-up answered" in log


def test_a_new_feature_is_versioned_and_the_same_schema_is_red_black_under_load(stack: Stack, models, v1, tmp_path):
    http, grpc = _router_clients(stack)
    run = stack.modelops("announce", _manifest(tmp_path, "2", 7, promote=True), "--wait")
    assert run.returncode == 0, run.stdout + run.stderr
    versions = _status(stack)
    assert versions["2"]["strategy"] == "versioned" and versions["2"]["weight"] == 100
    # The old default drains at weight 0 but stays routed: its callers keep it, pinned.
    assert (versions["1"]["state"], versions["1"]["weight"]) == ("draining", 0)
    for version in ("1", "2"):
        m = models[version]
        via_http, via_grpc = _predict(http, grpc, m["rows"], version)
        np.testing.assert_allclose(via_http, m["expected"], rtol=0, atol=1e-6)
        np.testing.assert_allclose(via_grpc, m["expected"], rtol=0, atol=1e-6)
        # KServe's answer names the version that answered; the version path pins it (tritonclient's model_version).
        inp = httpclient.InferInput("input__0", [1, len(m["rows"][0])], "FP32")
        inp.set_data_from_numpy(m["rows"][:1])
        by_path = http.infer(MODEL, [inp], model_version=version)
        assert by_path.get_response()["model_version"] == version
        np.testing.assert_allclose(by_path.as_numpy("output__0"), m["expected"][:1], rtol=0, atol=1e-6)
        ginp = grpcclient.InferInput("input__0", [1, len(m["rows"][0])], "FP32")
        ginp.set_data_from_numpy(m["rows"][:1])
        pinned = grpc.infer(MODEL, [ginp], headers={"x-model-id": MODEL, "x-model-version": version})
        assert pinned.get_response().model_version == version
    cleaned = stack.modelops("cleanup", "--idle-after", "0", "--model", MODEL)
    assert cleaned.returncode == 0, cleaned.stdout + cleaned.stderr
    assert _status(stack)["1"]["state"] == "retired"

    rows = models["3"]["rows"]
    seen: dict[str, int] = {}

    def kserve_http(client: httpx.Client, router: str) -> str | None:
        r = client.post(f"{router.removesuffix('/v1')}/v2/models/{MODEL}/infer", json={"inputs": [
            {"name": "input__0", "datatype": "FP32", "shape": [8, 7], "data": np.nan_to_num(rows[:8]).ravel().tolist()}]})
        seen[r.headers.get("X-Model-Version", "?")] = seen.get(r.headers.get("X-Model-Version", "?"), 0) + 1
        return None if r.status_code == 200 and len(r.json()["outputs"][0]["data"]) == 8 else \
            f"{r.status_code} {r.text[:200]}"

    def kserve_grpc(client: httpx.Client, router: str) -> str | None:
        inp = grpcclient.InferInput("input__0", [1, 7], "FP32")
        inp.set_data_from_numpy(np.nan_to_num(rows[:1]))
        try:
            out = grpc.infer(MODEL, [inp], headers={"x-model-id": MODEL}, client_timeout=30)
        except Exception as e:  # noqa: BLE001 - the load counts every failure
            return f"gRPC {e}"
        return None if out.as_numpy("output__0").shape == (1, 1) else f"shape {out.as_numpy('output__0').shape}"

    with RouterLoad(stack.router, [kserve_http, kserve_grpc]) as load:
        time.sleep(2)
        run = stack.modelops("announce", _manifest(tmp_path, "3", 7), "--wait")
        time.sleep(2)
    assert run.returncode == 0, run.stdout + run.stderr
    versions = _status(stack)
    assert (versions["3"]["state"], versions["3"]["weight"], versions["3"]["strategy"]) == ("serving", 100, "red-black")
    assert versions["2"]["state"] == "retired"
    # The replaced instance drained as an embedded one does: SIGTERM, the drain, then Triton stopped, exit 0.
    log = next((stack.home / "logs").glob(f"{MODEL}-2-*.log")).read_text()
    assert "after the drain (exit status" in log, log[-2000:]
    assert load.failed == 0, (load.codes, load.failures[:5])
    assert load.sent > 100 and seen.get("2", 0) > 0 and seen.get("3", 0) > 0, (load.codes, seen)
    via_http, via_grpc = _predict(http, grpc, models["3"]["rows"])
    np.testing.assert_allclose(via_http, models["3"]["expected"], rtol=0, atol=1e-6)
    np.testing.assert_allclose(via_grpc, models["3"]["expected"], rtol=0, atol=1e-6)
    print(f"xgboost red-black 2 → 3 under load: {load.sent} requests ({seen}), {load.failed} failed")
