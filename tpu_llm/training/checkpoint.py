"""The run's checkpoints (local disk or gs://, both through tf.io.gfile): the Checkpointer, which saves
and restores everything needed to resume, checked; and a run's checkpoint restored for another use:
the weights a run starts from (train.init_from) and a model for generate and export. The run
directory's own checks and records (marker, config, tokenizer) are in run_directory.py; the names of
its files and the link checks in tpu_llm/platform/run_layout.py.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shlex
import shutil
import stat
import tempfile

import tensorflow as tf

from tpu_llm.config import ModelConfig, config_from_dict
from tpu_llm.config.checks import ADAPTER_KEYS, check_base_run, trained_state
from tpu_llm.errors import UserError
from tpu_llm.model import GPT, adapters
from tpu_llm.platform.run_layout import (CHECKPOINT_DIR, CHECKPOINT_PREFIX, CHECKPOINT_STATE, CONFIG_FILE,
                                         SP_MODEL_FILE, SPEC_FILE, UNFINISHED_SUFFIX, check_run_tree, checkpoint_name,
                                         checkpoint_step)
from tpu_llm.tokenizers import Tokenizer, content_hash, load_tokenizer
from tpu_llm.training.fault import CLUSTER_ERRORS
from tpu_llm.training.run_directory import (check_tokenizer_fits, first_line, model_changes, model_differences,
                                            read_saved_config)


def check_init_from(source: str, current: ModelConfig, tokenizer: Tokenizer) -> None:
    """Every check of train.init_from=`source` that needs no model (build.check_run: before anything is
    written): a run directory of sound shape, of the same model section and tokenizer, without adapters."""
    check_run_tree(source)  # its files are read
    saved = read_saved_config(source)
    if saved is None:
        raise UserError(f"train.init_from={source!r} is not a run directory (no {CONFIG_FILE}); give the --run_dir of "
                        "a `tpu-llm import` or `train` run")
    differences = model_differences(saved.get("model", {}), current)
    if differences:
        raise UserError(f"train.init_from={source!r} holds a model made with {differences[0]}; start from its "
                        f"config (--config {source}/{CONFIG_FILE} --run_dir NEW)")
    theirs = load_tokenizer(source)
    if theirs is not None and theirs.spec() != tokenizer.spec():
        raise UserError(f"train.init_from={source!r} was trained with another tokenizer ({theirs.kind}) than this "
                        f"run's ({tokenizer.kind}); {same_tokenizer(theirs.kind, source)}")
    check_base_run(saved, source)  # no adapters of its own: they are no base weights


def same_tokenizer(kind: str, source: str) -> str:
    """How a new run reads its data with the tokenizer of the run `source` (of `kind`), for the refusal of a
    train.init_from with another; a command in it must work as printed (tests/test_hints.py)."""
    if kind == "byte":
        return "set data.tokenizer=byte"
    if kind == "char":  # a char vocabulary is its text's own characters: no other text rebuilds it
        return (f"a char vocabulary is built from the text: train on the text {source!r} was trained on (its "
                f"{CONFIG_FILE}'s data.train), or start from a run with another tokenizer")
    if kind == "sentencepiece":
        model = shlex.quote(os.path.join(source, SP_MODEL_FILE))
        return f"set --data.tokenizer=sentencepiece --data.tokenizer_model={model}"
    # hf: tokenized once into shards, which carry the tokenizer (cli/commands.train_flags)
    return (f"tokenize the data with it: `tpu-llm data prepare --input 'corpus/*.txt' --output SHARDS --tokenizer hf "
            f"--tokenizer_model {shlex.quote(source)}`, then train with --data.train='SHARDS/*.tfrecord' "
            "--data.tokenizer=hf")


def restore_init_from(source: str, current: ModelConfig, model, tokenizer: Tokenizer, io_device: str = "") -> str:
    """train.init_from: load the weights (only) of the newest readable checkpoint of the run `source` into
    `model`, made with the same model section and tokenizer; returns that checkpoint's path."""
    check_init_from(source, current, tokenizer)
    # with adapters: the base run holds none, so its weights go into a model without them, then across
    base = GPT(current, model.vocab_size).build_weights() if getattr(model, "adapters", None) else model
    checkpointer = Checkpointer(source, keep=1, io_device=io_device, model_config=current, tokenizer=tokenizer,
                                model=base)
    path = checkpointer.restore_latest()  # the newest readable one; UserError if none can be read
    if path is None:
        raise UserError(f"train.init_from={source!r} has no checkpoint in {CHECKPOINT_DIR}/ yet")
    if base is not model:
        adapters.copy_base(base, model)
    return path


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
    write to a new private scratch directory on their own local disk for each save (`scratch_directory`,
    made by mkdtemp), deleted straight after, so a gs:// run directory is not written twice. All of
    them restore from the run's. In a
    cluster (`cluster`), a save that fails because a task was lost (the save's collectives) raises
    that error, for the caller to stop the whole job (fault.Guard.call: exit 4).

    `io_device` (a remote TPU: tpu.CLIENT_IO) makes this process read and write the files: otherwise
    TensorFlow runs each variable's save and restore on the host that owns it, a TPU host whose
    credentials and view of the filesystem are not the ones `check_run_dir_usable` checked here.

    `model_config` (the run's model section) is saved in every checkpoint, and a checkpoint made with
    another model section is refused on restore (`restore`), naming the key: the same tensor shapes
    hold other models (model.n_head), so an edited config.yaml resumed silently with another model.
    `tokenizer`'s content hash (tokenizers.content_hash) is saved likewise, and a checkpoint made with
    another tokenizer is refused on restore: a tokenizer.json replaced since (another vocabulary, even one of
    the same size) fed and decoded other ids, garbage with exit 0.
    `save_counter` (the number of saves in the run's history) is restored with the checkpoint. `lock`
    (run_lock.acquire's handle) is checked before each save: a run that lost its lock writes no more.
    """

    NOT_RESTORED = ("data_position", "model_config", "tokenizer", "trained_state")

    def __init__(self, run_dir: str, keep: int, scratch: str = "", keep_every_hours: float = 0.0,
                 cluster: bool = False, io_device: str = "", model_config: ModelConfig | None = None,
                 tokenizer: Tokenizer | None = None, trained: dict | None = None, **trackables):
        self.options = tf.train.CheckpointOptions(experimental_io_device=io_device or None)
        self.run_dir, self.directory = run_dir, os.path.join(run_dir, CHECKPOINT_DIR)
        self.keep, self.keep_every_hours, self.cluster = keep, keep_every_hours, cluster
        self.worker = scratch
        self.scratch = ""  # the directory of this worker's newest save (gone once it is done)
        if scratch:  # what workers killed while saving left behind (never through a link: _remove_scratch)
            prefix = scratch_directory(run_dir, scratch)
            for leftover in [prefix, *tf.io.gfile.glob(f"{prefix}-*")]:
                _remove_scratch(leftover)
        self.model_config = model_config
        if model_config is not None:
            trackables["model_config"] = tf.Variable(model_section(model_config), trainable=False, dtype=tf.string)
        self.trained = trained  # config.checks.trained_state: the keys that shape the trained state
        if trained is not None:
            trackables["trained_state"] = tf.Variable(json.dumps(trained, sort_keys=True), trainable=False,
                                                      dtype=tf.string)
        self.tokenizer = content_hash(tokenizer) if tokenizer is not None else ""
        if self.tokenizer:
            trackables["tokenizer"] = tf.Variable(self.tokenizer, trainable=False, dtype=tf.string)
        self.lock = None
        self.saves: int | None = None  # save_counter of the checkpoint restored
        self.notes: list[str] = []  # warnings for the log
        self.trackables: dict = {}
        self.add(**trackables)

    def add(self, **trackables) -> None:
        """Save these too (objects made after the restore, such as the position variable)."""
        self.trackables.update(trackables)
        self.checkpoint = tf.train.Checkpoint(**self.trackables)
        if self.saves is not None:
            self.checkpoint.save_counter.assign(self.saves)
        self.manager = self._manager()

    def _manager(self) -> tf.train.CheckpointManager | None:
        """The run's CheckpointManager, or None while the state file names no checkpoint: TF raises
        ValueError on an empty one (what a power loss can leave: TF does not fsync it) or one that is not
        UTF-8. Until the first save, which writes a new state file, the checkpoints are found by their
        files. Every checkpoint the state file names must be one of this directory (`check_confined`): TF
        restores the newest from wherever it is, and deletes the oldest ones' files, wherever they are,
        when it drops them after a save."""
        try:
            manager = tf.train.CheckpointManager(self.checkpoint, self.directory, max_to_keep=self.keep,
                                                 keep_checkpoint_every_n_hours=self.keep_every_hours or None)
        except ValueError:
            return None
        check_confined(self.directory, [manager.latest_checkpoint, *manager.checkpoints])
        return manager

    @property
    def latest(self) -> str | None:
        if self.worker:  # the chief saves the run's checkpoints: this manager's list is from start-up
            try:
                state = tf.train.get_checkpoint_state(self.directory)
                if state and state.model_checkpoint_path:
                    return os.path.join(self.directory, os.path.basename(state.model_checkpoint_path))
            except (tf.errors.OpError, ValueError):  # unreadable state file: what was known at start
                pass
        return self.manager.latest_checkpoint if self.manager else self.restored

    restored: str | None = None  # the checkpoint restore_latest resumed from

    def candidates(self) -> list[str]:
        """Checkpoints to resume from, newest first: those the state file records, then every other
        checkpoint whose index file is there (the ones kept by checkpoint.keep_every_hours, which TF
        leaves out of the state file, or all of them when the state file is missing or unreadable)."""
        recorded = list(reversed(self.manager.checkpoints)) if self.manager else []
        found = index_files(self.run_dir)
        known = {os.path.basename(p) for p in recorded}
        others = sorted((p[: -len(".index")] for p in found if os.path.basename(p)[: -len(".index")] not in known),
                        key=lambda p: -1 if (step := checkpoint_step(p)) is None else step, reverse=True)
        if others and not recorded:
            self.notes.append(f"the checkpoint state file {os.path.join(self.directory, CHECKPOINT_STATE)} is "
                              f"missing, empty or unreadable; trying the checkpoint files themselves, newest first")
        return recorded + others

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
            if self.model_config is not None and "model_config" in held:  # (none before issue 28, or imported)
                self._check_model(path)
            if self.tokenizer and "tokenizer" in held:  # (none before issue 40)
                self._check_tokenizer(path)
            if self.trained is not None and "trained_state" in held:  # (none before issue 50)
                self._check_trained(path, optimizer="optimizer" in held)
            # the optimizer too if the checkpoint has one: `tpu-llm import` saves the model alone (step 0)
            objects = {k: v for k, v in self.trackables.items()
                       if k not in self.NOT_RESTORED and (k in held or k == "model")}
            status = tf.train.Checkpoint(**objects).restore(path, options=self.options)
            status.assert_existing_objects_matched()
            status.expect_partial()  # what is left (the position, an old iterator) is read elsewhere or unused
            saves = self.read(path, "save_counter")  # into the run's own Checkpoint, which writes the next save
            if saves is not None:
                self.saves = int(saves)
                self.checkpoint.save_counter.assign(self.saves)
        except (AssertionError, ValueError) as e:
            first = str(e).strip().splitlines()[0][:160]
            raise UserError(f"checkpoint {path} does not fit this model ({first}); resume with the "
                            "config it was made with, or use another --run_dir") from None
        except (tf.errors.OpError, IndexError) as e:  # IndexError: TF's reader on a truncated data file
            raise Unreadable(f"{type(e).__name__}: {first_line(e)}") from None

    def _check_model(self, path: str) -> None:
        text = self.read(path, "model_config")
        try:
            saved = json.loads(text.decode() if isinstance(text, bytes) else str(text))
        except ValueError:
            raise Unreadable(f"its model_config is not JSON ({str(text)[:60]!r})") from None
        changes = model_changes(saved, self.model_config)
        if changes:
            key, theirs, ours = changes[0]
            raise UserError(f"checkpoint {path} does not fit this model (it was made with model.{key}={theirs}, this "
                            f"config has {ours}): the model section changed since it was saved (an edited "
                            "config.yaml?); resume with the model section it was made with, or use another --run_dir")

    def _check_trained(self, path: str, optimizer: bool) -> None:
        """Refuse a checkpoint whose trained state (its adapters; with `optimizer`, the checkpoint holding
        AdamW's moments, also train.freeze) was made with other train.* keys than this config's (an edited
        config.yaml): a UserError naming the key, both values and the fixes."""
        text = self.read(path, "trained_state")
        try:
            saved = json.loads(text.decode() if isinstance(text, bytes) else str(text))
        except ValueError:
            raise Unreadable(f"its trained_state is not JSON ({str(text)[:60]!r})") from None
        saved = saved if isinstance(saved, dict) else {}
        keys = set(saved) | set(self.trained)  # the rank first: with no adapters, the others are not recorded
        # the others (train.freeze) only where both record them and the checkpoint has moments to misplace: a
        # checkpoint from before they were recorded, a model-only one (import, export --format run) and
        # generation, which builds no optimizer, do not compare them
        others = sorted(k for k in (set(saved) & set(self.trained)) - set(ADAPTER_KEYS)) if optimizer else []
        for key in [k for k in ADAPTER_KEYS if k in keys] + others:
            theirs, ours = saved.get(key), self.trained.get(key)
            if theirs != ours:
                what, fresh = ("its adapters would be dropped or misread", "a new run with another --run_dir") \
                    if key in ADAPTER_KEYS else ("its AdamW moments belong to other layers", "a new run from its "
                                                 f"weights: --run_dir NEW --train.init_from={self.run_dir}")
                raise UserError(f"checkpoint {path} was trained with train.{key}={theirs!r}, this config has {ours!r} "
                                f"(an edited {CONFIG_FILE}?): {what}; set train.{key}={theirs!r} again "
                                f"({self.run_dir}/{CONFIG_FILE}, or --train.{key} for train), or start {fresh}")

    def _check_tokenizer(self, path: str) -> None:
        theirs = self.read(path, "tokenizer")
        theirs = theirs.decode(errors="replace") if isinstance(theirs, bytes) else str(theirs)
        if theirs != self.tokenizer:
            raise UserError(f"checkpoint {path} was trained with another tokenizer than {self.run_dir}/{SPEC_FILE} "
                            f"(sha256 {theirs[:12]}..., this one's {self.tokenizer[:12]}...): the file was replaced "
                            "since (data prepare into the run directory, a copy from another run?); restore the "
                            "run's own tokenizer.json (from a copy of the run directory or its shards' directory)")

    def remove_unfinished(self) -> list[str]:
        """Delete the `ckpt-N_temp/` directories in checkpoints/ that no checkpoint state records: what a
        save killed mid-write (SIGKILL, power loss) leaves, never read by anyone. Only the writer (the
        chief, holding the lock) calls it, before its first save; returns what went (also in `notes`)."""
        recorded = {os.path.basename(p) for p in self.manager.checkpoints} if self.manager else set()
        gone = []
        pattern = os.path.join(self.directory, f"{CHECKPOINT_PREFIX}*{UNFINISHED_SUFFIX}")
        for path in sorted(tf.io.gfile.glob(pattern)):
            name = os.path.basename(path.rstrip("/"))
            unfinished = checkpoint_step(name, UNFINISHED_SUFFIX) is not None
            if unfinished and name.removesuffix(UNFINISHED_SUFFIX) not in recorded and tf.io.gfile.isdir(path):
                _remove(path)
                gone.append(path)
        if gone:
            self.notes.append(f"removed {', '.join(gone)}: unfinished saves of a killed run (no checkpoint state "
                              "names them)")
        return gone

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
            self.restored = path
            return path
        if skipped:
            raise UserError(f"no checkpoint in {self.directory} can be read (newest: {skipped[0][0]}: "
                            f"{skipped[0][1][:200]}); restore the directory from a copy, or move it away to "
                            "start over")
        return None

    def save(self, step: int) -> str:
        """Save at `step`. A failure (disk full, permissions, bucket gone) is a UserError naming the
        checkpoint still usable; the partial files of the failed save are removed. Before it: the lock
        is still this run's, and no link has appeared in checkpoints/ (TF's writers would follow it)."""
        if self.lock is not None:
            self.lock.check()
        if not self.worker:
            check_run_tree(self.run_dir, trees=(CHECKPOINT_DIR,))
        try:
            if not self.worker:
                if self.manager is None:  # the state file names no checkpoint: this save writes a new one
                    _remove(os.path.join(self.directory, CHECKPOINT_STATE))
                    self.manager = self._manager()
                    if self.manager is None:
                        raise OSError(f"cannot replace the empty checkpoint state file in {self.directory}")
                return self.manager.save(checkpoint_number=step, options=self.options)
            # a new private directory (mode 0700, a name nobody can guess or take first) for each save
            self.scratch = tempfile.mkdtemp(prefix=f"{os.path.basename(scratch_directory(self.run_dir, self.worker))}-",
                                            dir=tempfile.gettempdir())
            path = tf.train.CheckpointManager(self.checkpoint, self.scratch, max_to_keep=1).save(step, options=self.options)
            _remove_scratch(self.scratch)
            return path
        except (tf.errors.OpError, OSError) as e:
            name = checkpoint_name(step)
            if self.worker:  # a worker's own scratch save: never touch the chief's checkpoints
                _remove_scratch(self.scratch)
            elif self.manager and name not in {os.path.basename(p) for p in self.manager.checkpoints}:
                for pattern in (f"{name}.*", f"{name}{UNFINISHED_SUFFIX}*"):  # TF writes into *_temp first
                    for leftover in tf.io.gfile.glob(os.path.join(self.directory, pattern)):
                        _remove(leftover)
            if self.cluster and isinstance(e, CLUSTER_ERRORS):  # a peer is gone, not a disk problem
                raise
            latest = self.latest
            if _disk_full(e):  # TF's words name an internal function and a temporary file: say what happened
                kept = (f"earlier checkpoints are intact, the newest is {latest}" if latest
                        else "no checkpoint was saved before")
                raise UserError(f"saving checkpoint {name} in {self.directory} failed: the disk is full (No space "
                                f"left on device); {kept}; free space on the run directory's disk, then run the same "
                                "command to resume") from None
            raise UserError(f"saving checkpoint {name} in {self.directory} failed ({first_line(e)}); "
                            f"the newest usable checkpoint is {latest or 'none yet'}; free space or fix permissions "
                            "in the run directory, then run the same command to resume") from None


def index_files(run_dir: str) -> list[str]:
    """The `ckpt-*.index` files in `run_dir`'s checkpoints/ (every checkpoint's, recorded or not)."""
    return tf.io.gfile.glob(os.path.join(run_dir, CHECKPOINT_DIR, f"{CHECKPOINT_PREFIX}*.index"))


def check_confined(directory: str, paths: list[str | None]) -> None:
    """Refuse (UserError) a checkpoint path read from the state file of `directory` that is not `ckpt-N` in
    `directory` itself: a path elsewhere (absolute, `../`), a glob (TF deletes a dropped checkpoint's files
    by pattern) or another name. An edited or copied state file made a normal `train` delete files
    outside the run directory, and exit 0. Refused rather than rewritten: the state file is the run's
    record of which checkpoints it keeps, and a refusal changes nothing."""
    for path in paths:
        if path is None or (checkpoint_step(path) is not None and _same_directory(os.path.dirname(path), directory)):
            continue
        state = os.path.join(directory, CHECKPOINT_STATE)
        raise UserError(f"the checkpoint state file {state} names {path!r}, not a checkpoint ckpt-N of {directory}: "
                        "TensorFlow would restore from it, and delete its files when it drops old checkpoints, "
                        "wherever they are; restore the state file from a copy of the run directory, or delete it "
                        "(the checkpoints are then found by their own files)")


def _same_directory(one: str, other: str) -> bool:
    if "://" in one or "://" in other:
        return one.rstrip("/") == other.rstrip("/")
    return os.path.abspath(one) == os.path.abspath(other)


def model_section(model: ModelConfig) -> str:
    """The model section as a checkpoint records it (JSON, keys sorted)."""
    return json.dumps(vars(model), sort_keys=True)


def scratch_directory(run_dir: str, worker: str) -> str:
    """The prefix of a multi-worker non-chief's scratch directories (each save writes its throwaway part
    into a new one, `<prefix>-XXXXXXXX` made by mkdtemp, on the worker's own local disk): fixed per run
    and worker, so the next start finds what a killed worker left."""
    run = hashlib.sha256(run_dir.encode()).hexdigest()[:12]
    return os.path.join(tempfile.gettempdir(), f"tpu-llm-scratch-{run}-{worker}")


def _remove_scratch(path: str) -> None:
    """Delete a scratch directory only if it is a real directory of this user: /tmp is shared, and a
    link planted at its name would have had another directory's contents deleted. shutil.rmtree
    follows no link inside it either."""
    try:
        info = os.lstat(path)
    except OSError:
        return
    if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid():
        shutil.rmtree(path, ignore_errors=True)


def _disk_full(error: Exception) -> bool:
    return getattr(error, "errno", None) == errno.ENOSPC or "No space left on device" in str(
        getattr(error, "message", None) or error)


class Unreadable(Exception):
    """A checkpoint whose files cannot be read (truncated, corrupt or missing)."""


def _remove(path: str) -> None:
    try:
        if tf.io.gfile.isdir(path):
            tf.io.gfile.rmtree(path)
        else:
            tf.io.gfile.remove(path)
    except (tf.errors.OpError, OSError):
        pass  # best effort: a leftover of a failed save is never read (the state file does not name it)


def load_for_generation(run_dir: str, with_checkpoint: bool = False, with_notes: bool = False, strategy=None):
    """(model, tokenizer, config) restored from the newest readable checkpoint in `run_dir`, plus that
    checkpoint's path with `with_checkpoint`, plus with `with_notes` the warnings to show (an unreadable
    newest checkpoint is skipped for the one before: the caller must say so, as `train` does). With a
    tf.distribute `strategy`, the weights are made in its scope: a copy on each replica (`tpu-llm eval`)."""
    check_run_tree(run_dir)  # generate and export read a run's files: never through a link, never a FIFO
    saved = read_saved_config(run_dir)
    tokenizer = load_tokenizer(run_dir) if saved else None
    if saved is None or tokenizer is None:
        raise UserError(f"{run_dir!r} is not a run directory (no config.yaml/tokenizer.json); "
                        "pass the --run_dir of a `tpu-llm train` run")
    cfg = config_from_dict(saved, source=os.path.join(run_dir, CONFIG_FILE))
    check_tokenizer_fits(run_dir, tokenizer, cfg)
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model = GPT.from_config(cfg).build_weights()
        ckpt = Checkpointer(run_dir, keep=cfg.checkpoint.keep, model_config=cfg.model, tokenizer=tokenizer,
                            trained=trained_state(cfg, optimizer=False), model=model)
        path = ckpt.restore_latest()  # the newest readable one (a corrupt newest one is skipped)
    if path is None:
        raise UserError(f"{run_dir!r} has no checkpoint in {CHECKPOINT_DIR}/ yet; train it first")
    return (model, tokenizer, cfg) + ((path,) if with_checkpoint else ()) + ((ckpt.notes,) if with_notes else ())
