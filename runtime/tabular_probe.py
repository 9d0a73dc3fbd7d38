"""Read an XGBoost model file with the image's xgboost, for the package step's io_schema check.

    python -m runtime.tabular_probe MODEL_FILE   → one JSON line on stdout:
    {"num_features": 8, "num_outputs": 1, "objective": "binary:logistic", "xgboost": "3.2.0"}

``num_outputs`` is the width of one row's prediction (``inplace_predict`` on one row of zeros:
shape ``(1,)`` → 1, ``(1, C)`` → C), what the template returns per row. A file xgboost cannot
load exits non-zero with xgboost's own message on stderr.
"""

from __future__ import annotations

import json
import sys

__all__ = ["model_facts"]


def model_facts(path: str) -> dict:
    """Facts of the model at ``path`` (see the module docstring).

    Raises:
        xgboost.core.XGBoostError: the file is not a model this xgboost loads.
    """
    import numpy as np
    import xgboost

    booster = xgboost.Booster(model_file=path)
    features = booster.num_features()
    one = np.asarray(booster.inplace_predict(np.zeros((1, features), dtype=np.float32)))
    objective = json.loads(booster.save_config())["learner"]["objective"]["name"]
    return {"num_features": features, "num_outputs": int(np.prod(one.shape[1:])) if one.ndim > 1 else 1,
            "objective": objective, "xgboost": xgboost.__version__}


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: python -m runtime.tabular_probe MODEL_FILE")
    try:
        facts = model_facts(sys.argv[1])
    except Exception as e:  # noqa: BLE001 - one line the package step quotes
        sys.exit(f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else e!r}")
    print(json.dumps(facts))


if __name__ == "__main__":
    main()
