"""The run directory and its checkpoints (local disk or gs://, both through tf.io.gfile).

<run_dir>/
  config.yaml          the effective config of the run (model section fixed once written)
  tokenizer.json       the tokenizer (+ tokenizer.model for SentencePiece)
  checkpoints/         tf.train.CheckpointManager: model, optimizer, step, dropout RNG, data position
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


def check_run_dir_reachable(run_dir: str) -> None:
    """Fail early, before anything reads or writes it, if `run_dir`'s filesystem cannot be reached (a
    gs:// bucket that does not exist, no network or no credentials)."""
    try:
        tf.io.gfile.exists(run_dir)
    except (tf.errors.OpError, OSError) as e:
        where = "check the bucket name, the network and your credentials (gcloud auth application-default login)" \
            if "://" in run_dir else "check the path"
        raise UserError(f"run_dir {run_dir!r} cannot be reached ({_first_line(e)}); {where}") from None


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
    """Saves and restores everything needed to resume: model, optimizer (with its step), dropout RNG
    state, and the input stream's position.

    Saves are atomic: TensorFlow writes a checkpoint's files, then records it in the `checkpoint`
    state file (written to a temporary name and renamed, on local disk and on gs:// alike), so a
    crash during a save leaves the state naming the previous checkpoint. Restores are checked: a
    newest checkpoint that cannot be read (truncated, corrupt, files missing) is skipped for the one
    before it, with a warning naming both (`notes`); so is an unreadable state file.

    Objects a checkpoint does not hold (older checkpoints: no position or RNG state) are left out
    of the restore rather than failing it, so a checkpoint also moves between strategies. The
    position is not restored into its variable (a SUM-on-read variable would be divided among the
    replicas): `read` gives it to the input pipeline.

    Under multi_worker every worker must take part in a save (TF's rule: saving may need its
    collectives); only the chief writes the run's checkpoints, the others (`scratch` = a worker name)
    write to a scratch directory that is deleted straight after. All of them restore from the run's.

    `io_device` (a remote TPU: tpu.CLIENT_IO) makes this process read and write the files: otherwise
    TensorFlow runs each variable's save and restore on the host that owns it, a TPU host whose
    credentials and view of the filesystem are not the ones `check_run_dir_usable` checked here.
    """

    NOT_RESTORED = ("data_position",)

    def __init__(self, run_dir: str, keep: int, scratch: str = "", keep_every_hours: float = 0.0,
                 io_device: str = "", **trackables):
        self.options = tf.train.CheckpointOptions(experimental_io_device=io_device or None)
        self.directory = os.path.join(run_dir, CHECKPOINT_DIR)
        self.keep, self.keep_every_hours = keep, keep_every_hours
        self.scratch = os.path.join(run_dir, f".scratch-{scratch}") if scratch else ""
        self.notes: list[str] = []  # warnings for the log
        self.trackables: dict = {}
        self.add(**trackables)

    def add(self, **trackables) -> None:
        """Save these too (objects made after the restore, such as the position variable)."""
        self.trackables.update(trackables)
        self.checkpoint = tf.train.Checkpoint(**self.trackables)
        self.manager = tf.train.CheckpointManager(self.checkpoint, self.directory, max_to_keep=self.keep,
                                                  keep_checkpoint_every_n_hours=self.keep_every_hours or None)

    @property
    def latest(self) -> str | None:
        return self.manager.latest_checkpoint

    def candidates(self) -> list[str]:
        """Checkpoints to resume from, newest first: those the state file records, or, when the state
        file is missing or unreadable, every checkpoint whose index file is there."""
        recorded = list(reversed(self.manager.checkpoints))
        if recorded:
            return recorded
        found = tf.io.gfile.glob(os.path.join(self.directory, "ckpt-*.index"))
        prefixes = sorted((p[: -len(".index")] for p in found), key=_checkpoint_number, reverse=True)
        if prefixes:
            self.notes.append(f"the checkpoint state file {os.path.join(self.directory, 'checkpoint')} is "
                              f"missing or unreadable; trying the checkpoint files themselves, newest first")
        return prefixes

    def held(self, path: str | None = None) -> set[str]:
        """Names of the objects checkpoint `path` (default: the newest) holds."""
        path = path or self.latest
        return {name.split("/")[0] for name, _ in tf.train.list_variables(path)} if path else set()

    def read(self, path: str, name: str):
        """The value a checkpoint holds for the variable saved as `name` (numpy), or None."""
        reader = tf.train.load_checkpoint(path)
        key = f"{name}/.ATTRIBUTES/VARIABLE_VALUE"
        return reader.get_tensor(key) if reader.has_tensor(key) else None

    def restore(self, path: str) -> None:
        """Restore checkpoint `path` into the objects it holds. A checkpoint that does not fit is a
        UserError; one that cannot be read raises `Unreadable`."""
        try:
            held = self.held(path)
            objects = {k: v for k, v in self.trackables.items()
                       if k not in self.NOT_RESTORED and (k in held or k in ("model", "optimizer"))}
            status = tf.train.Checkpoint(**objects).restore(path, options=self.options)
            status.assert_existing_objects_matched()
            status.expect_partial()  # what is left (the position, an old iterator) is read elsewhere or unused
        except (AssertionError, ValueError) as e:
            first = str(e).strip().splitlines()[0][:160]
            raise UserError(f"checkpoint {path} does not fit this model ({first}); resume with the "
                            "config it was made with, or use another --run_dir") from None
        except (tf.errors.OpError, IndexError) as e:  # IndexError: TF's reader on a truncated data file
            raise Unreadable(f"{type(e).__name__}: {_first_line(e)}") from None

    def restore_latest(self) -> str | None:
        """Restore the newest readable checkpoint, if any; returns its path. Each unreadable newer one
        adds a warning to `notes`; if none can be read, that is a UserError (nothing is changed)."""
        skipped = []
        for path in self.candidates():
            try:
                self.restore(path)
            except Unreadable as e:
                skipped.append((path, str(e)))
                continue
            for bad, why in skipped:
                self.notes.append(f"checkpoint {bad} cannot be read ({why[:200]}); resumed from {path} instead")
            return path
        if skipped:
            raise UserError(f"no checkpoint in {self.directory} can be read (newest: {skipped[0][0]}: "
                            f"{skipped[0][1][:200]}); restore the directory from a copy, or move it away to "
                            "start over")
        return None

    def save(self, step: int) -> str:
        """Save at `step`. A failure (disk full, permissions, bucket gone) is a UserError naming the
        checkpoint still usable; the partial files of the failed save are removed."""
        try:
            if not self.scratch:
                return self.manager.save(checkpoint_number=step, options=self.options)
            path = tf.train.CheckpointManager(self.checkpoint, self.scratch, max_to_keep=1).save(step, options=self.options)
            tf.io.gfile.rmtree(self.scratch)
            return path
        except (tf.errors.OpError, OSError) as e:
            if f"ckpt-{step}" not in {os.path.basename(p) for p in self.manager.checkpoints}:
                for pattern in (f"ckpt-{step}.*", f"ckpt-{step}_temp*"):  # TF writes into *_temp first
                    for leftover in tf.io.gfile.glob(os.path.join(self.directory, pattern)):
                        _remove(leftover)
            latest = self.latest or "none yet"
            raise UserError(f"saving checkpoint ckpt-{step} in {self.directory} failed ({_first_line(e)}); "
                            f"the newest usable checkpoint is {latest}; free space or fix permissions in the "
                            "run directory, then run the same command to resume") from None


class Unreadable(Exception):
    """A checkpoint whose files cannot be read (truncated, corrupt or missing)."""


def _checkpoint_number(prefix: str) -> int:
    tail = prefix.rsplit("ckpt-", 1)[-1]
    return int(tail) if tail.isdigit() else -1


def _first_line(error: Exception) -> str:
    text = getattr(error, "message", None) or getattr(error, "strerror", None) or str(error)
    return (str(text).strip().splitlines() or [""])[0][:200]


def _remove(path: str) -> None:
    try:
        if tf.io.gfile.isdir(path):
            tf.io.gfile.rmtree(path)
        else:
            tf.io.gfile.remove(path)
    except (tf.errors.OpError, OSError):
        pass  # best effort: a leftover of a failed save is never read (the state file does not name it)
