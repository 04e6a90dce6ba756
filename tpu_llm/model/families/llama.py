"""llama: Llama 2 and 3.x (Touvron et al. 2023), as transformers' LlamaForCausalLM computes it.

Token embedding -> pre-RMSNorm blocks of grouped-query attention (model.n_kv_head key/value heads) with
rotary positions (HF's rotate_half layout; Llama 3.1's rescaled frequencies with model.rope_scaling=llama3)
and a SwiGLU MLP, no biases -> final RMSNorm -> the head: tied to the embedding or its own (V, C) table
(model.tie_embeddings). The rotary families (qwen2, mistral, qwen3) are this layout with their own
differences: what families/base.py's Family implements is Llama's.
"""

from __future__ import annotations

from tpu_llm.model.families.base import ROTARY, ROTARY_PEFT_TARGETS, Family

FAMILY = Family(
    name="llama", summary="Llama 2/3.x: RMSNorm, rotary, grouped-query attention, SwiGLU, no biases",
    block=ROTARY, architectures=("LlamaForCausalLM",), model_type="llama",
    peft_targets=ROTARY_PEFT_TARGETS, peft_default="q_proj,v_proj",  # PEFT's default for Llama
    defaults={"bias": False})
