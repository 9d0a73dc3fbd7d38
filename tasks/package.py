"""package: write the Triton model repository entry for a model version and seal it.

Layout of ``<home>/packages/<model_id>/<version>/``::

    model_repository/<model_id>/config.pbtxt   backend "vllm", parameter task (I/O auto-completed)
    model_repository/<model_id>/1/model.json   vLLM engine args; model/tokenizer = the FSx copy
    package.json                               model_id, version, task, triton_model,
                                               runtime lock hash, sha256 of every file (written last)

The package is written in a staging folder and renamed into place, so a rerun either finds an
identical sealed package (and reuses it) or replaces an unsealed one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

from prefect import task

from modelops.errors import ManifestError, PackageError
from modelops.manifest import Manifest
from modelops.settings import Settings, get_settings
from tasks._retry import retry_unless_bad_input
from tasks.image import RuntimeImage

__all__ = ["Package", "build_package", "check_engine_args", "engine_args", "package_task", "render_config_pbtxt"]


@dataclass(frozen=True)
class Package:
    """A sealed package: ``path`` of the package folder, ``triton_model`` name in its repository."""

    path: Path
    triton_model: str
    model_id: str
    version: str
    task: str


def engine_args(manifest: Manifest, weights: Path) -> dict:
    """The ``model.json`` content: the manifest's engine args plus the FSx weight paths.

    ``runner`` is ``pooling`` for ``task: embed`` (vLLM's embedding runner) and ``generate``
    otherwise; stats logging is off because /metrics comes from vLLM's Prometheus registry.
    """
    return {
        **manifest.engine_args,
        "model": str(weights),
        "tokenizer": str(weights),
        "runner": "pooling" if manifest.task == "embed" else "generate",
        "disable_log_stats": True,
    }


_PY_TYPES = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,)}


def check_engine_args(args: dict, schema: dict[str, dict], vllm_version: str) -> None:
    """Check engine arg names and simple types against the runtime's ``EngineArgs`` schema.

    Args:
        args: the manifest's ``engine_args``; schema: ``{name: {type, nullable, choices}}``
            from the runtime probe; vllm_version: for the message.

    Raises:
        ManifestError: naming ``engine_args.<name>``, what is wrong and the closest valid names.
    """
    import difflib

    problems = []
    for name, value in args.items():
        spec = schema.get(name)
        if spec is None:
            close = difflib.get_close_matches(name, schema, n=3)
            problems.append(f"engine_args.{name}: not an engine arg of vLLM {vllm_version}"
                            + (f" (did you mean {', '.join(close)}?)" if close else ""))
            continue
        if value is None:
            continue  # the engine's default
        kind = spec["type"]
        if kind == "choice" and value not in spec["choices"]:
            problems.append(f"engine_args.{name}: {value!r} is not one of {spec['choices']}")
        elif kind in _PY_TYPES and (not isinstance(value, _PY_TYPES[kind]) or (kind != "bool" and isinstance(value, bool))):
            problems.append(f"engine_args.{name}: expected {kind}, got {value!r}")
    if problems:
        raise ManifestError("invalid manifest:\n  " + "\n  ".join(problems))


def render_config_pbtxt(name: str, task: str) -> str:
    """config.pbtxt for the Python-based ``vllm`` backend: one model instance on the CPU/GPU the
    engine picks, I/O declared by the backend's ``auto_complete_config`` from ``task``."""
    return (
        f'name: "{name}"\n'
        'backend: "vllm"\n'
        "instance_group [{ kind: KIND_MODEL, count: 1 }]\n"
        f'parameters {{ key: "task" value {{ string_value: "{task}" }} }}\n'
    )


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build_package(manifest: Manifest, weights: Path, lock_hash: str, settings: Settings | None = None,
                  engine_args_schema: Path | None = None, vllm_version: str = "") -> Package:
    """Write and seal the package of ``manifest`` whose weights are at ``weights`` (on FSx).

    ``engine_args_schema`` (the runtime image's, see tasks.image) checks the engine args first.

    Raises:
        ManifestError: an engine arg is unknown to the pinned vLLM or has the wrong type.
        PackageError: the weights folder is missing, or the package cannot be written.
    """
    settings = settings or get_settings()
    if engine_args_schema is not None:
        check_engine_args(manifest.engine_args, json.loads(engine_args_schema.read_text()), vllm_version)
    if not (weights / "config.json").is_file():
        raise PackageError(f"weights folder {weights} has no config.json; materialize it first")
    name = manifest.model_id
    files = {
        f"model_repository/{name}/config.pbtxt": render_config_pbtxt(name, manifest.task),
        f"model_repository/{name}/1/model.json": json.dumps(engine_args(manifest, weights), indent=1, sort_keys=True),
    }
    meta = {
        "model_id": manifest.model_id,
        "version": manifest.version,
        "task": manifest.task,
        "triton_model": name,
        "runtime_lock_hash": lock_hash,
        "files": {rel: hashlib.sha256(text.encode()).hexdigest() for rel, text in files.items()},
    }
    dest = settings.packages_dir / manifest.model_id / manifest.version
    pkg = Package(dest, name, manifest.model_id, manifest.version, manifest.task)
    sealed = dest / "package.json"
    if sealed.is_file() and json.loads(sealed.read_text()) == meta and all(
        (dest / rel).is_file() and _sha256(dest / rel) == digest for rel, digest in meta["files"].items()
    ):
        return pkg
    staging = dest.parent / f".staging-{manifest.version}-{uuid.uuid4().hex[:8]}"
    try:
        for rel, text in files.items():
            (staging / rel).parent.mkdir(parents=True, exist_ok=True)
            (staging / rel).write_text(text)
        (staging / "package.json").write_text(json.dumps(meta, indent=1, sort_keys=True))
        if dest.exists():
            shutil.rmtree(dest)
        os.rename(staging, dest)
    except OSError as e:
        shutil.rmtree(staging, ignore_errors=True)
        raise PackageError(f"cannot write package {dest}: {e}") from e
    return pkg


@task(name="package", retries=1, retry_delay_seconds=2, retry_condition_fn=retry_unless_bad_input,
      timeout_seconds=120, tags=["modelops"])
def package_task(manifest: Manifest, weights: Path, image: RuntimeImage) -> Package:
    """Prefect task around :func:`build_package`, checked against ``image``'s engine args."""
    from prefect import get_run_logger

    pkg = build_package(manifest, weights, image.lock_hash, engine_args_schema=image.engine_args_schema,
                        vllm_version=image.vllm)
    get_run_logger().info("package %s/%s sealed at %s (Triton model %r, backend vllm, task %s)",
                          pkg.model_id, pkg.version, pkg.path, pkg.triton_model, pkg.task)
    return pkg
