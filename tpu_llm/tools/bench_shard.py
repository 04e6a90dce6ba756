"""`tpu-llm bench memory --only shard` (docs/memory.md, tables (e) and (f)).

(e) AdamW's moments whole (`parallel.shard_optimizer=none`) and divided over the replicas (`state`) on 2
and 4 logical CPU replicas: the optimizer bytes one replica's device holds (its variables, counted where
TF placed them), the planner's figure for the same config, and the step time of each.

(f) The accumulated gradients divided (`grads`) against `none`: a gradient is no variable, so what a
replica holds during the step is read from XLA's buffer assignment of the step TPUStrategy builds for
one replica (compiled offline through TF's own TPU compiler code, tpu_llm/harness/, and XLA:CPU's passes,
not a TPU's): its temporary bytes for each setting, the difference, and the planner's gradient saving.

Each case runs in a fresh process: the logical devices and XLA's dump flag are fixed once TensorFlow
has started.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

CONFIG = "configs/tiny.yaml"
REPLICAS = (2, 4)
SETTINGS = ("none", "state")
COMPILED_ACCUM = (2, 4)  # train.grad_accum in table (f): with 1 there is no running sum to divide


def measure(replicas: int, setting: str, steps: int) -> dict:
    """In this process (split into `replicas` logical CPUs): build the run, count the optimizer bytes on
    replica 1's device, train `steps` steps in host calls of steps/2, time the second call."""
    from tpu_llm.config import load_config
    from tpu_llm.tools import plan
    from tpu_llm.tools.bench import config_path
    from tpu_llm.training import sharded_adamw
    from tpu_llm.training.controller import build_run

    with tempfile.TemporaryDirectory() as work:
        cfg = load_config(config_path(CONFIG), {"run_dir": f"{work}/run", "cpu_devices": replicas,
                                                "parallel.shard_optimizer": setting, "train.steps": steps,
                                                "train.steps_per_loop": steps // 2, "train.eval_every": 0,
                                                "checkpoint.every_steps": 0, "sample.num_samples": 0})
        run = build_run(cfg)
        held = sharded_adamw.bytes_on(run.optimizer, run.dist.strategy, run.dist.strategy.extended.worker_devices[1])
        run.trainer.run(run.train_iterator, steps // 2, steps // 2)  # compiles
        start = time.perf_counter()
        run.trainer.run(run.train_iterator, steps // 2, steps // 2)
        seconds = (time.perf_counter() - start) / (steps // 2)
        cpu = plan.Accelerator("cpu", "CPU", 1, 1e11, 0.0, "no RAM check")
        planned = plan.plan(cfg, cpu, check=False).memory[0].optimizer
        run.release()
    return {"replicas": replicas, "setting": setting, "optimizer_bytes": held, "planned_bytes": planned,
            "step_ms": 1000 * seconds}


def compiled(replicas: int, dump: str) -> list[dict]:
    """In this process (XLA_FLAGS already dumping into `dump`): for `none` and `grads` at each COMPILED_ACCUM,
    the temporary bytes XLA's buffer assignment gives one replica's step, and the planner's gradient bytes for
    the same model."""
    from tpu_llm.harness import compiled_step, offline_tpu, xla_memory
    from tpu_llm.tools import plan

    cpu = plan.Accelerator("cpu", "CPU", 1, 1e11, 0.0, "no RAM check")
    rows = []
    for accum in COMPILED_ACCUM:
        for setting in ("none", "grads"):
            step = offline_tpu.build_step(1, 1, precision="float32", dropout=0.0, grad_accum=accum,
                                          shard_optimizer=setting, replicas=replicas)
            compiled_step.step_hlo(step, stage="optimized_hlo")
            step.cfg.cpu_devices = replicas  # the planner's replica count on the "cpu" accelerator
            rows.append({"replicas": replicas, "grad_accum": accum, "setting": setting,
                         "temp_bytes": xla_memory.temp_bytes(xla_memory.buffer_assignment(dump)),
                         "gradient_bytes": 4 * sum(v.shape.num_elements() for v in step.model.trainable_variables),
                         "planned_gradients": plan.plan(step.cfg, cpu, check=False).memory[0].gradients})
    return rows


def compiled_table() -> list[dict]:
    """Table (f), one process per replica count; printed as a markdown table."""
    rows = []
    for replicas in REPLICAS:
        with tempfile.TemporaryDirectory(prefix="tpu-llm-shard-") as dump:
            env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump}".strip()}
            done = subprocess.run([sys.executable, "-m", "tpu_llm.tools.bench_shard", "compiled", str(replicas), dump],
                                  capture_output=True, text=True, timeout=1800, env=env)
        if done.returncode != 0:
            raise RuntimeError(f"bench shard compiled {replicas} failed:\n{done.stderr[-2000:]}")
        rows += json.loads(done.stdout.strip().splitlines()[-1])
    print(f"\n(f) One replica's temporary bytes in the compiled TPU step, none vs grads (the offline harness's "
          f"model: {rows[0]['gradient_bytes'] / 1024:,.0f} KiB of float32 gradients; XLA:CPU's buffer assignment)\n")
    print("| replicas | grad_accum | none KiB | grads KiB | saved KiB | planner's saving KiB | measured / planned |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    by = {(r["replicas"], r["grad_accum"], r["setting"]): r for r in rows}
    for replicas in REPLICAS:
        for accum in COMPILED_ACCUM:
            none, grads = by[replicas, accum, "none"], by[replicas, accum, "grads"]
            saved = none["temp_bytes"] - grads["temp_bytes"]
            planned = none["planned_gradients"] - grads["planned_gradients"]
            print(f"| {replicas} | {accum} | {none['temp_bytes'] / 1024:,.0f} | {grads['temp_bytes'] / 1024:,.0f} | "
                  f"{saved / 1024:,.0f} | {planned / 1024:,.0f} | {f'{saved / planned:.2f}' if planned else '-'} |")
    return rows


def shard_table(steps: int = 40) -> list[dict]:
    """Table (e), every case in its own process; printed as it goes and as a markdown table at the end."""
    rows = []
    for replicas in REPLICAS:
        for setting in SETTINGS:
            done = subprocess.run([sys.executable, "-m", "tpu_llm.tools.bench_shard", str(replicas), setting,
                                   str(steps)], capture_output=True, text=True, timeout=1800)
            if done.returncode != 0:
                raise RuntimeError(f"bench shard {replicas} {setting} failed:\n{done.stderr[-2000:]}")
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"bench     {rows[-1]}", flush=True)
    whole = {r["replicas"]: r for r in rows if r["setting"] == "none"}
    print(f"\n(e) AdamW's moments whole and divided over the replicas ({CONFIG}, float32, {steps} steps; "
          "optimizer bytes on replica 1's device)\n")
    print("| replicas | shard_optimizer | optimizer KiB per replica | planner KiB | of whole | ms/step | of whole |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for r in rows:
        base = whole[r["replicas"]]
        print(f"| {r['replicas']} | {r['setting']} | {r['optimizer_bytes'] / 1024:,.0f} | "
              f"{r['planned_bytes'] / 1024:,.0f} | {r['optimizer_bytes'] / base['optimizer_bytes']:.0%} | "
              f"{r['step_ms']:.1f} | {r['step_ms'] / base['step_ms']:.2f}x |")
    return rows


if __name__ == "__main__":  # one case (JSON on stdout): python -m tpu_llm.tools.bench_shard REPLICAS SETTING STEPS,
    # or python -m tpu_llm.tools.bench_shard compiled REPLICAS DIR (with XLA_FLAGS=--xla_dump_to=DIR)
    if sys.argv[1] == "compiled":
        print(json.dumps(compiled(int(sys.argv[2]), sys.argv[3])))
    else:
        print(json.dumps(measure(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]))))
