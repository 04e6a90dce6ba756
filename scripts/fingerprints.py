#!/usr/bin/env python3
"""Fingerprints of a fixed set of short training runs: each run's logged losses and final weights, hashed.

A refactor that should change no numbers (moving modules, rewriting the training step) is checked by
running this before and after, on the same machine, and comparing the two outputs line for line:

    .venv/bin/python scripts/fingerprints.py > before.txt
    ... change ...
    .venv/bin/python scripts/fingerprints.py > after.txt && diff before.txt after.txt

Every run goes through the `tpu-llm` command (so the script works whatever the package's layout) into
a temporary run directory. The weights' hash covers every variable of the final checkpoint (model,
optimizer slots, compression and local-SGD state), by name, in name order; the model section the
checkpoint records is hashed apart (a new config key changes it, and no number). XLA's CPU code can differ
between processor types, so fingerprints are compared on one machine, never against a stored value.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile

BIN = os.path.join(os.path.dirname(sys.executable), "tpu-llm")
QUIET = ["--train.eval_every=0", "--sample.num_samples=0", "--checkpoint.every_steps=0"]
TINY = ["train", "--config", "configs/tiny.yaml", *QUIET]

# name -> the tpu-llm command line (the run directory is appended)
RUNS = {
    "tiny 50 steps (xla)": [*TINY, "--train.steps=50"],
    "2 stages x 2 tensor groups, 4 logical CPUs": [*TINY, "--train.steps=8", "--cpu_devices=4",
                                                   "--parallel.pipeline_stages=2", "--parallel.tensor=2",
                                                   "--parallel.microbatches=2"],
    "2 mirrored replicas, powersgd": [*TINY, "--train.steps=8", "--cpu_devices=2", "--comm.compression=powersgd"],
    "2 mirrored replicas, local sgd (H=3, nesterov)": [*TINY, "--train.steps=8", "--cpu_devices=2",
                                                       "--comm.sync_every=3", "--comm.outer_optimizer=nesterov",
                                                       "--comm.outer_lr=0.7"],
    "mixed_float16, grad_accum 2, dropout": [*TINY, "--train.steps=8", "--precision=mixed_float16",
                                             "--train.grad_accum=2", "--model.dropout=0.1"],
    "2 mirrored replicas, dropout, topk": [*TINY, "--train.steps=8", "--cpu_devices=2", "--model.dropout=0.1",
                                           "--comm.compression=topk", "--comm.topk_ratio=0.1"],
    "llama 20 steps (xla)": ["train", "--config", "configs/llama_tiny.yaml", *QUIET, "--train.steps=20"],
    "llama, 2 stages x 2 tensor groups, 4 logical CPUs": ["train", "--config", "configs/llama_tiny.yaml", *QUIET,
                                                          "--train.steps=8", "--cpu_devices=4",
                                                          "--parallel.pipeline_stages=2", "--parallel.tensor=2",
                                                          "--parallel.microbatches=2"],
    "2 pipeline stages, 2 logical CPUs": [*TINY, "--train.steps=8", "--cpu_devices=2",
                                          "--parallel.pipeline_stages=2", "--parallel.microbatches=2"],
    "2 tensor groups, 2 logical CPUs": [*TINY, "--train.steps=8", "--cpu_devices=2", "--parallel.tensor=2"],
    "llama lora (all seven projections)": ["train", "--config", "configs/llama_tiny.yaml", *QUIET, "--train.steps=8",
                                           "--train.lora_rank=4", "--train.lora_targets=" + ",".join(
                                               f"{p}_proj" for p in ("q", "k", "v", "o", "gate", "up", "down"))],
    "gpt2 lora, int8 base": [*TINY, "--train.steps=8", "--train.lora_rank=4", "--train.lora_targets=c_attn,c_proj,c_fc",
                             "--train.lora_base_dtype=int8"],
    # its adapters can end a float32 ulp or two apart from run to run when another job loads the machine (3 of
    # 13 runs on 6 December 2026, loss unchanged): compare runs made alone, and rerun this row if it differs
    "llama lora, bfloat16 base, 2 stages x 2 tensor groups": [
        "train", "--config", "configs/llama_tiny.yaml", *QUIET, "--train.steps=8", "--cpu_devices=4",
        "--parallel.pipeline_stages=2", "--parallel.tensor=2", "--train.lora_rank=4", "--train.lora_base_dtype=bfloat16"],
    "qwen2 20 steps (xla)": ["train", "--config", "configs/qwen2_tiny.yaml", *QUIET, "--train.steps=20"],
    "qwen2, 2 tensor groups": ["train", "--config", "configs/qwen2_tiny.yaml", *QUIET, "--train.steps=8",
                               "--cpu_devices=2", "--parallel.tensor=2"],
    "mistral 20 steps (xla)": ["train", "--config", "configs/llama_tiny.yaml", *QUIET, "--train.steps=20",
                               "--model.family=mistral"],
    "llama3 rope scaling, untied head": ["train", "--config", "configs/llama_tiny.yaml", *QUIET, "--train.steps=8",
                                         "--model.rope_scaling=llama3", "--model.rope_original_max_len=32",
                                         "--model.tie_embeddings=false"],
    # asynchronous workers draw a new data order every run (tpu_llm/training/build.py): it must run,
    # and its figures are printed, but they differ from run to run
    "parameter server, 1 worker (not deterministic)": ["launch", "--workers", "1", "--ps", "1", "--", *TINY,
                                                       "--train.steps=6", "--train.steps_per_loop=3",
                                                       "--execution=graph"],
}


def weights_hash(run_dir: str) -> str:
    import tensorflow as tf

    prefix = tf.train.latest_checkpoint(os.path.join(run_dir, "checkpoints"))
    if prefix is None:
        return "no checkpoint"
    reader = tf.train.load_checkpoint(prefix)
    digest = hashlib.sha256()
    for name in sorted(reader.get_variable_to_shape_map()):
        # the tokenizer's content hash (issue 40) is no weight: left out, so fingerprints of earlier runs still compare
        if "save_counter" in name or name.startswith(("_CHECKPOINTABLE_OBJECT_GRAPH", "tokenizer/")):
            continue
        # the model section the checkpoint records is configuration, not a weight: a new key (with its
        # default) changes it and no number; `config_hash` prints it apart
        if name.startswith("model_config/"):
            continue
        value = reader.get_tensor(name)
        digest.update(name.encode())
        digest.update(value.tobytes() if hasattr(value, "tobytes") else repr(value).encode())
    return digest.hexdigest()[:16]


def config_hash(run_dir: str) -> str:
    """A hash of the model section the newest checkpoint records (its `model_config`)."""
    import tensorflow as tf

    prefix = tf.train.latest_checkpoint(os.path.join(run_dir, "checkpoints"))
    reader = tf.train.load_checkpoint(prefix) if prefix else None
    key = "model_config/.ATTRIBUTES/VARIABLE_VALUE"
    if reader is None or not reader.has_tensor(key):
        return "none"
    return hashlib.sha256(reader.get_tensor(key)).hexdigest()[:16]


def losses(run_dir: str) -> list[str]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    out = []
    for line in open(path, encoding="utf-8"):
        record = json.loads(line)
        if record.get("split") == "train" and "loss" in record:
            out.append(f"{record['step']}:{record['loss']!r}")
    return out


def main() -> int:
    only = sys.argv[1:]
    for name, args in RUNS.items():
        if only and not any(o in name for o in only):
            continue
        scratch = tempfile.mkdtemp(prefix="fingerprint-")
        run_dir = os.path.join(scratch, "run")
        cmd = [BIN, *args, f"--run_dir={run_dir}"]
        done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
        if done.returncode != 0:
            print(f"{name}: exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}", file=sys.stderr)
            print(f"{name}: FAILED exit {done.returncode}", flush=True)
        else:
            print(f"{name}: losses {' '.join(losses(run_dir))}; weights {weights_hash(run_dir)}; "
                  f"model section {config_hash(run_dir)}", flush=True)
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
