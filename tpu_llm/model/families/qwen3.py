"""qwen3: Qwen3's dense models (Yang et al. 2025), transformers' Qwen3ForCausalLM: Llama's layout with an
RMSNorm over each head of q and of k before the rotation (q_norm, k_norm), no biases, and a head size of
its own (config.json's head_dim: 128 for Qwen3-0.6B's 1024-wide, 16-head layers). Its sliding window is
Qwen2's (use_sliding_window, from max_window_layers on): refused at import unless it covers the context.
"""

from __future__ import annotations

import dataclasses

from tpu_llm.model.families.base import ROTARY, ROTARY_PEFT_TARGETS, Family
from tpu_llm.model.families.qwen2 import Qwen2


class Qwen3(Qwen2):
    validate_bias = Family.validate_bias  # no biases

    def bias_from_hf(self, read) -> bool:
        read.expect("attention_bias", (False,), False, "false: Qwen3's checkpoints have no attention biases")
        return False

    def attention_extras(self, m, h: str, b: str) -> list[tuple[str, str, bool]]:
        """Qwen3's norms of each head's q and k."""
        return [(f"{h}self_attn.{p}_norm.weight", f"{b}attn/{p}_norm/scale", False) for p in ("q", "k")]

    def to_hf_extra(self, m) -> dict:
        return {"attention_bias": False, **super().to_hf_extra(m)}


FAMILY = Qwen3(
    name="qwen3", summary="Qwen3: Llama's layout with q/k norms per head, no biases, its own head size",
    block=dataclasses.replace(ROTARY, qk_norm=True), architectures=("Qwen3ForCausalLM",), model_type="qwen3",
    peft_targets=ROTARY_PEFT_TARGETS, peft_default="q_proj,v_proj", defaults={"bias": False})
