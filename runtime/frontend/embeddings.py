"""The embedding model's OpenAI routes: ``/v1/embeddings``, ``/score`` and ``/rerank`` (each also
under ``/v1``), answered from Triton embed calls; scores are cosine similarities, as vLLM scores
with an embedding model."""

from __future__ import annotations

import asyncio
import base64
import time
import uuid

import numpy as np
from fastapi import APIRouter, Request

from modelops.shadow import SHADOW_HEADER
from runtime.frontend.disconnect import until_disconnect
from runtime.frontend.errors import InvalidRequest
from runtime.frontend.protocol import EmbeddingRequest, RerankRequest, ScoreRequest
from runtime.frontend.served import Served
from runtime.frontend.usage import KEY_HEADER

__all__ = ["embedding_routes"]


def embedding_routes(served: Served) -> APIRouter:
    """The routes of :mod:`this module <runtime.frontend.embeddings>` for ``served``'s model (a
    model of another task answers them with a 400 naming ``model``)."""
    router = APIRouter()

    @router.post("/v1/embeddings")
    async def embeddings(req: EmbeddingRequest, request: Request) -> dict:
        started = time.monotonic()
        served.check_model(req.model, "embed")
        served.log_user("embeddings", req.user)
        texts = [req.input] if isinstance(req.input, str) else req.input  # non-empty texts (protocol.py)
        out = await until_disconnect(request, served.triton.embed(texts))
        dim = out.vectors.shape[1]
        if req.dimensions is not None and req.dimensions != dim:
            raise InvalidRequest(f"dimensions={req.dimensions} is not supported: this model returns {dim}",
                                 "dimensions")
        data = []
        for i, vec in enumerate(out.vectors):
            emb = base64.b64encode(vec.astype("<f4").tobytes()).decode() if req.encoding_format == "base64" \
                else vec.tolist()
            data.append({"object": "embedding", "index": i, "embedding": emb})
        tokens = int(sum(out.prompt_tokens))
        served.usage.record(request.headers.get(KEY_HEADER), tokens)
        if request.headers.get(SHADOW_HEADER):
            served.mirror.offer(request.headers[SHADOW_HEADER], "embeddings",
                         req.model_dump(exclude_unset=True, by_alias=True, mode="json"), out.vectors.tolist(), started)
        return {"object": "list", "data": data, "model": served.model_id,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def _scores(first: list[str], second: list[str], params: tuple[str, str]) -> tuple[list[float], int]:
        """The cosine similarity of each pair (one first text against every second one, or
        index by index) and the prompt tokens of all texts, each embedded once: what vLLM 0.32
        computes for an embedding model (vllm/entrypoints/pooling/scoring/io_processor.py,
        BiEncoderIOProcessor: torch cosine_similarity of the pooled embeddings). The sides go
        as two concurrent calls (Triton batches them together), so a refusal (a text over the
        context) names its side's field, ``params``."""
        one, two = await asyncio.gather(served.triton.embed(first, param=params[0]),
                                        served.triton.embed(second, param=params[1]))
        a, b = one.vectors.astype(np.float64), two.vectors.astype(np.float64)
        if len(a) == 1:
            a = np.repeat(a, len(b), axis=0)
        norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
        return ((a * b).sum(axis=1) / np.maximum(norms, 1e-8)).tolist(), int(sum(one.prompt_tokens + two.prompt_tokens))

    @router.post("/score")
    @router.post("/v1/score")
    async def score(req: ScoreRequest, request: Request) -> dict:
        served.check_model(req.model, "embed")
        served.log_user("score", req.user)
        first, second = req.sides()
        scores, tokens = await until_disconnect(request, _scores(first, second, req.pair))
        served.usage.record(request.headers.get(KEY_HEADER), tokens)
        # vLLM's ScoreResponse with its UsageInfo, every key as vLLM dumps it.
        return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                "model": served.model_id,
                "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                          "prompt_tokens_details": None, "completion_tokens_details": None}}

    @router.post("/rerank")
    @router.post("/v1/rerank")
    async def rerank(req: RerankRequest, request: Request) -> dict:
        served.check_model(req.model, "embed")
        served.log_user("rerank", req.user)
        documents = [req.documents] if isinstance(req.documents, str) else req.documents
        scores, tokens = await until_disconnect(request, _scores([req.query], documents, ("query", "documents")))
        served.usage.record(request.headers.get(KEY_HEADER), tokens)
        results = [{"index": i, **({"document": {"text": d, "multi_modal": None}} if req.return_documents else {}),
                    "relevance_score": s} for i, (d, s) in enumerate(zip(documents, scores))]
        results.sort(key=lambda r: r["relevance_score"], reverse=True)  # stable: ties keep input order, as vLLM's
        return {"id": f"score-{uuid.uuid4().hex}", "model": served.model_id,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                "results": results[:req.top_n] if req.top_n else results}

    return router
