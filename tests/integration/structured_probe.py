"""Run with the runtime image's Python: what llguidance and xgrammar (as vLLM 0.32 configures
them, compact JSON) do with JSON Schemas, without an engine.

    python structured_probe.py <tokenizer dir> <jobs.json> <report.json>

jobs: ``[{"schema": ..., "instances": ["<json text>", ...]}]``. Report, per job and backend
(``guidance``, ``xgrammar``): ``error`` (the compile/validate error, "" when accepted) and
``accepts`` (per instance: whether the grammar lets the whole text through and can stop there).
"""

import json
import sys

import llguidance
import llguidance.hf
import xgrammar as xgr
from transformers import AutoTokenizer
from xgrammar.testing import _is_grammar_accept_string


def guidance(llt, tok, schema, instances):
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        error = llguidance.LLMatcher.validate_grammar(grammar, llt)
    except Exception as e:  # noqa: BLE001 - the error is the finding
        return {"error": str(e), "accepts": []}
    if error:
        return {"error": error, "accepts": []}
    accepts = []
    for text in instances:
        matcher = llguidance.LLMatcher(llt, grammar)
        ids = tok.encode(text, add_special_tokens=False)
        taken = matcher.try_consume_tokens(ids)
        accepts.append(taken == len(ids) and not matcher.is_error() and matcher.is_accepting())
    return {"error": "", "accepts": accepts}


def xgrammar(schema, instances):
    try:
        grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))
    except Exception as e:  # noqa: BLE001
        return {"error": str(e), "accepts": []}
    return {"error": "", "accepts": [_is_grammar_accept_string(grammar, t) for t in instances]}


def main(tokenizer_dir, jobs_path, report_path):
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    llt = llguidance.hf.from_tokenizer(tok)
    jobs = json.load(open(jobs_path))
    report = [{"guidance": guidance(llt, tok, j["schema"], j["instances"]),
               "xgrammar": xgrammar(j["schema"], j["instances"])} for j in jobs]
    json.dump(report, open(report_path, "w"))


if __name__ == "__main__":
    main(*sys.argv[1:4])
