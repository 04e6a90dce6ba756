"""Benchmarks (`tpu-llm bench`, `make bench`): numbers for docs/benchmarks.md, never timed tests.

shakespeare_char: nanoGPT's CPU reference run (4 layers, 4 heads, width 128, context 64, batch 12,
2000 steps, lr 1e-3, dropout 0, character vocabulary) on tinyshakespeare (the copy shipped in the
package, `builtin:tinyshakespeare`). Targets on a 2-core CPU: >= 14k tokens/s and validation loss
<= 1.88 (nanoGPT's published result).

A config path that does not exist where the command runs is looked up in the checkout too
(configs/... beside tpu_llm/), so every suite runs from any working directory.

strategies: the same tiny config (configs/tiny.yaml on the embedded corpus) under every strategy
that runs off-accelerator, each in fresh processes: default, Mirrored over 2 and 4 logical CPUs,
multi_worker with 2 local workers, parameter_server with 2 workers and 1 ps. One table: tokens/s,
steps/s, losses after N steps, and for the parameter server the staleness it observed.

comm: gradient compression (bf16, PowerSGD, top-k) and local SGD / DiLoCo on the same config and steps,
next to synchronous and parameter-server training: losses, bytes sent per step, tokens/s
(docs/communication.md).

families: gpt2 against llama at matched parameter count on Shakespeare (char), configs/shakespeare_char.yaml
and configs/shakespeare_char_llama.yaml (same data, batch, schedule and steps): validation loss,
tokens/s and MFU on this machine; then `tpu-llm plan` of configs/llama_1b.yaml on v5p-16 and v6e-8
(docs/model-families.md).

The memory suite (chunked loss and blockwise attention) is tpu_llm/tools/bench_memory.py, the data
suite (the input pipeline against a slice's demand) tpu_llm/tools/bench_data.py; the placement suite
is tpu_llm/harness/placement_audit.py.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time

from tpu_llm.config import load_config
from tpu_llm.config.reading import parse_set_args, presets
from tpu_llm.data import corpora
from tpu_llm.errors import UserError
from tpu_llm.platform import tether

TARGET_TOKENS_PER_SEC = 14_000
TARGET_VAL_LOSS = 1.88
CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # where tpu_llm/ is


def config_path(config: str) -> str:
    """`config` as given if it exists, else the preset of its file's name (configs/tiny.yaml: tiny), which
    the package ships, so every suite runs from any working directory."""
    if os.path.exists(config) or os.path.isabs(config):
        return config
    return presets().get(os.path.basename(config).removesuffix(".yaml"), config)


def shakespeare_char(data: str = "", steps: int = 2000, config: str = "configs/shakespeare_char.yaml",
                     run_dir: str = "", set_args=None, overrides: dict | None = None) -> dict:
    from tpu_llm.training.controller import train

    cfg = load_config(config_path(config), {**parse_set_args(set_args), **(overrides or {})})
    if data:
        cfg.data.train = str(data)
    if cfg.data.train.startswith(corpora.PREFIX):
        corpora.resolve(cfg.data.train, "benchmark data")  # the checksum, before anything runs
    elif not os.path.exists(cfg.data.train):
        raise UserError(f"benchmark data {cfg.data.train!r} not found; pass --data PATH/tinyshakespeare.txt, "
                        f"or leave --data out for the shipped copy ({corpora.PREFIX}tinyshakespeare)")
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
    print_targets(rows, (16, 10, 10))
    return result


def print_targets(rows: list[tuple], widths: tuple[int, int, int]) -> None:
    """A Markdown table of (metric, value, target, met) rows, `met` None where there is no target; `widths`:
    of the first three columns."""
    a, b, c = widths
    print(f"| {'metric':<{a}} | {'value':>{b}} | {'target':>{c}} | met |")
    print(f"|{'-' * (a + 2)}|{'-' * (b + 2)}|{'-' * (c + 2)}|-----|")
    for name, value, target, met in rows:
        print(f"| {name:<{a}} | {value:>{b}} | {target:>{c}} | {'' if met is None else 'yes' if met else 'NO':>3} |")


# name, `tpu-llm` arguments before `train` (a launched cluster), extra train flags
STRATEGY_CASES = (
    ("default", [], ["--strategy=default"]),
    ("mirrored, 2 logical CPUs", [], ["--strategy=mirrored", "--cpu_devices=2"]),
    ("mirrored, 4 logical CPUs", [], ["--strategy=mirrored", "--cpu_devices=4"]),
    ("multi_worker, 2 workers", ["launch", "--workers", "2", "--"], []),
    ("parameter_server, 2 workers + 1 ps", ["launch", "--workers", "2", "--ps", "1", "--"], []),
)


def _run_case(name: str, prefix: list[str], config: str, steps: int, flags: list[str]) -> dict:
    """Train `config` for `steps` steps in fresh processes (`tpu-llm [prefix] train ...`); its summary."""
    run_dir = tempfile.mkdtemp(prefix="tpu-llm-bench-")
    command = [sys.executable, "-m", "tpu_llm", *prefix, "train", "--config", config_path(config), f"--run_dir={run_dir}",
               f"--train.steps={steps}", f"--train.decay_steps={steps}", f"--train.eval_every={steps}",
               f"--checkpoint.every_steps={steps}", "--sample.num_samples=0", *flags]
    print(f"bench     {name}: {' '.join(command[1:])}", flush=True)
    start = time.time()
    try:
        done = tether.run(command, capture_output=True, text=True)  # it stops (and saves) if this process is killed
        if done.returncode != 0:
            tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
            raise UserError(f"benchmark case {name!r} failed (exit {done.returncode}): {' | '.join(tail)}")
        summary = [line for line in map(json.loads, open(os.path.join(run_dir, "metrics.jsonl")))
                   if line["split"] == "summary"][-1]
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    print(f"bench     {name}: {summary['tokens_per_sec']:,.0f} tokens/s, {summary['ms_per_step']:.1f} ms/step, "
          f"val loss {summary['val_loss']:.4f}", flush=True)
    return {"case": name, "wall_seconds": time.time() - start, **summary}


def strategies(steps: int = 200, config: str = "configs/tiny.yaml", only: str = "") -> list[dict]:
    """Train `config` for `steps` steps under each strategy (fresh processes); print one table."""
    rows = [_run_case(name, prefix, config, steps, flags) for name, prefix, flags in STRATEGY_CASES
            if not only or only in name]
    print(f"\nstrategies, {config}, {steps} steps each (timing excludes the first, compiling, loop)")
    print(f"| {'strategy':<36} | {'tokens/s':>9} | {'steps/s':>7} | {'train loss':>10} | {'val loss':>8} "
          f"| {'staleness (mean/max)':>20} | {'wall s':>6} |")
    print(f"|{'-' * 38}|{'-' * 11}|{'-' * 9}|{'-' * 12}|{'-' * 10}|{'-' * 22}|{'-' * 8}|")
    for r in rows:
        stale = f"{r['staleness']:.2f} / {r['staleness_max']:.0f}" if r.get("staleness") is not None else "0 (sync)"
        print(f"| {r['case']:<36} | {r['tokens_per_sec']:>9,.0f} | {1000 / r['ms_per_step']:>7.2f} | "
              f"{r['train_loss']:>10.4f} | {r['val_loss']:>8.4f} | {stale:>20} | {r['wall_seconds']:>6.0f} |")
    return rows


def modes(steps: int = 100, config: str = "configs/tiny.yaml") -> list[dict]:
    """Execution modes (eager / graph / xla) and precisions (float32 / mixed_bfloat16) on the CPU."""
    cases = [("xla, float32", ["--execution=xla", "--precision=float32"], steps),
             ("graph, float32", ["--execution=graph", "--precision=float32"], steps),
             ("eager, float32", ["--execution=eager", "--precision=float32"], max(4, steps // 10)),
             ("xla, mixed_bfloat16", ["--execution=xla", "--precision=mixed_bfloat16"], steps)]
    rows = [{**_run_case(name, [], config, n, flags), "steps": n} for name, flags, n in cases]
    print(f"\nexecution modes and precision, {config} on this CPU (timing excludes the first call)")
    print(f"| {'mode':<22} | {'steps':>5} | {'tokens/s':>9} | {'ms/step':>8} | {'train loss':>10} |")
    print(f"|{'-' * 24}|{'-' * 7}|{'-' * 11}|{'-' * 10}|{'-' * 12}|")
    for r in rows:
        print(f"| {r['case']:<22} | {r['steps']:>5} | {r['tokens_per_sec']:>9,.0f} | {r['ms_per_step']:>8.1f} | "
              f"{r['train_loss']:>10.4f} |")
    return rows


def pipeline_stages(steps: int = 60, config: str = "configs/tiny.yaml", stages: str = "2,4",
                    microbatches: str = "1,2,4,8,16") -> list[dict]:
    """GPipe on logical CPUs: measured step time per (P, M) next to the schedule simulator's prediction.

    The simulator gets per-stage forward times from the measured unpipelined step (a third of it is
    the forward pass, split over the stages by their FLOPs and over the micro-batches evenly), so the
    comparison tests the schedule model, not a FLOPs-to-seconds guess."""
    from tpu_llm.config import load_config
    from tpu_llm.parallel import pipeline
    from tpu_llm.tools import plan_time

    cfg = load_config(config_path(config), {})
    base = _run_case("P=1", [], config, steps, [])
    rows = []
    for p in (int(v) for v in str(stages).split(",")):
        parts = pipeline.partition(cfg.model, 257, cfg.data.seq_len, p)  # byte vocabulary
        total = sum(s.flops_per_token for s in parts)
        for m in (int(v) for v in str(microbatches).split(",")):
            if cfg.train.batch_size % m:
                continue
            measured = _run_case(f"P={p} M={m}", [], config, steps,
                                 [f"--cpu_devices={p}", f"--parallel.pipeline_stages={p}",
                                  f"--parallel.microbatches={m}"])
            forward = [base["ms_per_step"] / 3 * s.flops_per_token / total / m for s in parts]
            predicted, bubble, _ = plan_time.simulate(forward, m)
            rows.append({"P": p, "M": m, "measured": measured["ms_per_step"], "predicted": predicted,
                         "bubble": bubble, "loss": measured["train_loss"]})
    print(f"\nGPipe on logical CPUs, {config}: {steps} steps; unpipelined: {base['ms_per_step']:.1f} ms/step")
    print(f"| P | M | measured ms/step | simulated ms/step | simulated bubble | train loss |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['P']} | {r['M']} | {r['measured']:.1f} | {r['predicted']:.1f} | {100 * r['bubble']:.0f}% | "
              f"{r['loss']:.4f} |")
    return rows


# name, `tpu-llm` arguments before `train` (a launched cluster), extra train flags. Every synchronous
# row mirrors over the same 2 logical CPUs; the async row is 2 parameter-server workers.
MIRRORED_2 = ["--strategy=mirrored", "--cpu_devices=2"]
COMM_CASES = (
    ("sync (float32 all-reduce)", [], MIRRORED_2),
    ("async (parameter server, 2 workers + 1 ps)", ["launch", "--workers", "2", "--ps", "1", "--"], []),
    ("bf16 all-reduce", [], [*MIRRORED_2, "--comm.compression=bf16"]),
    ("PowerSGD r=1", [], [*MIRRORED_2, "--comm.compression=powersgd", "--comm.rank=1"]),
    ("PowerSGD r=4", [], [*MIRRORED_2, "--comm.compression=powersgd", "--comm.rank=4"]),
    ("top-k 1%", [], [*MIRRORED_2, "--comm.compression=topk", "--comm.topk_ratio=0.01"]),
    ("local SGD H=4", [], [*MIRRORED_2, "--comm.sync_every=4"]),
    ("local SGD H=16", [], [*MIRRORED_2, "--comm.sync_every=16"]),
    ("DiLoCo H=16", [], [*MIRRORED_2, "--comm.sync_every=16", "--comm.outer_optimizer=nesterov",
                         "--comm.outer_lr=0.7", "--comm.outer_momentum=0.9"]),
)


def comm(steps: int = 100, config: str = "configs/tiny.yaml", only: str = "") -> list[dict]:
    """Gradient compression and local SGD (tpu_llm/parallel/comm.py) against synchronous and asynchronous data
    parallelism: the same config and steps in fresh processes; one table of losses, bytes per step and
    tokens/s. Bytes are what one replica (worker) sends per optimizer step: the float32 all-reduce
    payload for sync, what the compressor sends, the parameter delta / H for local SGD; for the
    parameter server a worker pushes its gradients and pulls the weights (2 x 4 bytes/parameter)."""
    rows = [_run_case(name, prefix, config, steps, flags) for name, prefix, flags in COMM_CASES
            if not only or only in name]
    for r in rows:
        dense = 4 * r["params"]
        if r.get("comm_bytes_per_step") is not None:
            r["bytes"] = r["comm_bytes_per_step"]
        else:
            r["bytes"] = 2 * dense if r["strategy"] == "parameter_server" else dense
        r["ratio"] = dense / r["bytes"]
    print(f"\ncommunication, {config}, {steps} steps each (tokens/s excludes the first, compiling, loop)")
    print(f"| {'run':<42} | {'train loss':>10} | {'val loss':>8} | {'bytes/step':>10} | {'vs fp32':>7} "
          f"| {'tokens/s':>9} |")
    print(f"|{'-' * 44}|{'-' * 12}|{'-' * 10}|{'-' * 12}|{'-' * 9}|{'-' * 11}|")
    for r in rows:
        print(f"| {r['case']:<42} | {r['train_loss']:>10.4f} | {r['val_loss']:>8.4f} | {r['bytes']:>10,.0f} "
              f"| {r['ratio']:>6.1f}x | {r['tokens_per_sec']:>9,.0f} |")
    return rows


FAMILY_CONFIGS = (("gpt2", "configs/shakespeare_char.yaml"), ("llama", "configs/shakespeare_char_llama.yaml"))
PLAN_CONFIG, PLAN_ACCELERATORS = "configs/llama_1b.yaml", ("v5p-16", "v6e-8")


def families(steps: int = 2000, configs=FAMILY_CONFIGS, plan_config: str = PLAN_CONFIG,
             accelerators=PLAN_ACCELERATORS) -> dict:
    """gpt2 vs llama on the same data and budget (fresh processes), then the planner on a 1B llama."""
    from tpu_llm.tools import plan

    rows = [_run_case(name, [], config, steps, []) for name, config in configs]
    print(f"\nmodel families on Shakespeare (char), {steps} steps each (tokens/s excludes the first, compiling, loop)")
    print(f"| {'family':<7} | {'config':<38} | {'params':>9} | {'val loss':>8} | {'tokens/s':>9} | {'MFU':>6} |")
    print(f"|{'-' * 9}|{'-' * 40}|{'-' * 11}|{'-' * 10}|{'-' * 11}|{'-' * 8}|")
    for (name, config), r in zip(configs, rows):
        print(f"| {name:<7} | {config:<38} | {r['params']:>9,} | {r['val_loss']:>8.4f} | {r['tokens_per_sec']:>9,.0f} "
              f"| {100 * r['mfu']:>5.2f}% |")
    cfg = load_config(config_path(plan_config), {})
    plans = [plan.plan(cfg, name, check=False) for name in accelerators]
    print(f"\n`tpu-llm plan --config {plan_config} --accelerator ACCELERATOR` "
          f"({plan._params(cfg, plans[0].vocab):,} parameters; "
          f"{cfg.parallel.pipeline_stages} stages x {cfg.parallel.microbatches} micro-batches, remat "
          f"{'on' if cfg.parallel.remat else 'off'}, batch {cfg.train.batch_size} x {cfg.data.seq_len}; MFU {plans[0].mfu:.0%} "
          "of peak while busy assumed)")
    print(f"| {'accelerator':<11} | {'memory per chip':>15} | {'HBM':>7} | {'step':>9} | {'tokens/s':>9} |")
    print(f"|{'-' * 13}|{'-' * 17}|{'-' * 9}|{'-' * 11}|{'-' * 11}|")
    for p in plans:
        need = p.memory_needed()
        print(f"| {p.acc.name:<11} | {plan._size(need):>15} | {100 * need / p.acc.memory_bytes:>6.0f}% | "
              f"{plan._seconds(p.step_seconds):>9} | {p.tokens_per_step / p.step_seconds:>9,.0f} |")
    return {"runs": rows, "plans": plans}
