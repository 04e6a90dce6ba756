"""The lines measured on the data-parallel run (one replica per TPU core, GPU or logical CPU): replicas,
bfloat16, checkpoint, input and plan, the profiler trace of two of its steps, and the same run with
AdamW's moments divided over the replicas (shard state), and the gradients too (shard grads)."""

from __future__ import annotations

import os
import time

import keras
import numpy as np
import tensorflow as tf

from tpu_llm.config import Config
from tpu_llm.config.checks import shard_refusal
from tpu_llm.data import dataset as data
from tpu_llm.errors import UserError
from tpu_llm.parallel import tpu
from tpu_llm.tools import plan
from tpu_llm.tools.doctor.report import Check, status
from tpu_llm.training import build, profiler, sharded_adamw

BF16_TOLERANCE = 0.02  # |bf16 - f32| / f32 of the mean loss (tests/test_pipeline.py uses the same)
PLAN_RATIO = (0.5, 200.0)  # measured / planned step time: below, the planner's FLOPs or peak are wrong;
# above, the step is not running on the accelerator (tiny models are overhead-bound, hence the width)


def replica_copies(v) -> list:
    """The per-replica tf.Variables behind a Keras or tf.distribute variable (one without replicas)."""
    value = v.value if isinstance(v, keras.Variable) else v
    return list(getattr(value, "values", [value]))


def check_replicas(run) -> Check:
    replicas = run.dist.num_replicas
    if replicas < 2:
        return Check("replicas", "SKIP", "one replica: nothing to compare")
    differ, total = [], 0
    for v in run.model.weights + run.optimizer.variables:
        copies = [c.numpy() for c in replica_copies(v)]
        total += 1
        if len(copies) > 1 and not all(np.array_equal(copies[0], c) for c in copies[1:]):
            differ.append(v.path)
    step = int(run.optimizer.iterations.numpy())
    numbers = (f"{len(differ)} of {total} variables differ between replicas, e.g. {differ[0]}" if differ else
               f"{total} variables bit-identical on {replicas} replicas after {step} steps")
    return Check("replicas", status(not differ), numbers, {"replicas": replicas, "differ": differ, "step": step})


def check_bfloat16(f32_loss: float, bf16_loss: float) -> Check:
    rel = abs(bf16_loss - f32_loss) / abs(f32_loss) if f32_loss else float("inf")
    ok = np.isfinite(bf16_loss) and rel <= BF16_TOLERANCE
    return Check("bfloat16", status(ok), f"mean loss {bf16_loss:.4f} vs float32 {f32_loss:.4f} "
                 f"({100 * rel:.2f}%, tolerance {100 * BF16_TOLERANCE:g}%)",
                 {"bf16": bf16_loss, "float32": f32_loss, "relative": rel})


def check_checkpoint(run) -> Check:
    step = int(run.optimizer.iterations.numpy())
    before = [w.copy() for w in run.model.get_weights()]
    start = time.perf_counter()
    try:
        path = run.checkpointer.save(step)
        saved = time.perf_counter() - start
        run.model.set_weights([np.zeros_like(w) for w in before])  # so the read has to bring them back
        start = time.perf_counter()
        run.checkpointer.restore(path)
        read = time.perf_counter() - start
    except (UserError, tf.errors.OpError, OSError) as e:
        run.model.set_weights(before)
        return Check("checkpoint", "FAIL", f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
    same = all(np.array_equal(a, b) for a, b in zip(before, run.model.get_weights()))
    size = sum(tf.io.gfile.stat(f).length for f in tf.io.gfile.glob(path + "*"))
    return Check("checkpoint", status(same), f"{path}: {size / 2**20:.1f} MiB written in {saved:.2f} s, read "
                 f"back {'bit-exact' if same else 'DIFFERENT'} in {read:.2f} s",
                 {"path": path, "bytes": size, "write_seconds": saved, "read_seconds": read, "exact": same})


def check_profile(run, steps: int = 2) -> Check:
    """One short profiler trace of the tiny run (after its timed calls: compiled already), where
    TensorBoard's profile plugin finds it; PASS when the trace holds the host call of the steps."""
    path, seconds, trace = profiler.capture(run, steps)
    logs = os.path.dirname(profiler.profile_dir(run.cfg.run_dir))
    return Check("profile", status(trace["host_calls"] >= 1), f"{steps} steps traced in {seconds:.1f} s: {path} "
                 f"({trace['events']:,} events, {len(trace['planes'])} planes); view: tensorboard --logdir {logs}",
                 {"path": path, "seconds": seconds, **trace})


def input_windows_per_second(run, batches: int = 10) -> float:
    """Windows (sequences) per second the training input pipeline delivers on its own, one pipeline."""
    cfg = run.cfg
    fn = data.make_dataset_fn(run.sources[0], run.tokenizer, cfg.data.seq_len, cfg.train.batch_size,
                              training=True, seed=cfg.train.seed, shuffle_buffer=cfg.data.shuffle_buffer)
    iterator = iter(fn(tf.distribute.InputContext()))
    for _ in range(2):  # warm up: open files, fill the shuffle chunk
        next(iterator)
    start = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    return batches * cfg.train.batch_size / (time.perf_counter() - start)


def check_input(windows_per_second: float, step_seconds: float, batch: int) -> Check:
    needed = batch / step_seconds
    ratio = windows_per_second / needed
    return Check("input", status(ratio >= 1.0), f"{windows_per_second:,.0f} windows/s from the input pipeline, "
                 f"the step consumes {needed:,.0f} ({ratio:.1f}x)",
                 {"windows_per_second": windows_per_second, "needed": needed, "ratio": ratio})


def accelerator_name(dist) -> str | None:
    """What `tpu-llm plan --accelerator` calls this machine, or None (GPUs: the planner has no figures)."""
    if dist.name == "tpu":
        found = next(((prefix, per_chip) for prefix, kind, per_chip in tpu._TYPES  # noqa: SLF001
                      if kind == dist.device_kind), None)
        return f"{found[0]}-{dist.chips * found[1]}" if found and dist.chips else None
    return "cpu" if dist.device_kind == "CPU" else None


def check_plan(cfg: Config, dist, step_seconds: float) -> Check:
    name = accelerator_name(dist)
    if name is None:
        return Check("plan", "SKIP", f"no planner figures for {dist.device_kind}; measured "
                     f"{1e3 * step_seconds:.1f} ms per step", {"measured_seconds": step_seconds})
    try:
        predicted = plan.plan(cfg, name, check=False).step_seconds
    except UserError as e:  # e.g. tensor groups on CPUs, which the planner does not model
        return Check("plan", "SKIP", f"{e}; measured {1e3 * step_seconds:.1f} ms per step",
                     {"measured_seconds": step_seconds})
    ratio = step_seconds / predicted
    ok = PLAN_RATIO[0] <= ratio <= PLAN_RATIO[1]
    return Check("plan", status(ok), f"measured {1e3 * step_seconds:.2f} ms per step, `tpu-llm plan "
                 f"--accelerator {name}` predicts {1e3 * predicted:.3f} ms: {ratio:.1f}x (expected "
                 f"{PLAN_RATIO[0]:g}x-{PLAN_RATIO[1]:g}x for this tiny model)",
                 {"accelerator": name, "measured_seconds": step_seconds, "predicted_seconds": predicted,
                  "ratio": ratio})


SHARD_LOSS_TOLERANCE = 1e-5  # relative: the divided update is Keras' arithmetic element by element, so
# the loss is equal to the whole one's up to the order XLA sums in (state: bit-identical on logical CPUs;
# grads sums each micro-batch over the replicas first: about 1e-7 there)
SHARD_PLAN_TOLERANCE = 0.05  # measured / planned optimizer bytes per device: ceil(rows / R) pads a little


SHARD_ACCUM = 2  # shard grads: micro-batches per step, so there is a running sum of gradients to divide


def check_shard(setting: str, make_cfg, dist, steps: int, f32, f32_loss: float) -> Check:
    """The float32 run again with parallel.shard_optimizer=`setting` on the data-parallel replicas: the
    same steps on the same batches give its mean loss, and replica 0's device holds 1/R of the moments the
    float32 run's holds, the planner's optimizer bytes for the config (training/sharded_adamw.py).
    `state` divides AdamW's moments; `grads` divides them and the running sum of the gradients over
    SHARD_ACCUM micro-batches, each reduced over the replicas inside the step (training/trainer.py:
    divided_loss_and_grads; on a TPU a tf.while_loop holding the collective, compiled only offline here)."""
    name, replicas = f"shard {setting}", dist.num_replicas
    if replicas < 2:
        return Check(name, "SKIP", "one replica: nothing to divide the optimizer's moments over")
    cfg = make_cfg(1, 1, "float32", f"shard-{setting}")
    cfg.parallel.shard_optimizer = setting
    why = shard_refusal(cfg, dist.name)
    if why:
        return Check(name, "SKIP", why)
    if setting == "grads":
        cfg.train.grad_accum = SHARD_ACCUM
        if cfg.train.batch_size % (replicas * SHARD_ACCUM):
            return Check(name, "SKIP", f"the doctor's batch of {cfg.train.batch_size} does not split into "
                         f"{replicas} replicas x {SHARD_ACCUM} micro-batches")
    run = build.build_run(cfg, dist)
    half = steps // 2 or 1
    first = run.trainer.run(run.train_iterator, half, half)["loss"]
    second = run.trainer.run(run.train_iterator, steps - half, steps - half)["loss"]
    loss = (first * half + second * (steps - half)) / steps
    rel = abs(loss - f32_loss) / abs(f32_loss) if f32_loss else float("inf")
    device = dist.strategy.extended.worker_devices[0]
    held = sharded_adamw.bytes_on(run.optimizer, dist.strategy, device)
    whole = sharded_adamw.bytes_on(f32.optimizer, dist.strategy, device)
    cpu = plan.Accelerator("cpu", "CPU", 1, 1e11, 0.0, "the planner's memory only")
    planned = plan.plan(cfg, cpu, check=False).memory[0].optimizer
    ok = np.isfinite(loss) and rel <= SHARD_LOSS_TOLERANCE and abs(held / planned - 1) <= SHARD_PLAN_TOLERANCE
    what = "AdamW's moments" if setting == "state" else \
        f"AdamW's moments and the gradients of {SHARD_ACCUM} micro-batches"
    return Check(name, status(ok), f"{what} divided over {replicas} replicas: moments {held / 1024:,.1f} "
                 f"KiB on {device.split('/')[-1].lower().replace('device:', '')} ({held / whole:.1%} of the whole "
                 f"{whole / 1024:,.1f}; plan {planned / 1024:,.1f}), mean loss {rel:.1e} from the whole run's "
                 f"(tolerance {SHARD_LOSS_TOLERANCE:g})",
                 {"replicas": replicas, "device": device, "bytes": held, "whole_bytes": whole,
                  "planned_bytes": planned, "loss": loss, "whole_loss": f32_loss, "relative": rel,
                  "grad_accum": cfg.train.grad_accum})
