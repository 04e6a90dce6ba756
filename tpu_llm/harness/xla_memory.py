"""XLA's own memory figures for a config's training step: what `tpu-llm bench memory` and the planner's
tests compare `tpu-llm plan` with.

The training micro-step (training/trainer.py: the pipeline's loss, its gradients converted to dense tensors,
XLA-compiled) is compiled for one device, never run, and XLA's buffer assignment is read from its dump:
"preallocated-temp" is everything alive beyond the program's inputs and outputs (saved activations
and the backward's transients) and "Total bytes used" adds the parameters read and the gradients
written. XLA_FLAGS is read once per process, so each measurement runs in a fresh subprocess.

`state` compiles the trainer's whole replica step too (the micro-step, the gradients' reduction and
clipping, AdamW's guarded update: what a TPU runs as one program) and reads its entry computation's
parameters: every variable the step reads is one, and those it writes (the trained weights, AdamW's
slots and step) XLA updates in place (the module's input_output_alias). What the state costs (the adapters'
trainable state against full fine-tuning's, docs/memory.md) is read there, not counted; it needs no dump, so it
runs in the caller's process.
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
import sys
import tempfile

from tpu_llm.config import Config, config_from_dict
from tpu_llm.platform import tether


def measure(cfgs: list[Config], vocab: int, timeout: float = 1800, state: bool = False) -> list[dict]:
    """[{"temp": bytes, "total": bytes}] per config, compiled (float32, P = T = 1) in one subprocess; with
    `state`, also `state`'s bytes of the gradients and of the whole step's parameters."""
    with tempfile.TemporaryDirectory(prefix="tpu-llm-xla-") as tmp:
        dump = os.path.join(tmp, "dump")
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2",
               "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump}".strip()}
        specs = json.dumps([{"cfg": cfg.to_dict(), "vocab": vocab, "state": state} for cfg in cfgs])
        # tethered: a compile of minutes ends with this process, however it ends
        done = tether.run([sys.executable, "-m", "tpu_llm.harness.xla_memory", dump], input=specs, env=env, text=True,
                           capture_output=True, timeout=timeout)
        if done.returncode:
            raise RuntimeError(f"XLA compile failed: {done.stderr[-2000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])


def micro_step(cfg: Config, built):
    """The trainer's micro-step for one device, one replica and no grad_accum, XLA-compiled: the pipeline's
    mean loss of (x, y) and its gradients as dense tensors (model.trainable_variables' order)."""
    import tensorflow as tf

    from tpu_llm.parallel import pipeline
    from tpu_llm.parallel.mesh import Placement

    stages = pipeline.partition(cfg.model, built.vocab_size, cfg.data.seq_len, 1)
    pipe = pipeline.Pipeline(built, stages, Placement(), 1, cfg.parallel.remat, cfg.train.loss_chunk)

    def micro(x, y):
        with tf.GradientTape() as tape:
            loss = pipe.loss(x, y, training=True)
        return loss, [tf.convert_to_tensor(g) for g in tape.gradient(loss, built.trainable_variables)]
    return tf.function(micro, jit_compile=True)


def _one_device(cfg: Config, vocab: int):
    """(the config with `vocab` ids and one stage, one tensor group, one replica; the default distribution)."""
    import dataclasses

    import tensorflow as tf

    from tpu_llm.parallel.distribute import Distribution

    one = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab),
                              parallel=dataclasses.replace(cfg.parallel, pipeline_stages=1, tensor=1, microbatches=1))
    return one, Distribution(tf.distribute.get_strategy(), "default", "xla_memory", "CPU")


def model(cfg: Config, vocab: int):
    """The model as a run builds it (training/assemble.py's build_model): its adapters and
    train.freeze's layers marked not trainable, so that the programs differentiate what a run does."""
    from tpu_llm.parallel import pipeline
    from tpu_llm.training.assemble import build_model

    one, dist = _one_device(cfg, vocab)
    return build_model(one, dist, pipeline.partition(one.model, vocab, one.data.seq_len, 1))


def train_step(cfg: Config, vocab: int):
    """The trainer's whole replica step for one device (training/trainer.py's `replica_step`: loss and
    gradients, their reduction and clipping, AdamW's guarded update), XLA-compiled, and the run's compute
    (training/assemble.py's Assembly) it steps."""
    import tensorflow as tf

    from tpu_llm.training.assemble import assemble

    compute = assemble(*_one_device(cfg, vocab))
    trainer = compute.trainer(execution="xla")
    return tf.function(lambda x, y: trainer.replica_step(x, y), jit_compile=True), compute


def _compiled(fn, x, dump: str) -> str:
    """XLA:CPU's buffer assignment of fn(x, x), compiled, not run."""
    fn.experimental_get_compiler_ir(x, x)(stage="optimized_hlo")
    return buffer_assignment(dump)


def buffer_assignment(dump: str) -> str:
    """The text of the newest buffer assignment XLA dumped into `dump` (XLA_FLAGS=--xla_dump_to), the
    program compiled last; `dump` is emptied for the next one."""
    newest = max(glob.glob(os.path.join(dump, "*buffer-assignment.txt")), key=os.path.getmtime)
    with open(newest) as f:
        text = f.read()
    for path in glob.glob(os.path.join(dump, "*")):
        os.remove(path)
    return text


def temp_bytes(assignment: str) -> int:
    """A buffer assignment's "preallocated-temp": what the program holds beyond its inputs and outputs."""
    temp = re.search(r"size (\d+), preallocated-temp", assignment)
    return int(temp.group(1)) if temp else 0


DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4,
               "f64": 8, "s64": 8, "u64": 8}
ARRAY = re.compile(r"([a-z]+[0-9]*)\[([0-9,]*)\]")


def _bytes(dtype: str, dims: str) -> int:
    return DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)


def _entry(hlo: str) -> tuple[list[int], list[int], set[int]]:
    """(bytes of each parameter, of each output, the parameters updated in place) of an HLO module's
    entry computation: its signature and the module's input_output_alias."""
    signature = re.search(r"^ENTRY [^(]*\((.*)\) -> (.*) \{$", hlo, re.M)
    params = [_bytes(*a) for a in ARRAY.findall(re.sub(r"\{[0-9,]*\}", "", signature.group(1)))]
    outputs = [_bytes(*a) for a in ARRAY.findall(re.sub(r"\{[0-9,]*\}", "", signature.group(2)))]
    header = hlo.split("\n", 1)[0]
    written = {int(k) for k in re.findall(r"\((\d+), \{\}, (?:may|must)-alias\)", header)}
    return params, outputs, written


def state(cfg: Config, vocab: int, gradients: bool = True) -> dict:
    """Bytes of what a training step holds beside its activations, read from the compiled programs (this
    process, no dump): of the whole step's parameters (`train_step`: x and y, "batch", then every variable
    it captures) "trained" (the trainable weights), "optimizer" (AdamW's slots and step), "frozen" (the
    weights it only reads) and "written", those XLA updates in place, which must be the first two; and
    "gradients", the micro-step's outputs but the loss (a second compile; not with gradients=False)."""
    import tensorflow as tf

    x = tf.zeros([cfg.train.batch_size, cfg.data.seq_len], tf.int32)
    step, compute = train_step(cfg, vocab)
    built, optimizer = compute.model, compute.optimizer
    out = {"trained": 0, "optimizer": 0, "frozen": 0, "batch": 0}
    if gradients:
        _, outputs, _ = _entry(micro_step(cfg, built).experimental_get_compiler_ir(x, x)(stage="optimized_hlo"))
        out["gradients"] = sum(outputs[1:])
    params, _, written = _entry(step.experimental_get_compiler_ir(x, x)(stage="optimized_hlo"))
    function = step.get_concrete_function(x, x)
    kind = {id(v.value.handle): "trained" for v in built.trainable_variables}
    kind.update({id(v.value.handle): "frozen" for v in built.non_trainable_variables})
    kind.update({id(v.value.handle): "optimizer" for v in optimizer.variables})
    inner = {id(placeholder): kind[id(handle)] for handle, placeholder in function.graph.captures}
    for arg, size in zip(function.inputs, params, strict=True):
        out[inner.get(id(arg), "batch")] += size
    out["written"] = sum(params[i] for i in written)
    return out


def _compile_and_read(cfg: Config, vocab: int, dump: str, with_state: bool = False) -> dict:
    import tensorflow as tf

    x = tf.zeros([cfg.train.batch_size, cfg.data.seq_len], tf.int32)
    text = _compiled(micro_step(cfg, model(cfg, vocab)), x, dump)
    result = {"temp": temp_bytes(text), "total": int(re.search(r"Total bytes used: (\d+)", text).group(1))}
    if with_state:
        result.update(state(cfg, vocab))
    return result


if __name__ == "__main__":
    results = []
    for spec in json.loads(sys.stdin.read()):
        results.append(_compile_and_read(config_from_dict(spec["cfg"], "bench"), spec["vocab"], sys.argv[1],
                                         spec.get("state", False)))
    print(json.dumps(results))
