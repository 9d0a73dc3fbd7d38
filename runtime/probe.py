"""Self-check of the serving image, run by the build_runtime_image task as a process.

    python -m runtime.probe [--strict] [MODULE:NAME ...]   → one JSON line on stdout:
    {"vllm": "0.32.0", "torch": "2.13.0+cpu", "xgboost": "3.2.0", "numpy": "1.26.4", "missing": [...],
     "engine_args": {name: spec},
     "imports": {"vllm.entrypoints.llm:LLM": "ok" | "<error>"}}

The arguments are the vLLM imports our Triton backend needs (``modelops.compat.
our_backend_imports``); each is really imported here, inside the built runtime. ``--strict``
exits non-zero when an import fails or tritonserver is incomplete (the Dockerfile's check).

``engine_args`` describes every ``vllm.EngineArgs`` field as ``{"type": int|float|bool|str|
choice|other, "nullable": bool, "choices": [...]}`` so manifests can be checked before a
model is provisioned.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import types
import typing

__all__ = ["engine_args_schema", "main"]

_SIMPLE = {int: "int", float: "float", bool: "bool", str: "str"}


def _spec(tp: object) -> dict:
    nullable = False
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        nullable = len(args) < len(typing.get_args(tp))
        if len(args) != 1:
            return {"type": "other", "nullable": nullable}
        tp, origin = args[0], typing.get_origin(args[0])
    if origin is typing.Literal:
        return {"type": "choice", "nullable": nullable, "choices": list(typing.get_args(tp))}
    return {"type": _SIMPLE.get(tp, "other"), "nullable": nullable}  # type: ignore[call-overload]


def engine_args_schema() -> dict[str, dict]:
    """``{field name: spec}`` for every field of ``vllm.engine.arg_utils.EngineArgs``."""
    from vllm.engine.arg_utils import EngineArgs

    # f.type is the evaluated annotation for most fields; a string (a forward reference) is "other".
    return {f.name: _spec(f.type) if not isinstance(f.type, str) else {"type": "other", "nullable": True}
            for f in dataclasses.fields(EngineArgs)}


def try_imports(specs: list[str]) -> dict[str, str]:
    """``{spec: "ok" | error}`` after importing each ``module`` / ``module:Name``."""
    import importlib

    result = {}
    for spec in specs:
        module, _, name = spec.partition(":")
        try:
            obj = importlib.import_module(module)
            if name:
                getattr(obj, name)
            result[spec] = "ok"
        except Exception as e:  # noqa: BLE001 - the report names any failure
            result[spec] = f"{type(e).__name__}: {e}"
    return result


def _tool_parsers() -> list[str]:
    """The names vLLM's ``--tool-call-parser`` accepts (a manifest's ``tool_parser``)."""
    from vllm.tool_parsers import ToolParserManager

    return sorted(ToolParserManager.list_registered())


def main() -> None:
    import fastapi  # noqa: F401
    import numpy
    import prometheus_client  # noqa: F401
    import tritonclient.grpc.aio  # noqa: F401
    import uvicorn  # noqa: F401
    import torch
    import vllm
    import xgboost  # framework: xgboost (runtime/engine/templates/xgboost/model.py)

    import runtime.frontend.app  # noqa: F401
    from runtime.startup import triton_layout

    strict = "--strict" in sys.argv[1:]
    try:
        import modelops_native

        native = "ok" if modelops_native.NATIVE else "the C++ extension did not load (pure-Python fallback)"
    except ImportError as e:
        native = f"ImportError: {e}"
    report = {
        "native": native,
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "xgboost": xgboost.__version__,
        "numpy": numpy.__version__,
        "missing": triton_layout().missing(),
        "engine_args": engine_args_schema(),
        "tool_parsers": _tool_parsers(),
        "imports": try_imports([a for a in sys.argv[1:] if a != "--strict"]),
    }
    print(json.dumps(report))
    # --strict (the production image build): fail the build on any missing piece.
    if strict and (report["missing"] or native != "ok" or any(v != "ok" for v in report["imports"].values())):
        sys.exit(f"runtime probe: missing {report['missing']}, native {native}, imports "
                 f"{ {k: v for k, v in report['imports'].items() if v != 'ok'} }")


if __name__ == "__main__":
    main()
