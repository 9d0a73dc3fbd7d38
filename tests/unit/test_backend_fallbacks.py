"""Our Triton vLLM backend's paths for older vLLM releases, which this machine's vLLM 0.32 never
takes: cumulative outputs (vLLM < 0.6.3 has no RequestOutputKind), guided decoding under its
pre-0.11 name, and structured outputs refused where vLLM has neither; and how it reads the API
key Triton forwards among a KServe request's parameters (the real engine: test_runtime.py).

The backend file runs inside Triton's Python backend stub; here ``triton_python_backend_utils``
is a small stand-in that records what the backend sends, so the backend's own logic runs as is.
"""

import importlib.util
import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest

MODEL_PY = Path(__file__).resolve().parents[2] / "runtime" / "engine" / "vllm_backend.py"


class _Tensor:
    def __init__(self, name, array):
        self.name, self.array = name, array

    def as_numpy(self):
        return self.array


class _Response:
    def __init__(self, output_tensors=None, error=None):
        self.tensors = {t.name: t.array for t in output_tensors or []}
        self.error = error


class _Sender:
    def __init__(self):
        self.sent = []

    def send(self, response, flags=0):
        self.sent.append((response, flags))

    def is_cancelled(self):
        return False


class _Request:
    def __init__(self, **tensors):
        self.tensors = {k: _Tensor(k, np.asarray([v], dtype=np.object_ if isinstance(v, bytes) else None))
                        for k, v in tensors.items()}
        self.sender = _Sender()

    def get_response_sender(self):
        return self.sender


@pytest.fixture(scope="module")
def backend():
    stub = types.ModuleType("triton_python_backend_utils")
    stub.Tensor, stub.InferenceResponse, stub.TritonError = _Tensor, _Response, str
    stub.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
    stub.TritonModelException = RuntimeError
    stub.get_input_tensor_by_name = lambda request, name: request.tensors.get(name)
    import runtime.engine.stub_prelude

    saved = sys.modules.get("triton_python_backend_utils")
    sys.modules["triton_python_backend_utils"] = stub
    # In the stub, the backends folder holds it under this name (runtime/startup.py).
    sys.modules["modelops_stub_prelude"] = runtime.engine.stub_prelude
    try:
        spec = importlib.util.spec_from_file_location("modelops_vllm_backend_under_test", MODEL_PY)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("modelops_stub_prelude", None)
        if saved is None:
            sys.modules.pop("triton_python_backend_utils", None)
        else:
            sys.modules["triton_python_backend_utils"] = saved


def _out(text, tokens, finished):
    completion = types.SimpleNamespace(text=text, token_ids=list(range(tokens)),
                                       finish_reason="length" if finished else None)
    return types.SimpleNamespace(outputs=[completion], finished=finished, prompt_token_ids=[1, 2, 3])


STEPS = [("Hel", 1, False), ("Hello wo", 3, False), ("Hello world", 4, True)]  # cumulative, as vLLM < 0.6.3 sends


def _texts(sender):
    return [r.tensors["text_output"][0].decode() for r, _ in sender.sent]


def test_cumulative_outputs_stream_as_deltas(backend):
    sender = _Sender()
    request = backend._KServeRequest("r", "Say:", None, sender, echo=False, cumulative=True)
    for step in STEPS:
        request.deliver(_out(*step))
    assert _texts(sender) == ["Hel", "lo wo", "rld"]
    assert [int(r.tensors["num_output_tokens"][0]) for r, _ in sender.sent] == [1, 3, 4]
    assert [flags for _, flags in sender.sent] == [0, 0, 1]
    assert sender.sent[-1][0].tensors["finish_reason"][0] == b"length"


def test_cumulative_outputs_unstreamed_send_the_final_one_only(backend):
    sender = _Sender()
    request = backend._KServeRequest("r", "Say:", None, sender, echo=True, cumulative=False)
    for step in STEPS:
        request.deliver(_out(*step))
    assert _texts(sender) == ["Say:Hello world"] and int(sender.sent[0][0].tensors["num_output_tokens"][0]) == 4


def test_delta_outputs_are_summed_as_before(backend):
    sender = _Sender()
    request = backend._KServeRequest("r", "Say:", None, sender, echo=False)
    for step in [("Hel", 1, False), ("lo wo", 2, False), ("rld", 1, True)]:
        request.deliver(_out(*step))
    assert "".join(_texts(sender)) == "Hello world"
    assert int(sender.sent[-1][0].tensors["num_output_tokens"][0]) == 4


def _model(backend, structured_cls, field, output_kind):
    model = backend.TritonPythonModel()
    model.sampling_params_cls = lambda **kw: kw  # records what would reach vLLM's SamplingParams
    model._structured_cls, model._structured_field, model._output_kind = structured_cls, field, output_kind
    model._vllm_version = "0.5.5"
    model._pending = __import__("queue").Queue()
    return model


def _generate(model, sampling):
    request = _Request(text_input=b"hi", sampling_parameters=json.dumps(sampling).encode())
    model._generate([request])
    return request


def test_structured_outputs_go_to_guided_decoding_before_vllm_0_11(backend):
    class GuidedDecodingParams:
        def __init__(self, **kw):
            self.kw = kw

    model = _model(backend, GuidedDecodingParams, "guided_decoding", None)
    _generate(model, {"max_tokens": 4, "structured_outputs": {"choice": ["yes", "no"]}})
    admitted = model._pending.get_nowait()
    params = admitted.params
    assert set(params) == {"max_tokens", "guided_decoding"}  # no output_kind: vLLM < 0.6.3 has none
    assert params["guided_decoding"].kw == {"choice": ["yes", "no"]}
    assert admitted.cumulative is False  # not streamed: the final output only


def test_structured_outputs_are_refused_where_vllm_has_none(backend):
    model = _model(backend, None, None, None)
    request = _generate(model, {"structured_outputs": {"regex": "a+"}})
    (response, flags), = request.sender.sent
    assert flags == 1 and response.error == "invalid request: structured_outputs needs vLLM ≥ 0.6.3; this image has 0.5.5"
    assert model._pending.empty()
    assert _generate(model, {"max_tokens": 2}).sender.sent == []  # plain requests still go to the engine
    assert model._pending.get_nowait().params == {"max_tokens": 2}


def test_errors_cross_from_the_backends_to_the_frontend_in_one_wire_form():
    from modelops.io_contract import engine_error, invalid_request, refusal_of, refused_param
    from runtime.frontend.errors import InvalidRequest, UpstreamError
    from runtime.frontend.triton import TritonModel

    assert refusal_of(invalid_request("max_tokens must be at least 1")) == "max_tokens must be at least 1"
    assert refusal_of("[StatusCode.INVALID_ARGUMENT] " + invalid_request("x")) == "x"  # as Triton wraps it
    assert refusal_of(engine_error("boom")) is None and engine_error(engine_error("boom")) == "engine error: boom"
    assert refused_param("extra_args: unknown key 'c'") == "vllm_xargs" and refused_param("n must be 1") is None

    class _Err:  # what tritonclient raises: InferenceServerException.message()
        def __init__(self, msg):
            self.msg = msg

        def message(self):
            return self.msg

    model = TritonModel.__new__(TritonModel)
    model.name = "m"
    refused = model._error(_Err(invalid_request("extra_args: constraint is not a list")), param=None)
    assert isinstance(refused, InvalidRequest) and refused.param == "vllm_xargs"
    assert refused.message == "extra_args: constraint is not a list"
    assert isinstance(model._error(_Err(engine_error("the instance is shutting down")), param=None), UpstreamError)


class _Parameters:
    def __init__(self, text: str):
        self.text = text

    def parameters(self) -> str:
        return self.text


def test_the_forwarded_key_counts_only_with_the_routers_hmac(backend, monkeypatch):
    # What tritonserver 2.51 hands the model (verified there): the body's parameters, then the
    # headers its --http/grpc-header-forward-pattern forwards (/infer and gRPC), as sent.
    from modelops.tenancy import key_mac

    from runtime.engine.api_key import request_parameters as read

    monkeypatch.setenv("MODELOPS_INSTANCE_SECRET", "s3cret")
    mac = key_mac("s3cret", "team-a")
    assert read(_Parameters(f'{{"max_tokens": 5, "x-modelops-key": "team-a", "x-modelops-key-mac": "{mac}"}}')) \
        == ({"max_tokens": 5}, "team-a")
    assert read(_Parameters(f'{{"X-Modelops-Key": "team-a", "X-Modelops-Key-Mac": "{mac.upper()}"}}')) == ({}, "team-a")
    assert read(_Parameters('{"temperature": 0}')) == ({"temperature": 0}, None)
    for forged in ('{"x-modelops-key": "team-a"}',  # /generate forwards no header: the client's own
                   f'{{"x-modelops-key": "team-b", "x-modelops-key-mac": "{mac}"}}',  # another key's HMAC
                   f'{{"x-modelops-key": "team-b", "x-modelops-key": "team-a", "x-modelops-key-mac": "{mac}"}}',
                   ):
        with pytest.raises(ValueError, match=r"parameters\.x-modelops-key: the router sets it"):
            read(_Parameters(forged))
    with pytest.raises(ValueError, match=r"parameters\.x-modelops-key-mac: the router sets it"):
        read(_Parameters(f'{{"x-modelops-key-mac": "{mac}"}}'))
    with pytest.raises(ValueError, match=r"parameters\.x-modelops-key-mac: the router sets it"):  # the one sent twice
        read(_Parameters(f'{{"x-modelops-key-mac": "00", "x-modelops-key": "team-a", "x-modelops-key-mac": "{mac}"}}'))
    # Without an instance secret (Kubernetes: the Gateway sets the header) nothing is vouched for.
    monkeypatch.delenv("MODELOPS_INSTANCE_SECRET")
    assert read(_Parameters('{"x-modelops-key": "team-a", "max_tokens": 2}')) == ({"max_tokens": 2}, None)
    with pytest.raises(ValueError, match="an object of names and values"):
        read(_Parameters("[1, 2]"))


def test_a_kserve_answer_is_counted_once_with_its_tokens_when_it_ends(backend):
    counted = []
    request = backend._KServeRequest("r", "Say:", None, _Sender(), echo=False,
                                     answered=lambda p, c: counted.append((p, c)))
    for step in [("Hel", 1, False), ("lo wo", 2, False)]:
        request.deliver(_out(*step))
    assert counted == []
    request.deliver(_out("rld", 1, True))
    assert counted == [(3, 4)]  # the prompt's 3 tokens, 4 generated: the answer's num_*_tokens
    request.hung_up()
    assert counted == [(3, 4)]  # once


def test_a_kserve_stream_the_client_left_counts_what_the_engine_spent(backend):
    counted = []

    def new_request():
        return backend._KServeRequest("r", "Say:", None, _Sender(), echo=False,
                                      answered=lambda p, c: counted.append((p, c)))

    new_request().hung_up()
    assert counted == []  # it left before the engine made anything of it
    request = new_request()
    for step in [("Hel", 1, False), ("lo wo", 2, False)]:
        request.deliver(_out(*step))
    request.hung_up()
    request.hung_up()
    assert counted == [(3, 3)]  # the prompt and the 3 tokens made before the client hung up, once


def test_only_the_instances_own_frontend_may_send_an_openai_request(backend, monkeypatch):
    # Triton forwards the frontend's token header as a request parameter (runtime/startup.py): a
    # KServe client's openai_request would skip the frontend's field checks and the usage per key.
    monkeypatch.setenv("MODELOPS_FRONTEND_TOKEN", "t0ken")
    ok = backend._from_frontend
    assert ok(_Parameters('{"x-modelops-frontend": "t0ken"}'))
    assert ok(_Parameters('{"max_tokens": 3, "X-Modelops-Frontend": "t0ken"}'))
    for sent in ("{}", '{"x-modelops-frontend": "guess"}', '{"x-modelops-frontend": 1}', "[1, 2]", "not json",
                 '{"x-modelops-frontend": "t0ken", "x-modelops-frontend": "t0ken"}'):
        assert not ok(_Parameters(sent)), sent
    monkeypatch.delenv("MODELOPS_FRONTEND_TOKEN")
    assert not ok(_Parameters('{"x-modelops-frontend": ""}'))  # no token in Triton's environment: never
