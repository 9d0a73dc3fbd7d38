"""The contract of a classic (``framework: xgboost``) model: its model file and its tensors.

Such a model is served by the Python backend template ``runtime/engine/templates/xgboost/model.py``:
one request is a batch of rows ``[n, F]`` FP32 → predictions ``[n, C]`` FP32 (``C`` = 1 for a
regression or binary model, the class count for ``multi:softprob``). Dims in ``io_schema`` exclude
the batch dimension (``max_batch_size`` > 0, Triton's dynamic batcher), so a model of 8 features
declares ``input__0 FP32 [8]`` → ``output__0 FP32 [1]``.

The model file is what ``xgboost.Booster.save_model`` writes: UBJSON (``.ubj``, the default since
XGBoost 2.1) or JSON (``.json``); XGBoost picks the format from the suffix (XGBoost docs, "Model IO").
"""

from __future__ import annotations

from modelops.io_contract import Tensor

__all__ = ["MODEL_SUFFIXES", "check_tabular_schema", "model_files"]

MODEL_SUFFIXES = (".ubj", ".json")

_RECORDS = (".modelops-",)  # the cache's own files beside the weights (tasks/materialize)


def model_files(names: list[str] | set[str]) -> list[str]:
    """The XGBoost model files among a source's keys: top-level ``*.ubj`` / ``*.json``, sorted."""
    return sorted(n for n in names if "/" not in n and n.endswith(MODEL_SUFFIXES) and not n.startswith(_RECORDS))


def check_tabular_schema(inputs: list[Tensor], outputs: list[Tensor], num_features: int | None = None,
                         num_outputs: int | None = None) -> list[str]:
    """Mismatches between a tabular model's declared tensors and what the template serves.

    Args:
        inputs, outputs: the declared ``io_schema`` tensors (dims without the batch dimension).
        num_features, num_outputs: the model file's facts (``Booster.num_features()``, the width of
            one row's prediction), when known; checked against the declared dims.

    Returns:
        One line per problem naming ``io_schema.inputs.<name>`` / ``io_schema.outputs.<name>``.
    """
    problems = []
    for side, tensors, fact, what in (("inputs", inputs, num_features, "features"),
                                      ("outputs", outputs, num_outputs, "prediction values per row")):
        if len(tensors) != 1:
            problems.append(f"io_schema.{side}: declare exactly one tensor (got {len(tensors)}); the XGBoost template "
                            f"takes one [rows, features] matrix and returns one [rows, outputs] matrix")
            continue
        t = tensors[0]
        if t.datatype != "FP32":
            problems.append(f"io_schema.{side}.{t.name}: datatype {t.datatype}; the XGBoost template uses FP32")
        if len(t.dims) != 1 or t.dims[0] == -1:
            hint = f" (dims exclude the batch dimension: write [{t.dims[-1]}])" if len(t.dims) == 2 and t.dims[0] == -1 \
                else ""
            problems.append(f"io_schema.{side}.{t.name}: dims {list(t.dims)}; declare the {what} as one fixed size, "
                            f"e.g. [8]{hint}")
        elif fact is not None and t.dims[0] != fact:
            problems.append(f"io_schema.{side}.{t.name}: declares {t.dims[0]} {what}, the model file has {fact}")
        if t.optional:
            problems.append(f"io_schema.{side}.{t.name}: cannot be optional")
    return problems
