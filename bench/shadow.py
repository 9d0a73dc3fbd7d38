"""Shadow traffic (issue 38): what a shadow costs the clients of the version that serves them.
Writes bench/results/shadow.json.

Parts: two instances of SmolLM2-135M-Instruct (``modelops serve``), version 1 serving every
request and version 2 (same weights) as the shadow at 100 %, our HAProxy router in front, the
primary's frontend copying marked requests through the router's internal socket
(runtime/frontend/shadow.py). A client sends greedy chat completions of 32 tokens at
concurrency 2 in rounds, the conditions interleaved within each round (this machine is noisy):

- ``none``: no shadow;
- ``hung``: a shadow whose instance is stopped (SIGSTOP): its copies hang until the router
  takes it out, then fail;
- ``healthy``: the shadow answers every copy. On this 2-core machine its engine shares the
  primary's cores, so this ratio measures CPU contention, not the mirror; in production the
  shadow has its own accelerator.

Then ``dead``: the shadow's instance is killed (SIGKILL) and one more round runs.

Keys: ``client_latency_p50_ratio_<condition>_vs_none`` and ``..._p99_...`` (a client's whole
request, one run); ``greedy_equal_rate_same_weights`` (healthy rounds: two instances of the same
weights answer greedy requests alike); the copies' outcomes per condition.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._servers import free_port, percentile, smollm2, started, wait_ready  # noqa: E402

OUT = Path(__file__).with_name("results") / "shadow.json"
REPO = Path(__file__).resolve().parents[1]


def _body(i: int) -> dict:
    return {"model": "smollm2", "messages": [{"role": "user", "content": f"Write one sentence about item {i}."}],
            "max_tokens": 32, "temperature": 0, "ignore_eos": True}


def _round(url: str, start: int, n: int) -> list[float]:
    """Seconds of each of ``n`` requests sent at concurrency 2, each answered 200."""
    def one(i: int) -> float:
        t0 = time.perf_counter()
        r = client.post(f"{url}/v1/chat/completions", json=_body(i))
        assert r.status_code == 200, r.text
        return time.perf_counter() - t0

    with httpx.Client(timeout=300) as client, ThreadPoolExecutor(2) as pool:
        return list(pool.map(one, range(start, start + n)))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--per-round", type=int, default=16, help="requests per condition per round")
    args = p.parse_args()

    from modelops.manifest import Manifest
    from modelops.registry import Registry
    from modelops.settings import Settings
    from modelops.shadow import SHADOW_ROUTER_ENV
    from tasks.traffic.haproxy import HAProxyRouter
    from tasks.traffic.interface import commit_routes, routes_from_registry
    from tasks.traffic.shadow import compare_shadow, start_shadow, stop_shadow

    image, weights, work, manifest, env = smollm2("bench-shadow-")
    settings = Settings(home=work / "router", router_port=free_port(), router_grpc_port=free_port())
    registry = Registry(settings.registry)
    report: dict = {"benchmark": "client latency of greedy chat (32 tokens, concurrency 2) through the router with a "
                                 "shadow at 100 % that hangs, answers, or is dead, against no shadow, interleaved",
                    "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
                    "runtime": {"vllm": image.vllm, "tritonserver": image.pin.tritonserver},
                    "workload": {"rounds": args.rounds, "per_round": args.per_round, "max_tokens": 32}}
    procs = {}
    with ExitStack() as stack:
        for version in ("1", "2"):
            path = work / f"smollm2-{version}.yaml"
            doc = {**yaml.safe_load(manifest.read_text()), "version": version}
            if version == "2":
                doc["strategy"] = "versioned"
            path.write_text(yaml.safe_dump(doc))
            port = free_port()
            run_env = {**env, SHADOW_ROUTER_ENV: f"unix:{settings.router_internal_socket}"} if version == "1" else env
            procs[version] = proc = stack.enter_context(started(
                [str(REPO / ".venv" / "bin" / "modelops"), "serve", str(path), "--port", str(port)], run_env,
                work / f"smollm2-{version}.log", REPO))
            wait_ready(f"http://127.0.0.1:{port}/ready", proc, timeout=900)
            registry.record_announcement(Manifest.model_validate(doc))
            registry.add_instance("smollm2", version, f"smollm2-{version}-1", str(work / f"smollm2-{version}.log"))
            registry.update_instance(f"smollm2-{version}-1", state="running", pid=proc.pid, endpoints={
                "openai": f"http://127.0.0.1:{port}/v1", "metrics": f"http://127.0.0.1:{port}/metrics"})
            registry.set_state("smollm2", version, "serving")
            registry.set_weights("smollm2", {version: 100 if version == "1" else 0})
        router = HAProxyRouter(settings)
        router.ensure_running(routes_from_registry(registry))
        commit_routes(registry, router)
        stack.callback(router.stop)
        url = f"http://127.0.0.1:{settings.router_port}"
        _round(url, 0, 4)  # warm-up

        times: dict[str, list[float]] = {"none": [], "hung": [], "healthy": [], "dead": []}
        copies: dict[str, dict] = {}
        i = 100

        def measured(condition: str) -> None:
            nonlocal i
            shadow = start_shadow(registry, router, "smollm2", "2", 100, origin="bench") \
                if condition != "none" else None
            times[condition] += _round(url, i, args.per_round)
            i += args.per_round
            if shadow is not None:
                time.sleep(2)  # the last copies land
                stats = compare_shadow(registry, shadow).as_dict()
                stop_shadow(registry, router, "smollm2")
                agg = copies.setdefault(condition, {"compared": 0, "shadow_failed": 0, "dropped": 0, "greedy": 0,
                                                    "equal": 0})
                for k in agg:
                    agg[k] += stats[k]

        for _ in range(args.rounds):
            measured("none")
            os.killpg(procs["2"].pid, signal.SIGSTOP)
            try:
                measured("hung")
            finally:
                os.killpg(procs["2"].pid, signal.SIGCONT)
            time.sleep(3)  # the router's check takes it back
            measured("healthy")
        os.killpg(procs["2"].pid, signal.SIGKILL)
        measured("dead")
        measured("none")

    for cond, ts in times.items():
        report[f"client_latency_ms_{cond}"] = {"n": len(ts), "p50": round(statistics.median(ts) * 1000, 1),
                                               "p99": round(percentile(ts, 0.99) * 1000, 1)}
    for cond in ("hung", "healthy", "dead"):
        for q, name in ((0.5, "p50"), (0.99, "p99")):
            report[f"client_latency_{name}_ratio_{cond}_vs_none"] = round(
                percentile(times[cond], q) / percentile(times["none"], q), 3)
    report["copies"] = copies
    healthy = copies.get("healthy", {})
    report["greedy_equal_rate_same_weights"] = round(healthy["equal"] / healthy["greedy"], 3) \
        if healthy.get("greedy") else None
    OUT.write_text(json.dumps(report, indent=2) + "\n")
    shown = ("copies", "greedy_equal_rate_same_weights")
    print(json.dumps({k: v for k, v in report.items() if "ratio" in k or k in shown}))


if __name__ == "__main__":
    main()
