"""`tpu-llm doctor`: the two-minute first-contact check of a new machine (TPU VM, pod worker 0,
Colab/Kaggle TPU, GPU box, laptop).

It checks on the real hardware what the repository's tests cannot check offline, prints one PASS /
FAIL / SKIP line per check with its numbers (and, under a failed line, what to do), writes
`doctor.json` into the run directory, and ends with a one-line error (exit status 2) when a check
failed. First a data-parallel run (one replica per TPU core, GPU or logical CPU; no pipeline stages,
no tensor groups), the best-proven path, and the lines measured on it:

  devices         the strategy and devices found, and how (distribute.look_around, tpu.find_tpu)
  replicas        every replica's copy of every weight and moment bit-identical after the steps
  bfloat16        the mean loss under mixed_bfloat16 within 2% of float32's on the same batches
  checkpoint      a checkpoint written to and read back from the run directory, bit-exact
  input           the input pipeline's windows/s against what the measured step consumes
  plan            the measured step time against `tpu-llm plan`'s prediction for the same config
  profile         a TensorFlow profiler trace of two steps, in <run>/logs/train/plugins/profile
  memory          the chunked loss and blockwise attention (docs/memory.md) on this device: loss and
                  gradients equal to the dense ones, and where TF reports device memory (TPU, GPU) the
                  step's peak with and without them against `tpu-llm plan`'s

then, as its own check, the least proven path:

  model parallel  the same model in P pipeline stages x T tensor groups per replica (`layout`: from
                  the devices found, 2 x 2 where 4 divides their number, 2 x 1 on two, none on one):
                  each stage's variables and AdamW moments on its own device or logical core, adding
                  up to `tpu-llm plan`'s per-stage parameters; replicas bit-identical; the mean loss
                  equal to the data-parallel run's on the same batches

so a failing model-parallel run costs one line, never the others. A check that crashes is that
check's FAIL, with its error; only a crash of the data-parallel run itself is the one `run` line.

Two minutes on a v5e-8 by design: one TPU connection for everything (the model-parallel run's
strategy reuses it: tpu._CONNECTED), a 2-block width-64 model, three training programs (float32 and
bfloat16 data-parallel, float32 model-parallel; the timed second call of the float32 run reuses its
program), no evaluation, no samples. The float32 run's first call includes the compilation and is not
timed. The memory line compiles a one-block model's step twice (dense, and with both options) on the
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

from tpu_llm import __version__
from tpu_llm.cloud import pod_check
from tpu_llm.config import Config, load_config
from tpu_llm.data import dataset as data
from tpu_llm.data import sources
from tpu_llm.errors import UserError
from tpu_llm.model import GPT
from tpu_llm.parallel import distribute
from tpu_llm.parallel import tpu
from tpu_llm.parallel import tpu as tpus
from tpu_llm.tools import plan, xla_memory
from tpu_llm.training import controller, profiler

BF16_TOLERANCE = 0.02  # |bf16 - f32| / f32 of the mean loss (tests/test_pipeline.py uses the same)
PLAN_RATIO = (0.5, 200.0)  # measured / planned step time: below, the planner's FLOPs or peak are wrong;
# above, the step is not running on the accelerator (tiny models are overhead-bound, hence the width)

FIX = {
    "devices": "run `tpu-llm info`; on a TPU VM install tpu-llm[tpu] (tensorflow-tpu + libtpu) and set tpu=local; "
               "on a pod run on worker 0 with TPU_NAME set; see docs for the strategy options",
    "model parallel": "model parallelism failed on this machine; the data-parallel lines above hold without it: "
                      "train with parallel.pipeline_stages=1 parallel.tensor=1 here, run `tpu-llm doctor --stages 2 "
                      "--tensor 1` to tell pipeline stages from tensor groups, and report it with doctor.json",
    "replicas": "replicas diverged: the all-reduce or the variable sync is broken on this runtime; report it "
                "with doctor.json and do not train data-parallel here",
    "bfloat16": "bfloat16 loss is off: train with precision=float32 and report it with doctor.json",
    "checkpoint": "the run directory cannot hold checkpoints: check its permissions or bucket (gs:// on a TPU, "
                  "with the TPU's service account allowed to write), or choose another --run_dir",
    "input": "the input pipeline is slower than the step: pre-tokenize with `tpu-llm data prepare` and read "
             "TFRecords, use more files, or a larger model/batch per step",
    "run": "the tiny data-parallel run itself failed: read the error above and doctor.json; run `tpu-llm info` "
           "and a `tpu-llm train --config configs/tiny.yaml` to see the full traceback",
    "plan": "the step time is far from the planner's: check the devices line (a step on the host CPU?) and "
            "compare `tpu-llm plan --accelerator ...` with this machine's type",
    "profile": "TensorFlow's profiler cannot trace here: train without train.profile_steps, and report it with "
               "doctor.json",
    "memory": "train with train.loss_chunk=0 model.attention=dense if the results differ, and plan with a margin if "
              "the memory differs from the planner's; report it with doctor.json",
}
MODEL_PARALLEL_TOLERANCE = 0.01  # |model-parallel - data-parallel| / data-parallel mean loss, same weights and
# batches: float32 sums in another order (a TPU's float32 matmuls run bfloat16 passes), far below the
# effect of a stage or tensor group that computes or updates the wrong thing
KINDS = {"tpu": "TPU core", "GPU": "GPU", "CPU": "logical CPU"}  # what one replica of the data-parallel run holds


@dataclasses.dataclass
class Check:
    name: str
    status: str  # PASS, FAIL or SKIP
    numbers: str  # what was measured, one line
    values: dict = dataclasses.field(default_factory=dict)  # the same as numbers, for doctor.json
    fix: str = ""  # what to do when it failed, if more precise than FIX[name]

    def line(self) -> str:
        return f"{self.status:<5} {self.name:<14} {self.numbers}"


def _status(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def tiny_config(run_dir: str, tpu: str, strategy: str, cpu_devices: int, stages: int, tensor: int,
                steps: int, precision: str = "float32", train: str = "", layers: int = 0) -> Config:
    """The doctor's run: a GPT of `layers` blocks (default: one per stage, at least 2), width 64, on
    `train` (default: the embedded corpus), bytes, no eval or samples."""
    return load_config(None, {
        "run_dir": run_dir, "tpu": tpu, "strategy": strategy, "cpu_devices": cpu_devices, "precision": precision,
        "model.n_layer": layers or max(2, stages), "model.n_head": 4, "model.n_embd": 64, "model.max_len": 64,
        "model.dropout": 0.0,
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
                  "logical_devices": [d.name for d in logical], "tpu_evidence": found.tpu, "gpus": found.gpus},
                 fix="" if ok else devices_fix(found, name))


def _tensorflow_tpus() -> int:
    try:  # physical devices: listing them does not start the TPU runtime
        return len(tf.config.list_physical_devices("TPU"))
    except Exception:  # noqa: BLE001 - a broken plugin lists nothing
        return 0


def devices_fix(found: distribute.Found, name: str = "", remote: bool = False) -> str:
    """What to do when the devices line failed, from what TensorFlow itself sees: the install advice
    only when it sees no TPU where one was found."""
    tpus = _tensorflow_tpus()
    if found.tpu and name and name != "tpu":
        return (f"a TPU is attached ({found.tpu}) but strategy={name} runs without it: use strategy=auto or tpu")
    if found.gpus and name and name != "tpu":
        return (f"TensorFlow lists {found.gpus} GPU(s) but the run used the CPU: use strategy=auto or mirrored, "
                "and check `tpu-llm info`")
    if found.tpu and tpus:
        return (f"TensorFlow sees this TPU ({tpus} TPU device(s)), so its install is right: the error above is the "
                "cause (another process holding the TPU? a TPU accepts one process at a time: stop it, or restart "
                "the notebook's runtime)")
    if found.tpu and remote:
        return ("the TPU named is reached over the network: check its name, zone and this machine's credentials "
                "(`gcloud compute tpus tpu-vm list`); on a pod run on worker 0 with TPU_NAME and TPU_LOAD_LIBRARY=0")
    if found.tpu:
        pjrt = os.environ.get("TF_PLUGGABLE_DEVICE_LIBRARY_PATH")
        return ("TensorFlow lists no TPU device: install the TPU build (pip install 'tpu-llm[tpu]': "
                "tensorflow-tpu 2.20.0 with libtpu 0.0.14, in place of the `tensorflow` wheel) and start tpu-llm "
                "afresh (a notebook: restart its runtime), which points TensorFlow at libtpu before it starts ("
                + (f"TF_PLUGGABLE_DEVICE_LIBRARY_PATH={pjrt} now" if pjrt else "no libtpu was found to point at")
                + "); see docs/colab-kaggle.md")
    return FIX["devices"]


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
        return Check("replicas", "SKIP", "one replica: nothing to compare")
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


def check_profile(run, steps: int = 2) -> Check:
    """One short profiler trace of the tiny run (after its timed calls: compiled already), where
    TensorBoard's profile plugin finds it; PASS when the trace holds the host call of the steps."""
    path, seconds, trace = profiler.capture(run, steps)
    logs = os.path.dirname(profiler.profile_dir(run.cfg.run_dir))
    return Check("profile", _status(trace["host_calls"] >= 1), f"{steps} steps traced in {seconds:.1f} s: {path} "
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


def layout(devices: int, stages: int = 0, tensor: int = 0) -> tuple[int, int]:
    """(pipeline stages, tensor groups) per replica of the model-parallel run on `devices` devices (TPU
    cores, GPUs or logical CPUs): what was asked, else

      4, 8, 16, ... (4 divides it)  2 x 2: both kinds of split in every replica (one replica on 4,
                                    two on 8: v5e-4/v4-8 and v5e-8/v6e-8/v3-8 alike), all cores used
      2                             2 x 1: the only split two cores allow (v5litepod-2)
      1, or any other number        1 x 1: nothing to split (v5e-1, v6e-1: Colab and Kaggle); the
                                    model-parallel line is a SKIP

    On 4 cores 2 x 2 (one replica) rather than 2 x 1 (two): the data-parallel run has already checked
    replicas over all 4 cores, so the model-parallel run spends them on what is unproven, stages and
    tensor groups together. A TPU slice's cores come in 1, 2, 4, 8, ...; a number 4 does not divide
    (3 or 6 GPUs) gets no default split, as a layout that leaves devices idle would say little.
    """
    if stages and tensor:
        return stages, tensor
    default = (2, 2) if devices % 4 == 0 else (2, 1) if devices == 2 else (1, 1)
    return stages or default[0], tensor or default[1]


def device_count(dist) -> int:
    """Devices a replica of the model-parallel run may span: the data-parallel run has one replica per TPU
    core, GPU or logical CPU. Multi-worker and parameter-server strategies keep one device per replica."""
    return dist.num_replicas if dist.name in ("tpu", "mirrored", "default") else 1


def _kind(dist) -> str:
    return KINDS["tpu"] if dist.name == "tpu" else KINDS.get(dist.device_kind, "device")


def fit_fix(devices: int, kind: str, stages: int, tensor: int, refused: bool = False) -> str:
    """What to do when P x T per replica does not fit the machine's devices (or, `refused`, its topology)."""
    k = stages * tensor
    where = "this TPU" if kind == KINDS["tpu"] else "this machine"
    if refused:
        return (f"{where} has {devices} {kind}(s), but its topology cannot be cut into blocks of {k} neighbouring "
                f"cores ({stages} x {tensor}; the line above lists the valid sizes): pass --stages/--tensor whose "
                "product is one of them, or leave them at 0 for the layout doctor picks")
    fits = [f"{p} x {t}" for p, t in ((2, 1), (2, 2), (4, 1), (4, 2)) if devices % (p * t) == 0]
    return (f"{where} has {devices} {kind}(s); {stages} x {tensor} = {k} {kind}(s) per replica needs a multiple of "
            f"{k}: pass --stages/--tensor whose product divides {devices}"
            + (f" ({', '.join(fits)})" if fits else " (none: model parallelism needs 2 or more)")
            + ", or leave them at 0 for the layout doctor picks")


def check_model_parallel(make_cfg, found: distribute.Found, dist, stages: int, tensor: int, steps: int,
                         reference_loss: float) -> Check:
    """The same model in `stages` x `tensor` per replica, trained `steps` steps on the same batches as the
    data-parallel run (`make_cfg(stages, tensor)` gives its config): placement, replicas, and the mean
    loss against `reference_loss`, the data-parallel run's."""
    devices, kind = device_count(dist), _kind(dist)
    layout_text = f"{stages} stage(s) x {tensor} tensor group(s)"
    if stages * tensor == 1:
        why = (f"{devices} {kind}(s): nothing to split" if dist.name in ("tpu", "mirrored", "default") else
               f"strategy {dist.name} runs one device per replica")
        return Check("model parallel", "SKIP", f"{why} (pipeline stages and tensor groups need 2+ per replica; "
                     "--stages/--tensor choose them)", {"devices": devices, "stages": stages, "tensor": tensor})
    values = {"devices": devices, "kind": kind, "stages": stages, "tensor": tensor}
    if devices % (stages * tensor):
        return Check("model parallel", "FAIL", f"{layout_text} per replica do not fit {devices} {kind}(s)", values,
                     fix=fit_fix(devices, kind, stages, tensor))
    cfg = make_cfg(stages, tensor)
    try:
        mp_dist = distribute.get_strategy(cfg, found)
    except UserError as e:  # e.g. tpu.device_assignment: the block does not fit this slice's topology
        return Check("model parallel", "FAIL", f"{layout_text}: {e}", values,
                     fix=fit_fix(devices, kind, stages, tensor, refused=True))
    try:
        run = controller.build_run(cfg, mp_dist)
        loss = run_model_parallel(run, steps)
        placement, replicas = check_placement(run), check_replicas(run)
    except Exception as e:  # noqa: BLE001 - what broke on this machine is the finding
        first = (str(e).strip().splitlines() or [""])[0][:300]
        return Check("model parallel", "FAIL", f"{layout_text} stopped: {type(e).__name__}: {first}", values)
    rel = abs(loss - reference_loss) / abs(reference_loss) if reference_loss else float("inf")
    values.update(loss=loss, data_parallel_loss=reference_loss, relative=rel, replicas=mp_dist.num_replicas,
                  placement=placement.values, replicas_check=replicas.values)
    problems = [c.numbers for c in (placement, replicas) if c.status == "FAIL"]
    if not (np.isfinite(loss) and rel <= MODEL_PARALLEL_TOLERANCE):
        problems.append(f"mean loss {loss:.4f} vs data-parallel {reference_loss:.4f} ({100 * rel:.2f}% apart, "
                        f"tolerance {100 * MODEL_PARALLEL_TOLERANCE:g}%)")
    if problems:
        return Check("model parallel", "FAIL", f"{layout_text} x {mp_dist.num_replicas} replica(s): {problems[0]}",
                     values)
    return Check("model parallel", "PASS", f"{mp_dist.num_replicas} replica(s) on {devices} {kind}(s), "
                 f"{placement.numbers}; {'replicas bit-identical' if replicas.status == 'PASS' else 'one replica'}; "
                 f"mean loss {loss:.4f} vs data-parallel {reference_loss:.4f} ({100 * rel:.3f}%)", values)


def run_model_parallel(run, steps: int) -> float:
    """The model-parallel run's mean loss over `steps` steps (a seam for tests)."""
    return run.trainer.run(run.train_iterator, steps, run.cfg.train.steps_per_loop)["loss"]


def _guarded(name: str, check, *args) -> Check:
    """check(*args), or that check's FAIL with the error when it crashes (the other lines still run)."""
    try:
        return check(*args)
    except Exception as e:  # noqa: BLE001 - what broke on this machine is the doctor's finding
        first = (str(e).strip().splitlines() or [""])[0][:300]
        return Check(name, "FAIL", f"the check stopped: {type(e).__name__}: {first}")


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
    try:
        remote = bool(found.tpu) and tpus.is_remote(tpu)
    except UserError:  # tpu=local without chips: the devices line says so
        remote = False
    # a remote TPU (a pod from worker 0, tpu=<name>) reads its data from shared storage, never local files
    train = stage_data(os.path.join(work, "data")) if remote and tpus.shared_storage(run_dir) else ""
    # data parallel first: one replica per TPU core, GPU or logical CPU, no stages, no tensor groups
    cfg = tiny_config(os.path.join(work, "float32"), tpu, strategy, cpu_devices, 1, 1, steps, train=train)
    checks: list[Check] = []
    if remote:  # a pod from worker 0: its hosts' TF servers first, which the strategy needs (cloud/pod_check.py)
        checks.append(Check("pod", *pod_check.check(tf.__version__)))
    say(f"doctor    tensorflow {tf.__version__}, keras {keras.__version__}; runs in {work}")
    for line in found.describe():
        say(f"          {line}")
    try:
        name, reason = distribute.choose(cfg, found)
        dist = distribute.get_strategy(cfg, found)
    except UserError as e:
        checks.append(Check("devices", "FAIL", str(e), fix=devices_fix(found, remote=remote)))
        return _finish(checks, run_dir, started, say)
    checks.append(check_devices(found, name, reason, dist))
    devices = device_count(dist)
    stages, tensor = layout(devices, stages, tensor)
    layers = max(2, stages)  # both runs train the same model: one block per stage of the model-parallel run
    cfg.model.n_layer = layers
    # the same global batch in both runs, split evenly into either's replicas and micro-batches, so the
    # two runs see the same windows (one input pipeline per host, cut into per-replica batches)
    batch = devices * cfg.parallel.microbatches * 4
    cfg.train.batch_size = batch

    def make_cfg(p: int, t: int, precision: str = "float32", where: str = "model-parallel") -> Config:
        c = tiny_config(os.path.join(work, where), tpu, strategy, cpu_devices, p, t, steps, precision=precision,
                        train=train, layers=layers)
        c.train.batch_size = batch
        return c

    try:
        f32 = controller.build_run(cfg, dist)
        half = steps // 2 or 1
        first = f32.trainer.run(f32.train_iterator, half, half)  # compiles
        start = time.perf_counter()
        second = f32.trainer.run(f32.train_iterator, steps - half, steps - half)
        step_seconds = (time.perf_counter() - start) / max(steps - half, 1)
        f32_loss = (first["loss"] * half + second["loss"] * (steps - half)) / steps
    except Exception as e:  # noqa: BLE001 - what broke on this machine is the doctor's finding
        first_line = (str(e).strip().splitlines() or [""])[0][:300]
        checks.append(Check("run", "FAIL", f"the tiny data-parallel run stopped: {type(e).__name__}: {first_line}"))
        return _finish(checks, run_dir, started, say)
    checks.append(_guarded("replicas", check_replicas, f32))

    def bfloat16() -> Check:
        try:
            bf16 = controller.build_run(make_cfg(1, 1, "mixed_bfloat16", "bfloat16"), dist)
            return check_bfloat16(f32_loss, bf16.trainer.run(bf16.train_iterator, steps, steps)["loss"])
        finally:
            keras.mixed_precision.set_global_policy("float32")
    checks.append(_guarded("bfloat16", bfloat16))
    checks.append(_guarded("checkpoint", check_checkpoint, f32))
    checks.append(_guarded("input", lambda: check_input(input_windows_per_second(f32), step_seconds, batch)))
    checks.append(_guarded("plan", check_plan, cfg, dist, step_seconds))
    checks.append(_guarded("profile", check_profile, f32))
    checks.append(_guarded("memory", check_memory, first_device(dist.strategy)))
    # the least proven path last, on its own line
    checks.append(check_model_parallel(make_cfg, found, dist, stages, tensor, steps, f32_loss))
    return _finish(checks, run_dir, started, say)


def _finish(checks: list[Check], run_dir: str, started: float, say) -> list[Check]:
    for check in checks:
        say(check.line())
        if check.status == "FAIL":
            say(f"      fix: {check.fix or FIX.get(check.name, 'see the line above')}")
    seconds = time.perf_counter() - started
    report = {"seconds": seconds, "tpu_llm": __version__, "tensorflow": tf.__version__, "keras": keras.__version__,
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
