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
  shard state     the float32 run again with parallel.shard_optimizer=state: the same mean loss, and
                  1/R of AdamW's moments on each replica's device, the planner's optimizer bytes
  shard grads     the same with parallel.shard_optimizer=grads and train.grad_accum=2: each micro-
                  batch's gradients reduced over the replicas inside the step, each keeping its rows

then, as its own check, the least proven path:

  model parallel  the same model in P pipeline stages x T tensor groups per replica (`layout`: from
                  the devices found, 2 x 2 where 4 divides their number, 2 x 1 on two, none on one):
                  each stage's variables and AdamW moments on its own device or logical core, adding
                  up to `tpu-llm plan`'s per-stage parameters; replicas bit-identical; the mean loss
                  equal to the data-parallel run's on the same batches
  hlo default     on a TPU only, the same layout trained one step in mixed_bfloat16 with dropout 0.1 and
  hlo mlir        grad_accum 2, with the bridge TensorFlow chooses and then with the MLIR bridge: per
                  core, the forward and backward matmuls of the train step's module in the HLO XLA's
                  TPU compiler dumped (hlo.py), within 25% of even; a core-0-heavy layout is a FAIL

so a failing model-parallel run costs one line, never the others. A check that crashes is that
check's FAIL, with its error; only a crash of the data-parallel run itself is the one `run` line.

Two minutes on a v5e-8 by design: one TPU connection for everything (the model-parallel run's
strategy reuses it: tpu._CONNECTED), a 2-block width-64 model, five training programs (float32 and
bfloat16 data-parallel, float32 with divided moments, with divided moments and gradients, float32
model-parallel; the timed second call of the float32 run reuses its program), no evaluation, no
samples. The float32 run's first call includes the compilation and is not timed. The memory line compiles a one-block model's step twice (dense, and with both options) on the
first device: seconds. On a TPU VM the two hlo lines add two more programs (not measured on one).

This module runs the checks in that order (`run`); they live one family to a module beside it:
`devices.py` (the devices line), `data_parallel.py` (replicas, bfloat16, checkpoint, input, plan,
profile), `memory.py`, `model_parallel.py` (the layout, the placement and the model parallel line), and
`report.py` (`Check`, one line each, and `FIX`, what to do under a FAIL line). A new check is a function
returning a `Check` in its family's module (or a new one), its `FIX` entry and its line in `run`.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import tempfile
import time

import keras
import tensorflow as tf

from tpu_llm import __version__
from tpu_llm.cloud import pod_check
from tpu_llm.config import Config, load_config
from tpu_llm.data import sources
from tpu_llm.errors import UserError
from tpu_llm.parallel import distribute
from tpu_llm.parallel import tpu as tpus
from tpu_llm.platform import xla_flags
from tpu_llm.tools.doctor import hlo
from tpu_llm.tools.doctor.data_parallel import (check_bfloat16, check_checkpoint, check_input, check_plan,
                                                check_profile, check_replicas, check_shard,
                                                input_windows_per_second)
from tpu_llm.tools.doctor.devices import check_devices, devices_fix
from tpu_llm.tools.doctor.memory import check_memory, first_device
from tpu_llm.tools.doctor.model_parallel import check_model_parallel, device_count, layout
from tpu_llm.tools.doctor.report import FIX, Check
from tpu_llm.training import build


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


def _guarded(name: str, check, *args) -> Check:
    """check(*args), or that check's FAIL with the error when it crashes (the other lines still run)."""
    try:
        return check(*args)
    except Exception as e:  # noqa: BLE001 - what broke on this machine is the doctor's finding
        first = (str(e).strip().splitlines() or [""])[0][:300]
        return Check(name, "FAIL", f"the check stopped: {type(e).__name__}: {first}")


def run(run_dir: str = "runs/doctor", tpu: str = "", strategy: str = "auto", cpu_devices: int = 8,
        stages: int = 0, tensor: int = 0, steps: int = 4, say=print, runtime: str = "",
        hlo_dump: str | None = None) -> list[Check]:
    """Run every check; print the table; write <run_dir>/doctor.json; returns the checks. `runtime`: which
    TPU runtime and libtpu this process was pointed at before TensorFlow started (the CLI's
    cli/pjrt.describe()), printed when a TPU is found. `hlo_dump`: where
    XLA was asked to dump (the CLI asks before TensorFlow is imported; '' for nowhere); None: asked here,
    on a TPU VM, before the first TPU contact."""
    flags = os.environ.get("XLA_FLAGS")
    try:
        return _run(run_dir, tpu, strategy, cpu_devices, stages, tensor, steps, say, runtime, hlo_dump)
    finally:  # the dump was asked for this run only (XLA itself reads the variable once per process)
        if flags is None:
            os.environ.pop("XLA_FLAGS", None)
        else:
            os.environ["XLA_FLAGS"] = flags


def _run(run_dir: str, tpu: str, strategy: str, cpu_devices: int, stages: int, tensor: int, steps: int,
         say, runtime: str, dump: str | None) -> list[Check]:
    if not isinstance(steps, int) or steps < 2:
        raise UserError(f"--steps={steps!r} must be an integer >= 2 (the first call compiles, the rest is timed)")
    started = time.perf_counter()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    work = os.path.join(run_dir, stamp)  # a fresh directory per doctor run: nothing is resumed or overwritten
    found, remote, train, dump = _look_around(work, run_dir, tpu, strategy, cpu_devices, steps, dump)
    # data parallel first: one replica per TPU core, GPU or logical CPU, no stages, no tensor groups
    cfg = tiny_config(os.path.join(work, "float32"), tpu, strategy, cpu_devices, 1, 1, steps, train=train)
    checks: list[Check] = []
    if remote:  # a pod from worker 0: its hosts' TF servers first, which the strategy needs (cloud/pod_check.py)
        checks.append(Check("pod", *pod_check.check(tf.__version__)))
    say(f"doctor    tensorflow {tf.__version__}, keras {keras.__version__}; runs in {work}")
    for line in found_lines(found, remote, runtime):
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
    cfg.model.n_layer = max(2, stages)  # both runs train the same model: one block per stage of the model-parallel run
    # the same global batch in both runs, split evenly into either's replicas and micro-batches, so the
    # two runs see the same windows (one input pipeline per host, cut into per-replica batches)
    cfg.train.batch_size = devices * cfg.parallel.microbatches * 4
    make_cfg = _config_maker(work, tpu, strategy, cpu_devices, steps, train, cfg)
    try:
        f32, step_seconds, f32_loss = _timed_float32_run(cfg, dist, steps)
    except Exception as e:  # noqa: BLE001 - what broke on this machine is the doctor's finding
        first_line = (str(e).strip().splitlines() or [""])[0][:300]
        checks.append(Check("run", "FAIL", f"the tiny data-parallel run stopped: {type(e).__name__}: {first_line}"))
        return _finish(checks, run_dir, started, say)
    checks += _data_parallel_checks(f32, make_cfg, cfg, dist, steps, step_seconds, f32_loss)
    # the least proven path last, on its own line
    checks.append(check_model_parallel(make_cfg, found, dist, stages, tensor, steps, f32_loss))
    if dist.name == "tpu":  # XLA's TPU compiler is what they read
        checks += _hlo_lines(make_cfg, found, stages, tensor, "" if remote else dump, devices)
    return _finish(checks, run_dir, started, say)


def _look_around(work: str, run_dir: str, tpu: str, strategy: str, cpu_devices: int, steps: int,
                 dump: str | None) -> tuple:
    """(what was found, whether the TPU is remote, data.train for the runs, where XLA dumps): a remote
    TPU's runs read the corpus staged on shared storage; a TPU VM asks XLA for its dump here, before the
    first TPU contact, unless the CLI did (`dump`)."""
    probe = tiny_config(os.path.join(work, "float32"), tpu, strategy, cpu_devices, 1, 1, steps)
    found = distribute.look_around(probe)
    try:
        remote = bool(found.tpu) and tpus.is_remote(tpu)
    except UserError:  # tpu=local without chips: the devices line says so
        remote = False
    # a remote TPU (a pod from worker 0, tpu=<name>) reads its data from shared storage, never local files
    train = stage_data(os.path.join(work, "data")) if remote and tpus.shared_storage(run_dir) else ""
    # a TPU VM compiles here: XLA dumps what it compiles (the hlo lines), asked before the first TPU contact
    if dump is None:
        dump = xla_flags.ask_dump(tempfile.mkdtemp(prefix=xla_flags.PREFIX)) if found.tpu and not remote else ""
    return found, remote, train, dump


def _config_maker(work: str, tpu: str, strategy: str, cpu_devices: int, steps: int, train: str, cfg: Config):
    """make_cfg(p, t, precision, where): the doctor's run in P stages x T tensor groups, with the model and
    the global batch of the data-parallel run `cfg`, in <work>/<where>."""
    layers, batch = cfg.model.n_layer, cfg.train.batch_size

    def make_cfg(p: int, t: int, precision: str = "float32", where: str = "model-parallel") -> Config:
        c = tiny_config(os.path.join(work, where), tpu, strategy, cpu_devices, p, t, steps, precision=precision,
                        train=train, layers=layers)
        c.train.batch_size = batch
        return c
    return make_cfg


def _timed_float32_run(cfg: Config, dist, steps: int) -> tuple:
    """(the float32 run, seconds per step of its second call, its mean loss over both calls): the first
    call compiles and is not timed."""
    f32 = build.build_run(cfg, dist)
    half = steps // 2 or 1
    first = f32.trainer.run(f32.train_iterator, half, half)  # compiles
    start = time.perf_counter()
    second = f32.trainer.run(f32.train_iterator, steps - half, steps - half)
    step_seconds = (time.perf_counter() - start) / max(steps - half, 1)
    return f32, step_seconds, (first["loss"] * half + second["loss"] * (steps - half)) / steps


def _data_parallel_checks(f32, make_cfg, cfg: Config, dist, steps: int, step_seconds: float,
                          f32_loss: float) -> list[Check]:
    """The lines measured on the data-parallel run: replicas, bfloat16, checkpoint, input, plan, profile,
    memory, shard state, shard grads; each check that crashes is its own FAIL."""
    def bfloat16() -> Check:
        try:
            bf16 = build.build_run(make_cfg(1, 1, "mixed_bfloat16", "bfloat16"), dist)
            return check_bfloat16(f32_loss, bf16.trainer.run(bf16.train_iterator, steps, steps)["loss"])
        finally:
            keras.mixed_precision.set_global_policy("float32")
    batch = cfg.train.batch_size
    return [_guarded("replicas", check_replicas, f32), _guarded("bfloat16", bfloat16),
            _guarded("checkpoint", check_checkpoint, f32),
            _guarded("input", lambda: check_input(input_windows_per_second(f32), step_seconds, batch)),
            _guarded("plan", check_plan, cfg, dist, step_seconds), _guarded("profile", check_profile, f32),
            _guarded("memory", check_memory, first_device(dist.strategy)),
            _guarded("shard state", check_shard, "state", make_cfg, dist, steps, f32, f32_loss),
            _guarded("shard grads", check_shard, "grads", make_cfg, dist, steps, f32, f32_loss)]


def found_lines(found, remote: bool, runtime: str) -> list[str]:
    """What was found (GPUs, TPU, TF_CONFIG) and, with a TPU, the runtime and libtpu used (`runtime`)."""
    lines = found.describe()
    if found.tpu and remote:  # the TF servers on the TPU's hosts hold the chips: nothing loaded here
        lines.append("TPU runtime: the TF servers of the TPU's hosts, reached over the network; no libtpu here")
    elif found.tpu and runtime:
        lines.append(runtime)
    return lines


def _hlo_lines(make_cfg, found, stages: int, tensor: int, dump: str, devices: int) -> list[Check]:
    """The hlo default and hlo mlir lines (hlo.py): SKIP where this process does not compile the TPU's
    programs (no dump) or the layout does not fit."""
    lines = []
    for bridge in hlo.BRIDGES:
        if not dump:
            lines.append(Check(f"hlo {bridge}", "SKIP", "the TPU's hosts compile its programs, not this process "
                               "(a TPU over the network, a pod's worker 0): set XLA_FLAGS=--xla_dump_to=DIR "
                               "--xla_dump_hlo_as_text there to read them"))
        elif devices % (stages * tensor):
            lines.append(Check(f"hlo {bridge}", "SKIP", f"{stages} x {tensor} does not fit (model parallel line)"))
        else:
            lines.append(_guarded(f"hlo {bridge}", hlo.check_hlo, make_cfg, found, stages, tensor, bridge, dump))
    return lines


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
    warned = sum(c.status == "WARN" for c in checks)
    say(f"doctor    {sum(c.status == 'PASS' for c in checks)} passed, {sum(c.status == 'FAIL' for c in checks)} "
        f"failed, {f'{warned} warned, ' if warned else ''}{sum(c.status == 'SKIP' for c in checks)} "
        f"skipped in {seconds:.0f} s; wrote {path}")
    return checks


def main(**kwargs) -> None:
    """The CLI's `doctor`: a one-line UserError (exit status 2) when a check failed."""
    checks = run(**kwargs)
    failed = [c.name for c in checks if c.status == "FAIL"]
    if failed:
        raise UserError(f"doctor: {', '.join(failed)} failed; see the fix under each FAIL line above and "
                        f"{os.path.join(kwargs.get('run_dir', 'runs/doctor'), 'doctor.json')}")
