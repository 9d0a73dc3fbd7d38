"""package: build the Triton model repository entry of a model version and seal it.

A package is one archive plus a manifest of sha256 digests (:mod:`modelops.archive`), in
``<home>/packages/<model_id>/<version>/``. The archive holds::

    model_repository/<model_id>/config.pbtxt       vllm-backend: backend "vllm", parameter task, no
                                                   tensor spec (the backend declares it at load);
                                                   python-backend: backend "python", inputs and
                                                   outputs from the manifest's io_schema
    model_repository/<model_id>/<v>/model.json     vLLM engine args; model/tokenizer = the FSx copy
                                                   (framework xgboost: model_file = the FSx copy, nthread)
    model_repository/<model_id>/<v>/model.py       python-backend only: the developer's, or the template
                                                   (framework xgboost: runtime/engine/templates/xgboost/model.py)
    model_repository/<model_id>/<v>/serving.json   generate only: served name, tool parser, chat template
    model_repository/<model_id>/<v>/chat_template.jinja   the manifest's chat_template, if any
    deployment.json                                execution_mode, resources, strategy, plugins
    plugins/<wheel>                                the model's vLLM plugin wheels (installed --no-deps)

``<v>`` is the Triton version of the modelops version (:func:`modelops.manifest.triton_version`):
the version itself when it is a positive integer, else 1; KServe answers it as ``model_version``.

Everything a package needs is checked before anything is written: the runtime request against
the pin, engine args against the pinned vLLM's ``EngineArgs``, a python-backend model's declared
tensors against what the frontend sends and reads for its task (a tabular model's against its
model file, read by the image's xgboost), and plugin wheels against the pinned packages. A rerun with the same inputs finds an identical sealed package and reuses it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from prefect import task

from modelops.archive import ARCHIVE, META, read_meta, seal
from modelops.artifacts import Package, RuntimeImage
from modelops.compat import LOCAL_CPU, RuntimePin, check_plugin_wheel, check_runtime_request
from modelops.errors import ManifestError, PackageError
from modelops.io_contract import (DECOUPLED, MAX_BATCH, STRUCTURED_OUTPUTS_CONFIG,
                                  check_against_contract, pbtxt_type)
from modelops.manifest import Manifest, triton_version
from modelops.process import file_lock
from modelops.settings import REPO_ROOT, Settings, get_settings
from modelops.tabular import check_tabular_schema, model_files
from tasks._retry import retry_unless_bad_input

__all__ = ["PYTHON_BACKEND_TEMPLATE", "XGBOOST_TEMPLATE", "build_package", "check_engine_args", "check_python_backend",
           "engine_args", "package_for_image", "package_task", "preflight", "render_config_pbtxt",
           "xgboost_model_facts"]

PYTHON_BACKEND_TEMPLATE = REPO_ROOT / "runtime" / "engine" / "templates" / "python_backend" / "model.py"
XGBOOST_TEMPLATE = REPO_ROOT / "runtime" / "engine" / "templates" / "xgboost" / "model.py"


def engine_args(manifest: Manifest, weights: Path) -> dict:
    """The ``model.json`` content: the manifest's engine args plus the FSx weight paths.

    ``runner`` is ``pooling`` for ``task: embed`` (vLLM's embedding runner) and ``generate``
    otherwise; ``structured_outputs_config`` (generate) is the backend the runtime's schema
    checks assume (``modelops.io_contract.STRUCTURED_OUTPUTS_CONFIG``); ``served_model_name`` is the model_id, so vLLM's metrics carry
    ``model_name="<model_id>"`` (not the FSx path, which differs per host); stats stay on: they feed vLLM's Prometheus metrics, merged into the instance's /metrics.
    """
    args = {
        **manifest.engine_args,
        "model": str(weights),
        "tokenizer": str(weights),
        "served_model_name": manifest.model_id,
        "runner": "pooling" if manifest.task == "embed" else "generate",
        "disable_log_stats": False,
    }
    if manifest.task == "generate":
        args["structured_outputs_config"] = dict(STRUCTURED_OUTPUTS_CONFIG)
    return args


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
            # Suggestions for the first few only: 20,000 made-up keys must not take minutes.
            close = difflib.get_close_matches(name, schema, n=3) if len(problems) < _SHOWN else []
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
        more = f"\n  ... and {len(problems) - _SHOWN} more" if len(problems) > _SHOWN else ""
        raise ManifestError("invalid manifest:\n  " + "\n  ".join(problems[:_SHOWN]) + more)


_SHOWN = 10  # problems listed in one error


def _tensor_block(kind: str, tensors) -> str:
    rows = []
    for t in tensors:
        opt = " optional: true" if getattr(t, "optional", False) and kind == "input" else ""
        rows.append(f'  {{ name: "{t.name}" data_type: {pbtxt_type(t.datatype)} dims: [ {", ".join(map(str, t.dims))} ]{opt} }}')
    return f"{kind} [\n" + ",\n".join(rows) + "\n]\n"


def render_config_pbtxt(name: str, task: str, manifest: Manifest | None = None) -> str:
    """config.pbtxt of the model.

    vllm-backend: ``backend: "vllm"``, one model instance on the device the engine picks, I/O
    declared by the backend's ``auto_complete_config`` from the ``task`` parameter.
    python-backend (``manifest.packaging``): ``backend: "python"``, the task's batching
    (:data:`modelops.io_contract.MAX_BATCH`; embed: ``max_batch_size: 64`` + dynamic batcher, dims
    without the batch dimension) and the declared ``io_schema`` as ``input`` / ``output``.
    """
    common = (f'name: "{name}"\n'
              "instance_group [{ kind: KIND_MODEL, count: 1 }]\n"
              f'parameters {{ key: "task" value {{ string_value: "{task}" }} }}\n')
    if manifest is None or manifest.packaging == "vllm-backend":
        return common.replace("\n", '\nbackend: "vllm"\n', 1)
    inputs, outputs = manifest.tensors()
    # The frontend streams from generate models (modelops.io_contract.DECOUPLED): model.py must
    # answer through response senders.
    policy = "model_transaction_policy { decoupled: true }\n" if DECOUPLED[task] else ""
    # Embed models batch in Triton like our vllm backend: dims exclude the batch dimension.
    batching = f"max_batch_size: {MAX_BATCH[task]}\n" + ("dynamic_batching { }\n" if MAX_BATCH[task] else "")
    return (common.replace("\n", '\nbackend: "python"\n' + batching, 1) + policy
            + _tensor_block("input", inputs) + _tensor_block("output", outputs))


def check_python_backend(manifest: Manifest) -> None:
    """Check a python-backend model's declared tensors against the frontend's request builder
    for its task (:func:`modelops.io_contract.check_against_contract`) and its ``model_py``.

    Raises:
        ManifestError: naming each mismatching ``io_schema`` tensor, or an unreadable model_py.
    """
    inputs, outputs = manifest.tensors()
    if manifest.framework == "xgboost":
        problems = check_tabular_schema(inputs, outputs)
    else:
        problems = check_against_contract(manifest.task, inputs, outputs)
    if manifest.model_py is None and manifest.task == "generate":
        problems.append(f"model_py: required for task {manifest.task}; the default template "
                        f"({PYTHON_BACKEND_TEMPLATE.relative_to(REPO_ROOT)}) serves task embed only")
    if manifest.model_py is not None:
        path = Path(manifest.model_py)
        if not path.is_file():
            problems.append(f"model_py: {path} is not a file")
        else:
            import ast

            try:
                tree = ast.parse(path.read_text())
            except SyntaxError as e:
                problems.append(f"model_py: {path} is not valid Python: {e}")
            else:
                if not any(isinstance(n, ast.ClassDef) and n.name == "TritonPythonModel" for n in tree.body):
                    problems.append(f"model_py: {path} defines no class TritonPythonModel (Triton Python backend)")
    if problems:
        raise ManifestError(f"package {manifest.model_id}/{manifest.version}: the model does not fit the frontend:\n  "
                            + "\n  ".join(problems))


def preflight(manifest: Manifest, pin: RuntimePin = LOCAL_CPU) -> list[dict]:
    """Every check of ``manifest`` against the platform that needs no runtime image: its
    ``runtime`` request against ``pin``, a python-backend model against the frontend (a tabular
    model's tensors against the XGBoost template), and its plugin wheels. Run at announce time (before the event), in validate and in package.

    Returns:
        The plugins as read from their wheels (``name``, ``version``, ``entry_points``).

    Raises:
        ManifestError: naming the field and the fix.
    """
    if manifest.runtime is not None:
        check_runtime_request(manifest.runtime.asked(), pin)
    if manifest.scaling.min == 0 and get_settings().provider == "kubernetes":
        raise ManifestError("scaling.min: 0 is not available on the kubernetes provider: KEDA's Prometheus trigger "
                            "reads the instances' own metrics, which a Deployment at zero replicas does not have, and "
                            "nothing holds a request meanwhile; use min: 1 (scale from zero is local for now)")
    if manifest.scaling.max > (cap := get_settings().autoscale_max_instances):
        raise ManifestError(f"scaling.max: {manifest.scaling.max} instances is above this platform's cap ({cap}, "
                            "MODELOPS_AUTOSCALE_MAX_INSTANCES); lower it or raise the cap")
    if manifest.packaging == "python-backend":
        check_python_backend(manifest)
    if manifest.chat_template is not None and not Path(manifest.chat_template).is_file():
        raise ManifestError(f"chat_template: {manifest.chat_template} is not a file; give the path of a Jinja "
                            "chat template (relative to the manifest's folder)")
    plugins = [check_plugin_wheel(p.name, Path(p.wheel), pin) for p in manifest.plugins]
    if pin == LOCAL_CPU:
        check_with_pinned_image(manifest)
    return plugins


def check_with_pinned_image(manifest: Manifest, settings: Settings | None = None) -> bool:
    """``engine_args`` and ``tool_parser`` against what the pinned runtime image's probe
    recorded (its ``EngineArgs`` schema and vLLM tool-call parsers), before any weights move.

    Returns:
        False when this machine has not built the pinned image yet (nothing to check against:
        the package step checks after the build), else True.

    Raises:
        ManifestError: naming the fields (:func:`check_engine_args`) or the parser.
    """
    from tasks.image import lock_hash

    if manifest.framework != "vllm":
        return True
    settings = settings or get_settings()
    root = settings.runtime_dir / lock_hash()
    image = RuntimeImage(root, root / "venv" / "bin" / "python", root.name, LOCAL_CPU, LOCAL_CPU.vllm)
    if not image.engine_args_schema.is_file():
        return False
    check_engine_args(manifest.engine_args, json.loads(image.engine_args_schema.read_text()), image.vllm)
    parsers = image.tool_parsers()
    if manifest.tool_parser is not None and parsers is not None and manifest.tool_parser not in parsers:
        raise ManifestError(f"tool_parser: {manifest.tool_parser!r} is not a tool-call parser of vLLM {image.vllm}; "
                            f"use one of {', '.join(parsers)}")
    return True


def xgboost_model_facts(python: Path, model_file: Path, env: dict[str, str] | None = None) -> dict:
    """Read an XGBoost model file with the runtime image's xgboost (``runtime/tabular_probe.py``).

    Args:
        python: the image's interpreter; model_file: the materialized ``*.ubj`` / ``*.json``.

    Returns:
        ``{"num_features": F, "num_outputs": C, "objective": str, "xgboost": version}``.

    Raises:
        ManifestError: the file is not a model the image's xgboost can load (its message quoted).
    """
    import subprocess

    proc = subprocess.run([str(python), "-m", "runtime.tabular_probe", str(model_file)], capture_output=True,
                          text=True, cwd=REPO_ROOT, timeout=120, env=env)
    if proc.returncode != 0:
        raise ManifestError(f"source: {model_file.name} is not an XGBoost model the runtime's xgboost can load "
                            f"(truncated, corrupt, or not written by Booster.save_model): "
                            f"{(proc.stderr.strip().splitlines() or ['(no message)'])[-1][:500]}; save the model "
                            "again with Booster.save_model('model.ubj') and upload it")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _xgboost_files(manifest: Manifest, weights: Path, facts: dict | None) -> dict[str, bytes | Path]:
    found = model_files({p.name for p in weights.iterdir() if p.is_file()}) if weights.is_dir() else []
    if len(found) != 1:
        raise PackageError(f"weights folder {weights} holds {found or 'no'} XGBoost model file(s), not one; "
                           "materialize it first")
    if facts is not None:
        inputs, outputs = manifest.tensors()
        if problems := check_tabular_schema(inputs, outputs, facts["num_features"], facts["num_outputs"]):
            raise ManifestError(f"package {manifest.model_id}/{manifest.version}: io_schema does not fit "
                                f"{found[0]} ({facts['objective']}):\n  " + "\n  ".join(problems))
    repo = f"model_repository/{manifest.model_id}/{triton_version(manifest.version)}"
    model_json = {"model_file": str(weights / found[0]), "nthread": max(1, int(manifest.resources.cpus))}
    return {f"{repo}/model.json": json.dumps(model_json, indent=1, sort_keys=True).encode(),
            f"{repo}/model.py": Path(manifest.model_py) if manifest.model_py else XGBOOST_TEMPLATE}


def build_package(manifest: Manifest, weights: Path, lock_hash: str, settings: Settings | None = None,
                  engine_args_schema: Path | None = None, vllm_version: str = "",
                  pin: RuntimePin = LOCAL_CPU, tool_parsers: list[str] | None = None,
                  model_facts: dict | None = None) -> Package:
    """Write and seal the package of ``manifest`` whose weights are at ``weights`` (on FSx).

    Args:
        lock_hash: the runtime image the package was checked against (recorded);
        engine_args_schema: the image's EngineArgs schema (see tasks.image), checked first;
        pin: the runtime pin the model's ``runtime`` request and plugins are checked against;
        tool_parsers: the image's vLLM tool-call parser names (``manifest.tool_parser`` must be one);
        model_facts: framework xgboost: the model file as the image read it
            (:func:`xgboost_model_facts`), checked against ``io_schema``.

    Raises:
        ManifestError: a runtime request off the pin, an engine arg unknown to the pinned vLLM,
            a python-backend io_schema that does not fit the frontend, a bad plugin wheel, a
            tool_parser the image's vLLM does not have.
        PackageError: the weights folder is missing, or the package cannot be written.
    """
    settings = settings or get_settings()
    plugins = [{**info, "wheel": f"plugins/{Path(p.wheel).name}"} for p, info in zip(manifest.plugins,
                                                                                        preflight(manifest, pin))]
    if engine_args_schema is not None and manifest.framework == "vllm":
        check_engine_args(manifest.engine_args, json.loads(engine_args_schema.read_text()), vllm_version)
    if manifest.tool_parser is not None and tool_parsers is not None and manifest.tool_parser not in tool_parsers:
        raise ManifestError(f"tool_parser: {manifest.tool_parser!r} is not a tool-call parser of vLLM {vllm_version}; "
                            f"use one of {', '.join(tool_parsers)}")
    name = manifest.model_id
    repo = f"model_repository/{name}"
    folder = f"{repo}/{triton_version(manifest.version)}"
    if manifest.framework == "xgboost":
        model_files_ = _xgboost_files(manifest, weights, model_facts)
    elif not (weights / "config.json").is_file():
        raise PackageError(f"weights folder {weights} has no config.json; materialize it first")
    else:
        model_files_ = {f"{folder}/model.json": json.dumps(engine_args(manifest, weights), indent=1,
                                                            sort_keys=True).encode()}
        if manifest.packaging == "python-backend":
            model_files_[f"{folder}/model.py"] = Path(manifest.model_py) if manifest.model_py \
                else PYTHON_BACKEND_TEMPLATE
    files: dict[str, bytes | Path] = {
        f"{repo}/config.pbtxt": render_config_pbtxt(name, manifest.task, manifest).encode(),
        **model_files_,
        "deployment.json": json.dumps({
            "execution_mode": manifest.execution_mode, "resources": manifest.resources.model_dump(),
            "strategy": manifest.strategy, "plugins": plugins,
        }, indent=1, sort_keys=True).encode(),
    }
    if manifest.task == "generate":
        # What `vllm serve` takes as flags (runtime/engine/openai_engine.py: ServingOptions).
        files[f"{folder}/serving.json"] = json.dumps({
            "served_model_name": manifest.model_id, "tool_parser": manifest.tool_parser,
            "chat_template": "chat_template.jinja" if manifest.chat_template else None,
            # modelops.limits: the manifest's, else the settings' (null tokens: 4 × max_model_len).
            "max_request_tokens": manifest.limits.max_request_tokens or settings.max_request_tokens,
            "max_request_share": manifest.limits.max_request_share or settings.max_request_share,
        }, indent=1, sort_keys=True).encode()
        if manifest.chat_template:
            files[f"{folder}/chat_template.jinja"] = Path(manifest.chat_template)
    for p, plugin in zip(manifest.plugins, plugins):
        files[plugin["wheel"]] = Path(p.wheel)
    meta = {
        "model_id": manifest.model_id, "version": manifest.version, "task": manifest.task,
        "packaging": manifest.packaging, "execution_mode": manifest.execution_mode, "framework": manifest.framework,
        "triton_model": name, "runtime_lock_hash": lock_hash, "io_schema_hash": manifest.io_schema_hash(),
    }
    dest = settings.packages_dir / manifest.model_id / manifest.version
    pkg = Package(dest, name, manifest.model_id, manifest.version, manifest.task, manifest.packaging,
                  manifest.execution_mode)
    digests = {rel: hashlib.sha256(c.read_bytes() if isinstance(c, Path) else c).hexdigest() for rel, c in files.items()}
    # Two runs of one version (announced twice at once) must not swap the package under each other.
    with file_lock(dest.parent / f".{manifest.version}.lock"):
        if (dest / META).is_file() and (dest / ARCHIVE).is_file():
            try:
                old = read_meta(dest)
            except PackageError:
                old = {}
            if {k: old.get(k) for k in meta} == meta and old.get("files") == digests:
                return pkg  # sealed from the same inputs
        seal(files, dest, meta)
    return pkg


def package_for_image(manifest: Manifest, weights: Path, image: RuntimeImage) -> Package:
    """:func:`build_package` checked against everything ``image`` knows: its vLLM's engine args and
    tool-call parsers, and (framework xgboost) the model file as the image's xgboost reads it.

    Raises:
        ManifestError, PackageError: as :func:`build_package`.
    """
    facts = None
    if manifest.framework == "xgboost":
        found = model_files({p.name for p in weights.iterdir()}) if weights.is_dir() else []
        if len(found) == 1:  # else build_package names the problem
            facts = xgboost_model_facts(image.python, weights / found[0], {**os.environ, **image.env()})
    return build_package(manifest, weights, image.lock_hash, engine_args_schema=image.engine_args_schema,
                         vllm_version=image.vllm, pin=image.pin, tool_parsers=image.tool_parsers(), model_facts=facts)


@task(name="package", retries=1, retry_delay_seconds=2, retry_condition_fn=retry_unless_bad_input,
      timeout_seconds=120, tags=["modelops"])
def package_task(manifest: Manifest, weights: Path, image: RuntimeImage) -> Package:
    """Prefect task around :func:`build_package`, checked against ``image``'s engine args."""
    from prefect import get_run_logger

    pkg = package_for_image(manifest, weights, image)
    get_run_logger().info("package %s/%s sealed at %s (Triton model %r, %s, task %s, execution mode %s)",
                          pkg.model_id, pkg.version, pkg.path, pkg.triton_model, pkg.packaging, pkg.task,
                          pkg.execution_mode)
    return pkg
