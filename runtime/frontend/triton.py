"""The frontend's engine-facing core: typed calls to the Triton model over KServe v2 gRPC.

Knows no HTTP and no OpenAI shapes; app.py adapts OpenAI requests onto these calls.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import tritonclient.grpc.aio as grpcclient
from tritonclient.utils import InferenceServerException

from modelops.io_contract import CONTRACTS, Tensor
from runtime.frontend.errors import InvalidRequest, UpstreamError

__all__ = ["Embeddings", "Generation", "TritonModel"]

# The request builder follows modelops.io_contract, the same table the package step checks a
# python-backend model's declared tensors against.
_SENDS = {task: {t.name: t for t in sends} for task, (sends, _) in CONTRACTS.items()}
_READS = {task: [t.name for t in reads] for task, (_, reads) in CONTRACTS.items()}


def _input(spec: Tensor, array: np.ndarray) -> grpcclient.InferInput:
    inp = grpcclient.InferInput(spec.name, list(array.shape), spec.datatype)
    inp.set_data_from_numpy(array)
    return inp


@dataclass(frozen=True)
class Embeddings:
    """``vectors``: float32 array [n, dim]; ``prompt_tokens``: tokens per input [n]."""

    vectors: np.ndarray
    prompt_tokens: list[int]


@dataclass(frozen=True)
class Generation:
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


class TritonModel:
    """One model on a Triton server.

    Args:
        url: Triton gRPC address ``host:port``.
        name: the model's name in the model repository.
    """

    def __init__(self, url: str, name: str) -> None:
        self.url, self.name = url, name
        self._client = grpcclient.InferenceServerClient(url=url)

    async def ready(self) -> bool:
        """Server ready and model ready (False while Triton is starting or down)."""
        try:
            return await self._client.is_server_ready() and await self._client.is_model_ready(self.name)
        except InferenceServerException:
            return False

    async def embed(self, texts: list[str]) -> Embeddings:
        """Embed ``texts`` (one request; the backend batches them in one engine call)."""
        sends = _SENDS["embed"]
        # The model batches (max_batch_size > 0): n texts are a batch of n, shape [n, 1].
        inp = _input(sends["text_input"], np.asarray([[t.encode()] for t in texts], dtype=np.object_))
        result = await self._infer([inp], _READS["embed"], param="input")
        return Embeddings(result.as_numpy("embedding"), result.as_numpy("num_input_tokens").reshape(-1).tolist())

    async def generate(self, prompt: str, sampling_params: dict, *, echo: bool = False) -> Generation:
        """One completion for ``prompt`` with ``vllm.SamplingParams(**sampling_params)``."""
        async for g in self._generate(prompt, sampling_params, echo=echo, stream=False):
            return g
        raise UpstreamError(f"Triton model {self.name!r} ended the stream without a final response")

    async def generate_stream(self, prompt: str, sampling_params: dict, *, echo: bool = False):
        """Async iterator of :class:`Generation` deltas (text since the previous one); the last
        has a ``finish_reason`` and the final token counts."""
        async for g in self._generate(prompt, sampling_params, echo=echo, stream=True):
            yield g

    async def _generate(self, prompt: str, sampling_params: dict, *, echo: bool, stream: bool):
        sends = _SENDS["generate"]
        inputs = [
            _input(sends["text_input"], np.asarray([prompt.encode()], dtype=np.object_)),
            _input(sends["sampling_parameters"], np.asarray([json.dumps(sampling_params).encode()], dtype=np.object_)),
            _input(sends["exclude_input_in_output"], np.asarray([not echo], dtype=bool)),
            _input(sends["stream"], np.asarray([stream], dtype=bool)),
        ]
        request = {"model_name": self.name, "inputs": inputs,
                   "outputs": [grpcclient.InferRequestedOutput(o) for o in _READS["generate"]]}

        async def one_request():
            yield request

        # The backend is decoupled: responses arrive on a gRPC stream; the one with a
        # finish_reason is the last (it carries Triton's final flag).
        responses = self._client.stream_infer(one_request())
        try:
            async for result, error in responses:
                if error is not None:
                    raise self._error(error, param=None)
                finish = result.as_numpy("finish_reason").reshape(-1)[0].decode()
                yield Generation(
                    text=result.as_numpy("text_output").reshape(-1)[0].decode(),
                    finish_reason=finish,
                    prompt_tokens=int(result.as_numpy("num_input_tokens").reshape(-1)[0]),
                    completion_tokens=int(result.as_numpy("num_output_tokens").reshape(-1)[0]),
                )
                if finish:
                    return
        except InferenceServerException as e:
            raise self._error(e, param=None) from e
        finally:
            responses.cancel()  # closes the stream (also when the client went away mid-stream)
        raise UpstreamError(f"Triton model {self.name!r} ended the stream without a final response")

    async def _infer(self, inputs, outputs, *, param: str | None):
        """One unary KServe v2 infer call (non-decoupled models)."""
        try:
            return await self._client.infer(
                self.name, inputs, outputs=[grpcclient.InferRequestedOutput(o) for o in outputs]
            )
        except InferenceServerException as e:
            raise self._error(e, param=param) from e

    def _error(self, e: InferenceServerException, *, param: str | None) -> Exception:
        """The backend marks requests it refuses "invalid request: ..." (HTTP 400, naming
        ``param``); anything else is the server's fault (502)."""
        msg = e.message() or str(e)
        if "invalid request: " in msg:
            detail = msg.split("invalid request: ", 1)[-1]
            if param is None and "extra_args" in detail:
                param = "vllm_xargs"  # what the client sent as SamplingParams.extra_args
            return InvalidRequest(detail, param=param)
        return UpstreamError(f"Triton model {self.name!r}: {msg}")

    async def close(self) -> None:
        await self._client.close()
