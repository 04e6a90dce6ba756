"""The memory line: the chunked loss and blockwise attention (docs/memory.md) on the first device, against
the dense loss and attention and against `tpu-llm plan`'s memory."""

from __future__ import annotations

import tensorflow as tf

from tpu_llm.config import load_config
from tpu_llm.model import GPT
from tpu_llm.harness import xla_memory
from tpu_llm.tools import plan
from tpu_llm.tools.doctor.report import Check, status

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
        return Check("memory", status(ok), numbers + "; device memory not reported here", values)
    ratios = {n: values[f"{n}_peak"] / values[f"{n}_planned"] for n in ("dense", "options")}
    values.update(ratio_dense=ratios["dense"], ratio_options=ratios["options"])
    ok = ok and values["options_peak"] < values["dense_peak"] and \
        all(MEMORY_PLAN_RATIO[0] <= r <= MEMORY_PLAN_RATIO[1] for r in ratios.values())
    return Check("memory", status(ok), numbers + f"; peak {values['dense_peak'] / 2**20:.1f} -> "
                 f"{values['options_peak'] / 2**20:.1f} MiB, {ratios['dense']:.2f}x and {ratios['options']:.2f}x "
                 f"the plan (PASS within {MEMORY_PLAN_RATIO[0]:g}-{MEMORY_PLAN_RATIO[1]:g}x)", values)
