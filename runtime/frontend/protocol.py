"""OpenAI request schemas as this frontend accepts them.

Every field of the OpenAI request is either honored or rejected with HTTP 400 naming it:
the models forbid unknown fields, and fields the engine cannot honor here are validated to
their no-op value. Source of the field lists: the OpenAI API reference (Embeddings, Completions,
Chat Completions) as modelled by the ``openai`` Python client's ``*CreateParams`` types.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = ["ChatCompletionRequest", "CompletionRequest", "EmbeddingRequest"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EmbeddingRequest(_Strict):
    """POST /v1/embeddings."""

    model: str
    # Token-id inputs (list[int], list[list[int]]) are valid OpenAI input; they are parsed so that
    # the refusal can say what is unsupported instead of a type error.
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, gt=0)
    user: str | None = None

    @field_validator("input")
    @classmethod
    def _text_only(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("input must not be an empty list")
        if isinstance(v, list) and not all(isinstance(x, str) for x in v):
            raise ValueError("token-id input is not supported by this server; send text (a string or list of strings)")
        if isinstance(v, list) and len(v) > 2048:
            raise ValueError(f"input has {len(v)} items; at most 2048 per request")
        return v


class _Sampling(_Strict):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: Literal[1] = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    stream: Literal[False] = False
    user: str | None = None

    def sampling_params(self) -> dict[str, Any]:
        """The ``vllm.SamplingParams`` fields this request sets (JSON-serializable)."""
        sp: dict[str, Any] = {}
        for name in ("max_tokens", "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value is not None:
                sp[name] = value
        if self.stop is not None:
            sp["stop"] = [self.stop] if isinstance(self.stop, str) else self.stop
        sp.setdefault("max_tokens", 16)
        return sp


class CompletionRequest(_Sampling):
    """POST /v1/completions (non-streaming; ``stream: true`` is refused with 400)."""

    prompt: str
    echo: bool = False


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = None


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions (non-streaming, text content only)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def sampling_params(self) -> dict[str, Any]:
        sp = super().sampling_params()
        if self.max_completion_tokens is not None:
            sp["max_tokens"] = self.max_completion_tokens
        return sp
