"""gpt2: GPT-2 (Radford et al. 2019), as transformers' GPT2LMHeadModel computes it.

Token embedding (tied with the output head) + learned positions -> pre-LayerNorm blocks of causal
multi-head attention (one fused (C, 3C) q/k/v projection, q, k and v side by side, each head-major) and
a tanh-GELU MLP -> final LayerNorm. model.bias puts biases on every Dense layer and a beta on every norm.
"""

from __future__ import annotations

from tpu_llm.model.families.base import Block, Family


class GPT2(Family):
    def hidden(self, m) -> int:
        return 4 * m.n_embd

    def validate(self, m, check) -> None:
        check(m.rope_scaling == "none", f"model.rope_scaling={m.rope_scaling!r}: gpt2 learns its positions (no rotary "
                                        "embeddings); set model.rope_scaling=none")
        check(m.n_kv_head in (0, m.n_head), f"model.n_kv_head={m.n_kv_head}: grouped-query attention is for "
                                             "model.family=llama; set model.n_kv_head=0 for gpt2")
        check(m.head_dim in (0, m.n_embd // m.n_head), f"model.head_dim={m.head_dim}: gpt2's heads are n_embd / "
                                                       "n_head wide (its q, k and v are one (C, 3C) kernel); set "
                                                       "model.head_dim=0")
        check(m.tie_embeddings, "model.tie_embeddings=false: gpt2's output head is the embedding table; "
                                "use model.family=llama for an untied head")
        check(m.rope_theta == DEFAULT_ROPE_THETA, f"model.rope_theta={m.rope_theta}: gpt2 learns its positions "
                                                  "(no rotary embeddings); remove it or use model.family=llama")

    # ---- Hugging Face ------------------------------------------------------------------------------

    def from_hf(self, read) -> dict:
        C = read.int("n_embd", "model.n_embd")
        read.expect("activation_function", ("gelu_new", "gelu_pytorch_tanh"), "gelu_new", "the tanh GELU: gelu_new")
        read.expect("n_inner", (None, 4 * C), None, f"4 x n_embd = {4 * C}")
        read.expect("scale_attn_weights", (True,), True, "true")
        read.expect("scale_attn_by_inverse_layer_idx", (False,), False, "false")
        read.expect("add_cross_attention", (False,), False, "false: a decoder only")
        read.expect("tie_word_embeddings", (True,), True, "true: GPT-2's head is its embedding table")
        return {"family": self.name, "n_layer": read.int("n_layer", "model.n_layer"),
                "n_head": read.int("n_head", "model.n_head"), "n_embd": C,
                "max_len": read.int("n_positions", "model.max_len"), "dropout": read.float("resid_pdrop", 0.1),
                "bias": True, "vocab_size": read.int("vocab_size", "model.vocab_size"),
                "norm_eps": read.float("layer_norm_epsilon", 1e-5)}

    def check_context(self, read, context: int) -> None:
        """GPT-2 attends over its whole context."""

    def to_hf(self, m, bos_id: int, eos_id: int, dtype: str) -> dict:
        return {"architectures": [self.architectures[0]], "model_type": self.model_type, "vocab_size": m.vocab_size,
                "n_positions": m.max_len, "n_embd": m.n_embd, "n_layer": m.n_layer, "n_head": m.n_head,
                "n_inner": None, "activation_function": "gelu_new", "resid_pdrop": m.dropout,
                "embd_pdrop": m.dropout, "attn_pdrop": m.dropout, "layer_norm_epsilon": getattr(m, "norm_eps", 1e-5),
                "initializer_range": 0.02, "scale_attn_weights": True, "use_cache": True,
                "bos_token_id": bos_id, "eos_token_id": eos_id, "tie_word_embeddings": True, "dtype": dtype}

    def weights(self, m) -> list[tuple[str, str, bool]]:
        out = [("transformer.wte.weight", "wte/embeddings", False), ("transformer.wpe.weight", "wpe/embeddings", False)]
        for i in range(m.n_layer):
            h, b = f"transformer.h.{i}.", f"block_{i}/"
            # GPT-2's Conv1D stores (in, out), as Keras does: no transpose
            for hf_name, ours in (("ln_1", "ln1"), ("attn.c_attn", "attn/qkv"), ("attn.c_proj", "attn/proj"),
                                  ("ln_2", "ln2"), ("mlp.c_fc", "mlp/fc"), ("mlp.c_proj", "mlp/proj")):
                w, bias = ("gamma", "beta") if ours.startswith("ln") else ("kernel", "bias")
                out += [(f"{h}{hf_name}.weight", f"{b}{ours}/{w}", False), (f"{h}{hf_name}.bias", f"{b}{ours}/{bias}", False)]
        return out + [("transformer.ln_f.weight", "ln_f/gamma", False), ("transformer.ln_f.bias", "ln_f/beta", False)]

    def hf_names(self, names: list[str]) -> dict[str, str]:
        """The hub's gpt2 checkpoint names its tensors without `transformer.` (wte.weight, h.0...)."""
        if any(n.startswith("transformer.") for n in names):
            return {n: n for n in names}
        return {f"transformer.{n}" if not n.startswith("lm_head") else n: n for n in names}

    def ignored(self, name: str, m) -> bool:
        """GPT-2's causal-mask buffers (older files), and its tied head saved beside the table."""
        return name.endswith((".attn.bias", ".attn.masked_bias")) or super().ignored(name, m)


DEFAULT_ROPE_THETA = 10000.0  # config.ModelConfig's: gpt2 has no rotary embeddings to give another

FAMILY = GPT2(
    name="gpt2", summary="GPT-2: LayerNorm, learned positions, fused q/k/v, GELU MLP, tied head",
    block=Block(norm="layer", mlp="gelu", qkv="fused", positions="learned", bias="all"),
    architectures=("GPT2LMHeadModel",), model_type="gpt2",
    # GPT-2's c_proj names the attention's and the MLP's output projections alike, as PEFT matches module names
    peft_targets={"c_attn": ("attn/qkv",), "c_proj": ("attn/proj", "mlp/proj"), "c_fc": ("mlp/fc",)},
    peft_default="c_attn", peft_fan_in_fan_out=True)
