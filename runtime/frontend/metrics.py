"""One Prometheus ``/metrics`` for an instance: Triton's endpoint plus vLLM's own metrics.

vLLM runs inside Triton's Python backend stub, a process the frontend cannot scrape; with
``PROMETHEUS_MULTIPROC_DIR`` set (runtime/startup.py) its prometheus_client metrics are written
to ``*.db`` files there, which ``prometheus_client.multiprocess.MultiProcessCollector`` reads
back. Names and labels are vLLM's own (``vllm:...``), so dashboards built for ``vllm serve``
keep working. Triton's metrics (``nv_...``) are fetched over HTTP and passed through as text. If
that fetch fails, vLLM's families are still served and ``modelops_triton_metrics_up`` is 0.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import httpx
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from modelops.io_contract import ENGINE_KEY_USAGE

__all__ = ["CONTENT_TYPE", "label", "merged_metrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _engine_text() -> tuple[str, dict[str, list[int]]]:
    """The engine process's families (vLLM's, the engine's own), less its per-key KServe
    counters (modelops.io_contract.ENGINE_KEY_USAGE), which come back apart as ``{key:
    [requests, prompt_tokens, completion_tokens]}`` for the frontend's own families."""
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not path or not os.path.isdir(path):
        return "", {}
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=path)
    families, usage = [], {}
    for family in registry.collect():
        if family.name not in ENGINE_KEY_USAGE:
            families.append(family)
            continue
        column = ENGINE_KEY_USAGE.index(family.name)
        for sample in family.samples:
            if sample.name.endswith("_total"):
                usage.setdefault(sample.labels["key"], [0, 0, 0])[column] += int(sample.value)
    # generate_latest reads anything with collect(): the families kept, as collected once.
    return generate_latest(SimpleNamespace(collect=lambda: families)).decode(), usage


def label(value: str) -> str:
    """``value`` escaped for a Prometheus label."""
    # Prometheus text format escapes backslash, double quote and newline in label values.
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


async def merged_metrics(client: httpx.AsyncClient, triton_metrics_url: str, model_id: str = "",
                         version: str = "", refused: dict[str, int] | None = None, engine_up: bool = True,
                         usage=None, shadow=None) -> str:
    """Prometheus text format: Triton's families, then vLLM's, then ``modelops_triton_metrics_up``
    and ``modelops_model_info{model_name, version} 1``, ``modelops_engine_up`` (0 while the engine
    is dead or stalled) and ``modelops_requests_refused_total{code}`` (OpenAI requests the
    frontend answered 503 itself: ``loading``, ``engine_unavailable``, ``draining``; Triton never
    saw them, so the gates count them from here). vLLM labels its series
    ``model_name="<model_id>"`` (its served name) and has no version label; the info metric joins
    them to the version (``* on(model_name) group_left(version) modelops_model_info``).

    Args:
        client: an HTTP client (reused across scrapes); triton_metrics_url: Triton's /metrics;
        model_id, version: what this instance serves (no info metric when model_id is empty);
        refused: the frontend's 503 counts by code; engine_up: whether the engine can serve;
        usage: the :class:`runtime.frontend.usage.KeyUsage` whose per-key counters are added, with
            the engine's KServe answers per key folded in (one family each);
        shadow: the :class:`runtime.frontend.shadow.ShadowMirror` whose comparisons are added.
    """
    try:
        r = await client.get(triton_metrics_url, timeout=2.0)
        r.raise_for_status()
        triton, up = r.text.rstrip("\n") + "\n", 1
    except httpx.HTTPError:
        triton, up = "", 0
    gauge = ("# HELP modelops_triton_metrics_up 1 if Triton's metrics endpoint answered this scrape, else 0.\n"
             "# TYPE modelops_triton_metrics_up gauge\n"
             f"modelops_triton_metrics_up {up}\n")
    if model_id:
        gauge += ("# HELP modelops_model_info The model version this instance serves (join on model_name).\n"
                  "# TYPE modelops_model_info gauge\n"
                  f'modelops_model_info{{model_name="{label(model_id)}",version="{label(version)}"}} 1\n')
    gauge += ("# HELP modelops_engine_up 1 while the engine process is alive and making progress, else 0.\n"
              "# TYPE modelops_engine_up gauge\n"
              f"modelops_engine_up {int(engine_up)}\n")
    if refused is not None:
        gauge += ("# HELP modelops_requests_refused_total OpenAI requests answered 503 by the frontend itself.\n"
                  "# TYPE modelops_requests_refused_total counter\n" +
                  "".join(f'modelops_requests_refused_total{{code="{label(code)}"}} {n}\n'
                          for code, n in sorted(refused.items())))
    engine, engine_usage = _engine_text()
    if usage is not None:
        gauge += usage.exposition(model_id, engine_usage)
    if shadow is not None:
        gauge += shadow.exposition()
    return triton + engine + gauge
