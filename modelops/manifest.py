"""The model announcement: what a model developer hands to modelops.

A manifest is YAML validated by :class:`Manifest`; unknown keys are errors so a typo never
silently falls back to a default. Example (deployments/models/all-minilm-l6-v2.yaml)::

    model_id: all-minilm-l6-v2
    version: "1"
    source: s3://models/all-minilm-l6-v2/1/
    task: embed
    packaging: vllm-backend
    engine_args: {dtype: float32, max_model_len: 256}
    strategy: auto
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from modelops.errors import ManifestError

__all__ = ["Manifest", "load_manifest", "parse_manifest"]

# Engine args modelops sets itself from the manifest; letting them through would point the
# engine at weights other than the materialized, verified copy.
_RESERVED_ENGINE_ARGS = {
    "model": "set by modelops to the FSx copy of `source`",
    "tokenizer": "set by modelops to the FSx copy of `source`",
    "runner": "derived from `task`",
    "task": "use the manifest's top-level `task`",
    "download_dir": "weights are materialized by modelops",
}

_FIXES = {
    "model_id": "use lowercase letters, digits and '-', e.g. all-minilm-l6-v2",
    "version": 'use letters, digits, ".", "_" or "-", e.g. "1" or "2024-11-30"',
    "source": "use s3://bucket/prefix/, file:///abs/dir or a local directory",
    "task": "use embed or generate",
    "engine_args": "use a mapping of vLLM engine args, e.g. {dtype: float32}",
    "packaging": "use vllm-backend",
    "strategy": "use auto, red-black or versioned",
}


class Manifest(BaseModel):
    """One model version as announced.

    Fields:
        model_id: the name clients put in the OpenAI ``model`` field (``[a-z0-9-]``, ≤ 63).
        version: the version label; ``(model_id, version)`` is unique in the registry.
        source: weights and tokenizer: ``s3://bucket/prefix/``, ``file://`` URI or a directory
            (a relative directory in a manifest file is relative to that file's folder).
        task: ``embed`` (vLLM pooling runner) or ``generate``.
        packaging: ``vllm-backend`` (Triton model with ``backend: "vllm"`` + ``model.json``).
        engine_args: vLLM engine args (``vllm.EngineArgs`` field names) for ``model.json``.
        strategy: ``auto`` picks red-black when the I/O schema is unchanged, else versioned.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_id: str = Field(pattern=r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
    version: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
    source: str = Field(min_length=1)
    task: Literal["embed", "generate"]
    packaging: Literal["vllm-backend"] = "vllm-backend"
    engine_args: dict[str, Any] = Field(default_factory=dict)
    strategy: Literal["auto", "red-black", "versioned"] = "auto"

    @field_validator("version", mode="before")
    @classmethod
    def _version_as_text(cls, value: Any) -> Any:
        # YAML reads `version: 1` as an int; a version label is text.
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value

    @field_validator("source")
    @classmethod
    def _source_scheme(cls, value: str) -> str:
        if "://" in value and not value.startswith(("s3://", "file://")):
            raise ValueError(f"unsupported scheme in {value!r}")
        if value.startswith("s3://") and len(value) <= len("s3://") or value.startswith("s3:///"):
            raise ValueError(f"{value!r} names no bucket")
        return value

    @field_validator("engine_args")
    @classmethod
    def _no_reserved_engine_args(cls, value: dict[str, Any]) -> dict[str, Any]:
        for key in value:
            if key in _RESERVED_ENGINE_ARGS:
                raise ValueError(f"engine_args.{key} is not allowed: {_RESERVED_ENGINE_ARGS[key]}")
        return value

    @property
    def is_s3(self) -> bool:
        return self.source.startswith("s3://")

    def io_schema_hash(self) -> str:
        """A digest of the model's request/response schema, used to choose the rollout.

        With the vLLM backend the tensors are fixed per task, so the task is the schema.
        """
        schema = {"packaging": self.packaging, "task": self.task}
        return hashlib.sha256(json.dumps(schema, sort_keys=True).encode()).hexdigest()[:16]


def _format(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "(manifest)"
        top = str(e["loc"][0]) if e["loc"] else ""
        if e["type"] == "missing":
            msg = "required field is missing"
        elif e["type"] == "extra_forbidden":
            msg = f"unknown field; allowed: {', '.join(Manifest.model_fields)}"
        else:
            msg = e["msg"].removeprefix("Value error, ")
        fix = _FIXES.get(top) if e["type"] != "extra_forbidden" else None
        lines.append(f"{field}: {msg}" + (f" ({fix})" if fix else ""))
    return "invalid manifest:\n  " + "\n  ".join(lines)


def parse_manifest(data: Any) -> Manifest:
    """Validate a mapping as a manifest.

    Raises:
        ManifestError: naming every bad field and how to fix it.
    """
    if not isinstance(data, dict):
        raise ManifestError(f"invalid manifest: expected a mapping of fields, got {type(data).__name__}")
    try:
        return Manifest.model_validate(data)
    except ValidationError as e:
        raise ManifestError(_format(e)) from None


def load_manifest(path: str | Path) -> Manifest:
    """Read and validate a YAML manifest file.

    Raises:
        ManifestError: the file is missing, is not YAML, or a field is invalid.
    """
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ManifestError(f"cannot read manifest {p}: {e.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ManifestError(f"manifest {p} is not valid YAML: {e}") from None
    if isinstance(data, dict) and isinstance(data.get("source"), str):
        src = data["source"]
        if "://" not in src and not Path(src).expanduser().is_absolute():
            # Like compose files: a relative local source is relative to the manifest's folder.
            data = {**data, "source": str((p.parent / src).resolve())}
    try:
        return parse_manifest(data)
    except ManifestError as e:
        raise ManifestError(f"{p}: {e}") from None
