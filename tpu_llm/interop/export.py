"""`tpu-llm export`: a trained run as a self-contained SavedModel plus a Keras weights file.

<output>/                       (default <run_dir>/export)
  saved_model.pb, variables/    tf.saved_model.load(output) or TF Serving; two signatures:
                                  logits:   tokens int32 [batch, time] -> logits float32 [batch, time, vocab]
                                  generate: tokens int32 [batch, time], max_new_tokens int32, temperature
                                            float32, top_k int32, top_p float32, seed int64
                                            -> ids int32 [batch, max_new_tokens]
  model.weights.h5              Keras weights: GPT(cfg.model, vocab).build_weights().load_weights(...)
  config.yaml, tokenizer.json   the run's config and tokenizer (+ tokenizer.model for SentencePiece)
  export.json                   what was exported from where, the vocabulary and end-of-text id

The weights are the run's newest readable checkpoint, restored exactly as `tpu-llm generate` restores
it. `generate` is the graph `tpu-llm generate` samples with (model/sampling.py's `generate_ids`: the
KV cache, the refill when it is full, the same stateless draws keyed by (seed, i)), saved as a plain
graph so that any TensorFlow build (and TF Serving) can run it. Logits are cropped to the
tokenizer's ids: a vocabulary padded past it (model.vocab_size) is never sampled, as in `generate`.

The export is written to a temporary directory beside `output` and renamed into place, so a failed
export never leaves a half-written one, and an existing export is replaced only with --overwrite:
renamed aside, the new one renamed in, and only then deleted (`staged_directory`). An `output` that
is a symbolic link is refused: replacing it would delete through the link.

`export_run` (`--format run`) writes a run directory instead: the newest weights (a LoRA run's adapters
merged in) as a new run's checkpoint at step 0, a base that train.init_from accepts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
import uuid

import keras
import tensorflow as tf

from tpu_llm.config.checks import trained_state
from tpu_llm.errors import UserError
from tpu_llm.model.sampling import GENERATE_SIGNATURE, generate_ids
from tpu_llm.platform.files import write_atomically
from tpu_llm.platform.run_layout import CONFIG_FILE, EXPORT_DIR, MARKER_FILE, checkpoint_step
from tpu_llm.tokenizers import save_tokenizer
from tpu_llm.training.checkpoint import Checkpointer, load_for_generation
from tpu_llm.training.run_directory import (check_run_dir_owner, check_run_dir_reachable, check_run_dir_usable,
                                            is_run_dir)

WEIGHTS_FILE = "model.weights.h5"
META_FILE = "export.json"


class ServingModule(tf.Module):
    """The GPT with its two serving functions (see the module docstring)."""

    def __init__(self, model, vocab_size: int, eos_id: int):
        super().__init__(name="tpu_llm_gpt")
        # The Keras model stays out of the SavedModel's object graph, so loading the export needs no
        # Keras and no tpu_llm: the signatures capture its variables, and this list tracks them.
        self.__dict__["model"] = model
        self.saved_variables = [getattr(v, "value", v) for v in model.weights]
        self.vocab_size, self.eos_id, self.max_len = vocab_size, eos_id, model.cfg.max_len

    def signatures(self) -> dict:
        """The serving signatures as concrete functions. They are not attributes of the module: saving a
        tf.function attribute retraces it under the save context, which doubled the export's time.
        autograph=False: the loop and branches are tf.while_loop / tf.cond already, and converting
        every Keras call made tracing several times slower."""
        tokens = tf.TensorSpec([None, None], tf.int32, name="tokens")
        logits = tf.function(lambda tokens: {"logits": self.model(tokens)[..., :self.vocab_size]},
                             input_signature=[tokens], autograph=False).get_concrete_function()
        generate = tf.function(
            lambda *args: {"ids": generate_ids(self.model, *args, eos_id=self.eos_id, vocab_size=self.vocab_size)},
            input_signature=GENERATE_SIGNATURE, autograph=False).get_concrete_function()
        return {"logits": logits, "generate": generate, "serving_default": logits}


def export_target(run_dir: str, output: str, default: str, overwrite: bool) -> tuple[str, str]:
    """(run_dir, output) of an export, output defaulting to <run_dir>/<default>; refused in one line: an
    unreachable run, an output holding the run, and an existing output without --overwrite or that
    is not an earlier export (--overwrite deletes it)."""
    run_dir = str(run_dir).rstrip("/")
    output = str(output or os.path.join(run_dir, default)).rstrip("/")
    check_run_dir_reachable(run_dir)
    if f"{run_dir}/".startswith(f"{output}/"):
        raise UserError(f"--output {output!r} is the run directory or holds it; give a directory of its own, "
                        f"e.g. the default <run_dir>/{default}")
    if tf.io.gfile.exists(output):
        if not overwrite:
            raise UserError(f"{output!r} already exists; pass --overwrite to replace it, or --output another "
                            "directory")
        if not tf.io.gfile.exists(os.path.join(output, META_FILE)):
            raise UserError(f"{output!r} exists and is not a tpu-llm export (no {META_FILE}); --overwrite replaces "
                            "only an earlier export, so give another --output")
    return run_dir, output


def load_float32(run_dir: str):
    """load_for_generation(run_dir) with its checkpoint and notes, built in float32 whatever this process
    trained with (a notebook exports in the process that trained under mixed_bfloat16 on a TPU): the
    variables are float32, and so is what an export writes. A model with adapters comes merged (its config
    without them). UserError for a directory that is not a run, or a run without a checkpoint yet."""
    policy = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("float32")
    try:
        model, tokenizer, cfg, checkpoint, notes = load_for_generation(run_dir, with_checkpoint=True, with_notes=True)
        if model.adapters is not None:  # the adapters folded into float32 kernels
            model, cfg.train = model.merged(), cfg.train.without_adapters()
        return model, tokenizer, cfg, checkpoint, notes
    finally:
        keras.mixed_precision.set_global_policy(policy)


def export(run_dir: str, output: str = "", overwrite: bool = False) -> dict:
    """Export `run_dir`'s newest checkpoint to `output` (default <run_dir>/export); returns export.json."""
    run_dir, output = export_target(run_dir, output, EXPORT_DIR, overwrite)
    model, tokenizer, cfg, checkpoint, notes = load_float32(run_dir)
    step = checkpoint_step(checkpoint)

    # --overwrite: an existing export is replaced only once the new one is complete
    with staged_directory(output, f"the export to {output!r}", EXPORT_FIX) as tmp:
        module = ServingModule(model, tokenizer.vocab_size, tokenizer.eos_id)
        logger = tf.get_logger()  # TF logs "Assets written to: <the temporary directory>" at INFO
        level = logger.level
        logger.setLevel("WARNING")
        try:
            tf.saved_model.save(module, tmp, signatures=module.signatures())
        finally:
            logger.setLevel(level)
        _save_weights(model, os.path.join(tmp, WEIGHTS_FILE))
        with tf.io.gfile.GFile(os.path.join(tmp, "config.yaml"), "w") as f:
            f.write(cfg.to_yaml())
        save_tokenizer(tokenizer, tmp)
        meta = {"run_dir": run_dir, "checkpoint": checkpoint, "step": step, "vocab_size": tokenizer.vocab_size,
                "model_vocab_size": cfg.model.vocab_size, "eos_id": tokenizer.eos_id,
                "max_len": cfg.model.max_len, "tokenizer": tokenizer.kind,
                "signatures": {"logits": "tokens -> logits", "generate": "tokens, max_new_tokens, temperature, "
                                                                          "top_k, top_p, seed -> ids"},
                "weights": WEIGHTS_FILE}
        with tf.io.gfile.GFile(os.path.join(tmp, META_FILE), "w") as f:
            f.write(json.dumps(meta, indent=1) + "\n")
    return {**meta, "output": output, "notes": notes}  # notes: e.g. the newest checkpoint was unreadable


RUN_SUFFIX = "-merged"  # --format run's default --output: <run_dir>-merged, beside the run


def export_run(run_dir: str, output: str = "") -> dict:
    """`tpu-llm export --format run`: a new run directory `output` (default <run_dir>-merged) holding
    `run_dir`'s newest weights as its checkpoint at step 0, a LoRA run's adapters merged into its kernels
    (load_float32), with the run's config without adapters (train.lora_rank=0, no train.init_from) and its
    tokenizer: a base run for train.init_from, whatever the tokenizer (`--format hf` writes none for byte,
    char or sentencepiece, so its round trip through `tpu-llm import` cannot make one). `output` must be
    new (or empty), as `tpu-llm import`'s --run_dir: a run directory is never replaced."""
    run_dir = str(run_dir).rstrip("/")
    output = str(output or f"{run_dir}{RUN_SUFFIX}").rstrip("/")
    check_run_dir_reachable(run_dir)
    check_run_dir_reachable(output)
    if f"{run_dir}/".startswith(f"{output}/") or f"{output}/".startswith(f"{run_dir}/"):
        raise UserError(f"--output {output!r} is the run directory, holds it or is inside it; give a new directory "
                        f"beside it, e.g. the default {run_dir}{RUN_SUFFIX}")
    check_run_dir_owner(output)  # not another tool's directory ...
    if is_run_dir(output):  # ... and never an existing run
        raise UserError(f"--output {output!r} already holds a tpu-llm run; give a new directory")
    model, tokenizer, cfg, checkpoint, notes = load_float32(run_dir)  # the adapters merged
    cfg = dataclasses.replace(cfg, run_dir=output, train=dataclasses.replace(cfg.train, init_from=""))
    check_run_dir_usable(os.path.dirname(output) or ".")
    with staged_directory(output, f"the run directory {output!r}", EXPORT_FIX) as tmp:
        tf.io.gfile.makedirs(tmp)
        write_atomically(os.path.join(tmp, MARKER_FILE), "a tpu-llm run directory (tpu_llm/training/checkpoint.py)\n")
        write_atomically(os.path.join(tmp, CONFIG_FILE), cfg.to_yaml())
        save_tokenizer(tokenizer, tmp)
        # the model only (a run started from it adds its own optimizer), with its model section and tokenizer
        Checkpointer(tmp, keep=cfg.checkpoint.keep, model_config=cfg.model, tokenizer=tokenizer,
                     trained=trained_state(cfg, optimizer=False), model=model).save(0)
    return {"run_dir": run_dir, "checkpoint": checkpoint, "step": checkpoint_step(checkpoint), "output": output,
            "params": model.num_params(), "tokenizer": tokenizer.kind, "notes": notes}


def _save_weights(model, path: str) -> None:
    """Keras writes .weights.h5 with h5py, which needs a local file: write locally, then copy (gs://)."""
    if "://" not in path:
        model.save_weights(path)
        return
    local = tempfile.mkdtemp(prefix="tpu-llm-export-")
    try:
        model.save_weights(os.path.join(local, WEIGHTS_FILE))
        tf.io.gfile.copy(os.path.join(local, WEIGHTS_FILE), path, overwrite=True)
    finally:
        shutil.rmtree(local, ignore_errors=True)


EXPORT_FIX = "fix the path's permissions or space, or pass another --output"


@contextlib.contextmanager
def staged_directory(target: str, what: str, fix: str):
    """Write a directory in full before it appears: yields a temporary directory beside `target`, which
    replaces `target` when the block completes. Replace, never destroy: an existing `target` is renamed
    aside, the new one renamed in, and the old one deleted only then (put back if the new one could not
    be moved in). A failed write never touches `target` and leaves no temporary directory: an OS or
    TensorFlow file error becomes one line, "writing {what} failed (reason); {fix}", and anything else
    propagates as it is. A `target` that is a symbolic link is refused before anything is written (its
    contents would have been deleted through it, then the rename failed: issue 28)."""
    if "://" not in target and os.path.islink(target):
        raise UserError(f"writing {what} refused: it is a symbolic link (to {os.readlink(target)}), and replacing it "
                        f"would delete through the link; pass the real path ({os.path.realpath(target)}) or another "
                        "location")
    tmp, old = f"{target}.tmp-{uuid.uuid4().hex[:8]}", None
    try:
        yield tmp
        if tf.io.gfile.exists(target):
            old = f"{target}.old-{uuid.uuid4().hex[:8]}"
            tf.io.gfile.rename(target, old)
        try:
            tf.io.gfile.rename(tmp, target)
        except BaseException:
            if old is not None:  # the old one back where it was
                tf.io.gfile.rename(old, target)
                old = None
            raise
    except (tf.errors.OpError, OSError) as e:
        _remove_quietly(tmp)
        reason = (getattr(e, "message", None) or getattr(e, "strerror", None) or str(e)).splitlines()[0][:200]
        raise UserError(f"writing {what} failed ({reason}); {fix}") from None
    except BaseException:
        _remove_quietly(tmp)
        raise
    if old is not None:
        _remove_quietly(old)  # the new one is in place: only now does the old one go


def _remove_quietly(path: str) -> None:
    try:
        if tf.io.gfile.exists(path):
            tf.io.gfile.rmtree(path)
    except (tf.errors.OpError, OSError):
        pass  # best effort: a leftover temporary directory is never read
