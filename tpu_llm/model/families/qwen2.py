"""qwen2: Qwen2 and Qwen2.5 (Yang et al. 2024), transformers' Qwen2ForCausalLM: Llama's layout with
biases on the q, k and v projections (model.bias: true; Qwen2's config.json does not mention them). Its
sliding window (use_sliding_window, on the layers from max_window_layers on) is refused at import unless
it covers the context.
"""

from __future__ import annotations

import dataclasses

from tpu_llm.model.families.base import ROTARY, ROTARY_PEFT_TARGETS, Family


class Qwen2(Family):
    def validate_bias(self, m, check) -> None:
        check(m.bias, "model.bias=false: the qwen2 family has q/k/v biases (model.bias=true); without them use "
                      "model.family=llama")

    def bias_from_hf(self, read) -> bool:
        read.expect("attention_bias", (False,), False, "false: no biases in Llama's attention (Qwen2 is its own family)")
        return True

    def window_on(self, read) -> bool:
        return read.bool("use_sliding_window", False)

    def window_layers(self, read) -> bool:
        """Only the layers from max_window_layers on (or as layer_types says) slide."""
        types = read.get("layer_types")
        first = read.int("max_window_layers", default=0, low=0)
        return "sliding_attention" in types if isinstance(types, list) else first < read.int("num_hidden_layers")

    def attention_extras(self, m, h: str, b: str) -> list[tuple[str, str, bool]]:
        """Qwen2's q/k/v biases (in the order its checkpoints list them)."""
        return [(f"{h}self_attn.{p}_proj.bias", f"{b}attn/{p}/bias", False) for p in ("q", "k", "v")]

    def to_hf_extra(self, m) -> dict:  # full causal attention
        return {"sliding_window": None, "use_sliding_window": False, "max_window_layers": m.n_layer}


FAMILY = Qwen2(
    name="qwen2", summary="Qwen2/2.5: Llama's layout with q/k/v biases",
    block=dataclasses.replace(ROTARY, bias="qkv"), architectures=("Qwen2ForCausalLM",), model_type="qwen2",
    peft_targets=ROTARY_PEFT_TARGETS, peft_default="q_proj,v_proj")
