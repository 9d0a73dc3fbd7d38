"""Benchmark: the autoscaler against fixed instance counts under a load step, one run.

Three isolated local stacks (own MODELOPS_HOME, free ports), one after another, each serving
SmolLM2-135M-Instruct (float32, max_model_len 2048, ``max_num_seqs: 4`` so that a step of load
queues in the engine, ``resources.cpus: 1``: one core per instance):

- ``autoscaled``: ``scaling: {min: 1, max: 2, target: {waiting: 2}, scale_up_window_s: 10,
  scale_down_window_s: 60}``;
- ``fixed1``: one instance; ``fixed2``: two instances (``min: 2, max: 2``: the autoscaler brings
  the version to its minimum after the announcement; the load starts once both are routed);
- ``from_zero``: ``scaling: {min: 0, max: 1, scale_down_window_s: 10}``, no load: once idle it goes
  to zero, then one streamed chat request is sent and held until an instance is up.

The same load against each, through the router: streamed chat completions of 64 output tokens
(``ignore_eos``), each request a different user's question, 90 s at concurrency 2, then 180 s at
12, then 120 s at 2 (BENCH_AUTOSCALE_PHASES="90,180,120" shortens it for a trial).

Keys (``bench/results/autoscale.json``):

- ``scale_up_reaction_s``: from the load step to the second instance's first request at the router
  (its own ``/metrics`` counters, read every 0.25 s);
- ``scale_up_decided_s``: from the load step to the autoscaler's decision (its up window is 5 s);
- ``cold_start_s``: the scale-up action, from the instance's start to ready and routed;
- ``ttft_p99_high_phase_ratio_vs_fixed2``: TTFT p99 of the autoscaled run's high phase after the
  reaction, against fixed2's over the same seconds of its high phase (and ``_vs_fixed1``);
- ``failed_requests``: in the autoscaled run (every phase, the scale-up and -down included);
- ``scale_down_s``: from the load's fall to one instance again (against the 60 s window + drain);
- ``scale_from_zero_first_answer_s``: in ``from_zero``, from sending the request to its first
  token, against ``scale_from_zero_cold_start_s``, that stack's start action (instance start to
  ready and routed).

    .venv/bin/python bench/autoscale.py     → bench/results/autoscale.json
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from _servers import free_port, percentile, smollm2, stream_request  # noqa: E402

OUT = REPO / "bench" / "results" / "autoscale.json"
MODELOPS = str(REPO / ".venv" / "bin" / "modelops")
MODEL = "smollm2"
ENGINE_ARGS = {"dtype": "float32", "max_model_len": 2048, "max_num_seqs": 4}
POLICIES = {
    "autoscaled": {"min": 1, "max": 2, "target": {"waiting": 2}, "scale_up_window_s": 5, "scale_down_window_s": 60},
    "fixed1": {"min": 1, "max": 1},
    "fixed2": {"min": 2, "max": 2},
    "from_zero": {"min": 0, "max": 1, "scale_down_window_s": 10},
}
PHASES = [int(x) for x in os.environ.get("BENCH_AUTOSCALE_PHASES", "90,180,120").split(",")]
CONCURRENCY = [2, 12, 2]


class Stack:
    """An isolated local stack: ``modelops up`` on free ports under ``work/<name>/home``."""

    def __init__(self, work: Path, name: str, env: dict[str, str]) -> None:
        ports = {"MODELOPS_ROUTER_PORT": free_port(), "MODELOPS_ROUTER_GRPC_PORT": free_port(),
                 "MODELOPS_PREFECT_PORT": free_port(), "MODELOPS_S3_PORT": free_port()}
        self.env = {**{k: v for k, v in env.items() if not k.startswith(("PREFECT_", "MODELOPS_"))},
                    **{k: str(v) for k, v in ports.items()}, "MODELOPS_HOME": str(work / name / "home"),
                    "COLUMNS": "200", "MODELOPS_VLLM_CPU_KVCACHE_GIB": env.get("MODELOPS_VLLM_CPU_KVCACHE_GIB", "1")}
        self.router = f"http://127.0.0.1:{ports['MODELOPS_ROUTER_PORT']}"

    def modelops(self, *args: str, timeout: float = 1800) -> subprocess.CompletedProcess:
        run = subprocess.run([MODELOPS, *args], env=self.env, cwd=REPO, capture_output=True, text=True,
                             timeout=timeout)
        if run.returncode != 0:
            raise RuntimeError(f"modelops {' '.join(args)} failed:\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}")
        return run

    def version(self) -> dict:
        status = json.loads(self.modelops("status", "--json").stdout)
        (model,) = [m for m in status["models"] if m["model_id"] == MODEL]
        (version,) = model["versions"]
        return {**version, "router": status.get("router", {})}


def _running(version: dict) -> list[str]:
    return sorted(n for n, i in version["instances"].items() if i["state"] == "running")


async def _load(router: str, t0: float, watch) -> list[dict]:
    """The three phases from ``t0``; each result gets ``start`` (s since t0) and ``phase``."""
    results: list[dict] = []
    users = itertools.count()

    async def worker(client: httpx.AsyncClient, phase: int, end: float) -> None:
        while time.monotonic() < end:
            body = {"model": MODEL, "max_tokens": 64, "ignore_eos": True, "stream": True, "temperature": 0,
                    "stream_options": {"include_usage": True},
                    "messages": [{"role": "user", "content": f"User {next(users)} asks: what makes a good day?"}]}
            start = time.monotonic() - t0
            try:
                r = await stream_request(client, f"{router}/v1/chat/completions", body)
            except httpx.HTTPError as e:
                r = {"ok": False, "error": repr(e)}
            results.append({**r, "start": start, "phase": phase})

    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        begin = t0
        watcher = asyncio.create_task(watch())
        for phase, (seconds, concurrency) in enumerate(zip(PHASES, CONCURRENCY)):
            end = begin + seconds
            await asyncio.gather(*(worker(client, phase, end) for _ in range(concurrency)))
            begin = end
        watcher.cancel()
    return results


def _announced(name: str, work: Path, weights: str, env: dict[str, str]) -> Stack:
    """A stack up with SmolLM2 announced under ``POLICIES[name]`` (``modelops down`` is the caller's)."""
    stack = Stack(work, name, env)
    manifest = work / f"{name}.yaml"
    manifest.write_text(yaml.safe_dump({"model_id": MODEL, "version": "1", "source": weights, "task": "generate",
                                        "engine_args": ENGINE_ARGS, "resources": {"cpus": 1},
                                        "scaling": POLICIES[name]}))
    print(f"[{name}] stack up, announce ...", flush=True)
    stack.modelops("up", timeout=600)
    try:
        stack.modelops("announce", str(manifest), "--wait")
    except BaseException:
        stack.modelops("down", timeout=600)
        raise
    return stack


def run(name: str, work: Path, weights: str, env: dict[str, str]) -> dict:
    """One stack with ``POLICIES[name]`` under the load; its requests and what the autoscaler did."""
    stack = _announced(name, work, weights, env)
    try:
        want = POLICIES[name]["min"]
        deadline = time.monotonic() + 300
        while len(_running(stack.version())) < want:  # fixed2: the autoscaler brings it to min
            assert time.monotonic() < deadline, f"{name}: {want} instances not running within 300 s"
            time.sleep(2)
        seen: dict[str, float] = {}  # instance → seconds since t0 when the router first sent it a request
        counts: list[tuple[float, int]] = []  # (s since t0, running instances)

        async def watch() -> None:
            # The router's own counters every 0.25 s (first request per instance); the running
            # count from `modelops status` (a second or two a call).
            async def first_requests() -> None:
                async with httpx.AsyncClient(timeout=5) as client:
                    while True:
                        text = (await client.get(f"{stack.router}/metrics")).text
                        for line in text.splitlines():
                            if line.startswith("modelops_router_requests_total{") and not line.endswith(" 0"):
                                inst = line.split('instance="', 1)[1].split('"', 1)[0]
                                seen.setdefault(inst, time.monotonic() - t0)
                        await asyncio.sleep(0.25)

            task = asyncio.create_task(first_requests())
            try:
                while True:
                    v = await asyncio.to_thread(stack.version)
                    counts.append((time.monotonic() - t0, len(_running(v))))
                    await asyncio.sleep(0.5)
            finally:
                task.cancel()

        print(f"[{name}] load {PHASES} s at concurrency {CONCURRENCY} ...", flush=True)
        t0, t0_wall = time.monotonic(), time.time()
        results = asyncio.run(_load(stack.router, t0, watch))
        final = stack.version()
        decisions = final["last_scale"]
        return {"results": results, "seen": seen, "counts": counts, "last_scale": decisions, "t0_wall": t0_wall,
                "scale_log": [line for line in (Path(stack.env["MODELOPS_HOME"]) / "logs" / "autoscaler.log")
                              .read_text().splitlines() if "scaling" in line or "now " in line]}
    finally:
        stack.modelops("down", timeout=600)


def from_zero(work: Path, weights: str, env: dict[str, str]) -> dict:
    """The ``from_zero`` stack: announce, wait for zero, one held streamed chat request."""
    name = "from_zero"
    stack = _announced(name, work, weights, env)
    try:
        deadline = time.monotonic() + 300
        while (v := stack.version())["instances"] or (v["last_scale"] or {}).get("after") != 0:
            assert time.monotonic() < deadline, f"{name}: not at zero within 300 s: {v}"
            time.sleep(1)

        async def ask() -> dict:
            async with httpx.AsyncClient(timeout=300) as client:
                return await stream_request(client, f"{stack.router}/v1/chat/completions", {
                    "model": MODEL, "max_tokens": 64, "ignore_eos": True, "stream": True, "temperature": 0,
                    "stream_options": {"include_usage": True},
                    "messages": [{"role": "user", "content": "What makes a good day?"}]})

        print(f"[{name}] at zero; one request ...", flush=True)
        answer = asyncio.run(ask())
        return {"answer": answer, "last_scale": stack.version()["last_scale"]}
    finally:
        stack.modelops("down", timeout=600)


def _ttft_p99(results: list[dict], lo: float, hi: float) -> float | None:
    ttfts = [r["ttft"] for r in results if r["ok"] and lo <= r["start"] < hi]
    return round(percentile(ttfts, 0.99), 3) if ttfts else None


def main() -> None:
    image, weights, work, _, env = smollm2("bench-autoscale-")
    runs = {name: run(name, work, weights, env) for name in ("autoscaled", "fixed1", "fixed2")}
    zero = from_zero(work, weights, env)
    step, fall = PHASES[0], PHASES[0] + PHASES[1]
    auto = runs["autoscaled"]
    first_seen = sorted(auto["seen"].values())
    reaction = round(first_seen[1] - step, 1) if len(first_seen) > 1 else None
    after = step + (reaction or 0)
    down_at = next((t for t, n in auto["counts"] if t > fall and n == 1), None)
    ups = [line for line in auto["scale_log"] if "now 2 instance" in line]
    decided = [line for line in auto["scale_log"] if "scaling up" in line]
    decided_s = None
    if decided:  # the log's wall-clock stamp, e.g. "2026-12-06 01:04:22,868 INFO ..."
        from datetime import datetime

        stamp = datetime.strptime(decided[0][:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        decided_s = round(stamp - auto["t0_wall"] - step, 1)
    cold = float(ups[0].rsplit("(", 1)[1].split(" s")[0]) if ups else None
    p99 = {name: _ttft_p99(r["results"], after, fall) for name, r in runs.items()}
    out = {
        "what": "autoscaled (min 1, max 2, target 2 waiting requests per instance, up window 5 s) against fixed 1 "
                "and fixed 2 instances, same load through the router: streamed chat, 64 tokens, phases "
                f"{PHASES} s at concurrency {CONCURRENCY}; SmolLM2-135M float32, max_num_seqs 4, one core an "
                "instance; then from zero (min 0, max 1): one streamed chat request held while an instance starts",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "scale_up_decided_s": decided_s,
        "scale_up_reaction_s": reaction,
        "cold_start_s": cold,
        "ttft_p99_high_phase_s": p99,
        "ttft_p99_high_phase_ratio_vs_fixed2": round(p99["autoscaled"] / p99["fixed2"], 3)
        if p99["autoscaled"] and p99["fixed2"] else None,
        "ttft_p99_high_phase_ratio_vs_fixed1": round(p99["autoscaled"] / p99["fixed1"], 3)
        if p99["autoscaled"] and p99["fixed1"] else None,
        "failed_requests": sum(not r["ok"] for r in auto["results"]),
        "failures": [r.get("error", "") for r in auto["results"] if not r["ok"]][:5],
        "requests": {name: len(r["results"]) for name, r in runs.items()},
        "scale_down_s": round(down_at - fall, 1) if down_at is not None else None,
        "scale_down_window_s": POLICIES["autoscaled"]["scale_down_window_s"],
        "scale_from_zero_first_answer_s": round(zero["answer"]["ttft"], 1) if zero["answer"]["ok"] else None,
        "scale_from_zero_cold_start_s": zero["last_scale"]["seconds"],
        "scale_from_zero": {"ok": zero["answer"]["ok"], "error": zero["answer"]["error"],
                            "decision": zero["last_scale"]},
        "autoscaler_log": auto["scale_log"],
        "targets": {"scale_up_reaction_s": "<= cold_start_s + 15", "ttft_p99_high_phase_ratio_vs_fixed2": "<= 1.3",
                    "failed_requests": 0, "scale_down_s": "<= scale_down_window_s + drain",
                    "scale_from_zero_first_answer_s": "<= scale_from_zero_cold_start_s + 10"},
    }
    OUT.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "autoscaler_log"}, indent=2))


if __name__ == "__main__":
    main()
