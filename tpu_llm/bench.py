"""Benchmarks (`tpu-llm bench`, `make bench`): numbers for the README, never timed tests.

shakespeare_char: nanoGPT's CPU reference run (4 layers, 4 heads, width 128, context 64, batch 12,
2000 steps, lr 1e-3, dropout 0, character vocabulary) on tinyshakespeare. Targets on a 2-core CPU:
>= 14k tokens/s and validation loss <= 1.88 (nanoGPT's published result).
"""

from __future__ import annotations

import os
import shutil
import tempfile

from tpu_llm.config import load_config, parse_set_args
from tpu_llm.errors import UserError

TARGET_TOKENS_PER_SEC = 14_000
TARGET_VAL_LOSS = 1.88


def shakespeare_char(data: str = "", steps: int = 2000, config: str = "configs/shakespeare_char.yaml",
                     run_dir: str = "", set_args=None, overrides: dict | None = None) -> dict:
    from tpu_llm.controller import train

    cfg = load_config(config, {**parse_set_args(set_args), **(overrides or {})})
    if data:
        cfg.data.train = str(data)
    if not os.path.exists(cfg.data.train):
        raise UserError(f"benchmark data {cfg.data.train!r} not found; pass --data PATH/tinyshakespeare.txt")
    cfg.train.steps = int(steps)
    cfg.train.decay_steps = int(steps)
    temporary = not run_dir
    cfg.run_dir = run_dir or tempfile.mkdtemp(prefix="tpu-llm-bench-")
    try:
        result = train(cfg)
    finally:
        if temporary:
            shutil.rmtree(cfg.run_dir, ignore_errors=True)

    rows = [("tokens/s", f"{result['tokens_per_sec']:,.0f}", f">= {TARGET_TOKENS_PER_SEC:,}",
             result["tokens_per_sec"] >= TARGET_TOKENS_PER_SEC),
            ("ms/step", f"{result['ms_per_step']:.1f}", "", None),
            ("MFU", f"{100 * result['mfu']:.1f}%", "", None),
            ("train loss", f"{result['train_loss']:.4f}", "", None),
            ("validation loss", f"{result['val_loss']:.4f}", f"<= {TARGET_VAL_LOSS}",
             result["val_loss"] <= TARGET_VAL_LOSS)]
    print(f"\nshakespeare_char, {cfg.train.steps} steps ({cfg.data.train})")
    print(f"| {'metric':<16} | {'value':>10} | {'target':>10} | met |")
    print(f"|{'-' * 18}|{'-' * 12}|{'-' * 12}|-----|")
    for name, value, target, met in rows:
        print(f"| {name:<16} | {value:>10} | {target:>10} | {'' if met is None else 'yes' if met else 'NO':>3} |")
    return result
