"""The run directory's checks and records (local disk or gs://, both through tf.io.gfile); the names of
its files, the step of a checkpoint's name and the link checks are in tpu_llm/platform/run_layout.py, its
checkpoints in checkpoint.py.

Re-using a run directory resumes it. `check_run_dir` refuses a non-empty directory that is not a
tpu-llm run and a run made by another model; `record_run` writes the marker, config and tokenizer,
only once every check of the run passed (training/build.py: build_run). A refused run leaves the directory
untouched. A run directory of an earlier version (config.yaml, tokenizer.json and checkpoints/, no
marker) is accepted, and gets its marker when it is resumed. A local run directory is read and written
through no symbolic link (`run_layout.check_run_tree`, at the start and before each save).
"""

from __future__ import annotations

import os
import re
import uuid

import tensorflow as tf
import yaml

from tpu_llm.config import Config, ModelConfig
from tpu_llm.config.checks import adapter_differences
from tpu_llm.config.reading import MAX_CONFIG_BYTES
from tpu_llm.errors import UserError
from tpu_llm.platform import files
from tpu_llm.platform.files import write_atomically
from tpu_llm.platform.run_layout import CHECKPOINT_DIR, CONFIG_FILE, MARKER_FILE, OWN_TEMPORARY, SPEC_FILE, WRITE_PROBE
from tpu_llm.tokenizers import Tokenizer, load_tokenizer, save_tokenizer


def read_saved_config(run_dir: str) -> dict | None:
    """The run's config.yaml as a mapping, None if it has none; read as a file from elsewhere (a regular
    file of at most MAX_CONFIG_BYTES, YAML holding a mapping), else one UserError."""
    path = os.path.join(run_dir, CONFIG_FILE)
    fix = "restore it or use another --run_dir"
    try:
        raw = files.read_regular(path, MAX_CONFIG_BYTES, "the run's config", fix)
    except FileNotFoundError:
        return None
    try:
        saved = yaml.safe_load(raw.decode("utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError, RecursionError):
        raise UserError(f"{path} is not valid YAML; {fix}") from None
    if not isinstance(saved, dict) or not isinstance(saved.get("model", {}), dict):
        raise UserError(f"{path} is not a tpu-llm config (a mapping with a model section); {fix}")
    return saved


def check_run_dir_reachable(run_dir: str) -> None:
    """Fail early, before anything reads or writes it, if `run_dir`'s filesystem cannot be reached (a
    gs:// bucket that does not exist, no network or no credentials)."""
    try:
        tf.io.gfile.exists(run_dir)
    except (tf.errors.OpError, OSError) as e:
        where = "check the bucket name, the network and your credentials (gcloud auth application-default login)" \
            if "://" in run_dir else "check the path"
        raise UserError(f"run_dir {run_dir!r} cannot be reached ({first_line(e)}); {where}") from None


def check_run_dir_usable(run_dir: str) -> None:
    """Fail early, before training, if the run directory cannot be created or written."""
    try:
        if tf.io.gfile.exists(run_dir) and not tf.io.gfile.isdir(run_dir):
            raise UserError(f"run_dir {run_dir!r} is a file, not a directory; choose another --run_dir")
        tf.io.gfile.makedirs(run_dir)
        probe = os.path.join(run_dir, f"{WRITE_PROBE}{uuid.uuid4().hex[:8]}")
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


def is_run_dir(run_dir: str) -> bool:
    """Whether `run_dir` holds a tpu-llm run: its marker, or the files of a run made by an earlier version
    (config.yaml, tokenizer.json and checkpoints/, written before the marker existed)."""
    def there(name):
        return tf.io.gfile.exists(os.path.join(run_dir, name))
    return there(MARKER_FILE) or there(CONFIG_FILE) and there(SPEC_FILE) and there(CHECKPOINT_DIR)


def check_run_dir_owner(run_dir: str) -> None:
    """Refuse a directory that is not empty and not a tpu-llm run (another tool's folder); read only."""
    if not tf.io.gfile.exists(run_dir):
        return
    if not tf.io.gfile.isdir(run_dir):
        raise UserError(f"run_dir {run_dir!r} is a file, not a directory; choose another --run_dir")
    held = sorted(n.rstrip("/") for n in tf.io.gfile.listdir(run_dir) if not n.startswith(OWN_TEMPORARY))
    if held and not is_run_dir(run_dir):
        shown = ", ".join(held[:5]) + (", ..." if len(held) > 5 else "")
        raise UserError(f"run_dir {run_dir!r} is not empty and is not a tpu-llm run (no {MARKER_FILE}; it holds "
                        f"{shown}); choose a new or empty --run_dir")


def check_run_dir(cfg: Config, unstated: str = "") -> None:
    """Everything `record_run` will need, checked without writing: the directory is a tpu-llm run (or
    new or empty), made by the same model (`cfg.model.vocab_size` already resolved). `unstated`: what
    the command line left to defaults (e.g. "no --run_dir"), named in the refusal because a newcomer's
    command without --run_dir lands on the default run directory of an earlier run."""
    run_dir = cfg.run_dir
    check_run_dir_owner(run_dir)
    saved = read_saved_config(run_dir)
    if saved is not None:
        differences = model_differences(saved.get("model", {}), cfg.model) + adapter_differences(saved, cfg)
        if differences:
            why = f" and this command gave {unstated}" if unstated else ""
            fresh = f"{run_dir.rstrip('/')}-2" if not run_dir.endswith("-2") else f"{run_dir}x"
            raise UserError(f"run_dir {run_dir!r} holds a run made with {differences[0]}{why}; for a new run add "
                            f"`--run_dir {fresh}`, to resume that run use its config: "
                            f"`--config {os.path.join(run_dir, CONFIG_FILE)}`")


def record_run(cfg: Config, tokenizer: Tokenizer) -> None:
    """Make `cfg.run_dir` a run directory (checked writable): the marker, then config and tokenizer.
    Called once every check of the run passed, before the first step."""
    run_dir = cfg.run_dir
    check_run_dir_usable(run_dir)
    if not tf.io.gfile.exists(os.path.join(run_dir, MARKER_FILE)):  # first: a worker may be looking
        write_atomically(os.path.join(run_dir, MARKER_FILE), "a tpu-llm run directory (tpu_llm/training/checkpoint.py)\n")
    write_atomically(os.path.join(run_dir, CONFIG_FILE), cfg.to_yaml())
    if load_tokenizer(run_dir) is None:
        save_tokenizer(tokenizer, run_dir)


def open_run_dir(cfg: Config, tokenizer: Tokenizer) -> None:
    """Check `cfg.run_dir` (usable, a run or new, same model as any run already in it), then record
    config and tokenizer: `check_run_dir` and `record_run` in one."""
    check_run_dir(cfg)
    record_run(cfg, tokenizer)


def model_differences(saved: dict, current: ModelConfig) -> list[str]:
    return [f"model.{key}={theirs} (this config has {ours})" for key, theirs, ours in model_changes(saved, current)]


def model_changes(saved: dict, current: ModelConfig) -> list[tuple]:
    """(key, saved value, current value) of every key both hold with different values: a key one of
    them lacks (added by a later version, with the earlier behaviour as its default) is no difference."""
    return [(key, saved[key], value) for key, value in vars(current).items() if key in saved and saved[key] != value]


def first_line(error: Exception) -> str:
    """The first line of a TensorFlow or OS error, for a one-line message."""
    text = getattr(error, "message", None) or getattr(error, "strerror", None) or str(error)
    # TF's prefix naming its internal function ({{function_node __wrapped__SaveV2_...}}) and op suffix say nothing
    text = re.sub(r"\s*\[Op:\w+\]\s*$", "", re.sub(r"^\s*\{\{function_node [^}]*\}\}\s*", "", str(text)))
    return (text.strip().splitlines() or [""])[0][:200]


def check_tokenizer_fits(run_dir: str, tokenizer: Tokenizer, cfg: Config) -> None:
    """Refuse (UserError) a tokenizer.json that contradicts the run's config: another kind than the one the
    run was trained with (data prepare into a run directory replaced a char vocabulary by a byte one),
    or more ids than the model's embedding has rows (its ids past them cannot be looked up)."""
    path = os.path.join(run_dir, SPEC_FILE)
    fix = "restore the run's own tokenizer.json (from a copy of the run directory or its shards' directory)"
    if tokenizer.kind != cfg.data.tokenizer:
        raise UserError(f"{path} holds a {tokenizer.kind} tokenizer, but the run was trained with "
                        f"data.tokenizer={cfg.data.tokenizer} (config.yaml); {fix}")
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise UserError(f"{path} has {tokenizer.vocab_size:,} ids, the model's embedding {cfg.model.vocab_size:,} "
                        f"rows (model.vocab_size); {fix}")
