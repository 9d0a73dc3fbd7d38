"""The frontend's engine-facing core: typed calls to the Triton model over KServe v2 gRPC.

Knows no HTTP and no OpenAI shapes; app.py adapts OpenAI requests onto these calls.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import numpy as np
import tritonclient.grpc.aio as grpcclient
from tritonclient.utils import InferenceServerException

from modelops.io_contract import CONTRACTS, FRONTEND_TOKEN_HEADER, MAX_BATCH, Tensor, refusal_of, refused_param
from modelops.tenancy import INSTANCE_SECRET_GRPC_HEADER
from runtime.frontend.errors import EngineUnavailable, InvalidRequest, UpstreamError

__all__ = ["Embeddings", "OpenAIReply", "TritonModel"]

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
class OpenAIReply:
    """``status``: the HTTP status vLLM's serving layer chose; ``body``: a JSON document, or one
    server-sent event (``data: ...``) of a stream; ``final``: nothing follows."""

    status: int
    body: str
    final: bool


class TritonModel:
    """One model on a Triton server.

    Args:
        url: Triton gRPC address ``host:port``.
        name: the model's name in the model repository.
        secret: the instance secret Triton's restricted APIs ask for ("" when it asks none).
        frontend_token: goes with each ``openai_request`` (:data:`FRONTEND_TOKEN_HEADER`).
    """

    def __init__(self, url: str, name: str, secret: str = "", frontend_token: str = "") -> None:
        self.url, self.name = url, name
        self._client = grpcclient.InferenceServerClient(url=url)
        self._headers = {INSTANCE_SECRET_GRPC_HEADER: secret} if secret else None
        self._openai_headers = {**(self._headers or {}), **({FRONTEND_TOKEN_HEADER: frontend_token}
                                                             if frontend_token else {})} or None
        self._dead: asyncio.Future | None = None  # holds the cause once the engine died

    def engine_died(self, cause: str) -> None:
        """The engine process is gone (runtime/frontend/engine_watch.py): every call waiting on
        it, and every later one, raises :class:`EngineUnavailable` naming ``cause`` (a dead
        stub never answers what it held)."""
        if self._dead is None:
            self._dead = asyncio.get_running_loop().create_future()
        if not self._dead.done():
            self._dead.set_result(cause)

    async def _or_dead(self, awaitable):
        """``await awaitable``, unless the engine dies first (then EngineUnavailable)."""
        if self._dead is None:
            self._dead = asyncio.get_running_loop().create_future()
        if self._dead.done():
            raise EngineUnavailable(f"the engine died: {self._dead.result()}")
        call = asyncio.ensure_future(awaitable)
        try:
            await asyncio.wait({call, self._dead}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not call.done():  # the engine died, or our caller was cancelled (client gone, drain over)
                call.cancel()
        if not call.cancelled() and call.done():
            return call.result()
        raise EngineUnavailable(f"the engine died: {self._dead.result()}")

    async def ready(self) -> bool:
        """Server ready and model ready (False while Triton is starting or down)."""
        try:
            return await self._client.is_server_ready(headers=self._headers) and \
                await self._client.is_model_ready(self.name, headers=self._headers)
        except InferenceServerException:
            return False

    async def embed(self, texts: list[str], param: str = "input") -> Embeddings:
        """Embed ``texts``: ``vectors`` [len(texts), dim] float32 in order, ``prompt_tokens``
        per text. Sent as concurrent requests of at most the model's ``max_batch_size`` texts
        (Triton refuses a larger batch; its dynamic batcher and the backend put concurrent ones
        in one engine call). ``param``: the request field a refusal names."""
        sends, step = _SENDS["embed"], MAX_BATCH["embed"]

        async def batch(chunk: list[str]):
            # The model batches (max_batch_size > 0): n texts are a batch of n, shape [n, 1].
            inp = _input(sends["text_input"], np.asarray([[t.encode()] for t in chunk], dtype=np.object_))
            return await self._infer([inp], _READS["embed"], param=param)

        results = await asyncio.gather(*(batch(texts[i:i + step]) for i in range(0, len(texts), step)))
        return Embeddings(np.concatenate([r.as_numpy("embedding") for r in results]),
                          [n for r in results for n in r.as_numpy("num_input_tokens").reshape(-1).tolist()])

    async def predict_zeros(self) -> np.ndarray:
        """One row of zeros through a tabular model (its declared input ``[F]``, read from the
        model's config): the warm-up of a model with no text face. Returns its ``[1, C]`` output."""
        try:
            config = (await self._client.get_model_config(self.name, as_json=True, headers=self._headers))["config"]
        except InferenceServerException as e:
            raise self._error(e, param=None) from e
        (inp,), (out,) = config["input"], config["output"]
        row = np.zeros((1, *(int(d) for d in inp["dims"])), dtype=np.float32)
        result = await self._infer([_input(Tensor(inp["name"], "FP32", tuple(inp["dims"])), row)], [out["name"]],
                                   param=None)
        return result.as_numpy(out["name"])

    async def openai(self, api: str, body: dict, key: str | None = None):
        """Async iterator of :class:`OpenAIReply` for one audited OpenAI request body
        (``api``: ``chat`` or ``completions``), answered by vLLM's serving classes in the
        backend: one JSON document, or the server-sent events of a stream, the last with
        ``final``. ``key`` (the API key's name) goes with the request: the backend counts the
        tokens the engine made for it, whether the client read the answer to its end or hung up
        (:data:`modelops.io_contract.ENGINE_KEY_USAGE`). Raises :class:`UpstreamError` when
        Triton or the backend fails the call."""
        sends = _SENDS["generate"]
        doc = json.dumps({"api": api, "body": body, **({"key": key} if key else {})}).encode()
        request = {"model_name": self.name,
                   "inputs": [_input(sends["openai_request"], np.asarray([doc], dtype=np.object_))],
                   "outputs": [grpcclient.InferRequestedOutput(o) for o in _READS["generate"]]}

        async def one_request():
            yield request

        # Decoupled: every reply is one response; the last one says so (openai_final).
        responses = self._client.stream_infer(one_request(), headers=self._openai_headers)
        try:
            while True:
                try:
                    result, error = await self._or_dead(responses.__anext__())
                except StopAsyncIteration:
                    break
                if error is not None:
                    raise self._error(error, param=None)
                final = bool(result.as_numpy("openai_final").reshape(-1)[0])
                text = result.as_numpy("openai_response").reshape(-1)[0].decode()
                yield OpenAIReply(int(result.as_numpy("openai_status").reshape(-1)[0]), text, final)
                if final:
                    return
        except InferenceServerException as e:
            raise self._error(e, param=None) from e
        finally:
            responses.cancel()  # closes the stream (also when the client went away mid-stream)
        raise UpstreamError(f"Triton model {self.name!r} ended the stream without a final response")

    async def _infer(self, inputs, outputs, *, param: str | None):
        """One unary KServe v2 infer call (non-decoupled models)."""
        try:
            return await self._or_dead(self._client.infer(
                self.name, inputs, outputs=[grpcclient.InferRequestedOutput(o) for o in outputs],
                headers=self._headers))
        except InferenceServerException as e:
            raise self._error(e, param=param) from e

    def _error(self, e: InferenceServerException, *, param: str | None) -> Exception:
        """The backend marks requests it refuses "invalid request: ..." (HTTP 400, naming
        ``param``); a dead stub is :class:`EngineUnavailable` (503); anything else is the
        server's fault (502)."""
        msg = e.message() or str(e)
        if "Stub process" in msg and "is not healthy" in msg:  # the engine died; the watch sees it soon
            return EngineUnavailable(f"Triton model {self.name!r}: {msg}")
        if (detail := refusal_of(msg)) is not None:
            return InvalidRequest(detail, param=param or refused_param(detail))
        return UpstreamError(f"Triton model {self.name!r}: {msg}")

    async def close(self) -> None:
        await self._client.close()
