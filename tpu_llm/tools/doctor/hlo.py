"""The `hlo default` and `hlo mlir` lines: where the TPU's own compiler put the model-parallel step's
matmuls, read from the HLO it dumps (issue 38).

The offline placement audit (harness/placement_audit.py) compiles the step with tf2xla on the CPU; only
a TPU runs XLA's TPU passes after that. So on a TPU VM the doctor asks XLA to dump every module it
compiles (xla_flags.ask_dump: XLA_FLAGS=--xla_dump_to=DIR --xla_dump_hlo_as_text, set before the first TPU
contact, because XLA reads XLA_FLAGS once per process, on its first use), trains the model-parallel
layout for one step in mixed_bfloat16 with dropout 0.1 and grad_accum 2 (`check_hlo`) once with the
bridge TensorFlow chooses and once with the MLIR bridge forced on (what TF_XLA_FLAGS=
--tf_mlir_enable_mlir_bridge=true does; `tf.config.experimental.enable_mlir_bridge` sets the same flag
in-process, so both runs share the one TPU connection a TPU VM allows), and audits the module of that
train step (`audit_dump`) with the offline audit's rule (placement_audit.matmul_spread): per core the
forward and backward dot/convolution instructions, shared within 25% of even by each stage's tensor
groups and by the stages. An instruction without a core counts on core 0, where a TPU runs it.
"""

from __future__ import annotations

import collections
import os
import re
import time

import keras
import tensorflow as tf

from tpu_llm.harness import placement_audit
from tpu_llm.harness.compiled_step import Module
from tpu_llm.parallel import distribute
from tpu_llm.platform import tf_compat
from tpu_llm.tools.doctor.report import FIX, Check
from tpu_llm.training import build

SETTINGS = {"precision": "mixed_bfloat16", "model.dropout": 0.1, "train.grad_accum": 2}  # what issue 38 broke
BRIDGES = {"default": "the bridge TensorFlow chooses", "mlir": "the MLIR bridge (TF_XLA_FLAGS="
                                                                "--tf_mlir_enable_mlir_bridge=true)"}
# module_0042.<name>.before_optimizations.txt; after: "after_optimizations.txt", with a platform prefix on
# some backends (the CPU's is "cpu_after_optimizations.txt")
_FILE = re.compile(r"^(module_\d+\..+)\.(?:[a-z]+_)?(before|after)_optimizations\.txt$")


def modules(directory: str) -> dict:
    """{module: {"before"/"after": path}} of the HLO text XLA dumped into `directory`."""
    found: dict = collections.defaultdict(dict)
    if os.path.isdir(directory):
        for name in os.listdir(directory):
            match = _FILE.match(name)
            if match:
                found[match.group(1)][match.group(2)] = os.path.join(directory, name)
    return dict(found)


def count(module: Module) -> dict:
    """Per core, the forward and backward matmuls (dot, convolution) of `module`. An instruction in a
    fusion's body takes the fusion's core when it has none of its own (XLA keeps the sharding on the
    fusion); one without any core counts on core 0, where a TPU runs it, and under None as well."""
    fusion_core = {}
    for ins in module.instructions.values():
        if ins.opcode == "fusion" and ins.core is not None:
            called = re.search(r"calls=%?([^\s,]+)", ins.attributes)
            if called:
                fusion_core[called.group(1)] = ins.core
    counts = {kind: collections.Counter() for kind in ("forward matmuls", "backward matmuls")}
    for ins in module.instructions.values():
        if ins.opcode in placement_audit.MATMULS:
            kind = "backward matmuls" if placement_audit.GRADIENT.search(ins.op_name) else "forward matmuls"
            core = ins.core if ins.core is not None else fusion_core.get(ins.computation)
            counts[kind][0 if core is None else core] += 1
            if core is None:
                counts[kind][None] += 1
    return counts


def _spread(counts: dict) -> dict:
    """counts without the None entries (each is counted on core 0 already)."""
    return {kind: collections.Counter({c: n for c, n in counter.items() if c is not None})
            for kind, counter in counts.items()}


def _shown(counts: dict, cores: int) -> str:
    return "; ".join(f"{kind} per core {[counter.get(c, 0) for c in range(cores)]}"
                     + (f" ({counter[None]} without a core, on core 0)" if counter.get(None) else "")
                     for kind, counter in counts.items())


def audit_dump(directory: str, stages: int, tensor: int, bridge: str = "default", only=None,
               stage: str = "") -> Check:
    """The line for the train step's module among those dumped in `directory` (`only`: the module names
    to consider, e.g. those new since the step was built): the one with the most backward matmuls. Its
    before-optimizations text is audited: the program the bridge (tf2xla or MLIR) handed XLA, where
    issue 38 found the cores lost. After XLA's own passes a core may be gone for reasons that are not a
    misplacement (here the CPU's passes rewrite batched matmuls without their sharding; a TPU's
    partitioner consumes the shardings it implements), so those counts are kept in the values only;
    `stage` ("before", "after") chooses another text."""
    name, layout = f"hlo {bridge}", f"{stages} x {tensor}, {bridge} bridge"
    found = {m: paths for m, paths in modules(directory).items() if only is None or m in only}
    values = {"directory": directory, "stages": stages, "tensor": tensor, "bridge": bridge, "modules": len(found)}
    if not found:
        return Check(name, "WARN", f"{layout}: XLA wrote no HLO module to {directory} (it read XLA_FLAGS before the "
                     "doctor set it, or this runtime does not dump): start a fresh `tpu-llm doctor`", values)
    best, best_backward = None, 0
    for module, paths in sorted(found.items()):
        parsed = {stage: Module.parse(open(path).read()) for stage, path in paths.items()}
        backward = max(sum(count(m)["backward matmuls"].values()) for m in parsed.values())
        if backward > best_backward:
            best, best_backward = (module, parsed), backward
    if best is None:
        return Check(name, "WARN", f"{layout}: none of the {len(found)} modules XLA dumped in {directory} has a "
                     "backward matmul (no train step among them)", values)
    module, parsed = best
    stage = stage or "before"
    counts = count(parsed[stage])
    values.update(module=module, stage=f"{stage} optimizations",
                  counts={stage_: {k: {str(c): n for c, n in v.items()} for k, v in count(m).items()}
                          for stage_, m in parsed.items()})
    problems = placement_audit.matmul_spread(_spread(counts), stages, tensor)
    shown = _shown(counts, stages * tensor)
    values["problems"] = [str(p) for p in problems]
    if problems:
        return Check(name, "FAIL", f"{layout} ({stage} optimizations): {problems[0].text}; {shown}; dump in "
                     f"{directory}", values,
                     fix=FIX[f"hlo {bridge}"])
    return Check(name, "PASS", f"{layout} ({stage} optimizations of {module.split('.')[0]}): {shown}", values)


def _set_bridge(bridge: str) -> None:
    """Force the MLIR bridge on, or off again (TF has no public way back to "unspecified": the doctor's
    MLIR run is its last)."""
    if bridge == "mlir":
        tf.config.experimental.enable_mlir_bridge()
    else:
        tf.config.experimental.disable_mlir_bridge()


def train_one_step(cfg, found) -> float:
    """Build the run on its own strategy and train one step (a seam for tests): its loss."""
    run = build.build_run(cfg, distribute.get_strategy(cfg, found))
    return run.trainer.run(run.train_iterator, 1, 1)["loss"]


def check_hlo(make_cfg, found, stages: int, tensor: int, bridge: str, directory: str) -> Check:
    """Train `stages` x `tensor` (make_cfg's config with SETTINGS) one step under `bridge` ("default": as
    TensorFlow chooses; "mlir": forced on) and audit the train step XLA dumped into `directory`. A run
    that does not compile or train is a FAIL with the default bridge and a WARN with the MLIR bridge
    (not what tpu-llm trains with unless asked); the bridge is restored afterwards."""
    name, layout = f"hlo {bridge}", f"{stages} x {tensor}, {bridge} bridge"
    if stages * tensor == 1:
        return Check(name, "SKIP", "nothing to split (one core per replica)", {"bridge": bridge})
    cfg = make_cfg(stages, tensor, SETTINGS["precision"], f"hlo-{bridge}")
    cfg.model.dropout, cfg.train.grad_accum = SETTINGS["model.dropout"], SETTINGS["train.grad_accum"]
    before = set(modules(directory))
    was = tf_compat.mlir_bridge_forced()
    start = time.perf_counter()
    try:
        if bridge == "mlir":
            _set_bridge("mlir")
        loss = train_one_step(cfg, found)
    except Exception as e:  # noqa: BLE001 - what broke on this TPU is the finding
        first = (str(e).strip().splitlines() or [""])[0][:300]
        return Check(name, "WARN" if bridge == "mlir" else "FAIL",
                     f"{layout} did not compile or train: {type(e).__name__}: {first}", {"bridge": bridge},
                     fix=FIX[f"hlo {bridge}"])
    finally:
        keras.mixed_precision.set_global_policy("float32")
        if bridge == "mlir" and not was:
            _set_bridge("default")
    seconds = time.perf_counter() - start
    check = audit_dump(directory, stages, tensor, bridge, only=set(modules(directory)) - before)
    check.values.update(loss=loss, seconds=seconds)
    if check.status == "PASS":
        check.numbers += f"; loss {loss:.4f}, {seconds:.0f} s"
    return check
