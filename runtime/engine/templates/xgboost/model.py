"""Template for ``framework: xgboost``: one XGBoost model file served by Triton's Python backend.

The package step writes ``<version>/model.json`` beside this file: ``{"model_file": <the FSx copy>,
"nthread": <resources.cpus>}``, and config.pbtxt with the manifest's ``io_schema``: one FP32 input
``[F]`` and one FP32 output ``[C]`` (dims without the batch dimension; ``max_batch_size`` 4096 and
Triton's dynamic batcher, modelops.io_contract.MAX_BATCH).

Per call Triton hands over every request its dynamic batcher merged; their rows are stacked into
one ``[sum n, F]`` matrix, predicted with one ``Booster.inplace_predict`` (the same trees and
values as ``Booster.predict`` on a DMatrix of those rows, without building one), and split back
into ``[n, C]`` per request. NaN in a row is XGBoost's missing value. Each answer counts for the
API key the router vouched for (runtime/engine/api_key.py): one request, no tokens.
"""

# First: the serving image's sys.path and locale (runtime/engine/stub_prelude.py, copied beside
# triton_python_backend_utils.py by runtime/startup.py).
import modelops_stub_prelude  # noqa: F401, I001

import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils

from runtime.engine.api_key import KeyCounters, request_parameters


class TritonPythonModel:
    """Triton Python backend model: initialize → execute (a list of requests) → finalize."""

    def initialize(self, args):
        import xgboost

        config = json.loads(args["model_config"])
        (inp,), (out,) = config["input"], config["output"]
        self.input_name, self.output_name = inp["name"], out["name"]
        self.width = int(out["dims"][0])
        with open(os.path.join(args["model_repository"], args["model_version"], "model.json")) as f:
            spec = json.load(f)
        self.booster = xgboost.Booster(model_file=spec["model_file"])
        self.booster.set_param({"nthread": int(spec.get("nthread", 1))})
        self.key_usage = KeyCounters(pb_utils.Logger.log_warn)
        features = int(inp["dims"][0])
        if self.booster.num_features() != features:  # the package step checked it; a swapped file is caught here
            raise pb_utils.TritonModelException(f"{spec['model_file']}: the model has {self.booster.num_features()} "
                                                f"features, config.pbtxt declares {features}")

    def execute(self, requests):
        rows = [pb_utils.get_input_tensor_by_name(r, self.input_name).as_numpy() for r in requests]
        # inplace_predict takes inf and answers something; Booster.predict's DMatrix refuses it.
        # Such a request is the caller's error (400 / INVALID_ARGUMENT); the rest of the batch is served.
        refused, keys = {}, {}
        for i, x in enumerate(rows):
            try:
                _, keys[i] = request_parameters(requests[i])  # other parameters are not read
            except ValueError as e:
                refused[i] = pb_utils.TritonError(str(e), pb_utils.TritonError.INVALID_ARG)
                continue
            if (bad := np.flatnonzero(np.isinf(x).any(axis=1))).size:
                refused[i] = pb_utils.TritonError(
                    f"{self.input_name}: row {int(bad[0])} holds an infinite value (or one beyond FP32's range); "
                    "XGBoost takes NaN as a missing value, not inf", pb_utils.TritonError.INVALID_ARG)
        kept = [x for i, x in enumerate(rows) if i not in refused]
        pred = None
        if kept:
            try:
                pred = np.asarray(self.booster.inplace_predict(np.concatenate(kept) if len(kept) > 1 else kept[0]),
                                  dtype=np.float32).reshape(-1, self.width)
            except Exception as e:  # noqa: BLE001 - every request of the call gets the reason
                error = pb_utils.TritonError(f"xgboost predict failed: {e}")
                return [pb_utils.InferenceResponse(error=refused.get(i, error)) for i in range(len(requests))]
        responses, start = [], 0
        for i, x in enumerate(rows):
            if i in refused:
                responses.append(pb_utils.InferenceResponse(error=refused[i]))
                continue
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor(self.output_name, pred[start:start + len(x)])]))
            self.key_usage.count(keys[i])
            start += len(x)
        return responses

    def finalize(self):
        self.booster = None
