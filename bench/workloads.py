"""Benchmark: the non-decode workloads, one run. Today: prefill-only scoring (log-likelihood).

Prefill-only: SmolLM2-135M-Instruct (tests/models/make_smollm2.py), the same engine args as
bench/generate.py (float32, max_model_len 2048, max_num_seqs 16, whole-prompt prefill). 128
prompts of 12-60 words, sent as completions requests of 8 prompts each (a prompt list) from 4
concurrent clients. Ours: ``echo: true, logprobs: 1, max_tokens: 0`` (the evaluation harnesses'
idiom); `vllm serve` on the same folder and image: its own ``prompt_logprobs: 1, max_tokens: 1``
and the same echo request. Per server: prompts/s, prompt tokens/s, and the engine steps the load
took (vllm:iteration_tokens_total's count: prefill steps only when nothing is decoded).

    .venv/bin/python bench/workloads.py     → bench/results/workloads.json
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


def main() -> None:
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
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(report, indent=2) + "\n")
    print(f"→ {OUT}")


if __name__ == "__main__":
    main()
