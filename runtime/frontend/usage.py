"""Usage per API key: the requests and tokens this instance answered for each key the router
named (``x-modelops-key``, set by the router only: tasks/traffic/haproxy.py).

Tokens are the answers' own usage: embeddings, scores and reranking count their prompt tokens
here. The engine counts the rest per key (:data:`modelops.io_contract.ENGINE_KEY_USAGE`), added
here: chat and completions from its outputs (as vLLM's ``usage``), streams included, whether or
not the client asked for ``stream_options.include_usage`` and whether or not it read the answer
to its end (what the engine made before a client hung up counts); a KServe generate's
``num_input_tokens`` and ``num_output_tokens``; a KServe embedding's input tokens. Exposed in the
instance's ``/metrics`` (:mod:`runtime.frontend.metrics`) as counters labelled ``model_name`` and
``key``; the autoscaler daemon reads them for ``modelops keys usage`` and the tpm limits.
"""

from __future__ import annotations

import re
import threading
from collections import defaultdict

from modelops.tenancy import KEY_HEADER, KEY_NAME_PATTERN

__all__ = ["KEY_HEADER", "KeyUsage"]

# (metric, help) in the order they are exposed.
_METRICS = (("modelops_key_requests_total", "Requests answered for each API key (successful answers)."),
            ("modelops_key_prompt_tokens_total", "Prompt tokens of the answers for each API key."),
            ("modelops_key_completion_tokens_total", "Completion tokens of the answers for each API key."))


class KeyUsage:
    """Counts per key since the instance started; thread-safe (the frontend answers on one
    event loop, but the usage callback may come from a stream's own task)."""

    def __init__(self) -> None:
        self._counts: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
        self._lock = threading.Lock()

    def record(self, key: str | None, prompt_tokens: int, completion_tokens: int = 0) -> None:
        """One answered request of ``key`` (nothing for a request without one, or with a name no
        key can have: the router sends every request with its key's name once keys are on)."""
        if not key or not re.match(KEY_NAME_PATTERN, key):
            return
        with self._lock:
            c = self._counts[key]
            c[0] += 1
            c[1] += int(prompt_tokens)
            c[2] += int(completion_tokens)

    def snapshot(self) -> dict[str, tuple[int, int, int]]:
        """``{key: (requests, prompt_tokens, completion_tokens)}``."""
        with self._lock:
            return {k: tuple(v) for k, v in self._counts.items()}

    def exposition(self, model_id: str, engine: dict[str, list[int]] | None = None) -> str:
        """Prometheus text of the counters (empty before any keyed request), with ``engine``'s
        ``{key: [requests, prompt_tokens, completion_tokens]}`` (the KServe answers the engine
        counted itself: runtime.frontend.metrics) added."""
        from runtime.frontend.metrics import label

        counts = {k: list(v) for k, v in self.snapshot().items()}
        for k, v in (engine or {}).items():
            if re.match(KEY_NAME_PATTERN, k):
                counts[k] = [a + b for a, b in zip(counts.get(k, [0, 0, 0]), v)]
        if not counts:
            return ""
        out = []
        for i, (name, help_) in enumerate(_METRICS):
            out += [f"# HELP {name} {help_}", f"# TYPE {name} counter"]
            out += [f'{name}{{model_name="{label(model_id)}",key="{label(k)}"}} {v[i]}'
                    for k, v in sorted(counts.items())]
        return "\n".join(out) + "\n"
