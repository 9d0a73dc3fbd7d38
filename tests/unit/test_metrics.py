"""One /metrics per instance (runtime/frontend/metrics.py): Triton's text passed through, vLLM's
families read back from the multiprocess folder its process writes (written here by a real
prometheus_client in another process, as vLLM's stub does), and the frontend's own gauges and
counters; Triton down costs only its own families."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

from modelops.histograms import parse_prometheus
from runtime.frontend.metrics import label, merged_metrics
from runtime.frontend.usage import KeyUsage

REPO = Path(__file__).resolve().parents[2]
TRITON = 'nv_inference_request_success{model="m",version="1"} 3\n'

# What vLLM's engine process does: prometheus_client counters in multiprocess mode.
ENGINE = """
from prometheus_client import Counter
c = Counter("vllm:prompt_tokens", "prompt tokens", ["model_name"])
c.labels(model_name="m").inc(42)
"""


def _triton_metrics() -> ThreadingHTTPServer:
    class H(BaseHTTPRequestHandler):
        def do_GET(self):
            data = TRITON.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


async def _text(url: str, **kw) -> str:
    async with httpx.AsyncClient() as client:
        return await merged_metrics(client, url, **kw)


def _scrape(url: str, **kw) -> dict:
    return parse_prometheus(asyncio.run(_text(url, **kw)))


def test_one_scrape_holds_triton_vllm_and_the_frontends_own(tmp_path, monkeypatch):
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    subprocess.run([sys.executable, "-c", ENGINE], check=True, env={"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)})
    triton = _triton_metrics()
    usage = KeyUsage()
    usage.record("team-a", 5, 7)
    m = _scrape(f"http://127.0.0.1:{triton.server_port}/metrics", model_id="m", version="2.0",
                refused={"draining": 2}, engine_up=False, usage=usage)
    assert m["nv_inference_request_success"] == [({"model": "m", "version": "1"}, 3.0)]
    assert m["vllm:prompt_tokens_total"] == [({"model_name": "m"}, 42.0)]
    assert m["modelops_triton_metrics_up"] == [({}, 1.0)] and m["modelops_engine_up"] == [({}, 0.0)]
    assert m["modelops_model_info"] == [({"model_name": "m", "version": "2.0"}, 1.0)]
    assert m["modelops_requests_refused_total"] == [({"code": "draining"}, 2.0)]
    assert m["modelops_key_completion_tokens_total"] == [({"model_name": "m", "key": "team-a"}, 7.0)]
    triton.shutdown()


def test_without_triton_vllms_families_are_still_served(tmp_path, monkeypatch):
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    subprocess.run([sys.executable, "-c", ENGINE], check=True, env={"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)})
    m = _scrape("http://127.0.0.1:9/metrics", model_id="m", version="1")
    assert m["modelops_triton_metrics_up"] == [({}, 0.0)]
    assert "nv_inference_request_success" not in m and m["vllm:prompt_tokens_total"][0][1] == 42.0


# What our engine does for the KServe answers it gives itself (runtime/engine/vllm_backend.py).
ENGINE_KEYS = """
from prometheus_client import Counter
from modelops.io_contract import ENGINE_KEY_USAGE
for name, n in zip(ENGINE_KEY_USAGE, (2, 30, 11)):
    c = Counter(name, "KServe answers", ["key"])
    c.labels("team-a").inc(n)
    c.labels("team-k").inc(n * 10)
"""


def test_the_engines_kserve_usage_joins_the_frontends_in_one_family_per_counter(tmp_path, monkeypatch):
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    for script in (ENGINE, ENGINE_KEYS):
        subprocess.run([sys.executable, "-c", script], check=True, cwd=REPO,
                       env={"PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PYTHONPATH": str(REPO)})
    usage = KeyUsage()
    usage.record("team-a", 5, 7)
    text = asyncio.run(_text("http://127.0.0.1:9/metrics", model_id="m", version="1", usage=usage))
    m = parse_prometheus(text)
    def per_key(name: str) -> dict[str, float]:
        assert all(labels["model_name"] == "m" for labels, _ in m[name])
        return {labels["key"]: value for labels, value in m[name]}

    # The frontend's (1 request, 5 + 7 tokens) plus the engine's, for a key both counted.
    assert per_key("modelops_key_requests_total") == {"team-a": 3.0, "team-k": 20.0}
    assert per_key("modelops_key_prompt_tokens_total") == {"team-a": 35.0, "team-k": 300.0}
    assert per_key("modelops_key_completion_tokens_total") == {"team-a": 18.0, "team-k": 110.0}
    assert not any(name.startswith("modelops_engine_key") for name in m)  # folded, not exposed twice
    assert text.count("# TYPE modelops_key_requests_total counter") == 1 and m["vllm:prompt_tokens_total"]


def test_label_values_are_escaped_as_the_text_format_wants():
    assert label('a"b\\c\nd') == 'a\\"b\\\\c\\nd'
