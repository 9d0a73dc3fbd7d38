"""Helpers the benchmarks share: free ports, waiting for a server, peak RSS of a process tree,
starting and stopping a server in its own process group."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

__all__ = ["LoadClient", "PeakRSS", "free_port", "isolated_env", "load_client", "percentile", "smollm2", "started",
           "stream_request", "tree_rss", "vllm_serve_command", "wait_ready"]


def isolated_env(home: Path, kvcache_gib: float) -> dict[str, str]:
    """This process's environment without ``PREFECT_*``/``MODELOPS_*`` (so a bench never reaches
    the developer's stack), with ``MODELOPS_HOME=home``, vLLM's CPU KV cache of ``kvcache_gib``
    GiB and the Hugging Face hub offline."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MODELOPS_"))}
    env.update(MODELOPS_HOME=str(home), VLLM_CPU_KVCACHE_SPACE=str(kvcache_gib), HF_HUB_OFFLINE="1")
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and all its descendants (from /proc)."""
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
            for task in Path(f"/proc/{p}/task").iterdir():
                stack.extend(int(c) for c in (task / "children").read_text().split())
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return total


class PeakRSS:
    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, tree_rss(self.pid))
            time.sleep(0.1)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 400) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode} while starting ({url})")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise SystemExit(f"{url} not ready after {timeout} s")



@contextmanager
def started(cmd: list[str], env: dict, log: Path, cwd: Path):
    """``cmd`` in its own session (stdout+stderr to ``log``); SIGTERM to the group on exit,
    SIGKILL after 60 s."""
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, start_new_session=True)
    try:
        yield proc
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


SMOLLM2_ENGINE_ARGS = {"dtype": "float32", "max_model_len": 2048, "max_num_seqs": 16}


def smollm2(prefix: str):
    """The pinned runtime image, SmolLM2-135M-Instruct's folder (tests/models/make_smollm2.py), a
    fresh work folder, a manifest (model ``smollm2``, SMOLLM2_ENGINE_ARGS) and an isolated
    environment: ``(image, weights, work, manifest, env)``."""
    import yaml

    from modelops.settings import get_settings
    from tasks.image import build_runtime_image

    repo = Path(__file__).resolve().parents[1]
    image = build_runtime_image()
    made = subprocess.run([str(image.python), str(repo / "tests" / "models" / "make_smollm2.py")], check=True,
                          capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    weights = made.stdout.strip().splitlines()[-1]
    work = Path(tempfile.mkdtemp(prefix=prefix))
    manifest = work / "smollm2.yaml"
    manifest.write_text(yaml.safe_dump({"model_id": "smollm2", "version": "1", "source": weights, "task": "generate",
                                        "engine_args": SMOLLM2_ENGINE_ARGS}))
    return image, weights, work, manifest, isolated_env(work / "home", get_settings().vllm_cpu_kvcache_gib)


def vllm_serve_command(image, weights: str, port: int) -> list[str]:
    """`vllm serve` (vLLM's OpenAI server) on ``weights`` with SMOLLM2_ENGINE_ARGS, whole-prompt
    prefill as our CPU backend runs it."""
    return [str(image.python), "-m", "vllm.entrypoints.openai.api_server", "--model", weights,
            "--served-model-name", "smollm2", "--dtype", "float32", "--max-model-len", "2048",
            "--max-num-seqs", "16", "--no-enable-chunked-prefill", "--host", "127.0.0.1", "--port", str(port)]


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (0..1) of ``values``."""
    values = sorted(values)
    return values[min(len(values) - 1, max(0, int(round(q * len(values))) - 1))]


async def stream_request(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    """POST one streamed completion or chat completion (``body`` with ``stream`` and
    ``stream_options.include_usage``); ``{"ok", "ttft", "e2e", "tokens", "prompt_tokens", "gaps",
    "error"}``, times in seconds,
    timed from the send to the first content chunk, the end, and between content chunks; ``ok``
    when the usage counts ``max_tokens`` tokens."""
    chat = "messages" in body
    t0 = time.perf_counter()
    first, stamps, tokens, prompt_tokens = None, [], 0, 0
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            return {"ok": False, "error": f"{r.status_code} {(await r.aread())[:200]!r}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens, prompt_tokens = event["usage"]["completion_tokens"], event["usage"].get("prompt_tokens", 0)
            for ch in event.get("choices", []):
                piece = (ch.get("delta") or {}).get("content") if chat else ch.get("text")
                if piece:
                    now = time.perf_counter()
                    first = first if first is not None else now
                    stamps.append(now)
    end = time.perf_counter()
    return {"ok": tokens == body["max_tokens"], "ttft": (first or end) - t0, "e2e": end - t0, "tokens": tokens,
            "prompt_tokens": prompt_tokens, "gaps": [b - a for a, b in zip(stamps, stamps[1:])],
            "error": "" if tokens else "no usage"}


class LoadClient:
    """A running ``python -m bench._load``: ``ttfts`` (s, with ``ttft``) as its answers come, and
    ``counts`` (``answered``, ``refused_429``, ``other``) once it stopped."""

    def __init__(self) -> None:
        self.ttfts: list[float] = []
        self.counts: dict[str, int] = {}


@contextmanager
def load_client(url: str, path: str, body: dict, streams: int = 1, key: str | None = None, ttft: bool = False):
    """``streams`` requests of ``body`` kept going to ``url`` + ``path`` by a client process of its
    own (bench/_load.py: each ``{i}`` in the body becomes the request's number) until the block
    ends; yields its :class:`LoadClient`."""
    cmd = [sys.executable, "-m", "bench._load", url, path, json.dumps(body), "--streams", str(streams),
           *(["--key", key] if key else []), *(["--ttft"] if ttft else [])]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1],
                            start_new_session=True)
    client = LoadClient()

    def read() -> None:
        for line in proc.stdout:
            if line.startswith("{"):
                client.counts = json.loads(line)
            elif line.strip():
                client.ttfts.append(float(line))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        yield client
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        reader.join(timeout=10)
