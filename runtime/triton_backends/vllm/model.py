"""Triton Python-based backend ``vllm``: runs a vLLM engine inside the Python backend stub.

A model whose config.pbtxt says ``backend: "vllm"`` loads this file (from
``<backend-directory>/vllm/model.py``). Engine args come from the sibling ``1/model.json``;
the I/O tensors are declared here in ``auto_complete_config`` by task, so a package holds no
tensor spec and model and frontend can change independently:

- task ``embed`` (vLLM pooling runner):
  ``text_input`` BYTES [-1] → ``embedding`` FP32 [-1, -1], ``num_input_tokens`` INT32 [-1]
- task ``generate``:
  ``text_input`` BYTES [1], optional ``sampling_parameters`` BYTES [1] (JSON of
  ``vllm.SamplingParams`` fields), optional ``exclude_input_in_output`` BOOL [1]
  → ``text_output`` BYTES [-1], ``finish_reason`` BYTES [-1], ``num_input_tokens`` INT32 [1],
  ``num_output_tokens`` INT32 [1]

The task is read from the config parameter ``task``. Errors are returned per request.
"""

import locale
import os
import sys

# The stub's sys.executable is whatever python is on PATH; vLLM spawns `sys.executable -m ...`
# (model architecture inspection), which must be the runtime's interpreter.
if os.environ.get("MODELOPS_RUNTIME_PYTHON"):
    sys.executable = os.environ["MODELOPS_RUNTIME_PYTHON"]

# The stub's embedded interpreter ignores PYTHONPATH, so the runtime environment's packages
# (vLLM, numpy 1.26) are put first on sys.path from the variable the startup sequence sets.
for _p in reversed([p for p in os.environ.get("MODELOPS_RUNTIME_PATH", "").split(os.pathsep) if p]):
    if _p not in sys.path:
        sys.path.insert(0, _p)

# The stub starts Python with the C locale; torch's import then fails decoding UTF-8
# (RUNTIME_NOTES.md). Must run before anything imports torch.
locale.setlocale(locale.LC_ALL, "C.UTF-8")

import json  # noqa: E402

import numpy as np  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402

from modelops.io_contract import CONTRACTS  # noqa: E402

# Declared from the table the frontend builds its requests from (modelops/io_contract.py).
_IO = {task: ([t.as_config() for t in sends], [t.as_config() for t in reads])
       for task, (sends, reads) in CONTRACTS.items()}


def _task_of(config: dict) -> str:
    task = config.get("parameters", {}).get("task", {}).get("string_value", "")
    if task not in _IO:
        raise pb_utils.TritonModelException(
            f"config.pbtxt parameter 'task' must be one of {sorted(_IO)}, got {task!r}"
        )
    return task


class TritonPythonModel:
    """The ``vllm`` backend: initialize → execute (batched) → finalize."""

    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        config = auto_complete_model_config.as_dict()
        inputs, outputs = _IO[_task_of(config)]
        have_in = {i["name"] for i in config.get("input", [])}
        have_out = {o["name"] for o in config.get("output", [])}
        for spec in inputs:
            if spec["name"] not in have_in:
                auto_complete_model_config.add_input(spec)
        for spec in outputs:
            if spec["name"] not in have_out:
                auto_complete_model_config.add_output(spec)
        auto_complete_model_config.set_max_batch_size(0)
        return auto_complete_model_config

    def initialize(self, args):
        self._setup_config(args)
        self._setup_engine()

    def _setup_config(self, args):
        self.model_config = json.loads(args["model_config"])
        self.task = _task_of(self.model_config)
        path = os.path.join(args["model_repository"], args["model_version"], "model.json")
        try:
            with open(path) as f:
                self.engine_args = json.load(f)
        except (OSError, ValueError) as e:
            raise pb_utils.TritonModelException(f"cannot read engine args from {path}: {e}") from e
        if not os.path.isdir(self.engine_args.get("model", "")):
            raise pb_utils.TritonModelException(
                f"{path}: 'model' must be the directory of the materialized weights, got {self.engine_args.get('model')!r}"
            )
        self.logger = pb_utils.Logger

    def _setup_engine(self):
        # The engine runs in this process: the stub is an embedding host (RUNTIME_NOTES.md).
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        # Imported from their defining modules so `modelops image plan` can check them
        # statically against any vLLM release's source (the package root resolves lazily).
        from vllm.entrypoints.llm import LLM
        from vllm.sampling_params import SamplingParams
        from vllm.version import __version__

        self.logger.log_info(f"vllm backend: starting vLLM {__version__} with {self.engine_args}")
        self.llm = LLM(**self.engine_args)
        self.sampling_params_cls = SamplingParams

    def execute(self, requests):
        return self._embed(requests) if self.task == "embed" else self._generate(requests)

    # -- embed -----------------------------------------------------------------------------
    def _embed(self, requests):
        responses = [None] * len(requests)
        texts, owners = [], []
        for r, request in enumerate(requests):
            try:
                items = [_text(t) for t in pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy().reshape(-1)]
                if not items:
                    raise ValueError("text_input is empty")
            except ValueError as e:
                responses[r] = _error_response(e)
                continue
            texts.extend(items)
            owners.extend([r] * len(items))
        if not texts:
            return responses
        try:
            outs = self.llm.embed(texts, use_tqdm=False)
        except Exception as e:
            if len(set(owners)) == 1:
                responses[owners[0]] = _error_response(e)
                return responses
            # One bad request (e.g. too long) fails the whole engine call: serve each on its own.
            for r in sorted(set(owners)):
                responses[r] = self._embed_one([t for t, o in zip(texts, owners) if o == r])
            return responses
        grouped = {}
        for r, out in zip(owners, outs):
            grouped.setdefault(r, []).append(out)
        for r, group in grouped.items():
            responses[r] = _embedding_response(group)
        return responses

    def _embed_one(self, texts):
        try:
            return _embedding_response(self.llm.embed(texts, use_tqdm=False))
        except Exception as e:
            return _error_response(e)

    # -- generate --------------------------------------------------------------------------
    def _generate(self, requests):
        responses = [None] * len(requests)
        prompts, params, owners, exclude = [], [], [], {}
        for r, request in enumerate(requests):
            try:
                prompt = _text(pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy().reshape(-1)[0])
                sp_tensor = pb_utils.get_input_tensor_by_name(request, "sampling_parameters")
                sp = json.loads(_text(sp_tensor.as_numpy().reshape(-1)[0])) if sp_tensor is not None else {}
                if not isinstance(sp, dict):
                    raise ValueError("sampling_parameters must be a JSON object")
                ex = pb_utils.get_input_tensor_by_name(request, "exclude_input_in_output")
                exclude[r] = bool(ex.as_numpy().reshape(-1)[0]) if ex is not None else True
                params.append(self.sampling_params_cls(**sp))
            except (ValueError, TypeError) as e:
                responses[r] = pb_utils.InferenceResponse(error=pb_utils.TritonError(f"invalid request: {e}"))
                continue
            prompts.append(prompt)
            owners.append(r)
        if prompts:
            try:
                outs = self.llm.generate(prompts, params, use_tqdm=False)
            except Exception as e:
                if len(owners) == 1:
                    responses[owners[0]] = _error_response(e)
                    return responses
                outs = []
                for r, prompt, sp in zip(owners, prompts, params):
                    try:
                        outs.append(self.llm.generate([prompt], [sp], use_tqdm=False)[0])
                    except Exception as one:  # only this request fails
                        responses[r] = _error_response(one)
                        outs.append(None)
            for r, prompt, out in zip(owners, prompts, outs):
                if out is None:
                    continue
                completion = out.outputs[0]
                text = completion.text if exclude[r] else prompt + completion.text
                responses[r] = pb_utils.InferenceResponse(output_tensors=[
                    pb_utils.Tensor("text_output", np.asarray([text.encode()], dtype=np.object_)),
                    pb_utils.Tensor("finish_reason", np.asarray([(completion.finish_reason or "").encode()], dtype=np.object_)),
                    pb_utils.Tensor("num_input_tokens", np.asarray([len(out.prompt_token_ids)], dtype=np.int32)),
                    pb_utils.Tensor("num_output_tokens", np.asarray([len(completion.token_ids)], dtype=np.int32)),
                ])
        return responses

    def finalize(self):
        self.llm = None


def _client_errors() -> tuple:
    try:
        from vllm.exceptions import VLLMClientError  # vLLM ≥ 0.2x: the 4xx side of its error split
    except ImportError:
        return (ValueError, TypeError)
    return (VLLMClientError, ValueError, TypeError)


def _error_response(e: Exception):
    """Per-request error. Errors vLLM classes as the client's (``VLLMClientError``: too long,
    bad sampling parameters) and ValueError/TypeError are marked "invalid request" (HTTP 400
    at the frontend); anything else is an engine error."""
    kind = "invalid request" if isinstance(e, _client_errors()) else "engine error"
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(f"{kind}: {e}"))


def _embedding_response(outs):
    emb = np.asarray([o.outputs.embedding for o in outs], dtype=np.float32)
    ntok = np.asarray([len(o.prompt_token_ids) for o in outs], dtype=np.int32)
    return pb_utils.InferenceResponse(output_tensors=[
        pb_utils.Tensor("embedding", emb), pb_utils.Tensor("num_input_tokens", ntok)])


def _text(value) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"text_input is not valid UTF-8: {e}") from None
    return str(value)
