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

A classic model (``framework: xgboost``) is a Python-backend package around an XGBoost model
file; it serves KServe v2 only, in its own Triton instance by default::

    model_id: fraud-xgb
    version: "1"
    source: s3://models/fraud-xgb/1/     # one model file: *.ubj or *.json (Booster.save_model)
    framework: xgboost                    # task tabular, packaging python-backend, execution_mode separate
    io_schema:
      inputs:  [{name: input__0, datatype: FP32, dims: [8]}]     # 8 features per row
      outputs: [{name: output__0, datatype: FP32, dims: [1]}]    # [C] for C-class softprob

A python-backend model declares its tensors (``io_schema``) and brings its ``model.py``::

    packaging: python-backend
    io_schema:
      inputs:  [{name: text_input, datatype: BYTES, dims: [1]}]    # dims without the batch dimension
      outputs: [{name: embedding, datatype: FP32, dims: [-1]},
                {name: num_input_tokens, datatype: INT32, dims: [1]}]
    model_py: model.py            # optional; default: runtime/engine/templates/python_backend/model.py
    plugins: [{name: my-logits-plugin, wheel: wheels/my_logits_plugin-1.0-py3-none-any.whl}]
    execution_mode: embedded      # or separate
    resources: {cpus: 2, memory_gb: 8, gpus: 0}
    routing: {policy: prefix-affinity, prefix_bytes: 1024, load_bound: 2}   # the default
    limits: {max_request_tokens: 8192, max_request_share: 0.5}   # generate; default 4 × max_model_len, 0.5
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from modelops.errors import ManifestError
from modelops.io_contract import CONTRACTS, DATATYPES, KSERVE_TENSORS, Tensor
from modelops.limits import RequestLimits
from modelops.routing import Routing
from modelops.scaling import Scaling
from modelops.shadow import ShadowPhase
from modelops.yamlfile import load_unique

__all__ = ["MODEL_ID_PATTERN", "RESERVED_ENGINE_ARGS", "VERSION_PATTERN", "Manifest", "load_manifest", "parse_manifest",
           "triton_version"]

# Engine args modelops sets itself from the manifest; letting them through would point the
# engine at weights other than the materialized, verified copy.
RESERVED_ENGINE_ARGS = {
    "model": "set by modelops to the FSx copy of `source`",
    "tokenizer": "set by modelops to the FSx copy of `source`",
    "runner": "derived from `task`",
    "task": "use the manifest's top-level `task`",
    "download_dir": "weights are materialized by modelops",
    "served_model_name": "set by modelops to `model_id` (the OpenAI model name and vLLM's model_name label)",
    "structured_outputs_config": "set by modelops (llguidance, compact JSON): the runtime checks every schema "
                                 "against what that backend enforces (docs/serving.md, structured outputs)",
    "disable_log_stats": "kept False by modelops: vLLM's stats feed the instance's merged /metrics and the "
                         "rollout gates",
}
"""Every engine arg modelops sets (tasks.package.engine_args), with why a manifest cannot."""

_FIXES = {
    "model_id": "use lowercase letters, digits and '-', e.g. all-minilm-l6-v2",
    "version": 'use letters, digits, ".", "_" or "-", e.g. "1" or "2024-11-30"',
    "source": "use s3://bucket/prefix/, file:///abs/dir or a local directory",
    "task": "use embed or generate (or tabular, with framework: xgboost)",
    "framework": "use vllm (LLMs, the default) or xgboost (an XGBoost model file)",
    "engine_args": "use a mapping of vLLM engine args, e.g. {dtype: float32}",
    "packaging": "use vllm-backend or python-backend",
    "strategy": "use auto, red-black or versioned",
    "tool_parser": "name one of vLLM's tool-call parsers, e.g. hermes",
    "io_schema": "declare inputs and outputs as lists of {name, datatype, dims}, e.g. "
                 "{name: text_input, datatype: BYTES, dims: [-1]}",
    "execution_mode": "use embedded (Triton behind the OpenAI frontend) or separate (Triton on its own, KServe only)",
    "plugins": "list {name: <distribution>, wheel: <path to .whl>}",
    "runtime": "remove it: vLLM, torch and Triton are pinned by the platform",
}

_NAME = r"^[A-Za-z_][A-Za-z0-9_]{0,63}$"
# A model id is an RFC 1123 DNS label; a version starts with a letter or digit. Both name folders
# of the FSx cache: `modelops cache` checks its arguments against them too.
MODEL_ID_PATTERN = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"
VERSION_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
# Triton loads only version folders named by a positive integer without a leading zero (its model
# repository docs, "Model Versions"); 18 digits stay inside its int64.
_TRITON_VERSION = re.compile(r"[1-9][0-9]{0,17}")
LABEL_TRITON_VERSION = "1"


def triton_version(version: str) -> str:
    """The Triton model version, and so the model repository's version folder, of a modelops version.

    A version that is a Triton version (``"2"``) is itself: KServe's ``model_version`` and the
    ``/v2/models/<m>/versions/<v>/`` path then say the modelops version. A label (``"2024-rc1"``,
    ``"02"``) has no Triton number; it is served as :data:`LABEL_TRITON_VERSION`, and the router
    names the label in ``X-Model-Version`` and maps the label's version path to it.
    """
    return version if _TRITON_VERSION.fullmatch(version) else LABEL_TRITON_VERSION


class TensorSpec(BaseModel):
    """One declared tensor of a python-backend model (KServe v2 datatype; -1 = variable dim)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=_NAME)
    datatype: Literal[DATATYPES]  # type: ignore[valid-type]
    dims: list[int] = Field(min_length=1, max_length=8)
    optional: bool = False

    @field_validator("dims")
    @classmethod
    def _dims(cls, value: list[int]) -> list[int]:
        if any(d == 0 or d < -1 for d in value):
            raise ValueError(f"dims {value}: each must be -1 (variable) or a positive size")
        return value

    def tensor(self) -> Tensor:
        return Tensor(self.name, self.datatype, tuple(self.dims), self.optional)


class IOSchema(BaseModel):
    """The tensors a python-backend model takes and returns."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    inputs: list[TensorSpec] = Field(min_length=1)
    outputs: list[TensorSpec] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> "IOSchema":
        for side in ("inputs", "outputs"):
            names = [t.name for t in getattr(self, side)]
            if dup := sorted({n for n in names if names.count(n) > 1}):
                raise ValueError(f"{side}: duplicate tensor names {dup}")
        return self


class Plugin(BaseModel):
    """A vLLM plugin shipped with the model: a wheel installed with ``--no-deps``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    wheel: str = Field(min_length=1)


class Resources(BaseModel):
    """Serving capacity per instance. ``cpus``: the local provider runs the instance on that many
    cores, rounded up (its CPU affinity: :func:`tasks.provision.local.plan_cores`), Kubernetes
    requests it; ``memory_gb`` and ``gpus``: Kubernetes requests and limits."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cpus: float = Field(default=2, gt=0, le=1024, allow_inf_nan=False)
    memory_gb: float = Field(default=8, gt=0, le=65536, allow_inf_nan=False)
    gpus: int = Field(default=0, ge=0)


class RuntimeRequest(BaseModel):
    """Versions a model asks for; accepted only when they equal the platform's pin."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    vllm: str | None = None
    torch: str | None = None
    triton: str | None = None

    def asked(self) -> dict[str, str]:
        return {k: v for k, v in self.model_dump().items() if v is not None}


def _task_checked_by_the_flow(schema: dict[str, Any]) -> None:
    # Prefect's server checks an announcement's payload against this JSON Schema before it creates
    # the flow run (the trigger's run-deployment action) and drops a payload that fails with only a
    # prefect.automation.action.failed event. `task` is required for framework vllm and defaulted
    # for xgboost (Manifest._framework_defaults): the schema leaves it optional, so a payload without
    # it gets a run that fails at once, naming the field.
    schema["required"] = [name for name in schema.get("required", []) if name != "task"]


class Manifest(BaseModel):
    """One model version as announced.

    Fields:
        model_id: the name clients put in the OpenAI ``model`` field (``[a-z0-9-]``, ≤ 63).
        version: the version label; ``(model_id, version)`` is unique in the registry.
        source: weights and tokenizer: ``s3://bucket/prefix/``, ``file://`` URI or a directory
            (a relative directory in a manifest file is relative to that file's folder).
        framework: ``vllm`` (the default: an LLM served by vLLM) or ``xgboost`` (a classic model:
            one XGBoost model file, ``*.ubj`` or ``*.json``, served by the Python backend template
            ``runtime/engine/templates/xgboost/model.py``).
        task: ``embed`` (vLLM pooling runner) or ``generate`` for framework vllm (required);
            ``tabular`` for framework xgboost (its default: rows of features → predictions).
        packaging: ``vllm-backend`` (Triton model with ``backend: "vllm"`` + ``model.json``) or
            ``python-backend`` (``backend: "python"``, explicit ``io_schema`` and ``model.py``);
            default vllm-backend, python-backend for framework xgboost (its only packaging).
        engine_args: vLLM engine args (``vllm.EngineArgs`` field names) for ``model.json``.
        strategy: ``auto`` picks red-black when the I/O schema is unchanged, else versioned.
        io_schema: python-backend only: the model's tensors (names, KServe datatypes, dims).
        model_py: python-backend only: path of the model's ``model.py`` (default: the template).
        execution_mode: ``embedded`` (the OpenAI frontend runs Triton as its child, sharing its
            lifetime) or ``separate`` (Triton on its own behind the startup gates, KServe v2 only,
            no OpenAI face); default embedded, separate for framework xgboost.
        resources: cpus, memory_gb, gpus per instance.
        scaling: how many instances the version runs, and on which signal the autoscaler changes
            that (:class:`modelops.scaling.Scaling`; default one instance, not autoscaled).
        routing: how the router balances the instances of one version
            (:class:`modelops.routing.Routing`; default prefix-affinity).
        limits: generate only: what one request may ask of the engine, its total tokens and its
            share of the sequence slots (:class:`modelops.limits.RequestLimits`; defaults from
            the settings).
        plugins: vLLM plugin wheels shipped with the model.
        runtime: vllm / torch / triton versions; refused unless equal to the pin
            (:func:`modelops.compat.check_runtime_request`).
        promote: with a versioned rollout, make this version the default once it is ready
            (otherwise ``modelops promote MODEL VERSION`` does).
        shadow: a red-black rollout's first step: copies of live requests compared before any
            traffic moves (:class:`modelops.shadow.ShadowPhase`; default none).
        chat_template: generate only: a Jinja chat template file shipped in the package, used
            instead of the model's own (vLLM's ``--chat-template``).
        tool_parser: generate only: a vLLM tool-call parser (``--tool-call-parser``, e.g.
            ``hermes``) for ``tool_choice: auto``; checked against the image's vLLM.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, json_schema_extra=_task_checked_by_the_flow)

    model_id: str = Field(pattern=MODEL_ID_PATTERN)
    version: str = Field(pattern=VERSION_PATTERN)
    source: str = Field(min_length=1)
    framework: Literal["vllm", "xgboost"] = "vllm"
    task: Literal["embed", "generate", "tabular"]
    packaging: Literal["vllm-backend", "python-backend"] = "vllm-backend"  # python-backend for xgboost
    engine_args: dict[str, Any] = Field(default_factory=dict)
    strategy: Literal["auto", "red-black", "versioned"] = "auto"
    io_schema: IOSchema | None = None
    model_py: str | None = None
    execution_mode: Literal["embedded", "separate"] = "embedded"  # separate for xgboost
    resources: Resources = Field(default_factory=Resources)
    scaling: Scaling = Field(default_factory=Scaling)
    routing: Routing = Field(default_factory=Routing)
    limits: RequestLimits = Field(default_factory=RequestLimits)
    plugins: list[Plugin] = Field(default_factory=list)
    runtime: RuntimeRequest | None = None
    promote: bool = False
    shadow: ShadowPhase | None = None
    chat_template: str | None = None
    tool_parser: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.-]+$")

    @model_validator(mode="before")
    @classmethod
    def _framework_defaults(cls, data: Any) -> Any:
        # task, packaging and execution_mode default by framework; an explicit value is checked after.
        if not isinstance(data, dict):
            return data
        xgb = data.get("framework") == "xgboost"
        scaling = data.get("scaling")
        if xgb and isinstance(scaling, dict) and isinstance(scaling.get("max"), int) and \
                scaling["max"] > scaling.get("min", 1):
            # Before the policy's own checks, which would ask for a target this framework cannot have.
            raise ValueError(f"scaling: the autoscaler's signals are vLLM's; framework xgboost runs no vLLM engine "
                             f"(set min = max for a fixed count, e.g. min: {scaling['max']}, max: {scaling['max']})")
        defaults = {"packaging": "python-backend" if xgb else "vllm-backend",
                    "execution_mode": "separate" if xgb else "embedded", **({"task": "tabular"} if xgb else {})}
        return {**defaults, **{k: v for k, v in data.items() if v is not None or k not in defaults}}

    @model_validator(mode="after")
    def _packaging_fields(self) -> "Manifest":
        if self.framework == "xgboost":
            wrong = {"task": (self.task, "tabular"), "packaging": (self.packaging, "python-backend")}
            for name, (got, only) in wrong.items():
                if got != only:
                    raise ValueError(f"{name}: {got!r} is not served for framework xgboost; use {name}: {only} "
                                     "(or leave it out)")
            if self.scaling.autoscaled:  # a max of another type than int passed the early check
                raise ValueError("scaling: the autoscaler's signals are vLLM's; framework xgboost runs no vLLM engine "
                                 f"(set min = max for a fixed count, e.g. min: {self.scaling.max}, "
                                 f"max: {self.scaling.max})")
            if self.engine_args or self.plugins:
                raise ValueError(f"{'engine_args' if self.engine_args else 'plugins'}: vLLM settings; framework "
                                 "xgboost runs no vLLM engine (remove the field)")
        elif self.task == "tabular":
            raise ValueError("task: tabular is served for framework xgboost only (add framework: xgboost)")
        if self.packaging == "python-backend" and self.io_schema is None:
            raise ValueError("io_schema: required with packaging python-backend (the model's inputs and outputs)")
        if self.packaging == "vllm-backend":
            for name in ("io_schema", "model_py"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name}: only for packaging python-backend; the vllm backend declares its "
                                     "tensors from `task`")
        if self.task != "generate":
            for name in ("chat_template", "tool_parser"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name}: only for task generate (chat completions)")
            if self.limits != RequestLimits():
                raise ValueError("limits: only for task generate (they bound generation requests); remove it")
        if self.shadow is not None and (self.strategy == "versioned" or self.task == "tabular"):
            raise ValueError("shadow: a phase of red-black rollouts of OpenAI models; " +
                             ("a tabular model is served over KServe only (remove it)" if self.task == "tabular" else
                              "with strategy versioned the version takes no traffic until promoted: run `modelops "
                              "shadow start MODEL VERSION` once it serves (or remove it)"))
        names = [p.name for p in self.plugins]
        if dup := sorted({n for n in names if names.count(n) > 1}):
            raise ValueError(f"plugins: {dup} listed twice")
        return self

    @field_validator("version", mode="before")
    @classmethod
    def _version_as_text(cls, value: Any) -> Any:
        # YAML reads `version: 1` as an int and `version: 2024-11-30` as a date, each written back
        # exactly; `version: 1.10` is the float 1.1, whose text is lost: that one must be quoted.
        import datetime

        if isinstance(value, int) and not isinstance(value, bool) or isinstance(value, datetime.date):
            return str(value)
        if isinstance(value, float):
            raise ValueError(f"YAML read it as the number {value!r}, which may not be what you wrote: quote it, "
                             'e.g. version: "1.10"')
        return value

    @field_validator("source")
    @classmethod
    def _source_scheme(cls, value: str) -> str:
        if "://" in value and not value.startswith(("s3://", "file://")):
            raise ValueError(f"unsupported scheme in {value!r}")
        if value.startswith("s3://") and len(value) <= len("s3://") or value.startswith("s3:///"):
            raise ValueError(f"{value!r} names no bucket")
        if value.startswith("file://") and not value.startswith("file:///"):  # file://tmp/x: host "tmp"
            raise ValueError(f"{value!r} names a host: a local directory needs three slashes")
        return value

    @field_validator("engine_args")
    @classmethod
    def _no_reserved_engine_args(cls, value: dict[str, Any]) -> dict[str, Any]:
        for key in value:
            if key in RESERVED_ENGINE_ARGS:
                raise ValueError(f"engine_args.{key} is not allowed: {RESERVED_ENGINE_ARGS[key]}")
        return value

    @property
    def is_s3(self) -> bool:
        return self.source.startswith("s3://")

    def io_schema_hash(self) -> str:
        """A digest of the model's request/response schema, used to choose the rollout.

        The schema is the tensors' names, datatypes and dims: the task's fixed contract for the
        vllm backend (:data:`modelops.io_contract.CONTRACTS`), the declared ``io_schema`` for
        the Python backend.
        """
        schema = {side: sorted((t.name, t.datatype, list(t.dims)) for t in tensors)
                  for side, tensors in zip(("inputs", "outputs"), self.tensors())}
        return hashlib.sha256(json.dumps(schema, sort_keys=True).encode()).hexdigest()[:16]


    def tensors(self) -> tuple[list[Tensor], list[Tensor]]:
        """(inputs, outputs) the model serves: the declared io_schema, else the task's contract
        plus the KServe text tensors our vllm backend also declares."""
        if self.io_schema is not None:
            return [t.tensor() for t in self.io_schema.inputs], [t.tensor() for t in self.io_schema.outputs]
        (sends, reads), (kserve_in, kserve_out) = CONTRACTS[self.task], KSERVE_TENSORS[self.task]
        return [*sends, *kserve_in], [*reads, *kserve_out]


def _unknown_field(loc: tuple) -> str:
    # Walk the models along the location to list the fields allowed where the typo is.
    model: Any = Manifest
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(str(part)) if isinstance(model, type) and issubclass(model, BaseModel) else None
        if field is None:
            return "unknown field"
        model = next((a for a in (field.annotation, *getattr(field.annotation, "__args__", ()))
                      if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if model is None:
            args = [a for a in getattr(field.annotation, "__args__", ()) for a in (a, *getattr(a, "__args__", ()))]
            model = next((a for a in args if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if model is None:
            return "unknown field"
    return f"unknown field; allowed: {', '.join(model.model_fields)}"


def _format(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "(manifest)"
        top = str(e["loc"][0]) if e["loc"] else ""
        if e["type"] == "missing":
            msg = "required field is missing"
        elif e["type"] == "extra_forbidden":
            msg = _unknown_field(e["loc"])
        else:
            msg = e["msg"].removeprefix("Value error, ")
        fix = _FIXES.get(top) if e["type"] != "extra_forbidden" else None
        lines.append((f"{field}: {msg}" if e["loc"] else msg) + (f" ({fix})" if fix else ""))
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
        data = load_unique(text, str(p))
    except yaml.YAMLError as e:
        raise ManifestError(f"manifest {p} is not valid YAML: {e}") from None
    if isinstance(data, dict):
        # Like compose files: relative local paths are relative to the manifest's folder.
        def resolve(path: object) -> object:
            if isinstance(path, str) and "://" not in path and not Path(path).expanduser().is_absolute():
                return str((p.parent / path).resolve())
            return path

        data = {**data}
        for key in ("source", "model_py", "chat_template"):
            if key in data:
                data[key] = resolve(data[key])
        if isinstance(data.get("plugins"), list):
            data["plugins"] = [{**pl, "wheel": resolve(pl.get("wheel"))} if isinstance(pl, dict) else pl
                               for pl in data["plugins"]]
    try:
        return parse_manifest(data)
    except ManifestError as e:
        raise ManifestError(f"{p}: {e}") from None
