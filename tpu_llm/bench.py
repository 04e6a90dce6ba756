"""Benchmarks (`tpu-llm bench`, `make bench`): numbers for the README, never timed tests.

shakespeare_char: nanoGPT's CPU reference run (4 layers, 4 heads, width 128, context 64, batch 12,
2000 steps, lr 1e-3, dropout 0, character vocabulary) on tinyshakespeare. Targets on a 2-core CPU:
>= 14k tokens/s and validation loss <= 1.88 (nanoGPT's published result).

strategies: the same tiny config (configs/tiny.yaml on the embedded corpus) under every strategy
that runs off-accelerator, each in fresh processes: default, Mirrored over 2 and 4 logical CPUs,
multi_worker with 2 local workers, parameter_server with 2 workers and 1 ps. One table: tokens/s,
steps/s, losses after N steps, and for the parameter server the staleness it observed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

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


# name, `tpu-llm` arguments before `train` (a launched cluster), extra train flags
STRATEGY_CASES = (
    ("default", [], ["--strategy=default"]),
    ("mirrored, 2 logical CPUs", [], ["--strategy=mirrored", "--cpu_devices=2"]),
    ("mirrored, 4 logical CPUs", [], ["--strategy=mirrored", "--cpu_devices=4"]),
    ("multi_worker, 2 workers", ["launch", "--workers", "2", "--"], []),
    ("parameter_server, 2 workers + 1 ps", ["launch", "--workers", "2", "--ps", "1", "--"], []),
)


def strategies(steps: int = 200, config: str = "configs/tiny.yaml", only: str = "") -> list[dict]:
    """Train `config` for `steps` steps under each strategy (fresh processes); print one table."""
    rows = []
    for name, prefix, flags in STRATEGY_CASES:
        if only and only not in name:
            continue
        run_dir = tempfile.mkdtemp(prefix="tpu-llm-bench-")
        command = [sys.executable, "-m", "tpu_llm", *prefix, "train", "--config", config, f"--run_dir={run_dir}",
                   f"--train.steps={steps}", f"--train.decay_steps={steps}", f"--train.eval_every={steps}",
                   f"--checkpoint.every_steps={steps}", "--sample.num_samples=0", *flags]
        print(f"bench     {name}: {' '.join(command[1:])}", flush=True)
        start = time.time()
        try:
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
                raise UserError(f"benchmark case {name!r} failed (exit {done.returncode}): {' | '.join(tail)}")
            summary = [line for line in map(json.loads, open(os.path.join(run_dir, "metrics.jsonl")))
                       if line["split"] == "summary"][-1]
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)
        rows.append({"case": name, "wall_seconds": time.time() - start, **summary})
        print(f"bench     {name}: {summary['tokens_per_sec']:,.0f} tokens/s, val loss {summary['val_loss']:.4f}",
              flush=True)

    print(f"\nstrategies, {config}, {steps} steps each (timing excludes the first, compiling, loop)")
    print(f"| {'strategy':<36} | {'tokens/s':>9} | {'steps/s':>7} | {'train loss':>10} | {'val loss':>8} "
          f"| {'staleness (mean/max)':>20} | {'wall s':>6} |")
    print(f"|{'-' * 38}|{'-' * 11}|{'-' * 9}|{'-' * 12}|{'-' * 10}|{'-' * 22}|{'-' * 8}|")
    for r in rows:
        stale = f"{r['staleness']:.2f} / {r['staleness_max']:.0f}" if r.get("staleness") is not None else "0 (sync)"
        print(f"| {r['case']:<36} | {r['tokens_per_sec']:>9,.0f} | {1000 / r['ms_per_step']:>7.2f} | "
              f"{r['train_loss']:>10.4f} | {r['val_loss']:>8.4f} | {stale:>20} | {r['wall_seconds']:>6.0f} |")
    return rows
