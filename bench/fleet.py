"""Benchmark: the router in front of two instances, ours against vLLM's router, one run.

Two instances of SmolLM2-135M-Instruct (float32, max_model_len 2048, max_num_seqs 16, 1 GiB of
KV cache each: 23,296 tokens; prefill in 256-token chunks: FLEET_ENGINE_ARGS), each pinned to one
core (``taskset`` on its process group and vLLM's OpenMP threads bound to that core). Workload:
24 distinct system prompts of about 1,000 tokens, 4 users each, 3-turn chats (canned assistant
turns, so every router gets the same request sequence: all first turns, then all second turns,
then all third turns, each wave in one seeded order), 32 streamed output tokens a request
(``ignore_eos``), concurrency 8. The 24 prompts (24,150 tokens) outgrow one instance's KV cache:
a router that sends every prompt everywhere makes each instance evict and prefill them again.
vLLM's CPU backend caches prefixes in 128-token blocks, so a second turn reuses its system
prompt's whole blocks only (the first turn's last block holds its generated tokens, not the
canned answer): on that turn affinity saves nothing over an instance that holds the prompt too.

Routers, each on freshly started instances (an empty prefix cache): ours (HAProxy) with
``round-robin`` and with the default ``prefix-affinity``, and ``vllm-router`` 0.1.17 (PyPI, its
own environment under ~/.cache/modelops/bench) with ``cache_aware`` and ``power_of_two``. Per
router: TTFT p50/p99 (first content chunk), e2e p50, output tokens/s, and the prefix-cache hit rate
from the instances' own counters (``vllm:prefix_cache_hits`` / ``vllm:prefix_cache_queries``),
in all and per turn (with the turn's mean prompt tokens, from the usage the instances report).

Router overhead: one instance measured directly and through our router (one server) in pairs
of rounds (alternating which goes first), streamed completions of 64 tokens:
``router_ttft_overhead_ms_c1/_c16`` = the median over the pairs of (router TTFT p50 − direct
TTFT p50), and the same for the inter-token p50; at c16 with 16 requests in flight steadily, and
(``_c16_burst``) with 16 sent in the same instant (:func:`router_overhead` says why both).

    .venv/bin/python bench/fleet.py [--skip-overhead] [--skip-routers]   → bench/results/fleet.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from _servers import free_port, percentile, smollm2, started, stream_request, wait_ready  # noqa: E402

OUT = REPO / "bench" / "results" / "fleet.json"
# Chunked prefill, as vLLM's engine runs by default on GPUs (our CPU backend turns it off unless a
# manifest asks: runtime/engine/openai_engine.py, seed). Without it a ~1,000-token prefill holds every
# other request of its one-core instance for its whole length, and the request order, not the
# router, decides most first tokens: with whole prefills ours measured 0.83x round-robin's TTFT p50
# (bench/results/fleet.json of 2026-12-04), with 256-token chunks 0.67-0.68x (two runs).
FLEET_ENGINE_ARGS = {"enable_chunked_prefill": True, "max_num_batched_tokens": 256}
MODEL = "smollm2"
VLLM_ROUTER = "vllm-router==0.1.17"
PROMPTS, USERS, TURNS, OUT_TOKENS, CONCURRENCY = 24, 4, 3, 32, 8
# 920 words make system prompts of 995-1,019 tokens (1,006 on average; SmolLM2's tokenizer), 24,150
# tokens in all: more than one instance's KV cache (23,296 tokens at 1 GiB, the engine's log), as
# the workload means them to be. (760 words made 834-token prompts, 20,024 tokens in all,
# which one instance could hold.)
SYSTEM_WORDS = 920
WORDS = ("model router cache prefix token latency queue replica region tenant quota batch engine kernel "
         "tensor schedule request stream answer policy weight version deploy rollout canary shadow gate metric "
         "window budget signal scale node pool cluster shard ledger river mountain harbor lantern orchard "
         "violet copper meadow falcon granite willow ember glacier summit canyon prairie").split()


def workload(seed: int = 7) -> list[list[dict]]:
    """Three waves of chat requests (one per turn), each a seeded shuffle of the 96 conversations."""
    rng = random.Random(seed)
    systems = []
    for p in range(PROMPTS):
        # Distinct from the first word on (a shared opening would be one prefix for the routers).
        words = [f"Assistant-{p}-{rng.randrange(10**6)}:"] + [rng.choice(WORDS) for _ in range(SYSTEM_WORDS)]
        systems.append("You follow these notes. " + " ".join(words))
    waves = []
    for turn in range(TURNS):
        wave = []
        for p in range(PROMPTS):
            for u in range(USERS):
                messages = [{"role": "system", "content": systems[p]}]
                for t in range(turn + 1):
                    messages.append({"role": "user", "content": f"User {u} asks question {t} about note {p}."})
                    if t < turn:
                        messages.append({"role": "assistant", "content": f"Answer {t} for user {u}: see note {p}."})
                wave.append({"model": MODEL, "messages": messages, "max_tokens": OUT_TOKENS, "temperature": 0,
                             "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
        rng.shuffle(wave)
        waves.append(wave)
    return waves


async def _run(url: str, requests: list[dict], concurrency: int) -> tuple[list[dict], float]:
    """Each request's result and the wall time of sending ``requests`` from ``concurrency`` workers."""
    queue: asyncio.Queue = asyncio.Queue()
    for body in requests:
        queue.put_nowait(body)
    results: list[dict] = []
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=concurrency)) as client:
        async def worker():
            while not queue.empty():
                results.append(await stream_request(client, url, queue.get_nowait()))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return results, time.perf_counter() - t0


def _summary(results: list[dict], wall: float | None) -> dict:
    ok = [r for r in results if r["ok"]]
    gaps = [g for r in ok for g in r["gaps"]]
    return {"requests": len(results), "failed": len(results) - len(ok),
            "errors": sorted({r["error"] for r in results if not r["ok"]})[:3],
            "seconds": round(wall, 2) if wall else None,
            "out_tok_s": round(sum(r["tokens"] for r in ok) / wall, 1) if ok and wall else None,
            "ttft_p50_ms": round(statistics.median(r["ttft"] for r in ok) * 1000, 1) if ok else None,
            "ttft_p99_ms": round(percentile([r["ttft"] for r in ok], 0.99) * 1000, 1) if ok else None,
            "itl_p50_ms": round(statistics.median(gaps) * 1000, 2) if gaps else None,
            "e2e_p50_ms": round(statistics.median(r["e2e"] for r in ok) * 1000, 1) if ok else None,
            "prompt_tokens_mean": round(statistics.mean(r["prompt_tokens"] for r in ok)) if ok else None}


def _load(url: str, requests: list[dict], concurrency: int) -> dict:
    return _summary(*asyncio.run(_run(url, requests, concurrency)))


def _prefix_counters(base: str) -> tuple[float, float]:
    """(hits, queries) of vLLM's prefix cache on one instance, in tokens (its merged /metrics)."""
    from tasks.traffic.gates import parse_prometheus

    m = parse_prometheus(httpx.get(f"{base}/metrics", timeout=10).text)
    return (sum(v for _, v in m.get("vllm:prefix_cache_hits_total", [])),
            sum(v for _, v in m.get("vllm:prefix_cache_queries_total", [])))


def _hit_rate(before: list[tuple[float, float]], after: list[tuple[float, float]]) -> float | None:
    """The instances' prefix-cache hit rate (tokens hit / tokens queried) between two readings."""
    hits = sum(a[0] - b[0] for a, b in zip(after, before))
    queries = sum(a[1] - b[1] for a, b in zip(after, before))
    return round(hits / queries, 3) if queries else None


@contextmanager
def instances(manifest: Path, env: dict, work: Path, tag: str, count: int = 2):
    """``count`` instances of the manifest, instance i pinned to core i; yields their base URLs."""
    with ExitStack() as stack:
        procs = []
        for core in range(count):
            port = free_port()
            cmd = ["taskset", "-c", str(core), str(REPO / ".venv" / "bin" / "modelops"), "serve", str(manifest),
                   "--port", str(port)]
            inst_env = {**env, "VLLM_CPU_OMP_THREADS_BIND": str(core), "VLLM_CPU_KVCACHE_SPACE": "1",
                        "MODELOPS_HOME": str(work / f"home-{tag}-{core}")}
            proc = stack.enter_context(started(cmd, inst_env, work / f"{tag}-instance-{core}.log", REPO))
            procs.append((proc, f"http://127.0.0.1:{port}"))
        for proc, base in procs:
            wait_ready(f"{base}/ready", proc, timeout=900)
        yield [base for _, base in procs]


@contextmanager
def our_router(work: Path, bases: list[str], policy: str):
    """Our HAProxy router, in its own home and port, over ``bases`` as one version's servers."""
    from modelops.routing import Routing
    from modelops.settings import Settings
    from tasks.traffic.haproxy import HAProxyRouter
    from tasks.traffic.interface import ModelRoute, Server

    settings = Settings(home=work / f"router-{policy}", router_port=free_port(), router_grpc_port=free_port())
    router = HAProxyRouter(settings)
    servers = tuple(Server(f"{MODEL}-1-{i}", b.removeprefix("http://"), 100) for i, b in enumerate(bases))
    router.apply([ModelRoute(MODEL, {"1": servers}, {"1": Routing(policy=policy)})])
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # both servers through their first health check
            if sum(",UP," in line for line in router._command("show stat").splitlines()
                   if line.startswith(f"m_{MODEL},{MODEL}-")) == len(bases):
                break
            time.sleep(0.1)
        yield f"http://127.0.0.1:{settings.router_port}"
    finally:
        router.stop()


def _vllm_router_binary() -> Path:
    """vllm-router 0.1.17 in its own environment (built on first use)."""
    venv = Path("~/.cache/modelops/bench/vllm-router-0.1.17").expanduser()
    binary = venv / "bin" / "vllm-router"
    if not binary.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                        VLLM_ROUTER], check=True)
    return binary


@contextmanager
def vllm_router(work: Path, bases: list[str], policy: str):
    port = free_port()
    cmd = [str(_vllm_router_binary()), "--worker-urls", *bases, "--policy", policy, "--host", "127.0.0.1",
           "--port", str(port)]
    with started(cmd, dict(os.environ), work / f"vllm-router-{policy}.log", REPO) as proc:
        wait_ready(f"http://127.0.0.1:{port}/health", proc, timeout=60)
        yield f"http://127.0.0.1:{port}"


def compare_routers(manifest: Path, env: dict, work: Path, only: list[str] | None = None) -> dict:
    waves = workload()
    routers = {"ours_round_robin": lambda b: our_router(work, b, "round-robin"),
               "ours_prefix_affinity": lambda b: our_router(work, b, "prefix-affinity"),
               "vllm_router_cache_aware": lambda b: vllm_router(work, b, "cache_aware"),
               "vllm_router_power_of_two": lambda b: vllm_router(work, b, "power_of_two")}
    out = {}
    for name, make in routers.items():
        if only and name not in only:
            continue
        print(f"[{name}] starting two instances ...", flush=True)
        with instances(manifest, env, work, name) as bases, make(bases) as url:
            for base in bases:  # warm the code paths with a prompt that shares no prefix with the workload
                _load(f"{base}/v1/chat/completions", [{"model": MODEL, "max_tokens": 4, "stream": True,
                                                      "messages": [{"role": "user", "content": "warm up"}]}] * 2, 2)
            counters = [[_prefix_counters(b) for b in bases]]
            results, wall, per_turn = [], 0.0, []
            for wave in waves:
                got, seconds = asyncio.run(_run(f"{url}/v1/chat/completions", wave, CONCURRENCY))
                results += got
                wall += seconds
                counters.append([_prefix_counters(b) for b in bases])
                per_turn.append({**_summary(got, seconds), "prefix_cache_hit_rate": _hit_rate(*counters[-2:])})
        summary = _summary(results, wall)
        summary["prefix_cache_hit_rate"] = _hit_rate(counters[0], counters[-1])
        summary["per_turn"] = per_turn
        out[name] = summary
        print(f"[{name}] {json.dumps({k: v for k, v in summary.items() if k != 'per_turn'})}", flush=True)
    return out


async def _steady(url: str, bodies: list[dict], concurrency: int, stagger_s: float) -> list[dict]:
    """``concurrency`` workers, worker w starting at w × ``stagger_s``, each sending its share of
    ``bodies`` one after another; the results of requests that ran at full concurrency (neither
    a worker's first, sent while the others start, nor its last, sent while they finish)."""
    per = len(bodies) // concurrency
    out: list[dict] = []
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=concurrency)) as client:
        async def worker(w: int):
            await asyncio.sleep(w * stagger_s)
            for k in range(per):
                result = await stream_request(client, url, bodies[w * per + k])
                if 0 < k < per - 1:
                    out.append(result)

        await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return out


def router_overhead(manifest: Path, env: dict, work: Path, rounds: dict[str, int] | None = None) -> dict:
    """One instance directly and through our router (one server), in pairs of rounds, each pair
    in alternating order; an overhead is the median of the pairs' differences of TTFT p50 (and
    inter-token p50). Rounds (``rounds``: pairs of each):

    - ``c1``: 8 requests one after another (6 pairs);
    - ``c16``: 16 in flight, steadily: 16 workers of 4 requests each, started an e2e / 16 apart
      (the e2e of a warm-up burst), so requests arrive spread as a loaded service's do; only the
      middle two of each worker's count, which ran with the 16 in flight (8 pairs);
    - ``c16_burst``: 16 requests sent in the same instant on new connections, then 16 more as
      those end (all the same length, so they end in the same engine step) (8 pairs). At c16 a
      one-core instance takes the 16 in one after another (its TTFT p50 is ~650 ms against
      ~350 ms steadily) and an engine step is ~77 ms: whether a request makes a step decides its
      first token, so one round's p50 swings by ±40 ms and the pairs' median from −1 to 40 ms
      between runs of the same router (2026-12-05): ``router_ttft_overhead_ms_c16_burst``, kept
      beside the key."""
    rounds = rounds or {"c1": 6, "c16": 8, "c16_burst": 8}

    def body(i: int) -> dict:
        return {"model": MODEL, "prompt": f"Write a short story number {i} about a lighthouse keeper.",
                "max_tokens": 64, "ignore_eos": True, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}

    out: dict = {}
    with instances(manifest, env, work, "overhead", count=1) as (base,), our_router(work, [base], "prefix-affinity") \
            as url:
        warm = _load(f"{base}/v1/completions", [body(i) for i in range(16)], 16)  # warm-up, and the c16 e2e
        stagger = warm["e2e_p50_ms"] / 1000 / 16
        runs = {"c1": lambda u: _load(u, [body(i) for i in range(8)], 1),
                "c16": lambda u: _summary(asyncio.run(_steady(u, [body(i) for i in range(64)], 16, stagger)), None),
                "c16_burst": lambda u: _load(u, [body(i) for i in range(32)], 16)}
        for key, run in runs.items():
            sides: dict[str, list[dict]] = {"direct": [], "router": []}
            for r in range(rounds[key]):
                for side in (("direct", "router") if r % 2 == 0 else ("router", "direct")):
                    sides[side].append(run(f"{base if side == 'direct' else url}/v1/completions"))
            summary = {side: {"ttft_p50_ms": round(statistics.median(x["ttft_p50_ms"] for x in runs_), 1),
                              "itl_p50_ms": round(statistics.median(x["itl_p50_ms"] for x in runs_), 2),
                              "failed": sum(x["failed"] for x in runs_)} for side, runs_ in sides.items()}
            for metric, digits in (("ttft", 1), ("itl", 2)):
                summary[f"{metric}_overhead_ms"] = round(statistics.median(
                    r[f"{metric}_p50_ms"] - d[f"{metric}_p50_ms"] for r, d in zip(sides["router"], sides["direct"])),
                    digits)
            summary["pairs_ttft_ms"] = [round(r["ttft_p50_ms"] - d["ttft_p50_ms"], 1)
                                        for r, d in zip(sides["router"], sides["direct"])]
            summary["rounds"] = {side: runs_ for side, runs_ in sides.items()}
            if key == "c16":
                summary["stagger_s"] = round(stagger, 3)
            out[key] = summary
            print(f"[overhead {key}] {json.dumps({k: v for k, v in summary.items() if k != 'rounds'})}", flush=True)
    return out


def yaml_engine_args(manifest: Path) -> dict:
    """The engine args the benchmark's instances ran with (its manifest's)."""
    import yaml

    return yaml.safe_load(manifest.read_text())["engine_args"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--skip-overhead", action="store_true")
    p.add_argument("--skip-routers", action="store_true")
    p.add_argument("--routers", nargs="*", help="run only these routers, keeping the others' last results "
                   "(ours_round_robin ours_prefix_affinity vllm_router_cache_aware vllm_router_power_of_two)")
    p.add_argument("--engine-args", default=json.dumps(FLEET_ENGINE_ARGS),
                   help="JSON engine args merged into the instances' manifest (default FLEET_ENGINE_ARGS; '{}' for "
                   "bench/_servers.py's SMOLLM2_ENGINE_ARGS alone)")
    p.add_argument("--out", type=Path, default=OUT, help="where the report goes (default bench/results/fleet.json)")
    args = p.parse_args()

    image, _weights, work, manifest, env = smollm2("bench-fleet-")
    extra = json.loads(args.engine_args)
    if extra:
        import yaml

        doc = yaml.safe_load(manifest.read_text())
        doc["engine_args"].update(extra)
        manifest.write_text(yaml.safe_dump(doc))
    out_path: Path = args.out
    report: dict = json.loads(out_path.read_text()) if out_path.exists() else {}
    report.update({
        "benchmark": "router in front of SmolLM2-135M-Instruct float32 instances pinned to one core each: "
                     f"{PROMPTS} system prompts of ~1,000 tokens x {USERS} users x {TURNS} turns, {OUT_TOKENS} "
                     f"streamed tokens, concurrency {CONCURRENCY}, engine args {json.dumps(extra)}; ours (HAProxy) vs "
                     "vllm-router 0.1.17 on the same "
                     "instances, fresh instances per router; overhead: one instance direct vs through ours",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "runtime": {"vllm": image.vllm, "tritonserver": image.pin.tritonserver, "lock_hash": image.lock_hash},
    })
    if not args.skip_overhead:
        overhead = router_overhead(manifest, env, work)
        report["overhead"] = overhead
        for key in ("c1", "c16", "c16_burst"):
            report[f"router_ttft_overhead_ms_{key}"] = overhead[key]["ttft_overhead_ms"]
            report[f"router_itl_overhead_ms_{key}"] = overhead[key]["itl_overhead_ms"]
    if not args.skip_routers:
        routers = {**report.get("routers", {}), **compare_routers(manifest, env, work, args.routers)}
        report["routers"] = routers
        theirs = [routers[k] for k in ("vllm_router_cache_aware", "vllm_router_power_of_two") if k in routers]
        ours, rr = routers.get("ours_prefix_affinity"), routers.get("ours_round_robin")
        if ours and rr:
            report["ttft_p50_ratio_vs_round_robin"] = round(ours["ttft_p50_ms"] / rr["ttft_p50_ms"], 3)
        if ours and theirs:
            report["ttft_p50_ratio_vs_vllm_router"] = round(
                ours["ttft_p50_ms"] / min(r["ttft_p50_ms"] for r in theirs), 3)
            report["throughput_ratio_vs_vllm_router"] = round(
                ours["out_tok_s"] / max(r["out_tok_s"] for r in theirs), 3)
    report["targets"] = {"ttft_p50_ratio_vs_round_robin_max": 0.7, "ttft_p50_ratio_vs_vllm_router_max": 1.0,
                         "throughput_ratio_vs_vllm_router_min": 1.0, "router_ttft_overhead_ms_max": 5.0}
    met = {}
    if "ttft_p50_ratio_vs_round_robin" in report:
        met["ttft_vs_round_robin"] = report["ttft_p50_ratio_vs_round_robin"] <= 0.7
    if "ttft_p50_ratio_vs_vllm_router" in report:
        met.update(ttft_vs_vllm_router=report["ttft_p50_ratio_vs_vllm_router"] <= 1.0,
                   throughput_vs_vllm_router=report["throughput_ratio_vs_vllm_router"] >= 1.0)
    if "router_ttft_overhead_ms_c1" in report:
        met.update(overhead_c1=report["router_ttft_overhead_ms_c1"] <= 5.0,
                   overhead_c16=report["router_ttft_overhead_ms_c16"] <= 5.0)
    report["targets_met"] = met
    report["engine_args"] = yaml_engine_args(manifest)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k not in ("routers", "overhead", "benchmark", "machine",
                                                                     "runtime")}))


if __name__ == "__main__":
    main()
