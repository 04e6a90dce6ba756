"""The LoRA settings (train.lora_*, docs/lora.md): PEFT's module names per layout, the stored base's
dtypes, and their checks; tpu_llm/config.py holds the schema and calls `validate_lora`."""

from __future__ import annotations

from tpu_llm.config_reading import REPR
from tpu_llm.config_reading import check as _check

# train.lora_targets: PEFT's module names per layout, and what each adapts here (model/lora.py). gpt2's c_proj
# names the attention's and the MLP's output projections alike, as PEFT matches module names.
LORA_TARGETS = {
    "gpt2": {"c_attn": ("attn/qkv",), "c_proj": ("attn/proj", "mlp/proj"), "c_fc": ("mlp/fc",)},
    "rotary": {"q_proj": ("attn/q",), "k_proj": ("attn/k",), "v_proj": ("attn/v",), "o_proj": ("attn/proj",),
               "gate_proj": ("mlp/gate",), "up_proj": ("mlp/up",), "down_proj": ("mlp/down",)},
}
LORA_DEFAULT_TARGETS = {"gpt2": "c_attn", "rotary": "q_proj,v_proj"}  # PEFT's defaults for GPT-2 and Llama
LORA_BASE_DTYPES = ("float32", "bfloat16", "int8")  # train.lora_base_dtype: how a LoRA run stores its frozen base


def validate_lora(cfg) -> None:
    """The train.lora_* settings of `cfg` (a config.Config), each bad one a UserError of one line."""
    t = cfg.train
    _check(t.lora_rank >= 0, f"train.lora_rank={t.lora_rank} must be >= 0 (0 = off)")
    _check(t.lora_base_dtype in LORA_BASE_DTYPES,
           f"train.lora_base_dtype={t.lora_base_dtype!r}; valid choices: {', '.join(LORA_BASE_DTYPES)}")
    if not t.lora_rank:
        _check(t.lora_base_dtype == "float32", f"train.lora_base_dtype={t.lora_base_dtype} needs train.lora_rank > 0 "
                                               "(only a LoRA run's base is frozen); set train.lora_rank or drop it")
        return
    lora_targets(t.lora_targets, cfg.model.family)
    _check(t.lora_alpha > 0, f"train.lora_alpha={t.lora_alpha} must be > 0 (the adapters' scale is alpha / rank)")
    _check(0 <= t.lora_dropout < 1, f"train.lora_dropout={t.lora_dropout} must be in [0, 1)")
    _check(not t.freeze, f"train.freeze={REPR.repr(t.freeze)} with train.lora_rank={t.lora_rank}: LoRA freezes every "
                         "weight but the adapters already; drop train.freeze (or choose train.lora_targets)")
    _check(t.lora_dropout == 0 or cfg.parallel.tensor == 1,
           f"train.lora_dropout={t.lora_dropout} is not supported with parallel.tensor={cfg.parallel.tensor} (each "
           "group would draw its own mask of the adapter's input); set train.lora_dropout=0 or parallel.tensor=1")


def lora_targets(text: str, family: str) -> list[str]:
    """train.lora_targets as PEFT module names ("" = PEFT's default for the family); a UserError names an
    unknown one and the valid ones."""
    layout = "gpt2" if family == "gpt2" else "rotary"
    names = [n.strip() for n in (text or LORA_DEFAULT_TARGETS[layout]).split(",") if n.strip()]
    valid = LORA_TARGETS[layout]
    unknown = [n for n in names if n not in valid]
    _check(not unknown and bool(names),
           lambda: f"train.lora_targets={REPR.repr(text)}: {REPR.repr(unknown[0]) if unknown else 'no module'} is not a "
                   f"module of model.family={family}; valid targets: {', '.join(valid)}")
    return list(dict.fromkeys(names))
