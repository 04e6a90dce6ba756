"""Evaluation with EleutherAI's lm-evaluation-harness (the `lm_eval` package, the `eval` extra): its tasks and
metrics run on a loaded run through `TpuLM` (tpu_llm/eval/backend.py), a backend of lm-eval's own kind.
docs/evaluation.md tells how. Importing this package needs no lm_eval; `require_lm_eval` names the extra."""

from __future__ import annotations

from tpu_llm.errors import UserError

EXTRA = "pip install 'tpu-llm[eval]'"


def require_lm_eval():
    """The lm_eval module, or a UserError naming the extra that installs it."""
    try:
        import lm_eval
    except ImportError:
        raise UserError(f"evaluation needs lm-evaluation-harness (lm_eval), which is not installed: {EXTRA}") from None
    return lm_eval
