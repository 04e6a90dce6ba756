"""The run directory and its checkpoints (local disk or gs://, both through tf.io.gfile).

<run_dir>/
  config.yaml          the effective config of the run (model section fixed once written)
  tokenizer.json       the tokenizer (+ tokenizer.model for SentencePiece)
  checkpoints/         tf.train.CheckpointManager: model, optimizer, step, data iterator
  logs/train, logs/validation   TensorBoard summaries
  metrics.jsonl        one JSON line per logged loop and evaluation (appended, never rewritten)

Re-using a run directory resumes it. Before anything is written, `open_run_dir` checks the directory
is usable and was made by the same model and tokenizer; a mismatch is a `UserError` and the
directory is left untouched.
"""

from __future__ import annotations

import os
import uuid

import tensorflow as tf
import yaml

from tpu_llm.config import Config, ModelConfig
from tpu_llm.errors import UserError
from tpu_llm.tokenizer import Tokenizer, load_tokenizer, save_tokenizer

CONFIG_FILE = "config.yaml"
CHECKPOINT_DIR = "checkpoints"


def read_saved_config(run_dir: str) -> dict | None:
    path = os.path.join(run_dir, CONFIG_FILE)
    if not tf.io.gfile.exists(path):
        return None
    with tf.io.gfile.GFile(path, "r") as f:
        try:
            return yaml.safe_load(f.read())
        except yaml.YAMLError:
            raise UserError(f"{path} is not valid YAML; restore it or use another --run_dir") from None


def check_run_dir_usable(run_dir: str) -> None:
    """Fail early, before training, if the run directory cannot be created or written."""
    try:
        if tf.io.gfile.exists(run_dir) and not tf.io.gfile.isdir(run_dir):
            raise UserError(f"run_dir {run_dir!r} is a file, not a directory; choose another --run_dir")
        tf.io.gfile.makedirs(run_dir)
        probe = os.path.join(run_dir, f".write-test-{uuid.uuid4().hex[:8]}")
        with tf.io.gfile.GFile(probe, "w") as f:
            f.write("ok")
        tf.io.gfile.remove(probe)
    except (tf.errors.OpError, OSError) as e:
        reason = getattr(e, "message", None) or getattr(e, "strerror", None) or str(e)
        raise UserError(f"run_dir {run_dir!r} is not writable ({reason.splitlines()[0]}); "
                        "fix its permissions or choose another --run_dir") from None


def resolve_tokenizer(run_dir: str, saved: Tokenizer | None, wanted_kind: str,
                      fresh: Tokenizer | None) -> Tokenizer | None:
    """The run's `saved` tokenizer if it has one (it must match the config and `fresh`), else `fresh`."""
    if saved is None:
        return fresh
    if saved.kind != wanted_kind:
        raise UserError(f"run_dir {run_dir!r} was trained with data.tokenizer={saved.kind}, this config "
                        f"asks for {wanted_kind}; use the same tokenizer or another --run_dir")
    if fresh is not None and saved.spec() != fresh.spec():
        what = "SentencePiece model" if saved.kind == "sentencepiece" else "vocabulary"
        raise UserError(f"the tokenizer of this config/data (a different {what}) does not match the one "
                        f"saved in {run_dir!r}; use the original tokenizer or another --run_dir")
    return saved


def open_run_dir(cfg: Config, tokenizer: Tokenizer) -> None:
    """Check `cfg.run_dir` (usable, same model as any run already in it), then record config and tokenizer."""
    run_dir = cfg.run_dir
    check_run_dir_usable(run_dir)
    saved = read_saved_config(run_dir)
    if saved is not None:
        differences = _model_differences(saved.get("model", {}), cfg.model)
        if differences:
            raise UserError(f"run_dir {run_dir!r} holds a run made with {differences[0]}; use the same "
                            "model settings to resume it, or another --run_dir for a new run")
    _write_atomically(os.path.join(run_dir, CONFIG_FILE), cfg.to_yaml())
    if load_tokenizer(run_dir) is None:
        save_tokenizer(tokenizer, run_dir)


def _model_differences(saved: dict, current: ModelConfig) -> list[str]:
    out = []
    for key, value in vars(current).items():
        if key in saved and saved[key] != value:
            out.append(f"model.{key}={saved[key]} (this config has {value})")
    return out


def _write_atomically(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with tf.io.gfile.GFile(tmp, "w") as f:
        f.write(text)
    tf.io.gfile.rename(tmp, path, overwrite=True)


class Checkpointer:
    """Saves and restores everything needed to resume: model, optimizer (with its step), data.

    Objects a checkpoint does not hold (the input iterator of a strategy whose iterators cannot be
    saved, see `controller.build_run`) are left out of the restore rather than failing it, so a
    checkpoint moves between strategies.

    Under multi_worker every worker must take part in a save (TF's rule: saving may need its
    collectives); only the chief writes the run's checkpoints, the others (`scratch` = a worker name)
    write to a scratch directory that is deleted straight after. All of them restore from the run's.
    """

    def __init__(self, run_dir: str, keep: int, scratch: str = "", **trackables):
        self.directory = os.path.join(run_dir, CHECKPOINT_DIR)
        self.trackables = trackables
        self.checkpoint = tf.train.Checkpoint(**trackables)
        self.manager = tf.train.CheckpointManager(self.checkpoint, self.directory, max_to_keep=keep)
        self.scratch = os.path.join(run_dir, f".scratch-{scratch}") if scratch else ""

    @property
    def latest(self) -> str | None:
        return self.manager.latest_checkpoint

    def held(self) -> set[str]:
        """Names of the objects the newest checkpoint holds (empty without a checkpoint)."""
        path = self.manager.latest_checkpoint
        return {name.split("/")[0] for name, _ in tf.train.list_variables(path)} if path else set()

    def restore_latest(self) -> str | None:
        """Restore the newest checkpoint into the objects it holds, if any; returns its path."""
        path = self.manager.latest_checkpoint
        if path is None:
            return None
        held = self.held()
        objects = {k: v for k, v in self.trackables.items() if k in held or k in ("model", "optimizer")}
        try:
            tf.train.Checkpoint(**objects).restore(path).assert_existing_objects_matched()
        except (AssertionError, ValueError, tf.errors.OpError) as e:
            first = str(e).strip().splitlines()[0][:160]
            raise UserError(f"checkpoint {path} does not fit this model ({first}); resume with the "
                            "config it was made with, or use another --run_dir") from None
        return path

    def save(self, step: int) -> str:
        if not self.scratch:
            return self.manager.save(checkpoint_number=step)
        path = tf.train.CheckpointManager(self.checkpoint, self.scratch, max_to_keep=1).save(step)
        tf.io.gfile.rmtree(self.scratch)
        return path
