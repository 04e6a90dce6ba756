"""The run directory's layout: the name of every file tpu-llm keeps in a run directory, the step of a
checkpoint's name, and the check that none of the files tpu-llm reads or writes there is a symbolic link
(docs/run-directory.md shows the same list; tests/test_run_layout.py compares the two), and the check that
no symbolic link, special file or other surprise is anywhere in a run directory (`check_run_tree`).

<run_dir>/
  .tpu-llm-run         MARKER_FILE: marks the directory as a tpu-llm run (nothing else is ever written into
                       a non-empty directory without it)
  .tpu-llm-lock        LOCK_FILE: the writer's lock (training/run_lock.py): one `tpu-llm train` at a time
  config.yaml          CONFIG_FILE: the effective config of the run (model section fixed once written)
  tokenizer.json       SPEC_FILE: the tokenizer, plus SP_MODEL_FILE (SentencePiece) or HF_FILE (Hugging Face)
  hf_import.json       IMPORT_FILE: an imported run's source, dtype and config.json (`tpu-llm import`)
  checkpoints/         CHECKPOINT_DIR: tf.train.CheckpointManager's ckpt-N.index, ckpt-N.data-*, and its
                       state file CHECKPOINT_STATE
  logs/                LOGS_DIR: TensorBoard summaries (LOG_SPLITS), the profiler's traces, and the Cloud
                       driver's copies of `make train`'s output
  metrics.jsonl        METRICS_FILE: one JSON line per logged loop and evaluation (a resume drops the lines
                       after its step)
  goodput.jsonl        GOODPUT_FILE: what each training process did and for how long, only appended to
  report.png           REPORT_FILE: `tpu-llm report`'s plot
  export/, hf/, peft/  EXPORT_DIR, HF_EXPORT_DIR, PEFT_EXPORT_DIR: `tpu-llm export`'s default --output
                       (SavedModel, Hugging Face, the adapters in PEFT's format)

Standard library only, and a leaf of the package (tests/test_layout.py, layer 0): the Cloud helpers
(cloud/storage.py lists a bucket's checkpoints without TensorFlow), `tpu-llm report` and the CLI's checks
(both before TensorFlow loads), the run lock, the line logs and the Checkpointer all take the names
from here, so the layout is written down once. Reading and writing the files (tf.io.gfile, for gs://)
stays with their owners: training/checkpoint.py (the Checkpointer), training/run_directory.py (the run
directory's checks), training/line_log.py, training/run_lock.py.

A local run directory is a guarded space: `check_run_tree` refuses a symbolic link anywhere in it (and
a special file, a name that is not UTF-8, a name of the layout of the wrong kind), at any depth and
whatever its name (not only the names of NAMES: an export's files, a tokenizer file of a
later version, a user's notes), at the start of train, generate, export and report, and again (checkpoints/
only) before each save: TensorFlow's writers follow links, so a planted `ckpt-N.index` link had the next
save write a checkpoint index into whatever file it named, and a link at a name of no list was read
through (`hf_import.json` was missed by one). The run directory itself may be a link (a disk mounted
elsewhere); gs:// has no links.
"""

from __future__ import annotations

import os

from tpu_llm.errors import UserError
from tpu_llm.platform.files import kind_of

MARKER_FILE = ".tpu-llm-run"
LOCK_FILE = ".tpu-llm-lock"
CONFIG_FILE = "config.yaml"
SPEC_FILE = "tokenizer.json"  # the tokenizer's spec (kind, vocabulary); in shard and export directories too
SP_MODEL_FILE = "tokenizer.model"  # a SentencePiece tokenizer's model
HF_FILE = "hf_tokenizer.json"  # Hugging Face's tokenizer.json (ours is SPEC_FILE)
IMPORT_FILE = "hf_import.json"
CHECKPOINT_DIR = "checkpoints"
CHECKPOINT_STATE = "checkpoint"  # TensorFlow's state file in CHECKPOINT_DIR: the checkpoints it keeps
LOGS_DIR = "logs"
LOG_SPLITS = ("train", "validation", "goodput")  # TensorBoard's logs/<split>; the profiler writes below logs/train
METRICS_FILE = "metrics.jsonl"
GOODPUT_FILE = "goodput.jsonl"
REPORT_FILE = "report.png"
EXPORT_DIR = "export"
HF_EXPORT_DIR = "hf"
PEFT_EXPORT_DIR = "peft"
# every top-level name of a run directory (docs/run-directory.md lists the same)
NAMES = (MARKER_FILE, LOCK_FILE, CONFIG_FILE, SPEC_FILE, SP_MODEL_FILE, HF_FILE, IMPORT_FILE, CHECKPOINT_DIR,
         LOGS_DIR, METRICS_FILE, GOODPUT_FILE, REPORT_FILE, EXPORT_DIR, HF_EXPORT_DIR, PEFT_EXPORT_DIR)

# the most metrics.jsonl or goodput.jsonl may hold when read back (a line per host call: a million calls of
# a long run are about 300 MB); a larger file is refused, not read into memory
MAX_LINE_LOG_BYTES = 1 << 30

WRITE_PROBE = ".write-test-"  # a probe that the directory (or bucket prefix) is writable, deleted straight after
# probes, workers' scratch (of earlier versions) and the lock (taken just before the marker is written):
# not content of their own, so a directory holding only these is still empty
OWN_TEMPORARY = (WRITE_PROBE, ".scratch-", LOCK_FILE)
CHECKPOINT_PREFIX = "ckpt-"  # tf.train.CheckpointManager's names (its default checkpoint_name "ckpt"): ckpt-N
UNFINISHED_SUFFIX = "_temp"  # TensorFlow writes checkpoint ckpt-N into ckpt-N_temp/ first


def checkpoint_name(step: int) -> str:
    """The name TensorFlow gives the checkpoint of `step` in checkpoints/ (its files: name + ".index", ...)."""
    return f"{CHECKPOINT_PREFIX}{step}"


def checkpoint_step(path: str | None, suffix: str = "") -> int | None:
    """N when the last component of `path` is `ckpt-N` + `suffix` (N in ASCII digits; a checkpoint's
    path, or one of its files with `suffix`, e.g. ".index"), else None."""
    name = os.path.basename(path or "")
    if not name.startswith(CHECKPOINT_PREFIX) or not name.endswith(suffix):
        return None
    digits = name[len(CHECKPOINT_PREFIX):len(name) - len(suffix)]
    return int(digits) if digits.isascii() and digits.isdigit() else None


WHOLE = ""  # check_run_tree's tree for the whole run directory
# the names of the layout that are directories (the others of NAMES are regular files), and logs/'s splits
DIRECTORIES = {CHECKPOINT_DIR, LOGS_DIR, EXPORT_DIR, HF_EXPORT_DIR, PEFT_EXPORT_DIR,
               *(os.path.join(LOGS_DIR, split) for split in LOG_SPLITS)}


def check_run_tree(run_dir: str, trees: tuple[str, ...] = (WHOLE,)) -> None:
    """Refuse (UserError) in a local `run_dir` (or only under `trees`, e.g. (CHECKPOINT_DIR,) before a
    save), naming the first one found: a symbolic link; a special file (FIFO, socket, device: TensorFlow
    opens the checkpoint state file, ckpt-N.index and the event files itself, where our own checks never
    see the open, and a reader of a FIFO waits forever); a name that is not UTF-8; a name of the layout
    of the wrong kind (checkpoints/ a regular file: a resume found no checkpoint, dropped metrics.jsonl's
    lines, then failed at its first save). Iterative, so a tree of any depth is one refusal or none, never
    a RecursionError; one directory read per directory (the entries' types come with them); gs:// has no
    links nor special files. (The run directory itself may be a link.)"""
    if "\0" in run_dir:  # os.scandir raises ValueError (the Python API and train.init_from reach here)
        raise UserError(f"run_dir {ascii(run_dir)} holds a NUL byte, which no path may hold")
    if "://" in run_dir:
        return
    for tree in trees:
        _check_tree(run_dir, tree)


def _check_tree(run_dir: str, top: str) -> None:
    if top and os.path.islink(os.path.join(run_dir, top)):
        raise link_error(run_dir, top)
    pending = [top]
    while pending:
        rel = pending.pop()
        for entry in _entries(run_dir, rel):
            child = os.path.join(rel, entry.name)
            _check_entry(run_dir, child, entry)
            if entry.is_dir(follow_symlinks=False):
                pending.append(child)


def _entries(run_dir: str, rel: str) -> list:
    path = os.path.join(run_dir, rel) if rel else run_dir
    try:
        with os.scandir(path) as entries:
            return list(entries)
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as e:  # a name too long at some depth, no permission
        raise UserError(f"run_dir {run_dir!r}: {ascii(rel)} cannot be read ({e.strerror or e}); fix its "
                        "permissions or remove it, or use another --run_dir") from None


def _check_entry(run_dir: str, rel: str, entry: os.DirEntry) -> None:
    """One entry of the run directory: its name, then its kind (from the directory entry where it can)."""
    try:
        rel.encode("utf-8")
    except UnicodeEncodeError:  # os.scandir gives a name of other bytes as surrogates
        raise UserError(f"run_dir {run_dir!r} holds a name that is not UTF-8, {ascii(rel)}: TensorFlow cannot "
                        "name it (a traceback); rename or remove it, or use another --run_dir") from None
    if entry.is_symlink():  # from the directory entry: no extra system call
        raise link_error(run_dir, rel)
    is_dir, is_file = entry.is_dir(follow_symlinks=False), entry.is_file(follow_symlinks=False)
    if not is_dir and not is_file:
        kind = kind_of(entry.stat(follow_symlinks=False).st_mode)
        raise UserError(f"run_dir {run_dir!r} holds a {kind}, {rel}, where only regular files and directories "
                        "belong: TensorFlow opens a run's files itself, and a reader of a FIFO or a device waits "
                        "forever; remove it, or use another --run_dir")
    expected = "directory" if rel in DIRECTORIES else "regular file" if rel in NAMES else ""
    if expected and expected != ("directory" if is_dir else "regular file"):
        raise UserError(f"run_dir {run_dir!r} holds {rel} as a {'directory' if is_dir else 'regular file'}, where "
                        f"tpu-llm keeps a {expected}; restore it from a copy of the run directory, or use another "
                        "--run_dir")


def link_error(run_dir: str, rel: str) -> UserError:
    """The refusal of a symbolic link at `rel` inside `run_dir`, naming where it leads."""
    try:
        target = os.readlink(os.path.join(run_dir, rel))
    except OSError:
        target = "?"
    return UserError(f"run_dir {run_dir!r} holds a symbolic link, {rel} -> {target}; tpu-llm never reads or writes a "
                     "run's files through a link (it could lead anywhere): replace the link with the file or "
                     "directory itself, or use another --run_dir")
