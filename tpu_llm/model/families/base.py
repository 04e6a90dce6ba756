"""What a model family declares, and the rotary layout most families share. No TensorFlow.

A family (`model.family`) is one module of this folder holding one `Family`: its block variant (which
norm, MLP, q/k/v projections, positions and biases the shared layers build: `Block`), its config checks
and the MLP's default size, its Hugging Face names (config.json both ways, the tensor names of its
weights) and the module names PEFT adapts (`peft_targets`). Everything else (the layers, the trainer,
pipeline stages, tensor groups, the planner, import and export) asks the family through the registry
(families/__init__.py) and never compares a family's name.

`m` below is a config.ModelConfig (or a model section read from an older run: the registry's `of`),
`read` an interop.hf_config.ConfigJson (typed, capped fields of a config.json) and `check(ok, message)`
config's one-line check. The families need none of those modules: they are handed in.
"""

from __future__ import annotations

import dataclasses
import math

from tpu_llm.errors import UserError


@dataclasses.dataclass(frozen=True)
class Block:
    """The decoder block a family builds from the shared layers (model/layers.py, model/transformer.py)."""

    norm: str  # "layer": LayerNormalization (beta with model.bias) | "rms": RMSNorm (one scale)
    mlp: str  # "gelu": proj(gelu(fc(x))) | "swiglu": down(silu(gate(x)) * up(x))
    qkv: str  # "fused": one (C, 3C) projection, q, k, v side by side | "separate": q, k, v (k, v Hkv heads wide)
    positions: str  # "learned": a (max_len, C) table added to the embeddings | "rotary": in attention
    bias: str  # with model.bias, which layers have biases: "all" (Dense layers and the norms' beta) | "qkv"
    qk_norm: bool = False  # an RMSNorm over each head of q and of k, before the rotation (Qwen3)

    def dense_bias(self, name: str, bias: bool) -> bool:
        """Whether the Dense layer `name` (qkv, q, k, v, proj, fc, gate, up, down) has a bias."""
        return bias and (self.bias == "all" or name in ("q", "k", "v"))

    @property
    def rotary(self) -> bool:
        return self.positions == "rotary"


@dataclasses.dataclass(frozen=True)
class Family:
    """A model family: the defaults below are Llama's layout, which the rotary families share."""

    name: str
    summary: str  # one line, for docs and messages
    block: Block
    architectures: tuple[str, ...]  # Hugging Face `architectures` read as this family
    model_type: str  # config.json's model_type, written by export (with architectures[0])
    # PEFT's module names -> the layers (below a block) each adapts; PEFT's default targets; fan_in_fan_out
    # (GPT-2's Conv1D stores (in, out), as Keras does)
    peft_targets: dict = dataclasses.field(default_factory=dict)
    peft_default: str = ""
    peft_fan_in_fan_out: bool = False
    # model section values this family needs where the schema's default (gpt2's) does not fit it
    defaults: dict = dataclasses.field(default_factory=dict)

    # ---- the model section ------------------------------------------------------------------------

    def hidden(self, m) -> int:
        """The MLP's hidden size when model.mlp_hidden is 0: Meta's rule for SwiGLU (int(2/3 of 4C), up to a
        multiple of 256: 11008 for 4096)."""
        return -(-int(8 * m.n_embd / 3) // 256) * 256

    def validate(self, m, check) -> None:
        """The model section's family-specific checks (config/checks.py runs the shared ones first)."""
        self.validate_bias(m, check)
        validate_rope_scaling(m, check)
        check(m.n_head % m.kv_heads() == 0, lambda: f"model.n_kv_head={m.n_kv_head} must divide model.n_head="
                                                    f"{m.n_head}; valid values: {divisors(m.n_head)}")
        check(m.head_size() % 2 == 0, f"the heads' width (model.head_dim, or model.n_embd / model.n_head) = "
                                      f"{m.head_size()} is odd: rotary embeddings rotate pairs of dimensions; "
                                      "choose an even head size")

    def validate_bias(self, m, check) -> None:
        check(not m.bias, f"model.bias=true: the {self.name} family has no biases; set model.bias=false")

    def peft_modules(self, text: str) -> list[str]:
        """The PEFT module names a comma-separated list gives ("": the family's default), in order, once
        each; unknown names kept (config/checks.py refuses them)."""
        return list(dict.fromkeys(n.strip() for n in (text or self.peft_default).split(",") if n.strip()))

    # ---- Hugging Face ------------------------------------------------------------------------------

    def from_hf(self, read) -> dict:
        """The model section for the config.json `read` wraps (Llama's layout)."""
        C, H = read.int("hidden_size", "model.n_embd"), read.int("num_attention_heads", "model.n_head")
        read.expect("hidden_act", ("silu",), "silu", "silu (SwiGLU)")
        bias = self.bias_from_hf(read)
        read.expect("mlp_bias", (False,), False, "false: no biases")
        head_dim = self.head_dim_from_hf(read, C, H)
        read.expect("pretraining_tp", (1,), 1, "1")
        kv = read.int("num_key_value_heads", "model.n_head") if read.get("num_key_value_heads") not in (None, 0) else H
        return {"family": self.name, "n_layer": read.int("num_hidden_layers", "model.n_layer"), "n_head": H,
                "n_embd": C, "max_len": read.int("max_position_embeddings", "model.max_len"),
                "dropout": read.float("attention_dropout", 0.0), "bias": bias,
                "vocab_size": read.int("vocab_size", "model.vocab_size"), "n_kv_head": kv,
                "mlp_hidden": read.int("intermediate_size", "model.mlp_hidden"), **head_dim, **rope_from_hf(read),
                "norm_eps": read.float("rms_norm_eps", 1e-6), "tie_embeddings": read.bool("tie_word_embeddings", False)}

    def bias_from_hf(self, read) -> bool:
        """model.bias: Llama's attention has none (Qwen2's q/k/v biases are its own family's)."""
        read.expect("attention_bias", (False,), False, "false: no biases in Llama's attention (Qwen2 is its own family)")
        return False

    def head_dim_from_hf(self, read, C: int, H: int) -> dict:
        """model.head_dim from config.json's head_dim: none (0) where it is hidden_size / num_attention_heads."""
        if read.get("head_dim") is None:
            return {}
        head_dim = read.int("head_dim", "model.head_dim")
        return {} if head_dim * H == C else {"head_dim": head_dim}

    def check_context(self, read, context: int) -> None:
        """A UserError if a sliding window (Mistral's) is shorter than `context`, the context the import
        keeps: only then does it differ from full causal attention, which is all tpu-llm has."""
        if not self.window_on(read) or read.get("sliding_window") is None:
            return
        window = read.int("sliding_window")
        if self.window_layers(read) and window < context:
            raise UserError(f"config.json: sliding_window={window} is shorter than the context of {context} tokens, "
                            f"and tpu-llm has no sliding-window attention; import with --max_len {window} (or less)")

    def window_on(self, read) -> bool:
        """Whether config.json's sliding_window is in use (Mistral: whenever it is given)."""
        return True

    def window_layers(self, read) -> bool:
        """Whether some layer attends through the sliding window (Mistral: every layer)."""
        return True

    def to_hf(self, m, bos_id: int, eos_id: int, dtype: str) -> dict:
        """config.json for the model section `m`."""
        rope = {"rope_type": "default", "rope_theta": m.rope_theta}
        if getattr(m, "rope_scaling", "none") == "llama3":
            rope = {"rope_type": "llama3", "rope_theta": m.rope_theta, "factor": m.rope_factor,
                    "low_freq_factor": m.rope_low_freq_factor, "high_freq_factor": m.rope_high_freq_factor,
                    "original_max_position_embeddings": m.rope_original_max_len}
        return {"architectures": [self.architectures[0]], "model_type": self.model_type, "vocab_size": m.vocab_size,
                "hidden_size": m.n_embd, "intermediate_size": m.hidden(), "num_hidden_layers": m.n_layer,
                "num_attention_heads": m.n_head, "num_key_value_heads": m.kv_heads(), "head_dim": m.head_size(),
                "max_position_embeddings": m.max_len, "rms_norm_eps": getattr(m, "norm_eps", 1e-5), "hidden_act": "silu",
                "attention_dropout": m.dropout, "initializer_range": 0.02,
                # rope_parameters for transformers 5, rope_theta and rope_scaling for 4.x
                "rope_theta": m.rope_theta, "rope_parameters": rope,
                **({"rope_scaling": {k: v for k, v in rope.items() if k != "rope_theta"}} if len(rope) > 2 else {}),
                "tie_word_embeddings": m.tie_embeddings, "use_cache": True, "bos_token_id": bos_id,
                "eos_token_id": eos_id, "dtype": dtype, **self.to_hf_extra(m)}

    def to_hf_extra(self, m) -> dict:
        """The family's own config.json fields."""
        return {"attention_bias": False, "mlp_bias": False}

    def weights(self, m) -> list[tuple[str, str, bool]]:
        """(Hugging Face tensor name, Keras variable path without the model's prefix, transposed?) of every
        weight, in the order export writes them (Llama's names)."""
        out = [("model.embed_tokens.weight", "wte/embeddings", False)]
        for i in range(m.n_layer):
            h, b = f"model.layers.{i}.", f"block_{i}/"
            out += [(f"{h}input_layernorm.weight", f"{b}ln1/scale", False)]
            out += [(f"{h}self_attn.{p}_proj.weight", f"{b}attn/{q}/kernel", True)
                    for p, q in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "proj"))]
            out += self.attention_extras(m, h, b)
            out += [(f"{h}post_attention_layernorm.weight", f"{b}ln2/scale", False)]
            out += [(f"{h}mlp.{p}_proj.weight", f"{b}mlp/{p}/kernel", True) for p in ("gate", "up", "down")]
        out.append(("model.norm.weight", "ln_f/scale", False))
        if not m.tie_embeddings:
            out.append(("lm_head.weight", "lm_head/embeddings", False))
        return out

    def attention_extras(self, m, h: str, b: str) -> list[tuple[str, str, bool]]:
        """A block's attention weights beyond q, k, v and o (Qwen2's biases, Qwen3's q/k norms)."""
        return []

    def hf_names(self, names: list[str]) -> dict[str, str]:
        """{the name `weights` uses: the name stored in the checkpoint} for a checkpoint's tensor names."""
        return {n: n for n in names}

    def ignored(self, name: str, m) -> bool:
        """A checkpoint's tensor that is no weight: rotary inv_freq buffers, a tied head saved beside its table."""
        return name.endswith("rotary_emb.inv_freq") or name == "lm_head.weight" and getattr(m, "tie_embeddings", True)


ROPE_SCALINGS = ("none", "llama3")  # model.rope_scaling: plain rotary, or Llama 3.1's long-context frequencies


def validate_rope_scaling(m, check) -> None:
    """model.rope_scaling and its factors, as transformers' _validate_llama3_parameters checks them."""
    check(m.rope_scaling in ROPE_SCALINGS,
          f"model.rope_scaling={m.rope_scaling!r}; valid choices: {', '.join(ROPE_SCALINGS)}")
    if m.rope_scaling == "llama3":
        check(m.rope_factor >= 1, f"model.rope_factor={m.rope_factor} must be >= 1")
        check(0 < m.rope_low_freq_factor < m.rope_high_freq_factor,
              f"model.rope_low_freq_factor={m.rope_low_freq_factor} and model.rope_high_freq_factor="
              f"{m.rope_high_freq_factor}: need 0 < low < high")
        check(m.rope_original_max_len >= 1, f"model.rope_original_max_len={m.rope_original_max_len} must be >= 1")


# the rotary families' PEFT module names, and what each adapts here (model/transformer.py's layers)
ROTARY_PEFT_TARGETS = {"q_proj": ("attn/q",), "k_proj": ("attn/k",), "v_proj": ("attn/v",), "o_proj": ("attn/proj",),
                       "gate_proj": ("mlp/gate",), "up_proj": ("mlp/up",), "down_proj": ("mlp/down",)}
ROTARY = Block(norm="rms", mlp="swiglu", qkv="separate", positions="rotary", bias="qkv")
ROPE_TYPES = ("default", "llama3")


def rope_from_hf(read) -> dict:
    """The model section's rotary settings, from transformers 5's rope_parameters or the older rope_theta
    and rope_scaling: the base, and Llama 3.1's frequency scaling (rope_type llama3) with its four numbers."""
    out = {"rope_theta": 10000.0}
    for field in ("rope_scaling", "rope_parameters"):  # the newer last: it wins
        params = read.object(field)
        kind = params.get("rope_type", params.get("type", "default"))
        if kind not in ROPE_TYPES:
            raise read.unsupported(f"{field}.rope_type", kind, "supported: " + ", ".join(ROPE_TYPES))
        params.expect("partial_rotary_factor", (1, 1.0), 1.0, "1.0: every dimension rotates")
        if kind == "llama3":
            out.update(rope_scaling="llama3", rope_factor=params.float("factor", None),
                       rope_low_freq_factor=params.float("low_freq_factor", None),
                       rope_high_freq_factor=params.float("high_freq_factor", None),
                       rope_original_max_len=params.int("original_max_position_embeddings",
                                                        "model.rope_original_max_len"))
        elif params:
            out.pop("rope_scaling", None)  # rope_parameters says default: an old rope_scaling is overruled
    out["rope_theta"] = read.object("rope_parameters").float("rope_theta", read.float("rope_theta", 10000.0))
    return out


def divisors(n: int, at_most: int | None = None, shown: int = 24) -> str:
    """The divisors of `n` (up to `at_most`) for a message, comma-separated: found in sqrt(n) steps, and
    only the first `shown` of them listed."""
    small = [k for k in range(1, math.isqrt(n) + 1) if n % k == 0]
    found = sorted(set(small + [n // k for k in small]))
    found = [k for k in found if at_most is None or k <= at_most]
    more = f" (and {len(found) - shown} more)" if len(found) > shown else ""
    return ", ".join(map(str, found[:shown])) + more
