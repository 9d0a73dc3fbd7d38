"""health: readiness and smoke checks of one instance, over the protocols clients use.

Checks, in order: KServe v2 HTTP ``/v2/health/ready`` and ``/v2/models/<m>/ready``; KServe v2
gRPC ``ServerReady`` and ``ModelReady`` (tritonclient); an OpenAI smoke request
(``/v1/embeddings`` for embed models; for generate models ``/v1/completions``, a completion
with ``response_format: json_schema`` whose answer must parse and fit the schema, and a chat
request, which must answer unless the model has no chat template, then it must say so).
A model with no OpenAI face (``execution_mode: separate``, or task tabular) gets a KServe v2
smoke instead: one infer over HTTP (a tabular model: one row of zeros of its declared width,
answered with finite values of its declared output width; embed: a text; generate: ``/generate``).
"""

from __future__ import annotations

import json
import math
import time

import httpx
import tritonclient.grpc as grpcclient
from prefect import task
from prefect.cache_policies import NO_CACHE

from modelops.artifacts import Package
from modelops.errors import HealthCheckError
from modelops.settings import get_settings
from modelops.tenancy import INSTANCE_SECRET_HEADER, stack_secret
from tasks import backends
from tasks.provision.interface import Endpoints

__all__ = ["check_instance", "health_task", "instance_headers", "probe_version", "verify_route", "verify_route_task"]


_HEALTH_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                  "additionalProperties": False}


def instance_headers() -> dict[str, str]:
    """What the platform's requests to an instance carry: the local stack's secret, without which
    its instances answer 403 (modelops/tenancy.py); nothing on Kubernetes, where a
    NetworkPolicy closes the door instead."""
    settings = get_settings()
    if settings.provider != "local":
        return {}
    return {INSTANCE_SECRET_HEADER: stack_secret(settings.instance_secret_file)}


def _check_once(package: Package, ep: Endpoints) -> dict[str, float]:
    timings: dict[str, float] = {}
    secret = instance_headers()

    def timed(name: str, fn) -> None:
        t0 = time.monotonic()
        fn()
        timings[name] = round(time.monotonic() - t0, 4)

    def http_ready() -> None:
        for path in ("/v2/health/ready", f"/v2/models/{package.triton_model}/ready"):
            r = httpx.get(ep.kserve_http + path, timeout=5)
            if r.status_code != 200:
                raise HealthCheckError(f"KServe HTTP {path}: status {r.status_code}")

    def grpc_ready() -> None:
        client = grpcclient.InferenceServerClient(ep.kserve_grpc)
        try:
            if not client.is_server_ready():
                raise HealthCheckError("KServe gRPC ServerReady: false")
            if not client.is_model_ready(package.triton_model):
                raise HealthCheckError(f"KServe gRPC ModelReady({package.triton_model}): false")
        finally:
            client.close()

    def kserve_smoke() -> None:
        url, body, name = _kserve_request(f"{ep.kserve_http}/v2/models/{package.triton_model}", package.task,
                                          secret)
        r = httpx.post(url, json=body, headers=secret, timeout=60)
        if r.status_code != 200:
            raise HealthCheckError(f"KServe HTTP {url}: status {r.status_code}: {r.text[:300]}")
        if package.task == "generate":
            if not isinstance(r.json().get("text_output"), str):
                raise HealthCheckError(f"KServe HTTP {url}: no text_output: {r.text[:300]}")
            return
        got = [o for o in r.json().get("outputs", []) if o["name"] == name]
        if not got or not got[0]["data"] or not all(math.isfinite(x) for x in got[0]["data"]):
            raise HealthCheckError(f"KServe HTTP {url}: no finite output: {r.text[:300]}")
        if package.task == "tabular" and got[0]["shape"][0] != 1:
            raise HealthCheckError(f"KServe HTTP {url}: one row gave output shape {got[0]['shape']}")

    def smoke() -> None:
        if package.execution_mode == "separate" or package.task == "tabular":
            kserve_smoke()
        elif package.task == "embed":
            r = httpx.post(f"{ep.openai}/embeddings", json={"model": package.model_id, "input": "modelops health check"},
                           headers=secret, timeout=30)
            if r.status_code != 200:
                raise HealthCheckError(f"OpenAI /v1/embeddings: status {r.status_code}: {r.text[:300]}")
            vec = r.json()["data"][0]["embedding"]
            if not vec or not all(math.isfinite(x) for x in vec):
                raise HealthCheckError(f"OpenAI /v1/embeddings returned a bad vector (dim {len(vec)})")
        else:
            r = httpx.post(f"{ep.openai}/completions", headers=secret,
                           json={"model": package.model_id, "prompt": "Hello", "max_tokens": 4}, timeout=60)
            if r.status_code != 200:
                raise HealthCheckError(f"OpenAI /v1/completions: status {r.status_code}: {r.text[:300]}")
            if r.json()["usage"]["completion_tokens"] < 1:
                raise HealthCheckError("OpenAI /v1/completions generated no tokens")
            # Structured outputs must hold too: response_format is a field clients rely on (on
            # completions, vLLM's extension, so a model without a chat template is checked too).
            r = httpx.post(f"{ep.openai}/completions", headers=secret, timeout=60, json={
                "model": package.model_id, "max_tokens": 32, "prompt": "ok?",
                "response_format": {"type": "json_schema", "json_schema": {"name": "health", "schema": _HEALTH_SCHEMA}}})
            if r.status_code != 200:
                raise HealthCheckError(f"OpenAI response_format json_schema: status {r.status_code}: {r.text[:300]}")
            try:
                doc = json.loads(r.json()["choices"][0]["text"])
            except ValueError as e:
                raise HealthCheckError(f"OpenAI response_format json_schema returned invalid JSON: {e}") from None
            if not isinstance(doc, dict) or not isinstance(doc.get("ok"), bool):
                raise HealthCheckError(f"OpenAI response_format json_schema returned {doc!r}, not the schema")
            # Chat renders with the model's template; a model without one refuses chat by design.
            r = httpx.post(f"{ep.openai}/chat/completions", headers=secret, timeout=60, json={
                "model": package.model_id, "max_tokens": 4, "messages": [{"role": "user", "content": "ok?"}]})
            no_template = r.status_code == 400 and "no chat template" in r.text
            if r.status_code != 200 and not no_template:
                raise HealthCheckError(f"OpenAI /v1/chat/completions: status {r.status_code}: {r.text[:300]}")

    timed("kserve_http_ready", http_ready)
    timed("kserve_grpc_ready", grpc_ready)
    timed("kserve_smoke" if package.execution_mode == "separate" or package.task == "tabular" else "openai_smoke",
          smoke)
    return timings


def check_instance(package: Package, endpoints: Endpoints, timeout_s: float | None = None) -> dict[str, float]:
    """Run every check until all pass or ``timeout_s`` (default: setting health_timeout_s) ends.

    Returns:
        seconds each check took in the passing round.

    Raises:
        HealthCheckError: the last failure when the deadline passed.
    """
    deadline = time.monotonic() + (timeout_s if timeout_s is not None else get_settings().health_timeout_s)
    while True:
        try:
            return _check_once(package, endpoints)
        except Exception as e:
            if time.monotonic() >= deadline:
                raise HealthCheckError(f"{package.model_id}/{package.version} at {endpoints.openai} unhealthy: {e}") from e
            time.sleep(1)


@task(name="health", retries=0, timeout_seconds=600, tags=["modelops"], cache_policy=NO_CACHE)
def health_task(package: Package, endpoints: Endpoints) -> dict[str, float]:
    """Prefect task around :func:`check_instance` (it retries internally until its deadline)."""
    from prefect import get_run_logger

    timings = check_instance(package, endpoints)
    get_run_logger().info("healthy: %s", timings)
    return timings


def _kserve_request(base: str, task: str, headers: dict[str, str] | None = None,
                    client: httpx.Client | None = None) -> tuple[str, dict, str]:
    """``(url, JSON body, output read)`` of one small KServe v2 HTTP request to the model at ``base``
    (``.../v2/models/<name>``): tabular, one row of zeros of the width its config declares (read
    from ``{base}/config``); embed, one text; generate, ``/generate`` of 2 tokens (the vllm
    backend's text tensors)."""
    if task == "generate":
        return (f"{base}/generate", {"text_input": "Hello", "sampling_parameters": json.dumps({"max_tokens": 2})},
                "text_output")
    if task == "embed":
        return f"{base}/infer", {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1, 1],
                                             "data": ["modelops health check"]}]}, "embedding"
    r = (client or httpx).get(f"{base}/config", headers=headers, timeout=10)
    if r.status_code != 200:
        raise HealthCheckError(f"KServe HTTP {base}/config: status {r.status_code}: {r.text[:300]}")
    config = r.json()
    (inp,), (out,) = config["input"], config["output"]
    width = int(inp["dims"][0])
    return f"{base}/infer", {"inputs": [{"name": inp["name"], "datatype": "FP32", "shape": [1, width],
                                         "data": [0.0] * width}]}, out["name"]


def verify_route(model_id: str, version: str, task: str, default: bool, router_url: str | None = None,
                 attempts: int = 5, kserve: bool = False) -> str:
    """After the traffic change: a request through the router reaches ``version``.

    ``default`` True (first version, red-black, promoted): an unpinned request must be answered
    by ``version`` (response header ``X-Model-Version``); False (versioned, not promoted): a
    request pinned with ``X-Model-Version: <version>`` must succeed. ``kserve`` (a model with no
    OpenAI face: execution_mode separate, task tabular): the request is KServe v2 HTTP at the
    router's ``/v2/models/<model_id>/``.

    Returns:
        what was checked, for the report. Raises HealthCheckError after ``attempts`` tries.
    """
    router = router_url or get_settings().router_url
    the_router = backends.router()
    headers = {**the_router.route_headers(model_id), **({} if default else {"X-Model-Version": version})}
    # The platform's own path to its router: API keys, when on, are for clients (tasks/traffic/haproxy.py).
    with httpx.Client(transport=None if router_url else the_router.platform_transport()) as client:
        problem, url = "", router
        for _ in range(attempts):
            try:
                url, r = _route_request(client, router, model_id, task, kserve, headers, "modelops route check")
                got = r.headers.get("X-Model-Version")
                if r.status_code == 200 and got == version:
                    return f"{'unpinned' if default else 'pinned'} request through the router answered by {version}"
                problem = f"status {r.status_code}, answered by version {got!r}: {r.text[:200]}"
            except (httpx.HTTPError, HealthCheckError, ValueError, KeyError) as e:
                problem = str(e) or type(e).__name__
            time.sleep(1)
    raise HealthCheckError(f"router {url}: {'an unpinned' if default else 'a pinned'} request for {model_id} did not "
                           f"reach version {version} ({problem})")


def _route_request(client: httpx.Client, router: str, model_id: str, task: str, kserve: bool,
                   headers: dict[str, str], text: str) -> tuple[str, httpx.Response]:
    """One small request for ``model_id`` through the router at ``router`` (its OpenAI base URL):
    OpenAI embeddings or a 1-token completion, or (``kserve``, or task tabular) the KServe v2
    request of :func:`_kserve_request` at ``/v2/models/<model_id>``; ``(url, response)``."""
    if kserve or task == "tabular":
        url, body, _ = _kserve_request(router.removesuffix("/v1") + f"/v2/models/{model_id}", task, headers, client)
    else:
        url = router + ("/embeddings" if task == "embed" else "/completions")
        body = {"model": model_id, "input": text} if task == "embed" else \
            {"model": model_id, "prompt": text, "max_tokens": 1}
    return url, client.post(url, json=body, headers=headers, timeout=30)


def probe_version(model_id: str, version: str, task: str, kserve: bool, count: int) -> list[str]:
    """Send ``count`` requests for ``model_id`` through the router, pinned to ``version``
    (``X-Model-Version``), one after another: a gate's own traffic when clients sent the version
    too little to judge (tasks/traffic/rollout.py, setting ``gate_no_traffic: probe``). Each
    carries its own session key (``X-Session-Id: modelops-gate-probe-<i>``), so the router's
    balancing spreads them over the version's instances; OpenAI probes' texts differ too.

    Returns:
        what went wrong with each request that was not answered 200 by ``version``; empty when
        all were.
    """
    the_router = backends.router()
    headers = {**the_router.route_headers(model_id), "X-Model-Version": version}
    problems = []
    with httpx.Client(transport=the_router.platform_transport()) as client:
        for i in range(count):
            try:
                _, r = _route_request(client, get_settings().router_url, model_id, task, kserve,
                                      {**headers, "X-Session-Id": f"modelops-gate-probe-{i}"}, f"modelops gate probe {i}")
                got = r.headers.get("X-Model-Version")
                if r.status_code != 200 or got != version:
                    problems.append(f"status {r.status_code}, answered by version {got!r}: {r.text[:200]}")
            except (httpx.HTTPError, HealthCheckError, ValueError, KeyError) as e:
                problems.append(str(e) or type(e).__name__)
    return problems


# 600 s: above verify_route's own attempts (5 × 31 s), and the transaction's rollback hooks run
# inside the failing task's run (Prefect 3.9), draining instances takes drain_timeout_s each.
@task(name="verify_route", retries=0, timeout_seconds=600, tags=["modelops"], cache_policy=NO_CACHE)
def verify_route_task(model_id: str, version: str, task: str, default: bool, kserve: bool = False) -> str:
    """Prefect task around :func:`verify_route`."""
    from prefect import get_run_logger

    checked = verify_route(model_id, version, task, default, kserve=kserve)
    get_run_logger().info("route: %s", checked)
    return checked
