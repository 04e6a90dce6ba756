"""`tpu-llm doctor`: the two-minute first-contact check of a new machine (TPU VM, pod worker 0,
Colab/Kaggle TPU, GPU box, laptop).

It checks on the real hardware what the repository's tests cannot check offline, prints one PASS /
FAIL / SKIP line per check with its numbers (and, under a failed line, what to do), writes
`doctor.json` into the run directory, and ends with a one-line error (exit status 2) when a check
failed:

  devices     the strategy and devices found, and how (distribute.look_around, tpu.find_tpu)
  placement   a tiny run with P pipeline stages (x T tensor groups): each stage's variables and AdamW
              moments on its own device or logical core, adding up to `tpu-llm plan`'s per-stage
              parameters; memory per device where TensorFlow reports it
  replicas    every replica's copy of every weight and moment bit-identical after the steps
  bfloat16    the mean loss under mixed_bfloat16 within 2% of float32's on the same batches
  checkpoint  a checkpoint written to and read back from the run directory, bit-exact
  input       the input pipeline's windows/s against what the measured step consumes
  plan        the measured step time against `tpu-llm plan`'s prediction for the same config
  memory      the chunked loss and blockwise attention (docs/memory.md) on this device: loss and
              gradients equal to the dense ones, and where TF reports device memory (TPU, GPU) the
              step's peak with and without them against `tpu-llm plan`'s

Two minutes on a v5e-8 by design: one TPU connection and one strategy for everything, a 2-block
width-64 model (one block per stage), two training programs (float32 and bfloat16; each compiles once: the timed second
call of the float32 run reuses its program), no evaluation, no samples. The float32 run's first call
includes the compilation and is not timed.
The memory line then compiles a one-block model's step twice (dense, and with both options) on the
first device: seconds.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import time

import keras
import numpy as np
import tensorflow as tf

from tpu_llm.config import Config, load_config
from tpu_llm.data import dataset as data
from tpu_llm.data import sources
from tpu_llm.errors import UserError
from tpu_llm.model import GPT
from tpu_llm.parallel import distribute
from tpu_llm.parallel import tpu
from tpu_llm.parallel import tpu as tpus
from tpu_llm.tools import plan, xla_memory
from tpu_llm.training import controller

BF16_TOLERANCE = 0.02  # |bf16 - f32| / f32 of the mean loss (tests/test_pipeline.py uses the same)
PLAN_RATIO = (0.5, 200.0)  # measured / planned step time: below, the planner's FLOPs or peak are wrong;
# above, the step is not running on the accelerator (tiny models are overhead-bound, hence the width)

FIX = {
    "devices": "run `tpu-llm info`; on a TPU VM install tpu-llm[tpu] (tensorflow-tpu + libtpu) and set tpu=local; "
               "on a pod run on worker 0 with TPU_NAME set; see docs for the strategy options",
    "placement": "a stage's variables are not on its own device: report this with doctor.json (pipeline and "
                 "tensor parallelism would hold every weight on one core); train with "
                 "parallel.pipeline_stages=1 parallel.tensor=1 meanwhile",
    "replicas": "replicas diverged: the all-reduce or the variable sync is broken on this runtime; report it "
                "with doctor.json and do not train data-parallel here",
    "bfloat16": "bfloat16 loss is off: train with precision=float32 and report it with doctor.json",
    "checkpoint": "the run directory cannot hold checkpoints: check its permissions or bucket (gs:// on a TPU, "
                  "with the TPU's service account allowed to write), or choose another --run_dir",
    "input": "the input pipeline is slower than the step: pre-tokenize with `tpu-llm data prepare` and read "
             "TFRecords, use more files, or a larger model/batch per step",
    "run": "the tiny run itself failed: read the error above and doctor.json; run `tpu-llm info` and a "
           "`tpu-llm train --config configs/tiny.yaml` to see the full traceback",
    "plan": "the step time is far from the planner's: check the devices line (a step on the host CPU?) and "
            "compare `tpu-llm plan --accelerator ...` with this machine's type",
    "memory": "train with train.loss_chunk=0 model.attention=dense if the results differ, and plan with a margin if "
              "the memory differs from the planner's; report it with doctor.json",
}


@dataclasses.dataclass
class Check:
    name: str
    status: str  # PASS, FAIL or SKIP
    numbers: str  # what was measured, one line
    values: dict = dataclasses.field(default_factory=dict)  # the same as numbers, for doctor.json

    def line(self) -> str:
        return f"{self.status:<5} {self.name:<11} {self.numbers}"


def _status(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def tiny_config(run_dir: str, tpu: str, strategy: str, cpu_devices: int, stages: int, tensor: int,
                steps: int, precision: str = "float32", train: str = "") -> Config:
    """The doctor's run: a GPT of one block per stage (at least 2), width 64, on `train` (default: the
    embedded corpus), bytes, no eval or samples."""
    return load_config(None, {
        "run_dir": run_dir, "tpu": tpu, "strategy": strategy, "cpu_devices": cpu_devices, "precision": precision,
        "model.n_layer": max(2, stages), "model.n_head": 4, "model.n_embd": 64, "model.max_len": 64, "model.dropout": 0.0,
        "data.train": train, "data.tokenizer": "byte", "data.seq_len": 64, "data.shuffle_buffer": 64,
        "train.steps": steps, "train.steps_per_loop": max(steps // 2, 1), "train.warmup_steps": 1,
        "train.eval_every": 0, "checkpoint.every_steps": 0, "sample.num_samples": 0,
        "parallel.pipeline_stages": stages, "parallel.tensor": tensor, "parallel.microbatches": 2})


def _copies(v) -> list:
    """The per-replica tf.Variables behind a Keras or tf.distribute variable (one without replicas)."""
    value = v.value if isinstance(v, keras.Variable) else v
    return list(getattr(value, "values", [value]))


def _devices_of(v) -> list[str]:
    return [c.device for c in _copies(v)]


STAGED_FILES = 12  # embedded-corpus files copied for a remote TPU (a few hundred KB: many batches of 64 bytes)


def stage_data(directory: str) -> str:
    """Copy a few files of the embedded corpus into `directory` (the run directory, on Cloud Storage for
    a remote TPU, whose hosts run the input pipeline and cannot read this machine's files); returns
    their glob for data.train. Byte tokenization runs on the hosts with core TF ops only."""
    tf.io.gfile.makedirs(directory)
    for i, path in enumerate(sources.embedded_corpus_files()[:STAGED_FILES]):
        with open(path, "rb") as f:
            text = f.read()
        with tf.io.gfile.GFile(os.path.join(directory, f"corpus-{i:02d}.txt"), "wb") as f:
            f.write(text)
    return os.path.join(directory, "corpus-*.txt")


def check_devices(found: distribute.Found, name: str, reason: str, dist) -> Check:
    logical = tf.config.list_logical_devices()
    kinds = {}
    for d in logical:
        kinds[d.device_type] = kinds.get(d.device_type, 0) + 1
    listed = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
    # what was seen must be what runs: a TPU or GPUs left unused are the classic first-contact failure
    ok = not (found.tpu and name != "tpu") and not (found.gpus and dist.device_kind != "GPU" and name != "tpu")
    return Check("devices", _status(ok), f"{name} ({reason}); {dist.num_replicas} replica(s) x "
                 f"{dist.placement.stages * dist.placement.tensor} device(s); TF lists {listed}",
                 {"strategy": name, "reason": reason, "replicas": dist.num_replicas, "device_kind": dist.device_kind,
                  "logical_devices": [d.name for d in logical], "tpu_evidence": found.tpu, "gpus": found.gpus})


def check_placement(run) -> Check:
    """Each stage's variables (and AdamW moments) on one device per replica, distinct per stage, adding
    up to the planner's parameters for that stage."""
    pipe, replicas = run.trainer.pipeline, run.dist.num_replicas
    moments = [v for v in run.optimizer.variables if v.path.endswith(("_momentum", "_velocity"))]
    moment_params = {}  # device -> AdamW m and v held there
    for m in moments:
        for device in _devices_of(m):
            moment_params[device] = moment_params.get(device, 0) + int(np.prod(m.shape))
    problems, per_device = [], {}
    seen = set()
    for stage in pipe.stages:
        own = [v for v in pipe.stage_variables(stage.index) if id(v) not in seen]  # the tied table: stage 0
        seen.update(id(v) for v in own)
        for r in range(replicas):
            devices = {_devices_of(v)[r] for v in own}
            count = sum(int(np.prod(v.shape)) for v in own)
            if len(devices) != 1:
                problems.append(f"stage {stage.index} of replica {r} spans {', '.join(sorted(devices))}")
                continue
            device = devices.pop()
            per_device[device] = per_device.get(device, 0) + count
            if count != stage.params:
                problems.append(f"stage {stage.index}: {count:,} parameters, the planner counts {stage.params:,}")
    for device, count in per_device.items():  # AdamW's moments beside their variables
        if moment_params.get(device, 0) != 2 * count:
            problems.append(f"{device.split('device:')[-1]} holds {count:,} parameters but "
                            f"{moment_params.get(device, 0):,} AdamW moment values (expected {2 * count:,})")
    stages = len(pipe.stages)
    if len(per_device) != stages * replicas:  # two stages of one replica share a device
        problems.append(f"{stages} stages x {replicas} replicas on {len(per_device)} devices")
    memory = {}
    for device in per_device:
        if "CPU" in device:  # logical CPUs share one allocator: its figure says nothing per device
            continue
        try:
            memory[device] = tf.config.experimental.get_memory_info(device)["current"]
        except (ValueError, tf.errors.OpError):  # not reported for this device type
            pass
    short = {d: d.split("device:")[-1] for d in per_device}
    shown = "; ".join(f"{short[d]} {n:,} params" + (f" {memory[d] / 2**20:.1f} MiB" if d in memory else "")
                      for d, n in per_device.items())
    layout = pipe.placement.describe()
    return Check("placement", _status(not problems), (problems[0] if problems else f"{layout}: {shown}"),
                 {"layout": layout, "params_per_device": per_device, "bytes_in_use": memory, "problems": problems,
                  "planned_params_per_stage": [s.params for s in pipe.stages]})


def check_replicas(run) -> Check:
    replicas = run.dist.num_replicas
    if replicas < 2:
        return Check("replicas", "SKIP", "one replica: nothing to compare (more devices, or parallel.tensor=1, "
                     "give two)")
    differ, total = [], 0
    for v in run.model.weights + run.optimizer.variables:
        copies = [c.numpy() for c in _copies(v)]
        total += 1
        if len(copies) > 1 and not all(np.array_equal(copies[0], c) for c in copies[1:]):
            differ.append(v.path)
    step = int(run.optimizer.iterations.numpy())
    numbers = (f"{len(differ)} of {total} variables differ between replicas, e.g. {differ[0]}" if differ else
               f"{total} variables bit-identical on {replicas} replicas after {step} steps")
    return Check("replicas", _status(not differ), numbers, {"replicas": replicas, "differ": differ, "step": step})


def check_bfloat16(f32_loss: float, bf16_loss: float) -> Check:
    rel = abs(bf16_loss - f32_loss) / abs(f32_loss) if f32_loss else float("inf")
    ok = np.isfinite(bf16_loss) and rel <= BF16_TOLERANCE
    return Check("bfloat16", _status(ok), f"mean loss {bf16_loss:.4f} vs float32 {f32_loss:.4f} "
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
    return Check("checkpoint", _status(same), f"{path}: {size / 2**20:.1f} MiB written in {saved:.2f} s, read "
                 f"back {'bit-exact' if same else 'DIFFERENT'} in {read:.2f} s",
                 {"path": path, "bytes": size, "write_seconds": saved, "read_seconds": read, "exact": same})


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
    return Check("input", _status(ratio >= 1.0), f"{windows_per_second:,.0f} windows/s from the input pipeline, "
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
    return Check("plan", _status(ok), f"measured {1e3 * step_seconds:.2f} ms per step, `tpu-llm plan "
                 f"--accelerator {name}` predicts {1e3 * predicted:.3f} ms: {ratio:.1f}x (expected "
                 f"{PLAN_RATIO[0]:g}x-{PLAN_RATIO[1]:g}x for this tiny model)",
                 {"accelerator": name, "measured_seconds": step_seconds, "predicted_seconds": predicted,
                  "ratio": ratio})


# the memory check's model: one llama block (grouped-query attention: 2 query heads share 1 key/value
# head) whose logits and scores are most of its step's memory, small enough to compile in seconds
# anywhere. Its head_dim (n_embd / n_head) is 128, as are or divide every other minor dimension (width
# 256, sequence 512, vocabulary 8,192): a TPU lays arrays out in tiles of 128 lanes on the minor
# dimension, so a head_dim of 32 (the probe's before) would be stored padded to 128, 4x the bytes the
# planner counts for q, k, v and the attention output, and a healthy TPU could fail the 0.5-2x band.
# With nothing to pad the band stays the same on every device (on CPU: 1.37x and 1.09x here).
MEMORY_PROBE = {"model.family": "llama", "model.n_layer": 1, "model.n_head": 2, "model.n_kv_head": 1,
                "model.n_embd": 256, "model.max_len": 512, "data.seq_len": 512, "model.vocab_size": 8192,
                "model.bias": False, "model.dropout": 0.0, "train.batch_size": 1, "precision": "float32"}
MEMORY_OPTIONS = {"train.loss_chunk": 128, "model.attention": "blockwise", "model.attention_block": 128}
MEMORY_TOLERANCE = 0.02  # relative difference of the loss and the gradients: a TPU's float32 matmuls run
# bfloat16 passes by default, so the two orders of summation differ by more than float32's rounding
MEMORY_PLAN_RATIO = (0.5, 2.0)  # measured / planned peak: outside, the planner is wrong for this chip


def _peak_bytes(device: str, step, x) -> float | None:
    """Device memory the step takes beyond what was resident before it, or None where TF does not report it."""
    try:
        tf.config.experimental.reset_memory_stats(device)
        before = tf.config.experimental.get_memory_info(device)["current"]
    except (ValueError, NotImplementedError, tf.errors.OpError):  # a CPU: no allocator stats
        return None
    out = step(x, x)
    float(out[0])
    return tf.config.experimental.get_memory_info(device)["peak"] - before


def first_device(strategy) -> str:
    """The device of the strategy's first replica; the default strategy (one device) has no list of them."""
    try:
        return strategy.extended.worker_devices[0]
    except (RuntimeError, AttributeError, NotImplementedError):  # tf.distribute's default strategy raises
        for kind in ("TPU", "GPU", "CPU"):
            found = tf.config.list_logical_devices(kind)
            if found:
                return found[0].name
    return "/device:CPU:0"


def check_memory(device: str) -> Check:
    """Dense against chunked loss + blockwise attention on `device`: the same weights and batch give the
    same loss and gradients; peak memory of each step where the device reports it, against the plan."""
    cfgs = {"dense": load_config(None, MEMORY_PROBE), "options": load_config(None, {**MEMORY_PROBE, **MEMORY_OPTIONS})}
    cpu = plan.Accelerator("cpu", "CPU", 1, 1e11, 0.0, "the planner's memory only")
    values: dict = {}
    with tf.device(device):
        x = tf.random.stateless_uniform([1, MEMORY_PROBE["data.seq_len"]], [7, 7], 0, MEMORY_PROBE["model.vocab_size"],
                                        tf.int32)
        dense = GPT(cfgs["dense"].model, MEMORY_PROBE["model.vocab_size"]).build_weights()
        options = GPT(cfgs["options"].model, MEMORY_PROBE["model.vocab_size"]).build_weights()
        options.set_weights(dense.get_weights())
        results = {}
        for name, model in (("dense", dense), ("options", options)):
            step = xla_memory.micro_step(cfgs[name], model)
            results[name] = step(x, x)  # compiles
            values[f"{name}_peak"] = _peak_bytes(device, step, x)
            mem = plan.plan(cfgs[name], cpu).memory[0]
            values[f"{name}_planned"] = mem.gradients + mem.activations + mem.workspace
    (loss, grads), (loss2, grads2) = results["dense"], results["options"]
    flat, flat2 = (tf.concat([tf.reshape(g, [-1]) for g in gs], 0) for gs in (grads, grads2))
    values["loss_diff"] = abs(float(loss2) - float(loss)) / abs(float(loss))
    values["grad_diff"] = float(tf.norm(flat2 - flat) / tf.norm(flat))
    ok = values["loss_diff"] <= MEMORY_TOLERANCE and values["grad_diff"] <= MEMORY_TOLERANCE
    numbers = (f"chunked loss + blockwise attention vs dense: loss {values['loss_diff']:.1e}, gradients "
               f"{values['grad_diff']:.1e} apart (tolerance {MEMORY_TOLERANCE:g})")
    if values["dense_peak"] is None:
        return Check("memory", _status(ok), numbers + "; device memory not reported here", values)
    ratios = {n: values[f"{n}_peak"] / values[f"{n}_planned"] for n in ("dense", "options")}
    values.update(ratio_dense=ratios["dense"], ratio_options=ratios["options"])
    ok = ok and values["options_peak"] < values["dense_peak"] and \
        all(MEMORY_PLAN_RATIO[0] <= r <= MEMORY_PLAN_RATIO[1] for r in ratios.values())
    return Check("memory", _status(ok), numbers + f"; peak {values['dense_peak'] / 2**20:.1f} -> "
                 f"{values['options_peak'] / 2**20:.1f} MiB, {ratios['dense']:.2f}x and {ratios['options']:.2f}x "
                 f"the plan (PASS within {MEMORY_PLAN_RATIO[0]:g}-{MEMORY_PLAN_RATIO[1]:g}x)", values)


def layout(found: distribute.Found, cpu_devices: int, stages: int, tensor: int) -> tuple[int, int]:
    """(stages, tensor groups): what was asked, else 2 x 2 where 8 devices give two replicas of it,
    2 x 1 from 2 devices, 1 x 1 on one device."""
    if stages and tensor:
        return stages, tensor
    devices = cpu_devices if not (found.tpu or found.gpus) else (found.gpus or 8)  # a TPU: v5e-8/v6e-8 have 8
    default = (2, 2) if devices >= 8 else (2, 1) if devices >= 2 else (1, 1)
    return stages or default[0], tensor or default[1]


def run(run_dir: str = "runs/doctor", tpu: str = "", strategy: str = "auto", cpu_devices: int = 8,
        stages: int = 0, tensor: int = 0, steps: int = 4, say=print) -> list[Check]:
    """Run every check; print the table; write <run_dir>/doctor.json; returns the checks."""
    if not isinstance(steps, int) or steps < 2:
        raise UserError(f"--steps={steps!r} must be an integer >= 2 (the first call compiles, the rest is timed)")
    started = time.perf_counter()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    work = os.path.join(run_dir, stamp)  # a fresh directory per doctor run: nothing is resumed or overwritten

    probe = tiny_config(os.path.join(work, "float32"), tpu, strategy, cpu_devices, 1, 1, steps)
    found = distribute.look_around(probe)
    stages, tensor = layout(found, cpu_devices, stages, tensor)

    # a remote TPU (a pod from worker 0, tpu=<name>) reads its data from shared storage, never local files
    train = stage_data(os.path.join(work, "data")) if found.tpu and tpus.is_remote(tpu) and \
        tpus.shared_storage(run_dir) else ""
    cfg = tiny_config(os.path.join(work, "float32"), tpu, strategy, cpu_devices, stages, tensor, steps, train=train)
    checks: list[Check] = []
    say(f"doctor    tensorflow {tf.__version__}, keras {keras.__version__}; runs in {work}")
    for line in found.describe():
        say(f"          {line}")
    try:
        name, reason = distribute.choose(cfg, found)
        dist = distribute.get_strategy(cfg, found)
    except UserError as e:
        checks.append(Check("devices", "FAIL", str(e)))
        return _finish(checks, run_dir, started, say)
    checks.append(check_devices(found, name, reason, dist))
    batch = dist.num_replicas * cfg.parallel.microbatches * 4
    cfg.train.batch_size = batch
    try:
        f32 = controller.build_run(cfg, dist)
        half = steps // 2 or 1
        first = f32.trainer.run(f32.train_iterator, half, half)  # compiles
        start = time.perf_counter()
        second = f32.trainer.run(f32.train_iterator, steps - half, steps - half)
        step_seconds = (time.perf_counter() - start) / max(steps - half, 1)
        f32_loss = (first["loss"] * half + second["loss"] * (steps - half)) / steps
        checks.append(check_placement(f32))
        checks.append(check_replicas(f32))
        bf16_cfg = tiny_config(os.path.join(work, "bfloat16"), tpu, strategy, cpu_devices, stages, tensor, steps,
                               precision="mixed_bfloat16", train=train)
        bf16_cfg.train.batch_size = batch
        try:
            bf16 = controller.build_run(bf16_cfg, dist)
            bf16_loss = bf16.trainer.run(bf16.train_iterator, steps, steps)["loss"]
        finally:
            keras.mixed_precision.set_global_policy("float32")
        checks.append(check_bfloat16(f32_loss, bf16_loss))
        checks.append(check_checkpoint(f32))
        checks.append(check_input(input_windows_per_second(f32), step_seconds, batch))
        checks.append(check_plan(cfg, dist, step_seconds))
        checks.append(check_memory(first_device(dist.strategy)))
    except Exception as e:  # noqa: BLE001 - what broke on this machine is the doctor's finding
        first = (str(e).strip().splitlines() or [""])[0][:300]
        checks.append(Check("run", "FAIL", f"the tiny run stopped: {type(e).__name__}: {first}"))
    return _finish(checks, run_dir, started, say)


def _finish(checks: list[Check], run_dir: str, started: float, say) -> list[Check]:
    for check in checks:
        say(check.line())
        if check.status == "FAIL":
            say(f"      fix: {FIX.get(check.name, 'see the line above')}")
    seconds = time.perf_counter() - started
    report = {"seconds": seconds, "tensorflow": tf.__version__, "keras": keras.__version__,
              "passed": all(c.status != "FAIL" for c in checks), "checks": [dataclasses.asdict(c) for c in checks]}
    tf.io.gfile.makedirs(run_dir)
    path = os.path.join(run_dir, "doctor.json")
    with tf.io.gfile.GFile(path, "w") as f:
        f.write(json.dumps(report, indent=1, default=str) + "\n")
    say(f"doctor    {sum(c.status == 'PASS' for c in checks)} passed, {sum(c.status == 'FAIL' for c in checks)} "
        f"failed, {sum(c.status == 'SKIP' for c in checks)} skipped in {seconds:.0f} s; wrote {path}")
    return checks


def main(**kwargs) -> None:
    """The CLI's `doctor`: a one-line UserError (exit status 2) when a check failed."""
    checks = run(**kwargs)
    failed = [c.name for c in checks if c.status == "FAIL"]
    if failed:
        raise UserError(f"doctor: {', '.join(failed)} failed; see the fix under each FAIL line above and "
                        f"{os.path.join(kwargs.get('run_dir', 'runs/doctor'), 'doctor.json')}")
