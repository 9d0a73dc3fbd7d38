"""Runs the real vLLM engine (offline ``vllm.LLM``, in-process) with the constraint processor on
the tiny random-weight Llama and checks every output against the plain-Python reference.

Run with the runtime image's interpreter (PYTHONPATH = repo root); writes one JSON report:

    python tests/integration/vllm_constraints_run.py MODEL_DIR OUT.json

Scenarios (two engines, one process):
* concurrent — 32 requests with 32 different constraints (catalogs by ids and by texts, DFAs,
  unique repeats with a separator, sequences), all in one ``generate`` call; the processor is
  passed as ``logits_processors=[cls]`` (the entry point loads it too; one instance stays idle).
* preemption — a KV cache of 16 blocks × 32 tokens (``num_gpu_blocks_override``: the smallest
  ``VLLM_CPU_KVCACHE_SPACE`` is 1 GiB, half a million tokens of this model), prompts of 150-300
  tokens, 24 requests: the scheduler must preempt; ``vllm:num_preemptions`` before/after.
* chunked_prefill — same engine (``max_num_batched_tokens`` 64), 8 prompts of 300-400 tokens, so
  every prompt is prefilled in 5+ chunks while other rows decode; loaded through the entry point only.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: starts faster, same engine code
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default takes most of the RAM

EOS = 1
FIRST_FREE = 2  # ids 0 (BOS) and 1 (EOS) never appear inside constraints


def _items(rng: random.Random, pool: list[int], n: int, max_len: int) -> list[list[int]]:
    return [[rng.choice(pool) for _ in range(rng.randint(1, max_len))] for _ in range(n)]


def _dfa(rng: random.Random, pool: list[int], depth: int, stride: int | None = None) -> dict:
    """An acyclic DFA: layered states, 1-3 transitions per state on disjoint slices of ``pool``,
    each jumping ahead by at most ``stride`` states; the last state accepts (and some middle
    ones), so every path ends within ``depth`` tokens."""
    sets, trans = [], []
    for s in range(depth):
        toks = rng.sample(pool, 6)
        k = rng.randint(1, 3)
        for j in range(k):
            sets.append(sorted(toks[j * 2:(j + 1) * 2]))
            trans.append([s, len(sets) - 1, min(depth, s + rng.randint(1, stride or depth))])
    accepting = [depth] + [s for s in range(1, depth) if stride is None and rng.random() < 0.3]
    return {"type": "dfa", "num_states": depth + 1, "start": 0, "accepting": accepting, "sets": sets,
            "transitions": trans}


def make_constraints(rng: random.Random, vocab: int, texts: list[str], n: int, long: bool = False) -> list[dict]:
    """``n`` different constraints, cycling through the kinds. Token pools are disjoint where parts
    meet so compositions are unambiguous. ``long``: outputs of 20-60 tokens (DFAs and repeats
    only), so sequences grow across KV blocks and get preempted."""
    ids = list(range(FIRST_FREE, vocab))
    out: list[dict] = []
    for i in range(n):
        rng.shuffle(ids)
        a, b, c, sep = ids[:120], ids[120:240], ids[240:360], ids[360]
        kind = i % 5
        if long:
            if i % 2:
                out.append(_dfa(rng, a, rng.randint(20, 40), stride=2))
            else:
                k = rng.randint(6, 10)
                out.append({"type": "repeat", "item": {"type": "catalog", "items": _items(rng, a, 40, 5)},
                            "min": k, "max": k, "separator": [sep], "unique": True})
        elif kind == 0:
            out.append({"type": "catalog", "items": _items(rng, a, rng.randint(5, 200), 6)})
        elif kind == 1:
            out.append({"type": "catalog", "texts": rng.sample(texts, rng.randint(3, len(texts)))})
        elif kind == 2:
            out.append(_dfa(rng, a, rng.randint(2, 8)))
        elif kind == 3:
            k = rng.randint(2, 4)
            out.append({"type": "repeat", "item": {"type": "catalog", "items": _items(rng, a, 12, 4)},
                        "min": k, "max": k, "separator": [sep], "unique": True})
        else:
            out.append({"type": "sequence", "parts": [
                {"type": "literal", "tokens": [sep]},
                {"type": "repeat", "item": {"type": "catalog", "items": _items(rng, b, 30, 3)}, "min": 1, "max": 3,
                 "separator": [c[0]]},
                _dfa(rng, c[1:], 3),
            ]})
    return out


def check(outputs, specs, vocab: int, tokenize) -> list[dict]:
    """Replay each output through the reference engine: valid = finished by EOS in an accepting state."""
    from modelops_native import compile_constraint

    rows = []
    for out, spec in zip(outputs, specs):
        comp = out.outputs[0]
        toks = list(comp.token_ids)
        body = toks[:-1] if toks and toks[-1] == EOS else toks
        ref = compile_constraint(spec, vocab, tokenize=tokenize, engine="reference")
        st = ref.program.initial()
        for t in body:
            st = ref.program.step(st, t)
        ok = comp.finish_reason == "stop" and toks[-1:] == [EOS] and ref.program.accepts(st)
        rows.append({"tokens": toks, "finish_reason": comp.finish_reason, "valid": bool(ok)})
    return rows


def preemptions(llm) -> float:
    return sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name == "vllm:num_preemptions")


def main(model_dir: str, out_path: str) -> None:
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.inputs import TokensPrompt

    from runtime.engine.logits import v1 as plugin

    tok = AutoTokenizer.from_pretrained(model_dir)
    with open(os.path.join(model_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]

    def tokenize(ts):
        return tok(ts, add_special_tokens=False)["input_ids"]

    texts = ["Triton", "vLLM", "red shoe", "blue shirt", "zero downtime", "object storage", "the lazy dog",
             "quick brown fox", "rollout", "traffic"]
    rng = random.Random(8)
    report: dict = {"vocab": vocab}

    def prompts(n: int, lo: int, hi: int):
        return [TokensPrompt(prompt_token_ids=[rng.randrange(FIRST_FREE, vocab) for _ in range(rng.randint(lo, hi))])
                for _ in range(n)]

    def params(specs, as_json_every: int = 0, seeded: bool = True):
        # Per-request seeds only without chunked prefill: vLLM 0.32 on CPU crashes when a seeded
        # request's partial-prefill sample is discarded ("CPU Generator does not use offset").
        ps = []
        for i, s in enumerate(specs):
            c = json.dumps(s) if as_json_every and i % as_json_every == 0 else s  # the vllm_xargs form
            ps.append(SamplingParams(temperature=1.0 if i % 4 else 0.0, seed=i if seeded else None, max_tokens=128,
                                     extra_args={"constraint": c}))
        return ps

    # -- concurrent -------------------------------------------------------------------------------
    t0 = time.monotonic()
    llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=64, seed=0,
              logits_processors=[plugin.ConstraintLogitsProcessor], disable_log_stats=False)
    report["engine_start_s"] = round(time.monotonic() - t0, 1)
    specs = make_constraints(rng, vocab, texts, 32)
    t0 = time.monotonic()
    outs = llm.generate(prompts(32, 8, 40), params(specs, as_json_every=3), use_tqdm=False)
    report["concurrent"] = {"seconds": round(time.monotonic() - t0, 2), "results": check(outs, specs, vocab, tokenize)}
    try:
        llm.generate(["x"], SamplingParams(max_tokens=4, extra_args={"constraint": {"type": "repeat", "min": 0,
                                                                                    "item": {"type": "literal",
                                                                                             "tokens": [5]}}}),
                     use_tqdm=False)
        report["malformed_error"] = None
    except (VLLMValidationError, ValueError) as e:
        report["malformed_error"] = f"{type(e).__name__}: {e}"
    del llm
    import gc

    gc.collect()

    # -- preemption + chunked prefill (one engine) --------------------------------------------------
    llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=480, block_size=32, num_gpu_blocks_override=16,
              max_num_batched_tokens=64, max_num_seqs=16, enable_chunked_prefill=True, seed=0,
              disable_log_stats=False)
    # Loaded through the entry point alone here: the working instance must exist.
    proc = next(p() for p in plugin._live.values() if p() is not None and not p()._idle)
    before = preemptions(llm)
    specs = make_constraints(rng, vocab, texts, 48, long=True)
    t0 = time.monotonic()
    outs = llm.generate(prompts(48, 60, 160), params(specs, seeded=False), use_tqdm=False)
    report["preemption"] = {"seconds": round(time.monotonic() - t0, 2), "results": check(outs, specs, vocab, tokenize),
                            "preemptions_before": before, "preemptions_after": preemptions(llm),
                            "resumed_with_history": proc.rows.resumed, "replays": proc.batch.replays}
    specs = make_constraints(rng, vocab, texts, 8)
    t0 = time.monotonic()
    outs = llm.generate(prompts(8, 300, 400), params(specs, seeded=False), use_tqdm=False)
    report["chunked_prefill"] = {"seconds": round(time.monotonic() - t0, 2), "max_num_batched_tokens": 64,
                                 "prompt_tokens": [len(o.prompt_token_ids) for o in outs],
                                 "results": check(outs, specs, vocab, tokenize)}
    with open(out_path, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
