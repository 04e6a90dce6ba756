"""XLA's own memory figures for a config's training step: what `tpu-llm bench memory` and the planner's
tests compare `tpu-llm plan` with.

The training micro-step (training/trainer.py: the pipeline's loss, its gradients converted to dense tensors,
XLA-compiled) is compiled for one device, never run, and XLA's buffer assignment is read from its dump:
"preallocated-temp" is everything alive beyond the program's inputs and outputs (saved activations
and the backward's transients) and "Total bytes used" adds the parameters read and the gradients
written. XLA_FLAGS is read once per process, so each measurement runs in a fresh subprocess.
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys
import tempfile

from tpu_llm import tether
from tpu_llm.config import Config, config_from_dict


def measure(cfgs: list[Config], vocab: int, timeout: float = 1800) -> list[dict]:
    """[{"temp": bytes, "total": bytes}] per config, compiled (float32, P = T = 1) in one subprocess."""
    with tempfile.TemporaryDirectory(prefix="tpu-llm-xla-") as tmp:
        dump = os.path.join(tmp, "dump")
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2",
               "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump}".strip()}
        specs = json.dumps([{"cfg": cfg.to_dict(), "vocab": vocab} for cfg in cfgs])
        # tethered: a compile of minutes ends with this process, however it ends
        done = tether.run([sys.executable, "-m", "tpu_llm.tools.xla_memory", dump], input=specs, env=env, text=True,
                           capture_output=True, timeout=timeout)
        if done.returncode:
            raise RuntimeError(f"XLA compile failed: {done.stderr[-2000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])


def micro_step(cfg: Config, model):
    """The trainer's micro-step for one device, one replica and no grad_accum, XLA-compiled: the pipeline's
    mean loss of (x, y) and its gradients as dense tensors (model.trainable_variables' order)."""
    import tensorflow as tf

    from tpu_llm.parallel import pipeline
    from tpu_llm.parallel.distribute import Placement

    stages = pipeline.partition(cfg.model, model.vocab_size, cfg.data.seq_len, 1)
    pipe = pipeline.Pipeline(model, stages, Placement(), 1, cfg.parallel.remat, cfg.train.loss_chunk)

    def micro(x, y):
        with tf.GradientTape() as tape:
            loss = pipe.loss(x, y, training=True)
        return loss, [tf.convert_to_tensor(g) for g in tape.gradient(loss, model.trainable_variables)]
    return tf.function(micro, jit_compile=True)


def _compile_and_read(cfg: Config, vocab: int, dump: str) -> dict:
    import tensorflow as tf

    from tpu_llm.model import GPT

    x = tf.zeros([cfg.train.batch_size, cfg.data.seq_len], tf.int32)
    micro_step(cfg, GPT(cfg.model, vocab).build_weights()).experimental_get_compiler_ir(x, x)(stage="optimized_hlo")
    newest = max(glob.glob(os.path.join(dump, "*buffer-assignment.txt")), key=os.path.getmtime)
    text = open(newest).read()
    for f in glob.glob(os.path.join(dump, "*")):
        os.remove(f)
    temp = re.search(r"size (\d+), preallocated-temp", text)
    return {"temp": int(temp.group(1)) if temp else 0,
            "total": int(re.search(r"Total bytes used: (\d+)", text).group(1))}


if __name__ == "__main__":
    results = []
    for spec in json.loads(sys.stdin.read()):
        results.append(_compile_and_read(config_from_dict(spec["cfg"], "bench"), spec["vocab"], sys.argv[1]))
    print(json.dumps(results))
