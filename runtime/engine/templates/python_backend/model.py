"""Template for ``packaging: python-backend``: custom pre- and post-processing around vLLM.

Copy it next to your manifest as ``model.py`` (manifest field ``model_py``) and change the three
marked steps. The package step checks your ``io_schema`` against what the frontend sends and
reads for your ``task``; this template serves ``task: embed`` with::

    inputs:  text_input BYTES [1]
    outputs: embedding FP32 [-1], num_input_tokens INT32 [1]

(the model batches: ``max_batch_size`` 64 with Triton's dynamic batcher, so a request of n texts
is [n, 1] → [n, dim] and [n, 1]; dims in io_schema exclude the batch dimension)

What it does per request:
1. pre-processing: tokenize with the model's own tokenizer and truncate to ``max_model_len``
   tokens (the vllm backend refuses over-long inputs; this model truncates them instead);
2. the engine: ``vllm.LLM.embed`` on the token ids (vLLM's pooling runner);
3. post-processing: L2-normalize each vector and report the tokens used.

Each answer counts for the API key the router vouched for, with its input tokens (``keys usage``:
runtime/engine/api_key.py); keep those lines in your own ``model.py``.

Engine args come from ``<version>/model.json`` beside this file, written by the package step
(``model``/``tokenizer`` point at the materialized weights on FSx).
"""

# First: the serving image's sys.path and locale (runtime/engine/stub_prelude.py, copied beside
# triton_python_backend_utils.py by runtime/startup.py).
import modelops_stub_prelude  # noqa: F401, I001

import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils

# A request refused with invalid_request(why) is the client's fault: the OpenAI frontend answers
# 400 with that reason; any other error is the model's (502).
from modelops.io_contract import invalid_request
from runtime.engine.api_key import KeyCounters, request_parameters


class TritonPythonModel:
    """Triton Python backend model: initialize → execute (a list of requests) → finalize."""

    def initialize(self, args):
        config = json.loads(args["model_config"])
        task = config.get("parameters", {}).get("task", {}).get("string_value", "")
        if task != "embed":
            raise pb_utils.TritonModelException(f"this template serves task embed, not {task!r}; bring your own "
                                                "model.py (manifest field model_py)")
        with open(os.path.join(args["model_repository"], args["model_version"], "model.json")) as f:
            engine_args = json.load(f)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from transformers import AutoTokenizer
        from vllm.entrypoints.llm import LLM

        self.tokenizer = AutoTokenizer.from_pretrained(engine_args["tokenizer"])
        self.max_tokens = int(engine_args.get("max_model_len") or self.tokenizer.model_max_length)
        self.llm = LLM(**engine_args)
        self.key_usage = KeyCounters(pb_utils.Logger.log_warn)

    def execute(self, requests):
        from vllm.inputs import TokensPrompt

        responses = []
        for request in requests:
            try:
                raw = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy().reshape(-1)
                texts = [t.decode() if isinstance(t, bytes) else str(t) for t in raw]
                if not texts:
                    raise ValueError("text_input is empty")
                _, key = request_parameters(request)  # the API key this answer counts for
                # 1. pre-processing: our tokenizer, truncation instead of refusal.
                ids = self.tokenizer(texts, truncation=True, max_length=self.max_tokens)["input_ids"]
                # 2. the engine.
                outs = self.llm.embed([TokensPrompt(prompt_token_ids=i) for i in ids], use_tqdm=False)
                # 3. post-processing: unit vectors.
                vectors = np.asarray([o.outputs.embedding for o in outs], dtype=np.float32)
                vectors /= np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
                responses.append(pb_utils.InferenceResponse([
                    pb_utils.Tensor("embedding", vectors),
                    pb_utils.Tensor("num_input_tokens", np.asarray([[len(i)] for i in ids], dtype=np.int32)),
                ]))
                self.key_usage.count(key, sum(map(len, ids)))
            except (ValueError, TypeError) as e:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(invalid_request(e))))
        return responses

    def finalize(self):
        self.llm = None
