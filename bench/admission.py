"""Benchmark: one client cannot hurt the others, on SmolLM2-135M-Instruct (one instance, one run).

- hang-ups: a long request of each kind (OpenAI chat unary and streamed, KServe gRPC stream)
  whose client goes mid-decode; seconds from the hang-up until vLLM's running gauge is 0;
- the probe: a short streamed completion's TTFT p50 alone, then while another client's request
  holds the most a request may (n = its share of the slots, the whole token budget); the ratio;
- the issue's reports: ``n: 16, max_tokens: 2000`` and 64 prompts of ~1,600 tokens, now refused.

Writes bench/results/admission.json.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from _servers import SMOLLM2_ENGINE_ARGS, free_port, smollm2, started, wait_ready  # noqa: E402

from tests.integration.engine_load import engine_load, grpc_stream, http_request, wait_for  # noqa: E402

OUT = REPO / "bench" / "results" / "admission.json"
SLOTS = SMOLLM2_ENGINE_ARGS["max_num_seqs"] // 2  # limits.max_request_share 0.5 (the default)
BUDGET = 4 * SMOLLM2_ENGINE_ARGS["max_model_len"]  # limits.max_request_tokens default: 4 contexts
LONG = {"max_tokens": 1500, "ignore_eos": True}
CHAT = {"model": "smollm2", "messages": [{"role": "user", "content": "Tell me a long story."}], **LONG}


def _ttft(base: str) -> float:
    t0 = time.perf_counter()
    with httpx.stream("POST", f"{base}/v1/completions", timeout=120, json={
            "model": "smollm2", "prompt": "The capital of France is", "max_tokens": 4, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - t0
    raise SystemExit("no token")


def _hang_ups(base: str, grpc: str) -> dict:
    kinds = {"openai_chat_unary": lambda: http_request(base, "/v1/chat/completions", CHAT),
             "openai_chat_stream": lambda: http_request(base, "/v1/chat/completions", {**CHAT, "stream": True}),
             "kserve_grpc_stream": lambda: grpc_stream(grpc, "smollm2", "Tell me a long story.", LONG)}
    out = {}
    for kind, open_request in kinds.items():
        wait_for(base, lambda load: not load["running"] and not load["waiting"], 120)
        before = engine_load(base)["cancelled"]
        with open_request():
            wait_for(base, lambda load: load["running"] >= 1, 60)
            time.sleep(1.0)  # mid-decode
        _, freed = wait_for(base, lambda load: not load["running"], 30)
        out[kind] = {"freed_s": round(freed, 3), "cancelled_counted": engine_load(base)["cancelled"] - before}
        print(f"[hang-up] {kind}: {out[kind]}", flush=True)
    return out


def _probe(base: str) -> dict:
    wait_for(base, lambda load: not load["running"] and not load["waiting"], 120)
    for _ in range(3):
        _ttft(base)
    alone = [_ttft(base) for _ in range(20)]
    ids = list(range(1000, 1032))  # a 32-token prompt of token ids
    largest = {"model": "smollm2", "prompt": ids, "n": SLOTS, "max_tokens": (BUDGET - len(ids)) // SLOTS,
               "ignore_eos": True}
    with http_request(base, "/v1/completions", largest):
        wait_for(base, lambda load: load["running"] == SLOTS, 60)
        beside = [_ttft(base) for _ in range(20)]
        still = engine_load(base)["running"]
    out = {"largest_request": {k: v for k, v in largest.items() if k != "prompt"} | {"prompt_tokens": len(ids)},
           "running_through_the_samples": still,
           "ttft_p50_alone_ms": round(statistics.median(alone) * 1000, 1),
           "ttft_p50_beside_largest_ms": round(statistics.median(beside) * 1000, 1)}
    out["ttft_ratio"] = round(out["ttft_p50_beside_largest_ms"] / out["ttft_p50_alone_ms"], 2)
    print(f"[probe] {out}", flush=True)
    return out


def _reported(base: str) -> dict:
    big_n = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={**CHAT, "n": 16, "max_tokens": 2000})
    many = httpx.post(f"{base}/v1/completions", timeout=60, json={
        "model": "smollm2", "prompt": [list(range(1000, 2600))] * 64, "max_tokens": 16})
    return {name: {"status": r.status_code, "message": r.json()["error"]["message"][:200]}
            for name, r in (("n16_max_tokens_2000", big_n), ("64_prompts_of_1600_tokens", many))}


def main() -> None:
    image, weights, work, manifest, env = smollm2("bench-admission-")
    port = free_port()
    with started([str(REPO / ".venv" / "bin" / "modelops"), "serve", str(manifest), "--port", str(port)], env,
                 work / "serve.log", REPO) as proc:
        base = f"http://127.0.0.1:{port}"
        wait_ready(f"{base}/ready", proc, timeout=900)
        grpc = next(line.split("gRPC ")[1].split(",")[0] for line in (work / "serve.log").read_text().splitlines()
                    if "KServe HTTP http://" in line and "gRPC " in line)
        result = {"compares": "SmolLM2-135M-Instruct, one instance of ours, 2 cores: seconds from a client's "
                              "hang-up to no running sequence, per request kind; a short request's TTFT p50 "
                              "alone vs beside the largest request the limits allow (one run)",
                  "engine_args": SMOLLM2_ENGINE_ARGS, "limits": {"max_request_tokens": BUDGET, "slots": SLOTS},
                  "hang_ups": _hang_ups(base, grpc), "probe": _probe(base), "reported_requests": _reported(base)}
    OUT.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
