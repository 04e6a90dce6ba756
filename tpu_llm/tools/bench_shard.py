"""`tpu-llm bench memory --only shard` (docs/memory.md, table (e)): AdamW's moments whole
(`parallel.shard_optimizer=none`) and divided over the replicas (`state`) on 2 and 4 logical CPU
replicas: the optimizer bytes one replica's device holds (its variables, counted where TF placed them),
the planner's figure for the same config, and the step time of each.

Each case runs in a fresh process: the logical devices are fixed once TensorFlow has started.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time

CONFIG = "configs/tiny.yaml"
REPLICAS = (2, 4)
SETTINGS = ("none", "state")


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


if __name__ == "__main__":  # one case: python -m tpu_llm.tools.bench_shard REPLICAS SETTING STEPS (JSON on stdout)
    print(json.dumps(measure(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]))))
