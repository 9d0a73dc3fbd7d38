"""vLLM's own OpenAI serving layer, run over the engine that lives in our Triton backend.

The ``vllm`` backend (``runtime/engine/vllm_backend.py``) owns one ``LLMEngine`` stepped
by one thread. :class:`LoopEngineClient` gives that engine the surface of vLLM's ``EngineClient``
that ``OpenAIServingChat`` and ``OpenAIServingCompletion`` use (``generate``, ``abort``,
``model_config``, ``renderer``, ``input_processor``, ``errored``, ``check_admission``), so chat
templates, tool calls, logprobs, ``n``, ``echo``, context-length checks and every response
shape come from the same code as ``vllm serve`` in the same image (vLLM 0.32:
``vllm/entrypoints/openai/{chat_completion,completion}/serving.py``) instead of a copy of it.

:class:`OpenAIServer` answers one OpenAI request body (already audited by the frontend,
``runtime/frontend/protocol.py``) with a stream of :class:`Reply` items: one JSON body, or the
server-sent-event lines of a stream, each with the HTTP status vLLM chose.

Threads: vLLM's serving coroutines run on one asyncio loop in a thread of its own; the engine
thread hands each request's ``RequestOutput`` to that loop (``call_soon_threadsafe``). Nothing
here touches the engine directly: admission and abort go through the backend's queues.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modelops.io_contract import STRUCTURED_OUTPUTS_CONFIG

__all__ = ["Admission", "LoopEngineClient", "OpenAIServer", "Reply", "RequestLimits", "STRUCTURED_TOOL_PARSER",
           "ServingOptions", "cancelled_requests", "stream_replies"]

STRUCTURED_TOOL_PARSER = "hermes"
"""The parser vLLM is given when the manifest names none: only ``required`` and named
``tool_choice`` reach it, and those vLLM answers through structured outputs, not the parser."""


# The output budget the client asked for, as (field name, tokens), for the request being served
# on this task: vLLM clamps max_tokens to what the context leaves; we refuse instead.
_ASKED: contextvars.ContextVar[tuple[str, int] | None] = contextvars.ContextVar("modelops_asked", default=None)


@dataclass(frozen=True)
class RequestLimits:
    """The bounds one request gets on this engine (modelops/limits.py), resolved: ``tokens``
    (prompt tokens + n × max_tokens over its prompts), ``slots`` (sequences it may hold at once,
    ``share`` × ``max_num_seqs``). Both protocols ask it: OpenAI through :class:`_Budget`, KServe
    generate in the backend."""

    tokens: int
    slots: int
    share: float
    max_num_seqs: int

    @classmethod
    def of(cls, options: "ServingOptions", max_model_len: int, max_num_seqs: int) -> "RequestLimits":
        from modelops.limits import CONTEXTS_PER_REQUEST

        return cls(options.max_request_tokens or CONTEXTS_PER_REQUEST * max_model_len,
                   max(1, int(options.max_request_share * max_num_seqs)), options.max_request_share, max_num_seqs)

    def over_tokens(self, tokens: int, prompts: int, field: str) -> str:
        """Why ``tokens`` of work is refused ("" when it is within the bound)."""
        if tokens <= self.tokens:
            return ""
        over = f" over {prompts} prompts" if prompts > 1 else ""
        return (f"this request asks for {tokens} tokens of work (prompt tokens + n × {field}{over}); one request may "
                f"ask for at most {self.tokens} on this model (limits.max_request_tokens): lower {field} or n"
                f"{', or send fewer prompts' if prompts > 1 else ''}")

    def over_slots(self, n: int) -> str:
        """Why ``n`` sequences of one prompt are refused ("" when they fit)."""
        if n <= self.slots:
            return ""
        return (f"n={n} needs {n} of this engine's {self.max_num_seqs} sequence slots at once; one request may hold "
                f"at most {self.slots} (limits.max_request_share {self.share:g} × max_num_seqs {self.max_num_seqs}): "
                f"lower n")


def over_context(limit: int, prompt_tokens: int, field: str, asked: int) -> str:
    """Why ``prompt_tokens + asked`` does not fit a ``limit``-token context (naming the three
    numbers and ``field``, the request's output bound), or "" when it fits. vLLM's own server
    silently shortens the output instead; both protocols refuse with this."""
    if prompt_tokens + asked <= limit:
        return ""
    room = limit - prompt_tokens
    fix = f"lower {field} to at most {room}" if room > 0 else "shorten the prompt"
    return (f"this model's maximum context length is {limit} tokens; the prompt has {prompt_tokens} tokens and "
            f"{field} asks for {asked} more ({prompt_tokens + asked} in all): {fix}")


class _Budget:
    """One OpenAI request's share of the engine: every prompt's work is counted when vLLM's
    serving class creates its generator (all of them before the first runs: vLLM 0.32,
    ``OpenAIServingCompletion.create_completion``), checked before any reaches the engine, and
    the prompts wait for the request's own sequence slots."""

    def __init__(self, limits: RequestLimits) -> None:
        self.limits, self.tokens, self.prompts, self.in_use = limits, 0, 0, 0
        self._freed = asyncio.Event()

    def count(self, prompt_tokens: int, n: int, max_tokens: int) -> None:
        self.tokens += prompt_tokens + n * max_tokens
        self.prompts += 1

    def refusal(self, n: int, field: str) -> tuple[str, str] | None:
        """(message, field) when this request is over a bound, else None."""
        if why := self.limits.over_slots(n):
            return why, "n"
        if why := self.limits.over_tokens(self.tokens, self.prompts, field):
            return why, field
        return None

    async def hold(self, n: int) -> None:
        while self.in_use + n > self.limits.slots:  # one event loop: no lock needed between check and take
            self._freed.clear()
            await self._freed.wait()
        self.in_use += n

    def release(self, n: int) -> None:
        self.in_use -= n
        self._freed.set()


# The budget of the OpenAI request being served on this task (set by OpenAIServer._answer).
_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("modelops_budget", default=None)


@dataclass
class _Usage:
    """Tokens of one OpenAI request as its engine outputs count them, as vLLM's ``usage`` does:
    each prompt once (``len(prompt_token_ids)``), every choice's generated tokens."""

    prompt_tokens: int = 0
    completion_tokens: int = 0


# The usage of the OpenAI request being served on this task (set by OpenAIServer._answer).
_USAGE: contextvars.ContextVar[_Usage | None] = contextvars.ContextVar("modelops_usage", default=None)


@dataclass
class Admission:
    """One engine request as the engine thread admits it: ``prompt`` is a rendered
    ``EngineInput`` (or a plain prompt), ``deliver`` receives each ``RequestOutput``, ``fail``
    the exception that ended the request."""

    request_id: str
    prompt: Any
    params: Any
    deliver: Callable[[Any], None]
    fail: Callable[[BaseException], None]
    priority: int = 0
    prompt_text: str | None = None


class LoopEngineClient:
    """The part of vLLM's ``EngineClient`` protocol its OpenAI serving classes call.

    Args:
        engine: the ``vllm.v1.engine.llm_engine.LLMEngine`` (read-only here: configs, renderer).
        admit: called with an :class:`Admission`; the engine thread adds it to the engine.
        abort: called with a request id; the engine thread aborts it.
    """

    def __init__(self, engine, admit: Callable[[Admission], None], abort: Callable[[str], None]) -> None:
        self.vllm_config = engine.vllm_config
        self.model_config = engine.model_config
        self.renderer = engine.renderer
        self.input_processor = engine.input_processor
        self._admit, self._abort = admit, abort
        self.errored = False
        self.dead_error: BaseException = RuntimeError("the engine loop stopped")

    def check_admission(self, n: int = 1, request_id: str | None = None) -> None:
        """No queue caps here: Triton and the engine's scheduler queue the requests."""

    def generate(self, prompt, sampling_params, request_id: str, *, priority: int = 0,
                 prompt_text: str | None = None, **_ignored) -> AsyncIterator[Any]:
        """``RequestOutput`` items of one request until it finishes, as ``AsyncLLM.generate``
        yields them, except that with ``n`` > 1 and DELTA outputs each child's output is its own
        item (vLLM's stream generators loop over ``outputs`` either way). LoRA, tracing,
        data-parallel, KV-transfer and reasoning arguments are not used here (none is configured).

        A plain function, so the request's work is counted against its budget when the
        generator is made, before any of the request's generators runs.

        Raises (on iteration): ``VLLMValidationError`` when the prompt and the asked output
        exceed the context or the request is over its limits; whatever the engine raised."""
        budget, n = _BUDGET.get(), getattr(sampling_params, "n", 1) or 1
        if budget is not None:
            ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
            budget.count(len(ids or ()), n, getattr(sampling_params, "max_tokens", None) or 0)
        return self._generate(prompt, sampling_params, request_id, priority, prompt_text, budget, n)

    async def _generate(self, prompt, sampling_params, request_id: str, priority: int, prompt_text: str | None,
                        budget: "_Budget | None", n: int) -> AsyncIterator[Any]:
        from vllm.exceptions import VLLMValidationError

        self._check_context(prompt)
        if budget is not None:
            asked = _ASKED.get()
            if refused := budget.refusal(n, asked[0] if asked else "max_tokens"):
                raise VLLMValidationError(refused[0], parameter=refused[1])
            await budget.hold(n)  # a list's prompts take turns within the request's slots
        try:
            async for out in self._engine_outputs(prompt, sampling_params, request_id, priority, prompt_text):
                yield out
        finally:
            if budget is not None:
                budget.release(n)

    async def _engine_outputs(self, prompt, sampling_params, request_id: str, priority: int,
                              prompt_text: str | None) -> AsyncIterator[Any]:
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()
        self._admit(Admission(request_id, prompt, sampling_params,
                              deliver=lambda out: loop.call_soon_threadsafe(outputs.put_nowait, out),
                              fail=lambda exc: loop.call_soon_threadsafe(outputs.put_nowait, exc),
                              priority=priority, prompt_text=prompt_text))
        finished, usage, cumulative, prompt_counted = False, _USAGE.get(), {}, False
        replaces = usage is not None and _is_cumulative(sampling_params)
        try:
            while True:
                out = await outputs.get()
                if isinstance(out, BaseException):
                    finished = True
                    raise out
                finished = out.finished
                if usage is not None:
                    if not prompt_counted:  # once per prompt, as vLLM's usage (every child repeats it)
                        usage.prompt_tokens += len(out.prompt_token_ids or ())
                        prompt_counted = True
                    for o in out.outputs:  # DELTA and FINAL_ONLY pieces add up; CUMULATIVE ones replace
                        if replaces:
                            usage.completion_tokens += len(o.token_ids) - cumulative.get(o.index, 0)
                            cumulative[o.index] = len(o.token_ids)
                        else:
                            usage.completion_tokens += len(o.token_ids)
                yield out
                if finished:
                    return
        finally:
            if not finished:  # the client went away (or the coroutine was cancelled)
                self._abort(request_id)

    def _check_context(self, prompt) -> None:
        """Refuse ``prompt tokens + max_tokens > max_model_len`` naming the three numbers (vLLM's
        server silently shortens max_tokens to what is left)."""
        from vllm.exceptions import VLLMValidationError

        asked = _ASKED.get()
        ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
        if asked is None or ids is None:
            return
        field, tokens = asked
        if why := over_context(self.model_config.max_model_len, len(ids), field, tokens):
            raise VLLMValidationError(why, parameter=field)

    async def abort(self, request_id, internal: bool = False) -> None:
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            self._abort(rid)

    async def is_tracing_enabled(self) -> bool:
        return False


@dataclass(frozen=True)
class ServingOptions:
    """What ``vllm serve`` takes as flags, read from the package's ``<version>/serving.json``.

    ``served_model_name``: the OpenAI ``model`` (the model_id); ``chat_template``: a Jinja file
    in the package overriding the model's own, or None; ``tool_parser``: a vLLM tool-call
    parser name (``--tool-call-parser``; enables ``tool_choice: auto``), or None;
    ``max_request_tokens`` / ``max_request_share``: the per-request bounds (modelops.limits;
    None tokens: 4 × max_model_len).
    """

    served_model_name: str
    chat_template: str | None = None
    tool_parser: str | None = None
    max_request_tokens: int | None = None
    max_request_share: float = 0.5

    @classmethod
    def read(cls, path: Path) -> "ServingOptions":
        data = json.loads(path.read_text())
        template = data.get("chat_template")
        if template:
            template = (path.parent / template).read_text()
        return cls(data["served_model_name"], template or None, data.get("tool_parser") or None,
                   data.get("max_request_tokens"), data.get("max_request_share") or 0.5)


@dataclass(frozen=True)
class Reply:
    """One piece of an answer: ``status`` (HTTP), ``body`` (a JSON document, or one SSE
    ``data: ...`` event when ``stream``) and whether more pieces follow (``final``)."""

    status: int
    body: str
    stream: bool
    final: bool


class OpenAIServer:
    """vLLM's ``OpenAIServingChat`` and ``OpenAIServingCompletion`` over a
    :class:`LoopEngineClient`, on an asyncio loop of their own.

    Raises (at construction): ``ValueError`` when ``options.tool_parser`` is not one of vLLM's
    parsers (the message lists them).
    """

    def __init__(self, client: LoopEngineClient, model_dir: str, options: ServingOptions) -> None:
        self.options = options
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="openai-serving", daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._setup(client, model_dir), self.loop).result()

    async def _setup(self, client: LoopEngineClient, model_dir: str) -> None:
        from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
        from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
        from vllm.entrypoints.openai.models.protocol import BaseModelPath
        from vllm.entrypoints.openai.models.serving import OpenAIServingModels
        from vllm.renderers.online_renderer import OnlineRenderer

        opts = self.options
        if opts.tool_parser is not None:
            from vllm.tool_parsers import ToolParserManager

            known = sorted(ToolParserManager.list_registered())
            if opts.tool_parser not in known:
                raise ValueError(f"tool_parser {opts.tool_parser!r} is not a vLLM tool-call parser; use one of {known}")
        models = OpenAIServingModels(engine_client=client,
                                     base_model_paths=[BaseModelPath(name=opts.served_model_name, model_path=model_dir)])
        # tool_choice "required" and named functions are structured outputs (a JSON array of
        # {name, parameters}, or the function's parameters schema) that vLLM parses whatever the
        # parser; vLLM 0.32 still wants --enable-auto-tool-choice and a parser named for them, so
        # without the manifest's one they get a generic one. "auto" needs the model's own format:
        # _answer refuses it unless the manifest names the parser. Structural tags are off
        # (modelops.io_contract.VLLM_ENV), so required/named calls are the tools' JSON Schemas,
        # which guidance enforces; the strict level only matters where tags are on.
        auto_tools, strict = True, "parameter"
        parser = opts.tool_parser or STRUCTURED_TOOL_PARSER
        renderer = OnlineRenderer(model_config=client.model_config, renderer=client.renderer, request_logger=None,
                                  chat_template=opts.chat_template, chat_template_content_format="auto",
                                  enable_auto_tools=auto_tools, tool_parser=parser, tool_strict_level=strict)
        self.chat = OpenAIServingChat(client, models, "assistant", online_renderer=renderer, request_logger=None,
                                      chat_template=opts.chat_template, chat_template_content_format="auto",
                                      enable_auto_tools=auto_tools, tool_parser=parser, tool_strict_level=strict)
        self.completion = OpenAIServingCompletion(client, models, online_renderer=renderer, request_logger=None)
        self.has_chat_template = self._resolve_template(client) is not None
        self.limits = RequestLimits.of(opts, client.model_config.max_model_len,
                                       client.vllm_config.scheduler_config.max_num_seqs)
        self.max_model_len = client.model_config.max_model_len
        self._tokenizer, self._ll_tokenizer = client.renderer.get_tokenizer(), None
        self._vocab_size = client.model_config.get_vocab_size()
        from vllm.platforms import current_platform

        self._seed_unsafe = current_platform.is_cpu() and bool(
            client.vllm_config.scheduler_config.enable_chunked_prefill)

    def kserve_refusal(self, prompt: str, params: dict) -> str:
        """Why a KServe generate request (``text_input`` = ``prompt``, ``sampling_parameters`` =
        ``params``) is refused before it reaches the engine, or "": its ``n`` is not 1 (the response
        has one ``text_output``: more sequences would be generated and dropped), its
        ``max_tokens`` is not a whole number ≥ 1 or null, the prompt and ``max_tokens`` overflow
        the context (as the OpenAI routes refuse it), or it is over the request limits. A null
        ``max_tokens`` is the rest of the context, as the engine reads it."""
        n = params.get("n", 1)
        if n != 1 or isinstance(n, bool):
            return (f"sampling_parameters.n: {n!r} is not served over KServe generate (its response holds one "
                    "text_output): send n = 1, one request per sequence, or use the OpenAI API for n choices")
        asked = params.get("max_tokens", 16)  # vLLM SamplingParams' default
        if asked is not None and (not isinstance(asked, int) or isinstance(asked, bool) or asked < 1):
            return f"sampling_parameters.max_tokens: {asked!r} is not a whole number ≥ 1 (or null: the rest of the context)"
        prompt_tokens, limit = len(self._tokenizer.encode(prompt)), self.max_model_len
        if asked is not None and (why := over_context(limit, prompt_tokens, "sampling_parameters.max_tokens", asked)):
            return why
        work = prompt_tokens + (asked if asked is not None else max(0, limit - prompt_tokens))
        return self.limits.over_tokens(work, 1, "max_tokens")

    def kserve_structured(self, structured: dict) -> tuple[dict, "OutputCheck | None"]:
        """A KServe generate request's ``sampling_parameters.structured_outputs`` through the
        checks the OpenAI routes' ``response_format`` passes (runtime/engine/structured_outputs/): a
        ``json`` schema the grammar would not enforce as written is refused with the JSON pointer
        of the keyword, else it goes to the engine prepared as the OpenAI routes prepare it, and
        the answer gets the same check (:meth:`kserve_fault`). The other kinds (``regex``,
        ``choice``, ``grammar``...) go as they are, unchecked.

        Returns:
            ``(structured outputs for the engine, the check of the answer or None)``.

        Raises:
            ValueError: ``sampling_parameters.structured_outputs.json<pointer>: <why>``.
        """
        from runtime.engine.structured_outputs import OutputCheck, SchemaRefused, locate, prepare

        schema = structured.get("json")
        if schema is None:
            return structured, None
        if isinstance(schema, str):  # StructuredOutputsParams takes the schema as text too
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise ValueError(f"sampling_parameters.structured_outputs.json: not a JSON schema: {e}") from None
        try:
            prepared = prepare(schema, True)
            if refused := locate(prepared, self._compile_error):
                raise refused
        except SchemaRefused as e:
            raise ValueError(f"sampling_parameters.structured_outputs.json{e.pointer or ' (the root)'}: "
                             f"{e.reason}") from None
        return {**structured, "json": prepared}, OutputCheck(schema)

    def kserve_fault(self, check: "OutputCheck", text: str, finish_reason: str | None) -> str | None:
        """Why a finished KServe answer (``text``, its ``finish_reason``) must not be returned: it
        breaks the schema of its ``structured_outputs.json`` (counted and logged as the OpenAI
        routes' violations are, ``api="kserve"``); None when it may."""
        violation = check.check_choice({"index": 0, "finish_reason": finish_reason, "text": text})
        if violation is None:
            return None
        _violations().labels(self.options.served_model_name, "kserve", "schema" if violation.pointer else "json").inc()
        _log.error("kserve: structured output violation at schema %s: %s", violation.pointer or "(parse)",
                   violation.message)
        return violation.text()

    def _resolve_template(self, client: LoopEngineClient) -> str | None:
        from vllm.renderers.hf import resolve_chat_template

        try:
            return resolve_chat_template(client.renderer.get_tokenizer(), self.options.chat_template, None,
                                         model_config=client.model_config)
        except Exception:  # noqa: BLE001 - no template is an answer, not a failure
            return None

    def _check_engine_limits(self, body: dict) -> None:
        """Refuse what the engine would get wrong rather than refuse itself.

        * A ``vllm_xargs.constraint`` naming token ids beyond the model's vocabulary: vLLM's
          API-side check cannot see the vocabulary, and the engine would end the request at once
          (an empty 200).
        * ``seed`` where the engine prefills in chunks on the CPU: vLLM 0.32 rewinds a seeded
          request's generator after a partial prefill with ``Generator.set_offset``, which CPU
          generators do not have, and the engine dies ("CPU Generator does not use offset").
          Our backend turns chunked prefill off on the CPU unless the manifest turns it on.

        Raises: _Refused naming the field (``vllm_xargs`` or ``seed``)."""
        xargs = body.get("vllm_xargs")
        if isinstance(xargs, dict) and xargs.get("constraint") is not None:
            from modelops_native import ConstraintSpecError, compile_constraint, parse_spec

            from runtime.engine.logits.config import ROOT, constraint_spec

            try:
                parsed = parse_spec(constraint_spec(xargs), root=ROOT)
                if parsed.complete and parsed.max_token() >= self._vocab_size:
                    compile_constraint(parsed, self._vocab_size)  # raises naming the field
            except ConstraintSpecError as e:
                raise _Refused("vllm_xargs", str(e)) from None
        if body.get("seed") is not None and self._seed_unsafe:
            raise _Refused("seed", "seed cannot be honored on this CPU engine with chunked prefill on (vLLM 0.32 "
                                   "crashes rewinding a seeded CPU generator): leave seed out, or remove "
                                   "engine_args.enable_chunked_prefill from the manifest")

    def _compile_error(self, schema: Any) -> str:
        """llguidance's verdict on ``schema`` as the engine's guidance backend builds it (compact
        JSON, this model's tokenizer): "" when it compiles, else its error."""
        import llguidance
        import llguidance.hf

        if self._ll_tokenizer is None:
            self._ll_tokenizer = llguidance.hf.from_tokenizer(self._tokenizer)
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                schema, defaults={"whitespace_flexible": not STRUCTURED_OUTPUTS_CONFIG["disable_any_whitespace"]})
        except (ValueError, TypeError) as e:
            return str(e)
        return llguidance.LLMatcher.validate_grammar(grammar, self._ll_tokenizer)

    def serve(self, api: str, body: dict, emit: Callable[[Reply], None],
              cancelled: Callable[[], bool] = lambda: False,
              on_usage: Callable[[int, int], None] | None = None) -> None:
        """Answer ``body`` for ``api`` (``chat`` or ``completions``) on the serving loop; each
        :class:`Reply` goes to ``emit`` (from the loop's thread), the last with ``final``.
        ``cancelled`` is polled every 0.5 s: once true, the request is aborted in the engine.
        ``on_usage(prompt_tokens, completion_tokens)`` gets what the engine made of the request
        once it ends, answered or aborted (nothing when it made nothing)."""
        asyncio.run_coroutine_threadsafe(self._serve(api, body, emit, cancelled, on_usage), self.loop)

    async def _serve(self, api: str, body: dict, emit: Callable[[Reply], None], cancelled, on_usage=None) -> None:
        from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

        watch = asyncio.ensure_future(_cancel_when(cancelled, asyncio.current_task()))
        usage, counted = _Usage(), False

        def count() -> None:  # once, when the answer ends or the request does
            nonlocal counted
            if not counted and on_usage is not None and (usage.prompt_tokens or usage.completion_tokens):
                on_usage(usage.prompt_tokens, usage.completion_tokens)
            counted = True

        try:
            # aclosing: whatever ends this loop (a send that fails, a cancel) closes vLLM's
            # generators too, down to LoopEngineClient.generate, which aborts the engine request.
            async with contextlib.aclosing(self._answer(api, body, usage)) as replies:
                async for reply in replies:
                    if reply.final:
                        count()  # before the answer ends: a client that reads /metrics next sees it
                    emit(reply)
        except asyncio.CancelledError:
            # The client went away (LoopEngineClient.generate aborted the engine request); the
            # Triton request still gets its final response.
            _quietly(emit, Reply(499, "", stream=False, final=True))
        except Exception as e:  # noqa: BLE001 - every request gets an answer
            # Exceptions vLLM's routes leave to its FastAPI handlers: mapped to HTTP as they map them.
            err = create_error_response(e)
            _quietly(emit, Reply(err.error.code, err.model_dump_json(), stream=False, final=True))
        finally:
            if watch.done() and not watch.cancelled():  # it fired: the client went away (vLLM's unary
                # generators answer that cancellation with an error document instead of raising it)
                cancelled_requests().labels(self.options.served_model_name, "openai").inc()
            watch.cancel()
            count()  # a request whose client hung up: what the engine made of it

    async def _answer(self, api: str, body: dict, usage: _Usage) -> AsyncIterator[Reply]:
        from pydantic import ValidationError
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse
        from vllm.exceptions import VLLMValidationError

        if api == "chat" and body.get("tools") and body.get("tool_choice", "auto") == "auto" \
                and self.options.tool_parser is None:
            yield _error(400, "tool_choice 'auto' (the default when tools are given) needs the model's tool-call "
                              "format: set tool_parser in the manifest (a vLLM parser, e.g. hermes), or send "
                              "tool_choice 'required', 'none' or a named function", param="tool_choice")
            return
        if api == "chat" and not self.has_chat_template:
            yield _error(400, f"model {self.options.served_model_name!r} has no chat template, so chat requests "
                              "cannot be rendered; use /v1/completions, or set chat_template in the manifest",
                         param="messages")
            return
        try:
            body, check = _structured(body, self._compile_error)
            self._check_engine_limits(body)
        except _Refused as e:
            yield _error(400, str(e), param=e.param)
            return
        cls, handler = ((ChatCompletionRequest, self.chat.create_chat_completion) if api == "chat"
                        else (CompletionRequest, self.completion.create_completion))
        for field in ("max_completion_tokens", "max_tokens"):
            if isinstance(body.get(field), int):
                _ASKED.set((field, body[field]))
                break
        _BUDGET.set(_Budget(self.limits))
        _USAGE.set(usage)  # counted by LoopEngineClient.generate
        try:
            request = cls.model_validate(body)
        except VLLMValidationError as e:
            yield _error(400, str(e), param=getattr(e, "parameter", None))
            return
        except ValidationError as e:
            first = e.errors()[0]
            yield _error(400, f"{'.'.join(map(str, first['loc']))}: {first['msg']}",
                         param=".".join(map(str, first["loc"])) or None)
            return
        result = await handler(request, None)
        if isinstance(result, ErrorResponse):
            yield Reply(result.error.code, json.dumps(result.model_dump()), stream=False, final=True)
        elif hasattr(result, "model_dump_json"):
            text = result.model_dump_json()
            if fault := self._fault(api, check, json.loads(text), whole=True):
                yield fault
                return
            yield Reply(200, text, stream=False, final=True)
        else:  # an async generator of "data: ...\n\n" strings, ending with "data: [DONE]\n\n"
            async for reply in stream_replies(result, lambda doc: self._fault(api, check, doc, whole=False)):
                yield reply

    def _fault(self, api: str, check: "OutputCheck", doc: dict, whole: bool) -> Reply | None:
        """The error that replaces an answer (or stream chunk) that must not reach the client: a
        finish_reason OpenAI never sends (an engine abort or error: 500), or a finished
        structured output that breaks its schema (500, counted and logged with the pointer)."""
        for choice in doc.get("choices") or []:
            reason = choice.get("finish_reason")
            if reason not in _FINISH_REASONS:
                _log.error("%s choice %s ended with finish_reason %r: answered as an engine error", api,
                           choice.get("index", 0), reason)
                return _error(500, f"the engine ended choice {choice.get('index', 0)} without an answer "
                                   f"(finish_reason {reason!r})", "EngineError")
        violation = (check.check_document(doc) if whole else check.feed(doc)) if check.active else None
        if violation is None:
            return None
        _violations().labels(self.options.served_model_name, api,
                             "schema" if violation.pointer else "json").inc()
        _log.error("%s: structured output violation at schema %s in %s: %s", api, violation.pointer or "(parse)",
                   violation.where, violation.message)
        return _error(500, violation.text(), "StructuredOutputViolation")

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)


# finish_reason values OpenAI defines; None is a chunk that has not finished.
_FINISH_REASONS = (None, "stop", "length", "tool_calls", "content_filter")
_log = logging.getLogger("vllm.modelops.openai")  # vLLM's handler prints it in the Triton log
_VIOLATIONS = []
_CANCELLED = []


def _violations():
    """``modelops_structured_output_violations_total{model_id, api, kind}``: prometheus_client in
    vLLM's multiprocess directory, so the instance's merged /metrics shows it."""
    if not _VIOLATIONS:
        from prometheus_client import Counter

        _VIOLATIONS.append(Counter("modelops_structured_output_violations",
                                   "Finished structured outputs that broke their schema (answered as errors)",
                                   ["model_id", "api", "kind"]))
    return _VIOLATIONS[0]


async def stream_replies(events: AsyncIterator[str],
                         fault: Callable[[dict], Reply | None]) -> AsyncIterator[Reply]:
    """vLLM's server-sent events (``"data: ...\\n\\n"`` strings ending with ``data: [DONE]``) as
    :class:`Reply` items, each passed on as it comes: holding one back to mark the last as final
    would delay every token, the first included, by one engine step. ``[DONE]`` is the final one
    (an empty final reply when the events end without it). ``fault(event's JSON document)``: the
    error reply that replaces a chunk that must not reach the client, and ends the stream."""
    async for event in events:
        doc = event.removeprefix("data: ").strip()
        if doc.startswith("{") and (replaced := fault(json.loads(doc))):
            yield replaced  # and stop: aclosing ends vLLM's generator, which aborts the request
            return
        if doc == "[DONE]":
            yield Reply(200, event, stream=True, final=True)
            return
        yield Reply(200, event, stream=True, final=False)
    yield Reply(200, "", stream=True, final=True)


def _is_cumulative(sampling_params) -> bool:
    from vllm.sampling_params import RequestOutputKind

    return getattr(sampling_params, "output_kind", None) == RequestOutputKind.CUMULATIVE


def cancelled_requests():
    """``modelops_requests_cancelled_total{model_id, protocol}`` (protocol ``openai`` or
    ``kserve``): requests whose client went away before the answer ended, aborted in the engine.
    vLLM's own ``finished_reason="abort"`` count misses them: an abort from outside the engine
    core drops the request's state before its stats are taken (vLLM 0.32, OutputProcessor.abort_requests)."""
    if not _CANCELLED:
        from prometheus_client import Counter

        _CANCELLED.append(Counter("modelops_requests_cancelled",
                                  "Requests whose client went away before the answer ended (aborted in the engine)",
                                  ["model_id", "protocol"]))
    return _CANCELLED[0]


class _Refused(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _structured(body: dict, compile_error: Callable[[Any], str]) -> tuple[dict, "OutputCheck"]:
    """The body with every schema checked and prepared for the engine
    (runtime/engine/structured_outputs/), and the check its answers get. ``compile_error`` is the
    grammar backend's verdict on a prepared schema ("" when it compiles).

    Raises: _Refused naming the field and the schema's JSON pointer."""
    from runtime.engine.structured_outputs import OutputCheck, SchemaRefused, locate

    def prepare(schema, strict):
        from runtime.engine.structured_outputs import prepare as check

        out = check(schema, strict)
        if refused := locate(out, compile_error):
            raise refused
        return out

    content_schema, content_strict = None, True
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        spec = fmt.get("json_schema") or {}
        try:
            prepared = prepare(spec.get("schema"), spec.get("strict"))
        except SchemaRefused as e:
            raise _Refused("response_format.json_schema.schema", f"response_format.json_schema.schema{e}") from None
        body = {**body, "response_format": {**fmt, "json_schema": {**spec, "schema": prepared}}}
        content_schema, content_strict = spec.get("schema"), spec.get("strict") is not False
    elif isinstance(fmt, dict) and fmt.get("type") == "json_object":
        content_schema = {"type": "object"}
    tool_schemas, tool_strict = {}, set()
    if body.get("tools") and body.get("tool_choice") != "none":
        tools, names = [], set()
        for i, tool in enumerate(body["tools"]):
            fn = tool.get("function") or {}
            if fn.get("name") in names:
                raise _Refused(f"tools[{i}].function.name", f"tools[{i}].function.name {fn.get('name')!r} is "
                                                            "declared twice: tool names must be unique")
            names.add(fn.get("name"))
            if fn.get("parameters") is not None:
                try:
                    prepared = prepare(fn["parameters"], fn.get("strict"))
                except SchemaRefused as e:
                    raise _Refused(f"tools[{i}].function.parameters", f"tools[{i}].function.parameters{e}") from None
                tool_schemas[fn.get("name")] = fn["parameters"]
                if fn.get("strict") is not False:
                    tool_strict.add(fn.get("name"))
                tool = {**tool, "function": {**fn, "parameters": prepared}}
            tools.append(tool)
        body = {**body, "tools": tools}
    return body, OutputCheck(content_schema, content_strict, tool_schemas, tool_strict)


def _quietly(emit: Callable[[Reply], None], reply: Reply) -> None:
    try:
        emit(reply)
    except Exception:  # noqa: BLE001 - a gone client
        pass


async def _cancel_when(cancelled: Callable[[], bool], task: asyncio.Task) -> None:
    while True:
        await asyncio.sleep(0.5)
        if cancelled():
            task.cancel()
            return


def _error(status: int, message: str, err_type: str = "BadRequestError", param: str | None = None) -> Reply:
    # vLLM's ErrorResponse shape: {"error": {"message", "type", "param", "code"}}, code = HTTP status.
    return Reply(status, json.dumps({"error": {"message": message, "type": err_type, "param": param, "code": status}}),
                 stream=False, final=True)
