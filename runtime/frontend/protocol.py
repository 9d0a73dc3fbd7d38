"""OpenAI request schemas as this frontend accepts them.

Every field of the OpenAI request is either honored or rejected with HTTP 400 naming it:
the models declare exactly the fields that are honored and forbid every other one (an OpenAI
field this server does not implement, such as ``tools`` or ``logprobs``, is refused like a typo). Source of the field lists: the OpenAI API reference (Embeddings, Completions,
Chat Completions) as modelled by the ``openai`` Python client's ``*CreateParams`` types.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

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


class StreamOptions(_Strict):
    include_usage: bool = False
    include_obfuscation: bool = False  # a side-channel mitigation of OpenAI's; nothing to obfuscate here


class JSONSchemaFormat(_Strict):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """``text``, ``json_object`` or ``json_schema``; the JSON ones become vLLM structured outputs."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("type json_schema needs json_schema.schema (a JSON Schema object)")
        return self

    def structured_outputs(self) -> dict[str, Any] | None:
        """``StructuredOutputsParams`` fields (RUNTIME_NOTES.md: json_object → ``json_object=True``,
        json_schema → ``json=<schema>``), or None for plain text."""
        if self.type == "json_object":
            return {"json_object": True}
        if self.type == "json_schema":
            return {"json": self.json_schema.schema_}
        return None


class _Sampling(_Strict):
    """Fields shared by completions and chat completions. Every field here is honored; fields of
    the OpenAI schema that are not declared are refused (extra="forbid")."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: Literal[1] = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extension: per-request arguments for logits processors (SamplingParams.extra_args).
    vllm_xargs: dict[str, Any] | None = None

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, v):
        if v is None:
            return v
        for key, bias in v.items():
            if not key.lstrip("-").isdigit() or int(key) < 0:
                raise ValueError(f"keys must be token ids, got {key!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"bias for token {key} must be in [-100, 100], got {bias}")
        return v

    @field_validator("stream_options")
    @classmethod
    def _only_with_stream(cls, v, info):
        if v is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed with stream: true")
        return v

    def sampling_params(self) -> dict[str, Any]:
        """The ``vllm.SamplingParams`` fields this request sets (JSON-serializable)."""
        sp: dict[str, Any] = {}
        for name in ("max_tokens", "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value is not None:
                sp[name] = value
        if self.stop is not None:
            sp["stop"] = [self.stop] if isinstance(self.stop, str) else self.stop
        if self.logit_bias:
            sp["logit_bias"] = {int(k): v for k, v in self.logit_bias.items()}
        if self.vllm_xargs is not None:
            sp["extra_args"] = self.vllm_xargs
        return sp


class CompletionRequest(_Sampling):
    """POST /v1/completions (``stream: true`` answers with server-sent events)."""

    prompt: str
    echo: bool = False

    def sampling_params(self) -> dict[str, Any]:
        sp = super().sampling_params()
        sp.setdefault("max_tokens", 16)  # the completions API's documented default
        return sp


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions (text content; ``stream: true`` answers with server-sent events)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    response_format: ResponseFormat | None = None
    safety_identifier: str | None = None

    def sampling_params(self) -> dict[str, Any]:
        sp = super().sampling_params()
        # Chat has no 16-token default (that is the legacy completions API's): without a limit
        # the answer may use the rest of the context, as in OpenAI's and vLLM's servers.
        sp["max_tokens"] = self.max_completion_tokens or self.max_tokens
        if sp["max_tokens"] is None:
            del sp["max_tokens"]
        if self.response_format is not None and (so := self.response_format.structured_outputs()) is not None:
            sp["structured_outputs"] = so
        return sp
