"""Constraint logits processor in the real vLLM engine (runtime image, tiny random-weight Llama).

One run of tests/integration/vllm_constraints_run.py per session (two engines in one process,
about 20 s on 2 cores); the tests below read its report. Every output is replayed through the
plain-Python reference: it must end with EOS in an accepting state.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.integration.conftest import REPO

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="session")
def report(tmp_path_factory) -> dict:
    from tasks.image import build_runtime_image
    from tests.models.make_tiny_llama import make

    image = build_runtime_image()
    model = make(tmp_path_factory.mktemp("tiny-llama-constraints") / "model")
    out = tmp_path_factory.mktemp("constraints") / "report.json"
    proc = subprocess.run([str(image.python), str(REPO / "tests" / "integration" / "vllm_constraints_run.py"),
                           str(model), str(out)], env={**os.environ, **image.env()}, cwd=REPO,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


def _invalid(results: list[dict]) -> list[dict]:
    return [r for r in results if not r["valid"]]


def test_32_concurrent_requests_with_different_constraints_are_all_valid(report):
    results = report["concurrent"]["results"]
    assert len(results) == 32
    assert not _invalid(results), _invalid(results)
    assert len({tuple(r["tokens"]) for r in results}) > 16  # different constraints, different outputs


def test_malformed_constraint_is_refused_naming_the_field(report):
    err = report["malformed_error"]
    assert err is not None and "extra_args.constraint.min" in err, err


def test_outputs_stay_valid_under_preemption(report):
    pre = report["preemption"]
    assert pre["preemptions_after"] > pre["preemptions_before"], pre
    assert pre["resumed_with_history"] >= 1  # re-added with output ids already there: replayed
    assert len(pre["results"]) == 48 and not _invalid(pre["results"]), _invalid(pre["results"])


def test_outputs_stay_valid_under_chunked_prefill(report):
    cp = report["chunked_prefill"]
    assert min(cp["prompt_tokens"]) > 4 * cp["max_num_batched_tokens"]  # every prompt takes 5+ chunks
    assert not _invalid(cp["results"]), _invalid(cp["results"])
