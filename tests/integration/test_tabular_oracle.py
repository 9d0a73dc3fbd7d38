"""XGBoost served by one instance (``modelops serve``, execution_mode separate) against
``Booster.predict`` in the runtime's own interpreter, the oracle: per objective (binary
probabilities, regression, multi-class probabilities, class labels) and feature count, hypothesis
draws batches of rows (1..300 rows, NaN as XGBoost's missing value, magnitudes up to 1e6), sent over
KServe v2 HTTP and gRPC; every answer equals the oracle's on the same rows."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from tritonclient.utils import InferenceServerException

from tests.integration.conftest import isolated_env, runtime_python, serving

pytestmark = pytest.mark.e2e

# Runs in the runtime's interpreter: trains one model, then answers Booster.predict for each .npy
# path it reads on stdin (the predictions go to PATH.out.npy; one line "ok" per request).
ORACLE = r'''
import sys
import numpy as np, xgboost as xgb
out, features, objective, classes = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
rng = np.random.default_rng(features)
x = rng.normal(size=(1500, features)).astype(np.float32)
score = x[:, 0] - 0.5 * x[:, features - 1] + (np.sin(x[:, 1]) if features > 1 else 0)
params = {"objective": objective, "max_depth": 5, "eta": 0.3, "seed": 3}
if classes > 1:
    y, params["num_class"] = np.digitize(score, np.quantile(score, np.linspace(0, 1, classes + 1)[1:-1])), classes
elif objective == "binary:logistic":
    y = (score > 0).astype(int)
else:
    y = score + rng.normal(scale=0.1, size=len(score))
booster = xgb.train(params, xgb.DMatrix(x, label=y), num_boost_round=30)
booster.save_model(f"{out}/model.ubj")
print("ok", flush=True)
for line in sys.stdin:
    rows = np.load(line.strip())
    np.save(line.strip() + ".out.npy", booster.predict(xgb.DMatrix(rows)).astype(np.float32).reshape(len(rows), -1))
    print("ok", flush=True)
'''

# (objective, features, classes, output width)
MODELS = [("binary:logistic", 9, 1, 1), ("reg:squarederror", 1, 1, 1), ("multi:softprob", 5, 3, 3),
          ("multi:softmax", 17, 4, 1)]


class Oracle:
    """Booster.predict of the trained model, in the runtime interpreter."""

    def __init__(self, folder, features: int, objective: str, classes: int):
        self.folder = folder
        self.proc = subprocess.Popen([str(runtime_python()), "-c", ORACLE, str(folder / "model"), str(features),
                                      objective, str(classes)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=sys.stderr, text=True)
        assert self.proc.stdout.readline().strip() == "ok", "the oracle could not train its model"
        self.calls = 0

    def predict(self, rows: np.ndarray) -> np.ndarray:
        self.calls += 1
        path = self.folder / f"rows-{self.calls}.npy"
        np.save(path, rows)
        self.proc.stdin.write(f"{path}\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "ok"
        return np.load(f"{path}.out.npy")

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module", params=MODELS, ids=[m[0] for m in MODELS])
def served(request, tmp_path_factory):
    objective, features, classes, width = request.param
    folder = tmp_path_factory.mktemp(objective.replace(":", "-"))
    (folder / "model").mkdir()
    oracle = Oracle(folder, features, objective, classes)
    manifest = folder / "m.yaml"
    manifest.write_text(yaml.safe_dump({
        "model_id": "oracle-xgb", "version": "1", "source": str(folder / "model"), "framework": "xgboost",
        "resources": {"cpus": 1},
        "io_schema": {"inputs": [{"name": "input__0", "datatype": "FP32", "dims": [features]}],
                      "outputs": [{"name": "output__0", "datatype": "FP32", "dims": [width]}]}}))
    try:
        with serving(manifest, isolated_env(folder / "home"), folder / "serve.log") as inst:
            yield {"inst": inst, "oracle": oracle, "features": features, "width": width,
                   "http": httpclient.InferenceServerClient(inst["http"].removeprefix("http://")),
                   "grpc": grpcclient.InferenceServerClient(inst["grpc"])}
    finally:
        oracle.close()


ELEMENTS = st.one_of(st.floats(-1e6, 1e6, width=32), st.floats(-3, 3, width=32), st.just(float("nan")))


@st.composite
def batches(draw, features: int) -> np.ndarray:
    n = draw(st.one_of(st.integers(1, 4), st.integers(5, 300)))
    return draw(arrays(np.float32, (n, features), elements=ELEMENTS))


def test_served_predictions_equal_booster_predict(served):
    seen = {"rows": 0, "nan": 0}

    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(data=st.data())
    def check(data):
        rows = data.draw(batches(served["features"]))
        expected = served["oracle"].predict(rows)
        assert expected.shape == (len(rows), served["width"])
        inp = httpclient.InferInput("input__0", list(rows.shape), "FP32")
        inp.set_data_from_numpy(rows)
        via_http = served["http"].infer("oracle-xgb", [inp]).as_numpy("output__0")
        ginp = grpcclient.InferInput("input__0", list(rows.shape), "FP32")
        ginp.set_data_from_numpy(rows)
        via_grpc = served["grpc"].infer("oracle-xgb", [ginp]).as_numpy("output__0")
        np.testing.assert_allclose(via_http, expected, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(via_grpc, expected, rtol=1e-6, atol=1e-6)
        seen["rows"] += len(rows)
        seen["nan"] += int(np.isnan(rows).any())

    check()
    assert seen["rows"] >= 25 and seen["nan"] > 0, seen  # the draws covered missing values


def test_an_infinite_value_is_refused_naming_the_row_and_the_model_keeps_serving(served):
    """Booster.predict refuses inf (its DMatrix does); the served model answers the caller's error."""
    rows = np.zeros((3, served["features"]), dtype=np.float32)
    rows[2, 0] = np.inf
    inp = httpclient.InferInput("input__0", list(rows.shape), "FP32")
    inp.set_data_from_numpy(rows)
    with pytest.raises(InferenceServerException) as http_error:
        served["http"].infer("oracle-xgb", [inp])
    assert http_error.value.status() == "400" and "input__0: row 2 holds an infinite value" in str(http_error.value)
    ginp = grpcclient.InferInput("input__0", list(rows.shape), "FP32")
    ginp.set_data_from_numpy(-rows)
    with pytest.raises(InferenceServerException) as grpc_error:
        served["grpc"].infer("oracle-xgb", [ginp])
    assert grpc_error.value.status() == "StatusCode.INVALID_ARGUMENT" and "row 2" in str(grpc_error.value)
    rows[2, 0] = np.nan  # the same rows with a missing value instead: served, equal to the oracle
    inp.set_data_from_numpy(rows)
    np.testing.assert_allclose(served["http"].infer("oracle-xgb", [inp]).as_numpy("output__0"),
                               served["oracle"].predict(rows), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("name", "content"), [("model.ubj", b"{L\x00\x00\x00\x00\x00\x00\x00\x07learner{"),
                                               ("model.json", b'{"learner": {"attributes": ')])
def test_a_truncated_model_file_is_refused_naming_it_and_the_fix(tmp_path, name, content):
    from modelops import ManifestError
    from tasks.package import xgboost_model_facts

    (tmp_path / name).write_bytes(content)
    with pytest.raises(ManifestError) as e:
        xgboost_model_facts(runtime_python(), tmp_path / name)
    message = str(e.value)
    assert message.startswith(f"source: {name} is not an XGBoost model the runtime's xgboost can load (truncated")
    assert "XGBoostError" in message and message.endswith("save the model again with Booster.save_model('model.ubj') and upload it")
