"""The serving image's entrypoint: start one instance (Triton + its frontend) of a package.

    python -m runtime.startup --package DIR --openai-port P --http-port P --grpc-port P \
        --metrics-port P --workdir DIR

Stages, each timed and logged; the timeline is written to ``<workdir>/startup-timeline.json``:

1. unpack_package: check the archive's sha256, extract it into ``<workdir>/package`` with
   tarfile's ``data`` filter and check every file's digest (:func:`modelops.archive.unpack`);
2. plugins: install the model's plugin wheels (``deployment.json``) with ``pip --no-deps`` into
   ``<workdir>/plugins``, appended to the path so they can never shadow a pinned package; a
   wheel in the package that the manifest did not declare is refused;
3. metrics_dir: wipe and recreate ``PROMETHEUS_MULTIPROC_DIR`` when set (no stale .db files);
4. backends: lay out Triton's backend directory (Python backend + our ``vllm`` backend);
5. start_triton: tritonserver on the package's model repository, a child that dies with us,
   on private ports;
6. load_and_warm_up: the frontend serves (``/ready`` 503) while the engine loads; once Triton
   reports the model ready and a warm-up request through the engine was answered (a tabular
   model: one row of zeros), the public KServe HTTP and gRPC ports open and ``/ready`` turns 200.

Execution modes (the package's ``deployment.json``): ``embedded`` serves the OpenAI API on
``--openai-port`` beside /health, /ready and /metrics; ``separate`` (models with no OpenAI face,
the XGBoost ones by default) serves only /health, /ready and /metrics there, and Triton's KServe
ports are the instance's whole data plane. Gates, drain, engine watch and the merged metrics are
the same code in both.

No open doors: with ``MODELOPS_INSTANCE_SECRET`` set (the local stack sets it), the OpenAI routes
and Triton's KServe APIs (all but health) take only requests carrying it in
``x-modelops-instance-secret``, which the router adds (modelops/tenancy.py).

SIGTERM: readiness turns false at once, new OpenAI requests get 503, the KServe ports close to
new connections, in-flight requests finish (up to ``--drain-timeout``), then the frontend exits
and Triton is stopped.

Engine death (runtime/frontend/engine_watch.py): once the engine process (Triton's Python backend
stub) is gone, readiness is false, requests waiting on it are answered 503, Triton is stopped
without a drain (nothing is left to drain) and the instance exits 70, or 75 when the engine was
killed from outside (``modelops.io_contract.ENGINE_DIED_EXIT``), so its supervisor sees it. A
stopped or wedged engine turns readiness false until it moves again; stalled for 60 s it counts
as dead (75).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

__all__ = ["TritonLayout", "install_plugins", "main", "triton_layout"]

log = logging.getLogger("modelops.runtime")

_PR_SET_PDEATHSIG = 1
# Triton's APIs that need the instance secret when the stack sets one: all but health, which
# the probes use (tritonserver --help: --http-restricted-api, --grpc-restricted-protocol).
_RESTRICTED = "metadata,inference,shared-memory,model-config,model-repository,statistics,trace,logging"
# Seconds tritonserver gets after the drain, for KServe requests still in flight and to unload (the
# vllm backend's finalize answers what is still queued in about 2 s; the stub's teardown after it
# took 4-5 s more on 2 cores, so Triton's timeout often ends it). Then it exits at once; 2 s later
# it is killed. With 30 s, an unload that hung at times (finalize never began) held the exit 30 s.
TRITON_EXIT_TIMEOUT_S = 5
# The module name every model.py imports first (runtime/engine/stub_prelude.py).
STUB_PRELUDE = "modelops_stub_prelude.py"


class TritonLayout:
    """Where tritonserver lives in this environment.

    Attributes: ``binary`` the tritonserver executable; ``python_backend`` its Python backend
    folder; ``stub`` the backend stub for this interpreter's Python; ``libs`` the folder of
    the shared libraries the stub links (CUDA runtime, even on a CPU-only host).

    Two layouts: the nvidia-pytriton wheel's (local runtime; ``site`` is its site-packages), or
    an NGC Triton image's (``MODELOPS_TRITON_HOME``, ``/opt/tritonserver``; ``ngc=True``).
    """

    def __init__(self, site: Path, ngc: bool = False) -> None:
        self.site = site
        if ngc:
            self.binary = site / "bin" / "tritonserver"
            self.python_backend = site / "backends" / "python"
            self.stub = self.python_backend / "triton_python_backend_stub"
            self.libs = site / "lib"
            return
        root = site / "pytriton" / "tritonserver"
        self.binary = root / "bin" / "tritonserver"
        self.python_backend = root / "backends" / "python"
        self.stub = root / "python_backend_stubs" / f"{sys.version_info[0]}.{sys.version_info[1]}" / "triton_python_backend_stub"
        self.libs = site / "nvidia_pytriton.libs"

    def missing(self) -> list[str]:
        return [str(p) for p in (self.binary, self.python_backend / "libtriton_python.so", self.stub) if not p.exists()]


def triton_layout() -> TritonLayout:
    """The layout of this environment: ``MODELOPS_TRITON_HOME`` (an NGC image) when set, else
    nvidia-pytriton's in the running interpreter's site-packages (the local runtime venv)."""
    if os.environ.get("MODELOPS_TRITON_HOME"):
        return TritonLayout(Path(os.environ["MODELOPS_TRITON_HOME"]), ngc=True)
    return TritonLayout(Path(sysconfig.get_paths()["purelib"]))


def install_plugins(package: Path, dest: Path) -> list[dict]:
    """Install the plugin wheels ``deployment.json`` declares into ``dest`` (``pip --no-deps``).

    Returns:
        The declared plugins (``name``, ``version``, ``wheel``, ``entry_points``).

    Raises:
        SystemExit: a wheel in ``plugins/`` is not declared, pip failed, or the installed
            distributions differ from the declared ones (a wheel tried to bring another package).
    """
    deployment = json.loads((package / "deployment.json").read_text())
    declared = {p["wheel"]: p for p in deployment.get("plugins", [])}
    shipped = {f"plugins/{w.name}" for w in (package / "plugins").glob("*")} if (package / "plugins").is_dir() else set()
    if undeclared := sorted(shipped - set(declared)):
        raise SystemExit(f"package {package}: plugin wheels {undeclared} are not declared in the manifest; refused")
    shutil.rmtree(dest, ignore_errors=True)
    if not declared:
        return []
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--disable-pip-version-check",
           "--target", str(dest), *(str(package / rel) for rel in sorted(declared))]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"installing plugins failed: {proc.stderr[-1500:]}")
    from importlib.metadata import distributions

    def canonical(name: str) -> str:
        return name.lower().replace("_", "-").replace(".", "-")

    installed = {canonical(d.metadata["Name"]) for d in distributions(path=[str(dest)])}
    wanted = {canonical(p["name"]) for p in declared.values()}
    if installed != wanted:
        raise SystemExit(f"plugins installed {sorted(installed)}, declared {sorted(wanted)}; refused")
    return list(declared.values())


def _assemble_backends(layout: TritonLayout, dest: Path) -> Path:
    shutil.rmtree(dest, ignore_errors=True)
    (dest / "python").mkdir(parents=True)
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        shutil.copy2(layout.python_backend / name, dest / "python" / name)
    shutil.copy2(layout.stub, dest / "python" / "triton_python_backend_stub")
    # Beside triton_python_backend_utils.py, on the stub's sys.path: every model.py imports it first.
    shutil.copy2(Path(__file__).parent / "engine" / "stub_prelude.py", dest / "python" / STUB_PRELUDE)
    (dest / "vllm").mkdir()
    shutil.copy2(Path(__file__).parent / "engine" / "vllm_backend.py", dest / "vllm" / "model.py")
    return dest


def _die_with_parent() -> None:
    # tritonserver must not outlive the instance that owns its ports.
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def triton_env(layout: TritonLayout, extra_paths: list[Path] = ()) -> dict[str, str]:
    """Environment for tritonserver and its Python backend stub.

    - LD_LIBRARY_PATH: this interpreter's libpython first (the stub otherwise loads the
      system's libpython3.11, whose stdlib does not match ours), then the CUDA runtime the
      stub links (RUNTIME_NOTES.md).
    - MODELOPS_RUNTIME_PATH: the stub's embedded Python ignores PYTHONPATH; every model.py's
      first import (runtime/engine/stub_prelude.py) puts these folders first on sys.path:
      site-packages, this checkout, PYTHONPATH's folders, then ``extra_paths`` (the model's
      plugins, last so they cannot shadow the image).
    - MODELOPS_RUNTIME_PYTHON: the interpreter vLLM's helper subprocesses must use.
    - VLLM_ENABLE_V1_MULTIPROCESSING=0: the engine runs inside the stub process.
    """
    repo = str(Path(__file__).resolve().parents[1])
    libs = [sysconfig.get_config_var("LIBDIR"), str(layout.libs), os.environ.get("LD_LIBRARY_PATH", "")]
    # The image's packages, this checkout, what PYTHONPATH adds (the native engine's build), then
    # the model's plugins; in order, without repeats.
    paths = [p for p in dict.fromkeys((sysconfig.get_paths()["purelib"], repo,
                                       *os.environ.get("PYTHONPATH", "").split(os.pathsep), *map(str, extra_paths)))
             if p]
    return {
        **os.environ,
        "LD_LIBRARY_PATH": os.pathsep.join(p for p in libs if p),
        "MODELOPS_RUNTIME_PATH": os.pathsep.join(paths),
        "MODELOPS_RUNTIME_PYTHON": sys.executable,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        "TOKENIZERS_PARALLELISM": "false",
    }


class _Timeline:
    def __init__(self, path: Path) -> None:
        self.path, self.stages, self.t0 = path, [], time.time()

    @contextmanager
    def stage(self, name: str):
        start = time.monotonic()
        log.info("startup: %s ...", name)
        yield
        self.record(name, time.monotonic() - start)

    def record(self, name: str, seconds: float) -> None:
        self.stages.append({"stage": name, "seconds": round(seconds, 3)})
        log.info("startup: %s done in %.2f s", name, seconds)
        self.path.write_text(json.dumps({"started": self.t0, "stages": self.stages}, indent=1))


@dataclass
class _Prepared:
    """What the instance's first stages made ready: the package's ``meta`` (model_id, version,
    task, triton_model, execution_mode), its unpacked folder, the plugins' folder (None: none),
    the runtime's layout and the assembled backends folder."""

    meta: dict
    package: Path
    plugins_dir: Path | None
    layout: TritonLayout
    backends: Path


@dataclass
class _Triton:
    """The running tritonserver: its process, its private (loopback) HTTP and gRPC ports, the
    stack's secret it requires ("" when none), the engine's heartbeat file and the token of the
    frontend's own requests (:data:`modelops.io_contract.FRONTEND_TOKEN_HEADER`)."""

    proc: subprocess.Popen
    http_port: int
    grpc_port: int
    secret: str
    heartbeat: Path
    frontend_token: str = ""


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--package", type=Path, required=True)
    p.add_argument("--workdir", type=Path, required=True)
    p.add_argument("--host", default="127.0.0.1")
    for name in ("openai", "http", "grpc", "metrics"):
        p.add_argument(f"--{name}-port", type=int, required=True)
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds in-flight requests get on SIGTERM")
    return p.parse_args(argv)


def _prepare(args: argparse.Namespace, timeline: _Timeline) -> _Prepared:
    """Unpack the package, install its plugins, empty vLLM's metrics folder and assemble the
    backends. Raises SystemExit with the reason when the package or the image is unusable."""
    from modelops.archive import unpack
    from modelops.errors import PackageError

    with timeline.stage("unpack_package"):
        package = args.workdir / "package"
        try:
            meta = unpack(args.package, package)
        except PackageError as e:
            raise SystemExit(str(e)) from None
    with timeline.stage("plugins"):
        plugins_dir = args.workdir / "plugins"
        plugins = install_plugins(package, plugins_dir)
        if plugins:
            sys.path.append(str(plugins_dir))
            log.info("plugins: %s", ", ".join(f"{p['name']} {p['version']} {p['entry_points']}" for p in plugins))
    with timeline.stage("metrics_dir"):
        # vLLM's Prometheus metrics live in the stub process; in multiprocess mode they are
        # written here and merged into the frontend's /metrics (runtime/frontend/metrics.py).
        mp = Path(os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", str(args.workdir / "prometheus")))
        shutil.rmtree(mp, ignore_errors=True)
        mp.mkdir(parents=True)
    with timeline.stage("backends"):
        layout = triton_layout()
        if missing := layout.missing():
            raise SystemExit(f"runtime image is incomplete, missing: {missing}")
        backends = _assemble_backends(layout, args.workdir / "backends")
    return _Prepared(meta, package, plugins_dir if plugins else None, layout, backends)


def _start_triton(args: argparse.Namespace, timeline: _Timeline, ready: _Prepared) -> _Triton:
    """Start tritonserver on private loopback ports (the public KServe ports on ``--host`` are
    gates the frontend opens once the engine has answered a warm-up request:
    runtime/frontend/readiness.py), taking the stack's secret when the environment has one."""
    from modelops.process import free_ports
    from modelops.io_contract import FRONTEND_TOKEN_ENV, FRONTEND_TOKEN_HEADER
    from modelops.tenancy import INSTANCE_SECRET_ENV, INSTANCE_SECRET_HEADER, KEY_HEADER, KEY_MAC_HEADER
    from runtime.frontend.readiness import PRIVATE_HOST

    private_http, private_grpc = free_ports(2)
    secret = os.environ.get(INSTANCE_SECRET_ENV, "")
    forwarded = f"^({KEY_HEADER}|{KEY_MAC_HEADER}|{FRONTEND_TOKEN_HEADER})$"
    frontend_token = secrets.token_hex(16)  # the frontend's openai_request only (modelops.io_contract)
    with timeline.stage("start_triton"):
        cmd = [
            str(ready.layout.binary), f"--model-repository={ready.package / 'model_repository'}",
            f"--backend-directory={ready.backends}", f"--http-address={PRIVATE_HOST}", f"--http-port={private_http}",
            f"--grpc-address={PRIVATE_HOST}", f"--grpc-port={private_grpc}", f"--metrics-address={args.host}",
            f"--metrics-port={args.metrics_port}", f"--exit-timeout-secs={TRITON_EXIT_TIMEOUT_S}",
            # The router's name for the caller's key and its HMAC (modelops.tenancy.KEY_MAC_HEADER)
            # reach the engine as request parameters, so KServe answers count for the key as the
            # frontend's OpenAI answers do (/infer and gRPC: Triton's /generate forwards no header);
            # and the frontend's token, without which the backend refuses an openai_request.
            f"--http-header-forward-pattern={forwarded}", f"--grpc-header-forward-pattern={forwarded}",
        ]
        if secret:  # every API but health takes the stack's secret header (modelops/tenancy.py)
            cmd += [f"--http-restricted-api={_RESTRICTED}:{INSTANCE_SECRET_HEADER}={secret}",
                    f"--grpc-restricted-protocol={_RESTRICTED}:{INSTANCE_SECRET_HEADER}={secret}"]
        heartbeat = args.workdir / "engine-heartbeat"
        heartbeat.unlink(missing_ok=True)
        env = {**triton_env(ready.layout, [ready.plugins_dir] if ready.plugins_dir else []),
               "MODELOPS_ENGINE_HEARTBEAT": str(heartbeat), FRONTEND_TOKEN_ENV: frontend_token}
        proc = subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent)
        log.info("tritonserver pid %d: %s", proc.pid, " ".join(cmd).replace(secret, "<secret>") if secret else
                 " ".join(cmd))
    return _Triton(proc, private_http, private_grpc, secret, heartbeat, frontend_token)


def _serve(args: argparse.Namespace, timeline: _Timeline, meta: dict, triton: _Triton) -> dict:
    """Serve the frontend until it stops: drained by SIGTERM, Triton gone, or the engine dead.
    Returns ``{"code", "at"}`` when it stopped because the engine died (empty otherwise)."""
    import uvicorn

    from modelops.io_contract import ENGINE_DIED_EXIT, ENGINE_DIED_TRANSIENT_EXIT
    from modelops.shadow import SHADOW_ROUTER_ENV
    from runtime.frontend.access_log import quiet_probes
    from runtime.frontend.app import create_app
    from runtime.frontend.engine_watch import EngineWatch
    from runtime.frontend.readiness import PRIVATE_HOST, Gate, Lifecycle

    loading_since = time.monotonic()
    lifecycle = Lifecycle([Gate("kserve-http", args.host, args.http_port, triton.http_port),
                           Gate("kserve-grpc", args.host, args.grpc_port, triton.grpc_port)], args.drain_timeout)
    lifecycle.on_ready = lambda: timeline.record("load_and_warm_up", time.monotonic() - loading_since)
    lifecycle.engine = EngineWatch(triton.proc.pid, triton.heartbeat)
    engine_died: dict = {}
    app = create_app(model_id=meta["model_id"], version=meta["version"], task=meta["task"],
                     triton_grpc_url=f"{PRIVATE_HOST}:{triton.grpc_port}", triton_model=meta["triton_model"],
                     triton_metrics_url=f"http://{args.host}:{args.metrics_port}/metrics", lifecycle=lifecycle,
                     openai=meta.get("execution_mode", "embedded") == "embedded", instance_secret=triton.secret,
                     shadow_router=os.environ.get(SHADOW_ROUTER_ENV, ""),
                     triton_http_url=f"http://{PRIVATE_HOST}:{triton.http_port}", frontend_token=triton.frontend_token)

    class DrainingServer(uvicorn.Server):
        """The first SIGTERM drains (runtime.frontend.readiness); a second one, or Ctrl-C, stops now."""

        async def startup(self, sockets=None):
            self.loop = asyncio.get_running_loop()
            await super().startup(sockets)

        def handle_exit(self, sig, frame):
            if sig == signal.SIGTERM and not lifecycle.draining and getattr(self, "loop", None) is not None:
                self.loop.call_soon_threadsafe(lambda: asyncio.ensure_future(lifecycle.drain()))
                return
            super().handle_exit(sig, frame)

    server = DrainingServer(uvicorn.Config(app, host=args.host, port=args.openai_port, log_level="info",
                                           timeout_graceful_shutdown=int(args.drain_timeout)))
    quiet_probes()  # after uvicorn's Config, which sets its loggers up
    lifecycle.stop_server = lambda: setattr(server, "should_exit", True)

    def on_engine_dead(state, phase: str) -> None:
        # One line a provider shows as the cause (tasks/provision/local.py), with the judgement.
        judged = "judged transient (killed from outside): one more start may help" if state.transient else \
            "judged deterministic: starting it again would fail the same way"
        log.error("engine died %s: %s; %s. Stopping the instance.", phase, state.cause, judged)
        engine_died.update(code=ENGINE_DIED_TRANSIENT_EXIT if state.transient else ENGINE_DIED_EXIT,
                           at=time.monotonic())
        triton.proc.terminate()  # no drain: what the engine held is lost, and was answered 503
        server.should_exit = True

    lifecycle.on_engine_dead = on_engine_dead

    def watch_triton() -> None:
        rc = triton.proc.wait()
        if not server.should_exit and not engine_died:
            log.error("tritonserver exited with %s; stopping the instance", rc)
            server.should_exit = True

    threading.Thread(target=watch_triton, daemon=True, name="triton-watch").start()
    server.run()
    return engine_died


def _stop_triton(triton: subprocess.Popen, engine_died: dict) -> int:
    """Stop tritonserver after the frontend stopped; the instance's exit status: the engine's
    death code (:data:`modelops.io_contract.ENGINE_DIED_EXIT` or ``..._TRANSIENT_EXIT``), 0
    after a drain, 1 when Triton had failed by itself."""
    if engine_died:
        try:
            triton.wait(timeout=2)
        except subprocess.TimeoutExpired:
            triton.kill()
            triton.wait()
        log.info("instance stopped %.1f s after its engine died; exit status %d", time.monotonic() - engine_died["at"],
                 engine_died["code"])
        return engine_died["code"]
    stopped_by_us = triton.poll() is None
    if stopped_by_us:  # the OpenAI requests have drained: Triton only unloads now
        t0 = time.monotonic()
        triton.terminate()
        try:
            triton.wait(timeout=TRITON_EXIT_TIMEOUT_S + 2)
        except subprocess.TimeoutExpired:
            triton.kill()
            triton.wait()
        log.info("tritonserver stopped %.1f s after the drain (exit status %s)", time.monotonic() - t0,
                 triton.returncode)
    # Past its exit timeout Triton exits 1 ("Exit timeout expired"): after a drain that is a stop, not a fault.
    return 0 if stopped_by_us or triton.returncode in (0, -signal.SIGTERM) else 1


def main(argv: list[str] | None = None) -> int:
    """Run one instance of a package until it is stopped; its exit status (:func:`_stop_triton`)."""
    args = _arguments(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args.workdir.mkdir(parents=True, exist_ok=True)
    timeline = _Timeline(args.workdir / "startup-timeline.json")
    ready = _prepare(args, timeline)
    triton = _start_triton(args, timeline, ready)
    engine_died = _serve(args, timeline, ready.meta, triton)
    return _stop_triton(triton.proc, engine_died)


if __name__ == "__main__":
    sys.exit(main())
