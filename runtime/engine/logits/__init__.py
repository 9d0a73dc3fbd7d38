"""Per-request token constraints for vLLM, on the native engine (modelops_native).

Front door for what needs no vLLM import: the request config (:mod:`runtime.engine.logits.config`) and
the batch bookkeeping (:mod:`runtime.engine.logits.state`). The V1 logits processor itself is
``runtime.engine.logits.v1:ConstraintLogitsProcessor`` (imports vLLM; registered by the entry point
``vllm.logits_processors`` of modelops-native, or via ``--logits-processors``).
"""

from runtime.engine.logits.config import (
    END_NOW,
    EXTRA_ARGS_KEY,
    constraint_spec,
    validate_constraint,
)
from runtime.engine.logits.state import ConstraintRows

__all__ = ["END_NOW", "EXTRA_ARGS_KEY", "ConstraintRows", "constraint_spec", "validate_constraint"]
