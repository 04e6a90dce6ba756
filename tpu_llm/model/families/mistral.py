"""mistral: Mistral 7B (Jiang et al. 2023), transformers' MistralForCausalLM: Llama's layout under
Mistral's names. Its sliding window is refused at import unless it covers the context (tpu-llm has full
causal attention only), and export writes `sliding_window: null`.
"""

from __future__ import annotations

from tpu_llm.model.families.base import ROTARY, ROTARY_PEFT_TARGETS, Family


class Mistral(Family):
    def to_hf_extra(self, m) -> dict:
        return {"sliding_window": None}  # full causal attention


FAMILY = Mistral(
    name="mistral", summary="Mistral: Llama's layout (a sliding window only where it covers the context)",
    block=ROTARY, architectures=("MistralForCausalLM",), model_type="mistral",
    peft_targets=ROTARY_PEFT_TARGETS, peft_default="q_proj,v_proj", defaults={"bias": False})
