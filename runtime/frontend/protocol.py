"""OpenAI request schemas as this frontend accepts them.

Every field of the OpenAI request is either honored or rejected with HTTP 400 naming it:
the models declare exactly the fields that are honored and forbid every other one (an OpenAI
field this server does not implement, such as ``audio`` or ``best_of``, is refused like a typo).
What passes is handed as it came to vLLM's own serving classes in the backend. Source of the field lists: the OpenAI API reference (Embeddings, Completions,
Chat Completions) as modelled by the ``openai`` Python client's ``*CreateParams`` types.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, create_model, field_validator, model_validator

__all__ = ["ChatCompletionRequest", "CompletionRequest", "EmbeddingRequest", "RerankRequest", "ScoreRequest"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# Texts per request that an embedding endpoint takes (the frontend sends them to Triton in
# batches of the model's max_batch_size).
MAX_TEXTS = 2048


def _as_list(v: str | list[str]) -> list[str]:
    return [v] if isinstance(v, str) else v


def _texts(field: str, v: str | list[str]) -> list[str]:
    """One side of a score or rerank request (or embedding input) as a list, refused when empty,
    holding an empty string (as /v1/embeddings refuses them) or a text that is not valid Unicode
    (a lone surrogate escape such as \\ud800 parses as JSON but has no UTF-8 form)."""
    texts = _as_list(v)
    if not texts:
        raise ValueError(f"{field} must not be an empty list")
    for i, t in enumerate(texts):
        where = field if isinstance(v, str) else f"{field}[{i}]"
        if not t:
            raise ValueError(f"{field} must not contain empty strings ({where} is empty)")
        try:
            t.encode()
        except UnicodeEncodeError:
            raise ValueError(f"{where} is not valid Unicode (a lone surrogate escape); send UTF-8 text") from None
    return texts


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
        _texts("input", v)
        if isinstance(v, list) and len(v) > MAX_TEXTS:
            raise ValueError(f"input has {len(v)} items; at most {MAX_TEXTS} per request")
        return v


class ScoreRequest(_Strict):
    """POST /score and /v1/score: the similarity of text pairs, in the shape of vLLM 0.32's
    server (``vllm/entrypoints/pooling/scoring/protocol.py``: ``ScoreRequest``). The two sides
    come under one of the pair names vLLM takes (``text_1``/``text_2``, ``queries``/``documents``,
    ``queries``/``items``, ``data_1``/``data_2``), each a string or a list of strings, paired 1:1,
    1:N (the one first text against each second) or N:N (index by index). Multimodal content
    parts, vLLM's truncation fields and chat-template fields are refused (not honored here)."""

    model: str
    text_1: str | list[str] | None = None
    text_2: str | list[str] | None = None
    queries: str | list[str] | None = None
    documents: str | list[str] | None = None
    items: str | list[str] | None = None
    data_1: str | list[str] | None = None
    data_2: str | list[str] | None = None
    user: str | None = None

    _PAIRS: ClassVar[tuple[tuple[str, str], ...]] = (
        ("text_1", "text_2"), ("queries", "documents"), ("queries", "items"), ("data_1", "data_2"))
    _SIDES: ClassVar[tuple[str, ...]] = ("text_1", "text_2", "queries", "documents", "items", "data_1", "data_2")

    @field_validator(*_SIDES)
    @classmethod
    def _side(cls, v, info):
        if v is not None:
            _texts(info.field_name, v)
        return v

    @model_validator(mode="after")
    def _one_pair(self) -> "ScoreRequest":
        given = [f for f in self._SIDES if getattr(self, f) is not None]
        pairs = [(a, b) for a, b in self._PAIRS if a in given and b in given]
        if len(pairs) != 1 or len(given) != 2:
            partner = {"text_1": "text_2", "text_2": "text_1", "queries": "documents or items", "documents": "queries",
                       "items": "queries", "data_1": "data_2", "data_2": "data_1"}
            hint = f"{given[0]} needs {partner[given[0]]}; " if len(given) == 1 else ""
            raise ValueError(f"{hint}give exactly one pair of sides: text_1 and text_2, queries and documents, "
                             f"queries and items, or data_1 and data_2 (got {', '.join(given) or 'none'})")
        (first, second), = pairs  # each side was checked by _side
        one, two = _as_list(getattr(self, first)), _as_list(getattr(self, second))
        if len(one) > 1 and len(one) != len(two):
            raise ValueError(f"{first} has {len(one)} texts and {second} {len(two)}: pairs are 1:1, 1:N or N:N")
        if len(one) + len(two) > MAX_TEXTS:
            raise ValueError(f"{first} and {second} hold {len(one) + len(two)} texts; at most {MAX_TEXTS} per request "
                             "(both sides together)")
        return self

    @property
    def pair(self) -> tuple[str, str]:
        """The names of the two fields the request used, e.g. ``("text_1", "text_2")``."""
        return next((a, b) for a, b in self._PAIRS if getattr(self, a) is not None and getattr(self, b) is not None)

    def sides(self) -> tuple[list[str], list[str]]:
        """``(first side, second side)`` as lists (1 or N first texts, N second texts)."""
        first, second = self.pair
        return _as_list(getattr(self, first)), _as_list(getattr(self, second))


class RerankRequest(_Strict):
    """POST /rerank and /v1/rerank: ``documents`` ordered by relevance to ``query``, in the
    shape of vLLM 0.32's server (Jina AI's rerank API): the ``top_n`` best (0: all). The
    rerank APIs' ``return_documents`` (default true, as vLLM always answers) set false leaves
    each result's ``document`` out."""

    model: str
    query: str = Field(min_length=1)
    documents: str | list[str]
    top_n: int = Field(default=0, ge=0)
    return_documents: bool = True
    user: str | None = None

    @field_validator("documents")
    @classmethod
    def _documents(cls, v):
        texts = _texts("documents", v)
        if len(texts) + 1 > MAX_TEXTS:
            raise ValueError(f"documents has {len(texts)} texts; at most {MAX_TEXTS - 1} per request")
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
    """``text``, ``json_object`` or ``json_schema``; vLLM turns the JSON ones into structured
    outputs (``json_object=True`` / ``json=<schema>``, RUNTIME_NOTES.md)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("type json_schema needs json_schema.schema (a JSON Schema object)")
        return self


# Fields an LLM router in front of the instances adds to every generate request it forwards
# (vllm-router 0.1.17, of SGLang's router lineage, seen here), each at the value that means "as if
# absent": no reasoning parser runs, stop strings are trimmed and special tokens skipped as vLLM
# does by default, no hidden states are returned. At that value a field is honoured by doing
# nothing and never forwarded; any other value is refused naming the field and the value taken.
ROUTER_DEFAULTS: dict[str, Any] = {"no_stop_trim": False, "skip_special_tokens": True, "separate_reasoning": True,
                                   "stream_reasoning": True, "include_reasoning": True,
                                   "return_hidden_states": False}

def _a_bool(value: Any) -> Any:
    # Literal[True] alone takes 1 (1 == True): these fields take JSON true/false only.
    if value is not None and not isinstance(value, bool):
        raise ValueError("must be true or false")
    return value


_RouterDefaults = create_model(
    "_RouterDefaults", __base__=_Strict,
    **{name: (Annotated[Literal[value] | None, BeforeValidator(_a_bool)], Field(default=None, exclude=True))
       for name, value in ROUTER_DEFAULTS.items()})


class _Sampling(_RouterDefaults):
    """Fields shared by completions and chat completions. Every field here is honored (by vLLM's
    own serving classes in the backend, runtime/engine/openai_engine.py); fields of the OpenAI schema
    that are not declared are refused (extra="forbid"); :data:`ROUTER_DEFAULTS` are taken at their
    default value only, and not forwarded."""

    model: str
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=128)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    stream: bool | None = False  # null: not streamed (OpenAI's and vLLM's schemas allow it)
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's sampling extensions (vLLM's OpenAI server accepts them in the same body).
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0, le=2)
    min_tokens: int | None = Field(default=None, ge=0)
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = Field(default=None, max_length=256)  # token ids that end the answer
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

    # Honored by the frontend itself (logged), unknown to vLLM's request types.
    FRONTEND_ONLY: ClassVar[frozenset[str]] = frozenset()

    def body(self) -> dict[str, Any]:
        """The request as vLLM's server takes it: the fields the client set, nothing added."""
        return {k: v for k, v in self.model_dump(exclude_unset=True, by_alias=True, mode="json").items()
                if k not in self.FRONTEND_ONLY}


class CompletionRequest(_Sampling):
    """POST /v1/completions (``stream: true`` answers with server-sent events). ``prompt`` is a
    string, a list of strings, a list of token ids or a list of those: one choice per prompt
    (times ``n``); ``max_tokens: 0`` with ``echo`` and ``logprobs`` scores the prompt only."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=None, ge=0)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    # vLLM's extension (not in OpenAI's completions API): structured outputs without a chat template.
    response_format: ResponseFormat | None = None

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, v):
        if isinstance(v, list) and (not v or any(isinstance(x, list) and not x for x in v)):
            raise ValueError("prompt must not be an empty list")
        if isinstance(v, list) and len(v) > 2048:
            raise ValueError(f"prompt has {len(v)} items; at most 2048 per request")
        return v


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str  # a JSON document, as OpenAI sends it


class ToolCall(_Strict):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Strict):
    """One message: ``content`` as a string or text parts; an assistant turn may carry
    ``tool_calls`` (then content may be null); a ``tool`` message answers ``tool_call_id``."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _shape(self) -> "ChatMessage":
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (null only for an assistant message with tool_calls)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls belong to assistant messages, not {self.role!r}")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id (the id of the call it answers)")
        return self


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions (``stream: true`` answers with server-sent events). The prompt
    is the model's chat template (or the manifest's ``chat_template``) rendered by vLLM."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    response_format: ResponseFormat | None = None
    safety_identifier: str | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's chat extensions.
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None

    FRONTEND_ONLY: ClassVar[frozenset[str]] = frozenset({"safety_identifier"})

    @model_validator(mode="after")
    def _consistent(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = {t.function.name for t in self.tools or []}
            if self.tool_choice.function.name not in names:
                raise ValueError(f"tool_choice names function {self.tool_choice.function.name!r}, which is not "
                                 f"in tools ({sorted(names) or 'none given'})")
        elif self.tool_choice in ("auto", "required") and not self.tools:
            raise ValueError(f"tool_choice {self.tool_choice!r} needs tools")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        return self
