"""Benchmark: the non-decode workloads, one run: prefill-only scoring (log-likelihood) and a
tabular (XGBoost) model over KServe gRPC.

Prefill-only: SmolLM2-135M-Instruct (tests/models/make_smollm2.py), the same engine args as
bench/generate.py (float32, max_model_len 2048, max_num_seqs 16, whole-prompt prefill). 128
prompts of 12-60 words, sent as completions requests of 8 prompts each (a prompt list) from 4
concurrent clients. Ours: ``echo: true, logprobs: 1, max_tokens: 0`` (the evaluation harnesses'
idiom); `vllm serve` on the same folder and image: its own ``prompt_logprobs: 1, max_tokens: 1``
and the same echo request. Per server: prompts/s, prompt tokens/s, and the engine steps the load
took (vllm:iteration_tokens_total's count: prefill steps only when nothing is decoded).

Tabular: an XGBoost model trained here (binary:logistic, 32 features, 200 trees of depth 6, on
generated rows) announced as ``framework: xgboost`` and served by ``modelops serve`` (execution_mode
separate: Triton's Python backend, the template's one ``inplace_predict`` per dynamic batch). Rows/s
over KServe gRPC (tritonclient, TAB_CLIENTS threads) at batch 1 and 64 against the floor: the same
rows through ``Booster.predict`` on a DMatrix in-process (the image's xgboost, one thread per call
as the served model's nthread). Every served prediction is checked against Booster.predict.

    .venv/bin/python bench/workloads.py                 → bench/results/workloads.json
    .venv/bin/python bench/workloads.py --only tabular  (updates that section only)
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from _servers import SMOLLM2_ENGINE_ARGS, free_port, smollm2, started, vllm_serve_command, wait_ready  # noqa: E402

from modelops.io_contract import VLLM_CPU_ENV  # noqa: E402

OUT = REPO / "bench" / "results" / "workloads.json"
MODEL = "smollm2"
PROMPTS, BATCH, CLIENTS = 128, 8, 4
WORDS = ("the model serves weights from a fast shared file system while traffic shifts between versions and "
         "every request is answered by the engine that holds the prompt in its cache").split()


def _prompts() -> list[str]:
    rng = random.Random(7)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(12, 60))).capitalize() + "." for _ in range(PROMPTS)]


def _steps(base: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("vllm:iteration_tokens_total_count"))


async def _load(base: str, extra: dict, prompts: list[str]) -> dict:
    """All ``prompts`` in requests of BATCH from CLIENTS concurrent clients; every answer checked."""
    batches = [prompts[i:i + BATCH] for i in range(0, len(prompts), BATCH)]
    tokens = 0

    async def client(http: httpx.AsyncClient, mine: list[list[str]]) -> None:
        nonlocal tokens
        for batch in mine:
            r = await http.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": batch, "temperature": 0,
                                                                  **extra})
            r.raise_for_status()
            body = r.json()
            assert len(body["choices"]) == len(batch), body
            tokens += body["usage"]["prompt_tokens"]

    steps = _steps(base)
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as http:
        await asyncio.gather(*(client(http, batches[i::CLIENTS]) for i in range(CLIENTS)))
    wall = time.perf_counter() - t0
    return {"prompts": len(prompts), "seconds": round(wall, 2), "prompts_per_s": round(len(prompts) / wall, 1),
            "prompt_tokens_per_s": round(tokens / wall, 1), "engine_steps": int(_steps(base) - steps)}


def _measure(name: str, cmd: list[str], env: dict, ready: str, base: str, loads: dict, log: Path) -> dict:
    print(f"[{name}] starting ...", flush=True)
    prompts = _prompts()
    with started(cmd, env, log, REPO) as proc:
        wait_ready(ready, proc, timeout=900)
        asyncio.run(_load(base, {"max_tokens": 1}, prompts[:16]))  # warm-up, not measured
        out = {}
        for key, extra in loads.items():
            out[key] = asyncio.run(_load(base, extra, prompts))
            print(f"[{name}] {key}: {out[key]}", flush=True)
        return out


ECHO = {"echo": True, "logprobs": 1, "max_tokens": 0}

TAB_FEATURES, TAB_ROWS, TAB_CLIENTS, TAB_SECONDS = 32, 4096, 4, 8.0
# Runs in the image's interpreter: trains the model, then times Booster.predict (the floor).
TAB_SCRIPT = r"""
import json, sys, time
import numpy as np, xgboost as xgb
out, features, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rng = np.random.default_rng(11)
x = rng.normal(size=(20000, features)).astype(np.float32)
y = (x[:, 0] + np.sin(x[:, 1]) - 0.5 * x[:, 2] * x[:, 3] > 0).astype(int)
booster = xgb.train({"objective": "binary:logistic", "max_depth": 6, "eta": 0.1, "seed": 11, "nthread": 1},
                    xgb.DMatrix(x, label=y), num_boost_round=200)
booster.save_model(f"{out}/model/model.ubj")
rows = rng.normal(size=(n, features)).astype(np.float32)
np.save(f"{out}/rows.npy", rows)
np.save(f"{out}/expected.npy", booster.predict(xgb.DMatrix(rows)).astype(np.float32))
floor = {}
for batch in (1, 64):
    done, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 4.0:
        start = (done % n) // batch * batch
        booster.predict(xgb.DMatrix(rows[start:start + batch]))
        done += batch
    floor[batch] = done / (time.perf_counter() - t0)
print(json.dumps({"xgboost": xgb.__version__, "floor_rows_per_s": floor}))
"""


def _grpc_load(grpc_url: str, rows, expected, batch: int) -> dict:
    """TAB_CLIENTS threads send requests of ``batch`` rows for TAB_SECONDS; every answer checked."""
    import threading

    import numpy as np
    import tritonclient.grpc as grpcclient

    counts, latencies, errors, lock = [0], [], [], threading.Lock()
    stop = time.perf_counter() + TAB_SECONDS

    def client(k: int) -> None:
        try:
            _client(k)
        except Exception as e:  # noqa: BLE001 - a thread's failure is reported by the caller, not lost
            errors.append(f"client {k}: {e}")

    def _client(k: int) -> None:
        c = grpcclient.InferenceServerClient(grpc_url)
        i = k * batch
        while time.perf_counter() < stop:
            start = i % (len(rows) - batch + 1)
            inp = grpcclient.InferInput("input__0", [batch, TAB_FEATURES], "FP32")
            inp.set_data_from_numpy(rows[start:start + batch])
            t0 = time.perf_counter()
            out = c.infer("tabular", [inp]).as_numpy("output__0").reshape(-1)
            took = time.perf_counter() - t0
            if not np.allclose(out, expected[start:start + batch], rtol=0, atol=1e-6):
                raise AssertionError(f"served predictions differ from Booster.predict at rows {start}..")
            with lock:
                counts[0] += batch
                latencies.append(took)
            i += batch * TAB_CLIENTS
        c.close()

    threads = [threading.Thread(target=client, args=(k,)) for k in range(TAB_CLIENTS)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise SystemExit(f"tabular load at batch {batch} failed: {errors[0]}")
    latencies.sort()
    return {"batch": batch, "clients": TAB_CLIENTS, "rows": counts[0], "seconds": round(wall, 2),
            "rows_per_s": round(counts[0] / wall, 1), "p50_ms": round(1000 * latencies[len(latencies) // 2], 2),
            "p99_ms": round(1000 * latencies[int(len(latencies) * 0.99)], 2)}


def tabular() -> dict:
    """The XGBoost section of the report (see the module docstring)."""
    import subprocess
    import tempfile

    import numpy as np
    import yaml

    from modelops.settings import get_settings
    from _servers import isolated_env
    from tasks.image import build_runtime_image

    image = build_runtime_image()
    work = Path(tempfile.mkdtemp(prefix="bench-tabular-"))
    (work / "model").mkdir()
    made = subprocess.run([str(image.python), "-c", TAB_SCRIPT, str(work), str(TAB_FEATURES), str(TAB_ROWS)],
                          check=True, capture_output=True, text=True)
    floor = json.loads(made.stdout.strip().splitlines()[-1])
    rows, expected = np.load(work / "rows.npy"), np.load(work / "expected.npy")
    manifest = work / "tabular.yaml"
    manifest.write_text(yaml.safe_dump({
        "model_id": "tabular", "version": "1", "source": str(work / "model"), "framework": "xgboost",
        "resources": {"cpus": 1},
        "io_schema": {"inputs": [{"name": "input__0", "datatype": "FP32", "dims": [TAB_FEATURES]}],
                      "outputs": [{"name": "output__0", "datatype": "FP32", "dims": [1]}]}}))
    port, grpc_port = free_port(), free_port()
    env = isolated_env(work / "home", get_settings().vllm_cpu_kvcache_gib)
    cmd = [str(REPO / ".venv" / "bin" / "modelops"), "serve", str(manifest), "--port", str(port),
           "--grpc-port", str(grpc_port)]
    print("[tabular] starting ...", flush=True)
    with started(cmd, env, work / "serve.log", REPO) as proc:
        ready_s = wait_ready(f"http://127.0.0.1:{port}/ready", proc, timeout=300)
        _grpc_load(f"127.0.0.1:{grpc_port}", rows, expected, 1)  # warm-up, not measured
        served = {}
        for batch in (1, 64):
            served[batch] = _grpc_load(f"127.0.0.1:{grpc_port}", rows, expected, batch)
            print(f"[tabular] batch {batch}: {served[batch]}", flush=True)
    floor_rows = {int(k): round(v, 1) for k, v in floor["floor_rows_per_s"].items()}
    return {
        "model": f"XGBoost {floor['xgboost']} binary:logistic, {TAB_FEATURES} features, 200 trees of depth 6",
        "served_ready_s": round(ready_s, 2),
        "kserve_grpc": {f"batch_{b}": v for b, v in served.items()},
        "booster_predict_in_process": {f"batch_{b}_rows_per_s": v for b, v in floor_rows.items()},
        **{f"ratio_batch_{b}_to_booster_predict": round(served[b]["rows_per_s"] / floor_rows[b], 3) for b in (1, 64)},
        # Every answer was compared with Booster.predict (atol 1e-6); one mismatch ends the run above.
        "rows_checked_against_booster_predict": sum(v["rows"] for v in served.values()),
    }


def main() -> None:
    if sys.argv[1:] == ["--only", "tabular"]:
        report = json.loads(OUT.read_text()) if OUT.is_file() else {}
        report["tabular"] = tabular()
        OUT.parent.mkdir(parents=True, exist_ok=True)
        OUT.write_text(json.dumps(report, indent=2) + "\n")
        print(f"→ {OUT} (tabular)")
        return
    image, weights, work, manifest, env = smollm2("bench-workloads-")
    port = free_port()
    ours = _measure("ours", [str(REPO / ".venv" / "bin" / "modelops"), "serve", str(manifest), "--port", str(port)],
                    env, f"http://127.0.0.1:{port}/ready", f"http://127.0.0.1:{port}",
                    {"echo_max_tokens_0": ECHO, "max_tokens_16": {"max_tokens": 16, "ignore_eos": True}},
                    work / "ours.log")
    port = free_port()
    vllm = _measure("vllm serve", vllm_serve_command(image, weights, port), {**env, **image.env(), **VLLM_CPU_ENV},
                    f"http://127.0.0.1:{port}/health", f"http://127.0.0.1:{port}",
                    {"prompt_logprobs": {"prompt_logprobs": 1, "max_tokens": 1}, "echo_max_tokens_0": ECHO},
                    work / "vllm.log")
    report = {
        "benchmark": f"prefill-only scoring: SmolLM2-135M-Instruct float32, {PROMPTS} prompts of 12-60 words in "
                     f"requests of {BATCH} from {CLIENTS} clients; ours (echo, logprobs 1, max_tokens 0) vs vllm "
                     "serve (prompt_logprobs 1, max_tokens 1; and the same echo request), same image",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "runtime": {"vllm": image.vllm, "tritonserver": image.pin.tritonserver, "lock_hash": image.lock_hash},
        "engine_args": SMOLLM2_ENGINE_ARGS,
        "prefill_only": {
            "ours": ours, "vllm_serve": vllm,
            "ratio_prompts_per_s_to_vllm_prompt_logprobs": round(
                ours["echo_max_tokens_0"]["prompts_per_s"] / vllm["prompt_logprobs"]["prompts_per_s"], 3),
            "ratio_prompts_per_s_to_vllm_echo": round(
                ours["echo_max_tokens_0"]["prompts_per_s"] / vllm["echo_max_tokens_0"]["prompts_per_s"], 3),
            # Engine steps of the prefill-only load, and of the same prompts decoding 16 tokens each.
            "steps_prefill_only_vs_16_tokens": [ours["echo_max_tokens_0"]["engine_steps"],
                                                ours["max_tokens_16"]["engine_steps"]],
        },
        "tabular": tabular(),
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(report, indent=2) + "\n")
    print(f"→ {OUT}")


if __name__ == "__main__":
    main()
