"""Triton Python-based backend ``vllm``: runs a vLLM engine inside the Python backend stub.

A model whose config.pbtxt says ``backend: "vllm"`` loads this file (from
``<backend-directory>/vllm/model.py``). Engine args come from the sibling ``<version>/model.json``;
the I/O tensors are declared in ``auto_complete_config`` from ``modelops/io_contract.py`` (the
table the frontend builds its requests from), so a package holds no tensor spec:

- task ``embed`` (vLLM pooling runner; one response per request; Triton's dynamic batcher hands
  concurrent requests to one ``execute``, embedded in one engine call): ``max_batch_size`` 64,
  ``text_input`` BYTES [1] → ``embedding`` FP32 [-1], ``num_input_tokens`` INT32 [1] (shapes
  [n, 1] → [n, dim], [n, 1] for a request of n texts)
- task ``generate`` (decoupled: a stream of responses per request), two kinds of request:

  * from the OpenAI frontend: ``openai_request`` BYTES [1], JSON ``{"api": "chat"|"completions",
    "body": {...}}`` → one response per reply of vLLM's own serving classes
    (``runtime/engine/openai_engine.py``): ``openai_response`` BYTES [1] (a JSON document, or one
    server-sent event of a stream), ``openai_status`` INT32 [1] (its HTTP status),
    ``openai_final`` BOOL [1];
  * from KServe clients (Triton's vLLM-backend tensors): ``text_input`` BYTES [1], optional
    ``sampling_parameters`` BYTES [1] (JSON of ``vllm.SamplingParams`` fields;
    ``structured_outputs`` is a JSON object of ``StructuredOutputsParams`` fields, ``extra_args``
    reaches logits processors), optional ``exclude_input_in_output`` BOOL [1], optional
    ``stream`` BOOL [1] → ``text_output`` BYTES [-1], ``finish_reason`` BYTES [-1],
    ``num_input_tokens`` INT32 [1], ``num_output_tokens`` INT32 [1]. With ``stream`` each
    response carries the new text since the previous one; otherwise one response carries all of
    it. The last response of a request is the one with a non-empty ``finish_reason``.

Generation runs on one ``vllm.v1.engine.llm_engine.LLMEngine`` (the V0 ``LLMEngine`` on vLLM
< 0.7, where the KServe path works and the OpenAI API is refused) in this process, stepped by a
background thread: requests of both kinds join the running batch (continuous batching); each
request's outputs go back through its response sender (KServe) or to vLLM's serving coroutines
(OpenAI). The task is read from the config parameter ``task``. Errors are returned per request.
"""

# First: the serving image's sys.path and locale (runtime/engine/stub_prelude.py, copied beside
# triton_python_backend_utils.py by runtime/startup.py).
import modelops_stub_prelude  # noqa: F401, I001

import hmac
import inspect
import json
import os
import queue
import re
import threading
import time
import uuid
from collections import OrderedDict
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from modelops.io_contract import (CONTRACTS, DECOUPLED, FRONTEND_TOKEN_ENV, FRONTEND_TOKEN_HEADER, KSERVE_TENSORS,
                                  MAX_BATCH, VLLM_CPU_ENV, VLLM_ENV, engine_error, invalid_request)
from modelops.tenancy import KEY_NAME_PATTERN
from runtime.engine.api_key import KeyCounters, parameter_pairs, request_parameters

# Declared from the table the frontend builds its requests from (modelops/io_contract.py), plus
# the text tensors KServe clients use.
_IO = {task: ([t.as_config() for t in sends + KSERVE_TENSORS[task][0]],
              [t.as_config() for t in reads + KSERVE_TENSORS[task][1]])
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
        task = _task_of(config)
        auto_complete_model_config.set_max_batch_size(MAX_BATCH[task])
        if MAX_BATCH[task]:
            auto_complete_model_config.set_dynamic_batching()  # concurrent requests → one engine call
        if DECOUPLED[task]:
            auto_complete_model_config.set_model_transaction_policy({"decoupled": True})
        return auto_complete_model_config

    def initialize(self, args):
        self._setup_config(args)
        self._setup_engine()

    def _setup_config(self, args):
        self.model_config = json.loads(args["model_config"])
        self.task = _task_of(self.model_config)
        self._version_dir = os.path.join(args["model_repository"], args["model_version"])
        self._model_name = args["model_name"]
        path = os.path.join(self._version_dir, "model.json")
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
        # Answers per API key: KServe's (the router's vouched-for key) and the OpenAI frontend's (its key field).
        self._key_usage = KeyCounters(lambda message: self.logger.log_warn(f"vllm backend: {message}"))

    def _setup_engine(self):
        # The engine runs in this process: the stub is an embedding host (RUNTIME_NOTES.md).
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        for key, value in VLLM_ENV.items():  # before vLLM's tool parsers are imported
            os.environ.setdefault(key, value)
        # Imported from their defining modules so `modelops image plan` can check them
        # statically against any vLLM release's source (the package root resolves lazily).
        # The fallbacks keep the backend on every Triton release whose official backend runs
        # (vLLM 0.5.5 in 24.10 on); `except ImportError` tells the check which is optional.
        from vllm.engine.arg_utils import EngineArgs
        from vllm.entrypoints.llm import LLM
        from vllm.sampling_params import SamplingParams
        from vllm.platforms import current_platform
        from vllm.version import __version__

        try:  # vLLM ≥ 0.7: the V1 engine
            from vllm.v1.engine.llm_engine import LLMEngine
        except ImportError:  # 0.5/0.6: the V0 engine steps the same way (add_request, step, abort_request)
            from vllm.engine.llm_engine import LLMEngine
        try:  # vLLM ≥ 0.6.3: outputs as deltas or final only; before, every step's output is cumulative
            from vllm.sampling_params import RequestOutputKind
        except ImportError:
            RequestOutputKind = None
        try:  # vLLM ≥ 0.11
            from vllm.sampling_params import StructuredOutputsParams as Structured
            structured_field = "structured_outputs"
        except ImportError:
            try:  # 0.6.3-0.11: the same constraints under their older name
                from vllm.sampling_params import GuidedDecodingParams as Structured
                structured_field = "guided_decoding"
            except ImportError:  # 0.5: none (requests that ask are refused)
                Structured, structured_field = None, None

        if current_platform.is_cpu():  # read when the model compiles, after these imports
            for key, value in VLLM_CPU_ENV.items():
                os.environ.setdefault(key, value)
        args = dict(self.engine_args)
        if self.task != "embed" and current_platform.is_cpu() and \
                not {"enable_chunked_prefill", "max_num_batched_tokens"} & set(args):
            # vLLM 0.32 on the CPU crashes on a seeded request prefilled in chunks (it rewinds
            # the request's generator with set_offset, which CPU generators lack): whole prompts
            # only, unless the manifest asks (then runtime/engine/openai_engine.py refuses seed).
            args["enable_chunked_prefill"] = False
        # Logged once every default is in: what the engine is given.
        self.logger.log_info(f"vllm backend: starting vLLM {__version__} ({self.task}) with {args}")
        self.sampling_params_cls = SamplingParams
        self._vllm_version = __version__
        if self.task == "embed":
            self.llm = LLM(**args)
            try:
                self._embed_texts = self.llm.embed  # vLLM ≥ 0.7
            except AttributeError:
                self._embed_texts = self.llm.encode  # 0.5/0.6: the same outputs under encode
            return
        self._structured_cls, self._structured_field, self._output_kind = Structured, structured_field, RequestOutputKind
        if isinstance(args.get("structured_outputs_config"), dict):  # EngineArgs takes the dataclass only
            try:
                from vllm.config.structured_outputs import StructuredOutputsConfig
            except ImportError:
                raise pb_utils.TritonModelException(
                    f"engine arg structured_outputs_config needs vLLM ≥ 0.11; this image has {__version__} "
                    "(use guided_decoding_backend there)") from None
            args["structured_outputs_config"] = StructuredOutputsConfig(**args["structured_outputs_config"])
        self.engine = LLMEngine.from_engine_args(EngineArgs(**args))
        # Keywords of add_request this release takes (priority: 0.6.3+, prompt_text: 0.11.1+).
        accepted = inspect.signature(LLMEngine.add_request).parameters
        self._add_keywords = tuple(k for k in ("priority", "prompt_text") if k in accepted)
        # Filled by Triton's execute thread and the OpenAI serving thread; only the engine thread
        # reads them and touches the engine, _live and _early_aborts.
        self._pending = queue.Queue()  # _KServeRequest | Admission to add
        self._aborts = queue.Queue()  # request ids to abort
        self._live = {}  # request id → _KServeRequest | Admission
        self._early_aborts = OrderedDict()  # aborts that overtook their admission (bounded)
        self._stop = threading.Event()
        # Touched between engine steps: the frontend reads its age as the loop's progress
        # (runtime/frontend/engine_watch.py; a wedged loop turns /ready to 503).
        self._heartbeat, self._beat_at = os.environ.get("MODELOPS_ENGINE_HEARTBEAT"), 0.0
        self._cancel_counter = None  # modelops_requests_cancelled_total, made on first use
        self._loop = threading.Thread(target=self._engine_loop, name="vllm-engine", daemon=True)
        self._loop.start()
        self._setup_openai()

    def _setup_openai(self):
        """vLLM's own OpenAI serving classes over this engine (runtime/engine/openai_engine.py), for
        the frontend's ``openai_request`` tensor: chat templates, tools, logprobs, n, echo."""
        self.openai = None
        try:
            from runtime.engine.openai_engine import LoopEngineClient, OpenAIServer, ServingOptions
        except ImportError as e:  # vLLM's serving classes moved: KServe generate still works
            self._openai_missing = f"the OpenAI API is not available on vLLM {self._vllm_version}: {e}"
            self.logger.log_warn(f"vllm backend: {self._openai_missing}")
            return

        path = os.path.join(self._version_dir, "serving.json")
        try:
            # A package sealed before serving.json existed: the Triton model is named after the model_id.
            options = ServingOptions.read(Path(path)) if os.path.exists(path) else \
                ServingOptions(self.engine_args.get("served_model_name") or self._model_name)
            client = LoopEngineClient(self.engine, self._pending.put, self._aborts.put)
            self.openai = OpenAIServer(client, self.engine_args["model"], options)
        except (OSError, ValueError, KeyError) as e:
            raise pb_utils.TritonModelException(f"{path}: {e}") from e
        self.logger.log_info(f"vllm backend: OpenAI serving as {options.served_model_name!r}, chat template "
                             f"{'found' if self.openai.has_chat_template else 'missing (chat is refused)'}, "
                             f"tool parser {options.tool_parser or 'none'}; one request may ask for "
                             f"{self.openai.limits.tokens} tokens and hold {self.openai.limits.slots} of "
                             f"{self.openai.limits.max_num_seqs} sequence slots")

    def execute(self, requests):
        return self._embed(requests) if self.task == "embed" else self._generate(requests)

    # -- embed -----------------------------------------------------------------------------
    def _embed(self, requests):
        responses, keys = [None] * len(requests), [None] * len(requests)
        texts, owners = [], []
        for r, request in enumerate(requests):
            try:
                items = [_text(t) for t in pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy().reshape(-1)]
                if not items:
                    raise ValueError("text_input is empty")
                unread, keys[r] = request_parameters(request)
                if unread:  # e.g. generate's max_tokens sent to an embedding model
                    raise ValueError(f"parameters.{sorted(unread)[0]}: an embedding model reads no parameters "
                                     "(it embeds text_input as it is); send text_input alone")
            except ValueError as e:
                responses[r] = _error_response(e)
                continue
            texts.extend(items)
            owners.extend([r] * len(items))
        if not texts:
            return responses
        try:
            outs = self._embed_texts(texts, use_tqdm=False)
        except Exception as e:
            if len(set(owners)) == 1:
                responses[owners[0]] = _error_response(e)
                return responses
            # One bad request (e.g. too long) fails the whole engine call: serve each on its own.
            for r in sorted(set(owners)):
                responses[r] = self._embed_one([t for t, o in zip(texts, owners) if o == r], keys[r])
            return responses
        grouped = {}
        for r, out in zip(owners, outs):
            grouped.setdefault(r, []).append(out)
        for r, group in grouped.items():
            responses[r] = _embedding_response(group)
            self._key_usage.count(keys[r], sum(len(o.prompt_token_ids) for o in group))
        return responses

    def _embed_one(self, texts, key):
        try:
            outs = self._embed_texts(texts, use_tqdm=False)
        except Exception as e:
            return _error_response(e)
        self._key_usage.count(key, sum(len(o.prompt_token_ids) for o in outs))
        return _embedding_response(outs)

    # -- generate (decoupled) -----------------------------------------------------------------
    def _generate(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            openai = pb_utils.get_input_tensor_by_name(request, "openai_request")
            if openai is not None:
                if _from_frontend(request):
                    self._serve_openai(openai, sender)
                else:  # a KServe client's: it would skip the frontend's field checks and usage counts
                    sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(invalid_request(
                        "openai_request is the input of this instance's own OpenAI frontend; send text_input "
                        "(KServe generate), or use the OpenAI API (/v1/chat/completions, /v1/completions)"))),
                                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            check = None  # the answer's structured-output check (a json schema asked for)
            try:
                text = pb_utils.get_input_tensor_by_name(request, "text_input")
                if text is None:
                    raise ValueError("send text_input: the prompt (KServe generate)")
                prompt = _text(text.as_numpy().reshape(-1)[0])
                sp_tensor = pb_utils.get_input_tensor_by_name(request, "sampling_parameters")
                sp = json.loads(_text(sp_tensor.as_numpy().reshape(-1)[0])) if sp_tensor is not None else {}
                if not isinstance(sp, dict):
                    raise ValueError("sampling_parameters must be a JSON object")
                from_parameters, key = request_parameters(request)
                sp = _with_parameters(sp, from_parameters, self.sampling_params_cls)
                stream = _flag(request, "stream", False)
                echo = not _flag(request, "exclude_input_in_output", True)
                if isinstance(sp.get("logit_bias"), dict):  # JSON object keys are strings
                    sp["logit_bias"] = {int(k): float(v) for k, v in sp["logit_bias"].items()}
                server = getattr(self, "openai", None)  # None: vLLM's serving classes are missing
                if sp.get("structured_outputs") is not None:
                    if self._structured_cls is None:
                        raise ValueError(f"structured_outputs needs vLLM ≥ 0.6.3; this image has {self._vllm_version}")
                    if not isinstance(sp["structured_outputs"], dict):
                        raise ValueError("structured_outputs must be a JSON object")
                    structured = sp.pop("structured_outputs")
                    if server is not None:  # the schema checks of the OpenAI routes (one way in)
                        structured, check = server.kserve_structured(structured)
                    sp[self._structured_field] = self._structured_cls(**structured)
                if self._output_kind is not None:
                    sp["output_kind"] = self._output_kind.DELTA if stream else self._output_kind.FINAL_ONLY
                if server is not None and (refused := server.kserve_refusal(prompt, sp)):
                    for key in from_parameters:  # name the field where the client put it
                        refused = re.sub(rf"\bsampling_parameters\.{re.escape(key)}\b", f"parameters.{key}", refused)
                    raise ValueError(refused)  # n, max_tokens, the context and modelops.limits, before the engine
                params = self.sampling_params_cls(**sp)
            except (ValueError, TypeError) as e:
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(invalid_request(e))),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            self._pending.put(_KServeRequest(uuid.uuid4().hex, prompt, params, sender, echo,  # ids unique per engine
                                             cumulative=(None if self._output_kind is not None else stream),
                                             fault=(lambda text, why, c=check: server.kserve_fault(c, text, why))
                                             if check is not None else None,
                                             answered=(lambda p, c, k=key: self._key_usage.count(k, p, c))
                                             if key else None))
        return None  # decoupled: responses go through the senders

    def _serve_openai(self, tensor, sender):
        """``openai_request`` = ``{"api": "chat"|"completions", "body": {...}, "key": the API key's
        name or absent}``: answered by vLLM's serving classes; each reply is one response
        (``openai_response`` text, ``openai_status``, ``openai_final``). What the engine made of
        it counts for the key once it ends, answered to its end or not."""
        if self.openai is None:
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(self._openai_missing)),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return
        try:
            doc = json.loads(_text(tensor.as_numpy().reshape(-1)[0]))
            api, body, key = doc["api"], doc["body"], doc.get("key")
            if api not in ("chat", "completions") or not isinstance(body, dict) or not isinstance(key, str | None):
                raise ValueError("openai_request must be {\"api\": \"chat\"|\"completions\", \"body\": {...}}")
        except (ValueError, KeyError, TypeError) as e:
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(invalid_request(e))),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return

        def emit(reply):
            response = pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("openai_response", np.asarray([reply.body.encode()], dtype=np.object_)),
                pb_utils.Tensor("openai_status", np.asarray([reply.status], dtype=np.int32)),
                pb_utils.Tensor("openai_final", np.asarray([reply.final], dtype=bool)),
            ])
            sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if reply.final else 0)

        self.openai.serve(api, body, emit, cancelled=sender.is_cancelled,
                          on_usage=(lambda p, c: self._key_usage.count(key, p, c))
                          if key and re.match(KEY_NAME_PATTERN, key) else None)

    def _engine_loop(self):
        """Add waiting requests, step the engine, hand each request its new output. Never dies:
        whatever goes wrong fails the requests in flight (engine error) and the loop goes on."""
        busy = False
        while not self._stop.is_set():
            self._beat()
            try:
                self._admit(block=not self.engine.has_unfinished_requests())
                aborted = self._drop_aborted()
                for rid, live in list(self._live.items()):
                    if isinstance(live, _KServeRequest) and live.sender.is_cancelled():  # the client went away
                        self.engine.abort_request([rid])
                        live.hung_up()
                        self._live.pop(rid, None)
                        self._cancelled("kserve")
                        aborted = True
                if not self.engine.has_unfinished_requests():
                    if busy or aborted:
                        # One more step lets the scheduler report the requests that just finished or
                        # were aborted: vllm:num_requests_running would keep its last value while idle.
                        self.engine.step()
                        busy = False
                    continue
                busy = True
                for out in self.engine.step():
                    live = self._live.get(out.request_id)
                    if live is not None:
                        if out.finished:
                            self._live.pop(out.request_id, None)
                        live.deliver(out)
            except Exception as e:  # noqa: BLE001 - the loop must survive to serve later requests
                self.logger.log_error(f"vllm backend: engine loop error, failing {len(self._live)} request(s): {e}")
                self._fail_live(e)

    def _cancelled(self, protocol):
        """Count a request whose client went away (modelops_requests_cancelled_total)."""
        try:
            if self._cancel_counter is None:
                from runtime.engine.openai_engine import cancelled_requests

                self._cancel_counter = cancelled_requests()
            self._cancel_counter.labels(self.engine_args.get("served_model_name") or self._model_name, protocol).inc()
        except Exception as e:  # noqa: BLE001 - a metric must never fail the engine loop
            self.logger.log_warn(f"vllm backend: cannot count a cancelled request: {e}")

    def _beat(self):
        now = time.monotonic()
        if self._heartbeat and now - self._beat_at >= 0.5:
            self._beat_at = now
            try:
                with open(self._heartbeat, "a"):
                    os.utime(self._heartbeat)
            except OSError:
                pass

    def _drop_aborted(self):
        """Abort what the OpenAI side gave up on; True when a request left the engine."""
        aborted = False
        while True:
            try:
                rid = self._aborts.get_nowait()
            except queue.Empty:
                return aborted
            if self._live.pop(rid, None) is not None:
                self.engine.abort_request([rid])
                aborted = True
            else:  # not admitted yet (or already finished): drop it if it is admitted later
                self._early_aborts[rid] = None
                while len(self._early_aborts) > 10_000:
                    self._early_aborts.popitem(last=False)

    def _fail_live(self, e):
        failed = list(self._live.items())
        self._live.clear()
        try:
            self.engine.abort_request([rid for rid, _ in failed])
        except Exception:  # noqa: BLE001 - the engine may be the thing that broke
            pass
        for _, live in failed:
            try:
                live.fail(RuntimeError(engine_error(e)))
            except Exception:  # noqa: BLE001 - a gone client
                pass

    def _admit(self, block):
        try:
            item = self._pending.get(timeout=0.1) if block else self._pending.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            if self._early_aborts.pop(item.request_id, 0) is None:
                item = self._next_pending()
                continue
            try:
                self.engine.add_request(item.request_id, item.prompt, item.params,
                                        **{k: getattr(item, k) for k in self._add_keywords})
                self._live[item.request_id] = item
            except Exception as e:  # refused by the engine (too long, bad params): this request only
                item.fail(e)
            item = self._next_pending()

    def _next_pending(self):
        try:
            return self._pending.get_nowait()
        except queue.Empty:
            return None

    def finalize(self):
        """Unload: stop the engine loop (bounded), answer every request still queued or in the
        engine with an error (so Triton has nothing left to wait for), stop the OpenAI thread."""
        t0 = time.monotonic()
        if getattr(self, "openai", None) is not None:
            self.openai.close()  # first: no admission can be queued behind the sweep below
        if getattr(self, "_loop", None) is not None:
            self._stop.set()
            self._loop.join(timeout=2)  # inside Triton's 5 s exit timeout (runtime/startup.py)
            if self._loop.is_alive():
                self.logger.log_warn("vllm backend: the engine loop did not stop within 2 s; unloading anyway")
            else:
                stopped = len(self._live)
                self._fail_live(RuntimeError("the instance is shutting down"))
                while (item := self._next_pending()) is not None:
                    stopped += 1
                    try:
                        item.fail(RuntimeError(engine_error("the instance is shutting down")))
                    except Exception:  # noqa: BLE001 - a gone client
                        pass
                if stopped:
                    self.logger.log_warn(f"vllm backend: {stopped} request(s) answered with an error at unload")
        self.llm = None
        self.engine = None
        self.logger.log_info(f"vllm backend: finalized in {time.monotonic() - t0:.2f} s")


class _KServeRequest:
    """A KServe generate request (``text_input``) in the engine: its sender and what was sent."""

    __slots__ = ("answered", "cumulative", "echo", "fault", "generated", "params", "priority", "prompt",
                 "prompt_text", "prompt_tokens", "request_id", "sender", "sent_any", "sent_chars", "text")

    def __init__(self, request_id, prompt, params, sender, echo, cumulative=None, fault=None, answered=None):
        self.request_id, self.prompt, self.params, self.sender, self.echo = request_id, prompt, params, sender, echo
        # answered(prompt_tokens, completion_tokens): called once the whole answer went back.
        self.answered = answered
        self.generated, self.sent_any, self.priority, self.prompt_text, self.prompt_tokens = 0, False, 0, None, 0
        # None: the engine sends deltas or the final output (RequestOutputKind); else vLLM < 0.6.3
        # sends the whole output every step, and this says whether the client streams.
        self.cumulative, self.sent_chars = cumulative, 0
        # fault(whole text, finish_reason) -> why the finished answer must not go back (its
        # structured output broke its schema), or None; the text so far, for it.
        self.fault, self.text = fault, []

    def hung_up(self):
        """The client went away: what the engine spent on it so far still counts for its key."""
        if self.answered is not None and (self.prompt_tokens or self.generated):
            self.answered(self.prompt_tokens, self.generated)
        self.answered = None

    def deliver(self, out):
        completion = out.outputs[0]
        self.prompt_tokens = len(out.prompt_token_ids or [])
        if self.cumulative is None:
            self.generated += len(completion.token_ids)
            text = completion.text
        elif not self.cumulative and not out.finished:
            return  # not streamed: only the final output goes back
        else:
            self.generated = len(completion.token_ids)
            text, self.sent_chars = completion.text[self.sent_chars:], len(completion.text)
        final = out.finished
        if self.fault is not None:
            self.text.append(text)
            if final and (why := self.fault("".join(self.text), completion.finish_reason or "stop")):
                self.sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(engine_error(why))),
                                 flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                return
        if self.echo and not self.sent_any:
            text = self.prompt + text
        self.sent_any = True
        response = pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("text_output", np.asarray([text.encode()], dtype=np.object_)),
            pb_utils.Tensor("finish_reason", np.asarray([((completion.finish_reason or "stop") if final else "").encode()],
                                                        dtype=np.object_)),
            pb_utils.Tensor("num_input_tokens", np.asarray([len(out.prompt_token_ids or [])], dtype=np.int32)),
            pb_utils.Tensor("num_output_tokens", np.asarray([self.generated], dtype=np.int32)),
        ])
        self.sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0)
        if final and self.answered is not None:
            self.answered(len(out.prompt_token_ids or []), self.generated)
            self.answered = None

    def fail(self, e):
        response = _error_response(e) if str(e) != engine_error(e) else \
            pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e)))  # failed as the engine's already
        self.sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)


# Inputs of the generate request that a client might put among `parameters` instead.
_INPUT_FLAGS = ("stream", "exclude_input_in_output", "text_input", "sampling_parameters")


def _from_frontend(request) -> bool:
    """Whether the request carries the instance's frontend token (modelops.io_contract
    FRONTEND_TOKEN_HEADER, forwarded by Triton as a request parameter) exactly once; never when
    Triton's environment has none."""
    expected = os.environ.get(FRONTEND_TOKEN_ENV, "")
    try:
        sent = [v for k, v in parameter_pairs(request) if k.lower() == FRONTEND_TOKEN_HEADER]
    except ValueError:
        return False
    return bool(expected) and len(sent) == 1 and isinstance(sent[0], str) and \
        hmac.compare_digest(sent[0].encode(), expected.encode())


def _with_parameters(sp: dict, parameters: dict, sampling_params_cls) -> dict:
    """``sampling_parameters`` with the request's ``parameters`` merged in: each must be a field
    of ``vllm.SamplingParams`` (as in ``sampling_parameters``), so none is dropped unread.

    Raises:
        ValueError: a parameter that is no sampling parameter (an input, structured_outputs, or
            an unknown name), or one given in both places with different values; named
            ``parameters.<name>``.
    """
    fields = set(getattr(sampling_params_cls, "__struct_fields__", ())) or \
        set(inspect.signature(sampling_params_cls).parameters)
    merged = dict(sp)
    for key, value in parameters.items():
        if key in _INPUT_FLAGS:
            raise ValueError(f"parameters.{key}: {key} is an input of the generate request: send it as one (a "
                             "top-level field of a generate body, an input tensor over gRPC), not in parameters")
        if key == "structured_outputs":
            raise ValueError("parameters.structured_outputs: send it in sampling_parameters, as a JSON object")
        if key.startswith("_") or key == "output_kind" or key not in fields:
            raise ValueError(f"parameters.{key}: not a sampling parameter; parameters and sampling_parameters take "
                             "vLLM SamplingParams fields (e.g. max_tokens, temperature, top_p, seed, stop, ignore_eos)")
        if key in sp and json.dumps(sp[key]) != json.dumps(value):  # true is not 1
            raise ValueError(f"parameters.{key}: {value!r} disagrees with sampling_parameters.{key} ({sp[key]!r}); "
                             "send it once")
        merged[key] = value
    return merged


def _flag(request, name, default):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return bool(tensor.as_numpy().reshape(-1)[0]) if tensor is not None else default


def _client_errors() -> tuple:
    try:
        from vllm.exceptions import VLLMClientError  # vLLM ≥ 0.2x: the 4xx side of its error split
    except ImportError:
        return (ValueError, TypeError)
    return (VLLMClientError, ValueError, TypeError)


def _error_response(e: Exception):
    """Per-request error. Errors vLLM classes as the client's (``VLLMClientError``: too long,
    bad sampling parameters) and ValueError/TypeError are marked "invalid request" (HTTP 400
    at the frontend) and carry Triton's INVALID_ARG code, so a KServe client gets HTTP 400 /
    gRPC INVALID_ARGUMENT too (python_backend's ``TritonError(message, code)``; a stub without
    codes keeps INTERNAL); anything else is an engine error (INTERNAL)."""
    client = isinstance(e, _client_errors())
    code = getattr(pb_utils.TritonError, "INVALID_ARG", None) if client else None
    message = invalid_request(e) if client else engine_error(e)
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code) if code is not None
                                      else pb_utils.TritonError(message))


def _embedding_response(outs):
    emb = np.asarray([o.outputs.embedding for o in outs], dtype=np.float32)
    ntok = np.asarray([[len(o.prompt_token_ids)] for o in outs], dtype=np.int32)  # [n, 1]: batched dims
    return pb_utils.InferenceResponse(output_tensors=[
        pb_utils.Tensor("embedding", emb), pb_utils.Tensor("num_input_tokens", ntok)])


def _text(value) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"text_input is not valid UTF-8: {e}") from None
    return str(value)
