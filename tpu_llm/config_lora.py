"""The LoRA settings (train.lora_*, docs/lora.md): PEFT's module names per layout, the stored base's
dtypes, and their checks; tpu_llm/config.py holds the schema and calls `validate_lora`."""

from __future__ import annotations

from tpu_llm.config_reading import REPR
from tpu_llm.model import families
from tpu_llm.config_reading import check as _check

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
    known = families.get(family)
    names, valid = known.peft_modules(text), known.peft_targets
    unknown = [n for n in names if n not in valid]
    _check(not unknown and bool(names),
           lambda: f"train.lora_targets={REPR.repr(text)}: {REPR.repr(unknown[0]) if unknown else 'no module'} is not a "
                   f"module of model.family={family}; valid targets: {', '.join(valid)}")
    return names
