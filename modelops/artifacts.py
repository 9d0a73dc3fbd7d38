"""What the stages hand each other: a built runtime image and a sealed package.

The image stage makes a :class:`RuntimeImage`, the package stage a :class:`Package` checked
against it; provision, health, traffic, rollback and restore read both. They live here, in the
core, so no stage imports another stage's module for a type, and the one rule that ties the two
together (a package serves only on the runtime it was built for, :func:`check_package_runtime`)
is written once.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from modelops.archive import read_meta
from modelops.compat import RuntimePin
from modelops.errors import PackageError, TrafficError
from modelops.settings import REPO_ROOT, Settings

__all__ = ["Package", "RuntimeImage", "check_package_runtime", "sealed_package"]


@dataclass(frozen=True)
class RuntimeImage:
    """A built runtime.

    Attributes:
        path: the runtime's folder; python: its interpreter (run ``-m runtime.startup``);
        lock_hash: sha256[:12] of the lock and recipe; pin: the compatibility row;
        vllm: the vLLM version the probe imported; native: the folder holding the native
        constraint engine built for this interpreter (put on ``PYTHONPATH``), if built.
    """

    path: Path
    python: Path
    lock_hash: str
    pin: RuntimePin
    vllm: str = ""
    native: Path | None = None

    @property
    def engine_args_schema(self) -> Path:
        """JSON ``{EngineArgs field: {type, nullable, choices}}`` written by the probe."""
        return self.path / "engine_args.json"

    @property
    def tool_parsers_file(self) -> Path:
        """JSON list of the image's vLLM tool-call parser names, written by the probe."""
        return self.path / "tool_parsers.json"

    def tool_parsers(self) -> list[str] | None:
        """The image's vLLM tool-call parser names, or None before the probe wrote them."""
        f = self.tool_parsers_file
        return json.loads(f.read_text()) if f.is_file() else None

    def env(self) -> dict[str, str]:
        """Variables to run this checkout's ``runtime`` package with the image's interpreter.

        The image holds third-party packages only; the runtime code comes from the checkout,
        as ``COPY runtime/`` would put it in a container image, and the native constraint engine
        from its build folder (``tasks.image.build_native``).
        """
        paths = [str(REPO_ROOT)] + ([str(self.native)] if self.native else [])
        return {"PYTHONPATH": os.pathsep.join(paths), "HF_HUB_OFFLINE": "1"}


@dataclass(frozen=True)
class Package:
    """A sealed package: ``path`` of the package folder (``package.tar.gz`` + ``package.json``),
    ``triton_model`` its name in the model repository."""

    path: Path
    triton_model: str
    model_id: str
    version: str
    task: str
    packaging: str = "vllm-backend"
    execution_mode: str = "embedded"


def sealed_package(settings: Settings, model_id: str, version: str) -> Package | None:
    """The sealed package of a version under ``settings.packages_dir`` (to serve it again), or
    None when it is gone or unreadable."""
    path = settings.packages_dir / model_id / version
    try:
        meta = read_meta(path)
    except PackageError:
        return None
    return Package(path, meta["triton_model"], model_id, version, meta["task"], meta.get("packaging", "vllm-backend"),
                   meta.get("execution_mode", "embedded"))


def check_package_runtime(package: Package, lock_hash: str) -> None:
    """Refuse to provision a package on a runtime it was not built for (its ``package.json``
    records ``runtime_lock_hash``; the engine args and I/O checks it passed hold for that one).

    Raises:
        TrafficError: naming both runtime lock hashes and the fix.
    """
    built_for = read_meta(package.path).get("runtime_lock_hash")
    if built_for != lock_hash:
        raise TrafficError(f"{package.model_id} {package.version}: its package was built for runtime {built_for}, "
                           f"this runtime is {lock_hash}; announce the version again (a new version id) instead")
