"""Trust 3 (issue 50): nothing outside a run directory is touched through a path read from one of its
files, and what TensorFlow opens itself in a run directory is checked before it does. Each refusal is one
UserError and leaves every byte as it was (`state` hashes the whole tree, outside files included); each
test failed before its fix. In-process and TF-light: a Checkpointer of one small variable, no training
(the CLI-level cases, on a trained run, are in test_trust_boundaries.py).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import time

import pytest
import tensorflow as tf
from helpers import state

from tpu_llm.errors import UserError
from tpu_llm.platform import run_layout
from tpu_llm.training.checkpoint import Checkpointer


def saved_run(tmp_path, steps=(1, 2)):
    """A run directory tmp_path/run whose checkpoints/ holds ckpt-1 and ckpt-2 of one variable."""
    weights = tf.Variable([1.0, 2.0])
    checkpointer = Checkpointer(str(tmp_path / "run"), 2, weights=weights)
    for step in steps:
        checkpointer.save(step)
    return tmp_path / "run", weights


def write_state(run, newest: str, paths: list[str]) -> None:
    """A state file as TF writes it, naming `paths` (oldest first), each younger than the last preserved
    time: all of them are TF's to drop (delete) once more than `keep` are held."""
    now = time.time()
    lines = [f'model_checkpoint_path: "{newest}"', *(f'all_model_checkpoint_paths: "{p}"' for p in paths),
             *(f"all_model_checkpoint_timestamps: {now - 10 + i}" for i in range(len(paths))),
             f"last_preserved_timestamp: {now - 100}"]
    (run / "checkpoints" / "checkpoint").write_text("\n".join(lines) + "\n")


def outside_victim(tmp_path):
    """Files outside the run directory named as a checkpoint's would be (victim.index, victim.data-...)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    for suffix in (".index", ".data-00000-of-00001"):
        (outside / f"victim{suffix}").write_text("precious")
    return outside / "victim"


@pytest.mark.parametrize("listed", ["OUTSIDE", "../../outside/victim", "ckpt-*", "notes"])
def test_a_state_file_naming_a_checkpoint_outside_is_refused_and_nothing_is_deleted(tmp_path, listed):
    """Issue 50 #1: a state file listing /elsewhere/victim had the next save delete victim.index and
    victim.data-* (TF drops the oldest checkpoints by their paths, by glob), and exit 0."""
    run, weights = saved_run(tmp_path)
    listed = str(outside_victim(tmp_path)) if listed == "OUTSIDE" else listed
    write_state(run, "ckpt-2", [listed, "ckpt-1", "ckpt-2"])
    before = state(tmp_path)
    with pytest.raises(UserError, match=f"names '.*{re.escape(listed[-6:])}', not a checkpoint ckpt-N"):
        checkpointer = Checkpointer(str(run), 2, weights=weights)
        checkpointer.restore_latest()
        checkpointer.save(3)
    assert state(tmp_path) == before


def test_a_newest_checkpoint_outside_is_refused_not_restored(tmp_path):
    """Issue 50 #1: model_checkpoint_path naming another directory's checkpoint was restored from there."""
    elsewhere, _ = saved_run(tmp_path / "elsewhere", steps=(7,))
    run, weights = saved_run(tmp_path)
    write_state(run, str(elsewhere / "checkpoints" / "ckpt-7"), ["ckpt-1", "ckpt-2"])
    before = state(tmp_path)
    with pytest.raises(UserError, match="ckpt-7', not a checkpoint ckpt-N of"):
        Checkpointer(str(run), 2, weights=weights).restore_latest()
    assert state(tmp_path) == before


def test_the_run_directorys_own_absolute_path_and_a_state_file_not_utf8_are_accepted(tmp_path):
    """What the check must let through: a state file naming its own directory absolutely (no escape), and
    one that is not UTF-8, unreadable like a torn one (the checkpoints are found by their files)."""
    run, weights = saved_run(tmp_path)
    write_state(run, str(run / "checkpoints" / "ckpt-2"), [str(run / "checkpoints" / "ckpt-1"), "ckpt-2"])
    assert Checkpointer(str(run), 2, weights=weights).restore_latest().endswith("ckpt-2")
    (run / "checkpoints" / "checkpoint").write_bytes(b'model_checkpoint_path: "ckpt-\xff2"\n')
    checkpointer = Checkpointer(str(run), 2, weights=weights)
    assert checkpointer.restore_latest().endswith("ckpt-2") and "state file" in checkpointer.notes[0]
    assert checkpointer.save(3).endswith("ckpt-3")  # and a save writes a new state file


# ---- what TensorFlow opens itself: the run directory's tree, checked before it runs --------------------

def run_tree(tmp_path):
    """A run directory's usual tree, files of plain text (check_run_tree looks at kinds and names only)."""
    run = tmp_path / "run"
    for rel in ["config.yaml", "metrics.jsonl", "checkpoints/checkpoint", "checkpoints/ckpt-2.index",
                "checkpoints/ckpt-2.data-00000-of-00001", "logs/train/events.out.tfevents.1.host.2.v2",
                "logs/goodput/events.out.tfevents.1.host.2.v2", "export/saved_model.pb"]:
        (run / rel).parent.mkdir(parents=True, exist_ok=True)
        (run / rel).write_text("ours")
    return run


@pytest.mark.parametrize("rel", ["checkpoints/checkpoint", "checkpoints/ckpt-2.index",
                                 "checkpoints/ckpt-2.data-00000-of-00001", "logs/train/events.out.tfevents.1.host.2.v2",
                                 "logs/goodput/events.out.tfevents.1.host.2.v2", "export/saved_model.pb", "notes"])
def test_a_fifo_anywhere_in_the_run_directory_is_refused_naming_it(tmp_path, rel):
    """Issue 50 #3: a FIFO at the state file, a ckpt-N.index or an event file hung train and generate
    forever: TensorFlow opens those itself, where files.open_regular never sees the open."""
    run = run_tree(tmp_path)
    (run / rel).unlink(missing_ok=True)
    os.mkfifo(run / rel)
    with pytest.raises(UserError, match=f"holds a named pipe \\(FIFO\\), {re.escape(rel)}, where only regular files"):
        run_layout.check_run_tree(str(run))


def test_a_socket_is_refused_and_before_a_save_in_checkpoints(tmp_path):
    run = run_tree(tmp_path)
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(run / "checkpoints" / "ckpt-4.index"))
        with pytest.raises(UserError, match="holds a socket, checkpoints/ckpt-4.index"):
            run_layout.check_run_tree(str(run), trees=(run_layout.CHECKPOINT_DIR,))


def test_a_tree_a_thousand_levels_deep_is_walked_without_recursion(tmp_path):
    """Issue 50 #6: a directory tree 1,000 levels deep was a RecursionError (a traceback) in every command."""
    run = run_tree(tmp_path)
    top = deep = str(run / "logs" / "train")
    try:
        for _ in range(1000):  # one level at a time: pathlib's and os's makedirs recurse themselves
            deep = os.path.join(deep, "d")
            os.mkdir(deep)
        run_layout.check_run_tree(str(run))  # directories only: nothing to refuse
        os.mkfifo(os.path.join(deep, "pipe"))
        with pytest.raises(UserError, match="holds a named pipe"):
            run_layout.check_run_tree(str(run))
    finally:
        remove_deep(top, deep)


def remove_deep(top: str, deep: str) -> None:
    """Remove the tree from `deep` up to `top` (exclusive) one level at a time: pytest's own clean-up of old
    temporary directories (shutil.rmtree, recursive) hit a RecursionError on it."""
    for name in os.listdir(deep):
        os.remove(os.path.join(deep, name))
    while deep != top:
        os.rmdir(deep)
        deep = os.path.dirname(deep)


def test_a_name_that_is_not_utf8_is_refused(tmp_path):
    """Issue 50 #6: a checkpoint file name that is not UTF-8 was a traceback (TF's glob cannot decode it)."""
    run = run_tree(tmp_path)
    with open(os.path.join(os.fsencode(run / "checkpoints"), b"ckpt-\xff.index"), "w") as f:
        f.write("ours")
    with pytest.raises(UserError, match=r"holds a name that is not UTF-8, 'checkpoints/ckpt-\\udcff.index'"):
        run_layout.check_run_tree(str(run))


@pytest.mark.parametrize("rel, kind", [("checkpoints", "regular file"), ("logs", "regular file"),
                                       ("logs/train", "regular file"), ("config.yaml", "directory"),
                                       ("metrics.jsonl", "directory")])
def test_a_name_of_the_layout_of_the_wrong_kind_is_refused(tmp_path, rel, kind):
    """Issue 50 #2 and #6: checkpoints/ replaced by a regular file made a resume find no checkpoint, drop
    metrics.jsonl's lines (6 to 1), then fail at its first save; logs/ a regular file was a traceback."""
    run = run_tree(tmp_path)
    shutil.rmtree(run / rel) if (run / rel).is_dir() else (run / rel).unlink()
    (run / rel).mkdir() if kind == "directory" else (run / rel).write_text("not ours")
    expected = "directory" if kind == "regular file" else "regular file"
    with pytest.raises(UserError, match=f"holds {re.escape(rel)} as a {kind}, where tpu-llm keeps a {expected}"):
        run_layout.check_run_tree(str(run))


@pytest.mark.parametrize("args", [["generate", "--run_dir", "runs/a\0b"], ["report", "--run_dir=runs/a\0b"],
                                  ["train", "--run_dir", "runs/x", "--train.init_from=runs/a\0b", "--dry_run"]])
def test_a_nul_byte_in_an_argument_is_one_line(capsys, args):
    """Issue 50 #6: a NUL byte in --run_dir or train.init_from was ValueError: embedded null byte (a traceback)."""
    from tpu_llm import cli

    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: argument ") and "holds a NUL byte" in err and err.count("\n") == 1, err


def test_a_nul_byte_in_a_config_or_a_run_dir_of_the_python_api_is_one_userror(tmp_path):
    from tpu_llm.config import load_config

    with pytest.raises(UserError, match=r"config: train.init_from='a\\x00b' holds a NUL byte"):
        load_config(None, {"train.init_from": "a\0b"})
    (tmp_path / "c.yaml").write_text('run_dir: "runs/a\\0b"\n')
    with pytest.raises(UserError, match=r"config: run_dir='runs/a\\x00b' holds a NUL byte"):
        load_config(str(tmp_path / "c.yaml"), {})
    with pytest.raises(UserError, match="holds a NUL byte"):
        run_layout.check_run_tree("runs/a\0b")  # tpu_llm.load(run_dir) and train.init_from's source


def test_the_trained_state_record_names_adapter_keys_not_layout_keys(tmp_path):
    """Issue 50 #5: what each checkpoint records of the config (config.checks.trained_state): the adapters'
    keys, PEFT's default targets spelt out; cpu_devices and parallel.* are layout (a run may resume in
    another), and a record of other adapters is refused by the Checkpointer, naming the key."""
    from helpers import tiny_config

    from tpu_llm.config.checks import trained_state

    lora = {"train.lora_rank": 2, "train.lora_alpha": 4.0}
    one = trained_state(tiny_config(tmp_path, **lora))
    assert one == {"lora_rank": 2, "lora_alpha": 4.0, "lora_base_dtype": "float32", "lora_targets": "c_attn",
                   "freeze": ""}
    layout = {"cpu_devices": 2, "parallel.pipeline_stages": 2, "parallel.microbatches": 2, "parallel.tensor": 2}
    assert trained_state(tiny_config(tmp_path, **lora, **layout)) == one
    assert trained_state(tiny_config(tmp_path)) == {"lora_rank": 0, "freeze": ""}
    assert trained_state(tiny_config(tmp_path), optimizer=False) == {"lora_rank": 0}  # generation: no moments
    frozen = trained_state(tiny_config(tmp_path, **{"train.freeze": "blocks:1, embeddings,blocks:0-1"}))
    assert frozen["freeze"] == "embeddings,blocks:0,blocks:1"  # one spelling of the same layers
    weights = tf.Variable([1.0, 2.0])
    Checkpointer(str(tmp_path / "run"), 2, trained=one, weights=weights).save(1)
    with pytest.raises(UserError, match=r"was trained with train.lora_rank=2, this config has 0 .*another --run_dir"):
        Checkpointer(str(tmp_path / "run"), 2, trained={"lora_rank": 0}, weights=weights).restore_latest()
    # train.freeze: compared where both sides record it and the checkpoint holds moments (not by generation,
    # nor against a checkpoint from before, nor against a model-only one: tpu-llm import, export --format run)
    moments = tf.Variable([0.5, 0.5])  # (stands in for the optimizer: what the check looks for is its name)
    Checkpointer(str(tmp_path / "all"), 2, trained={"lora_rank": 0, "freeze": ""}, weights=weights,
                 optimizer=moments).save(1)
    with pytest.raises(UserError, match=r"was trained with train.freeze='', this config has 'embeddings' .*its AdamW "
                                        r"moments belong to other layers.*--train.init_from="):
        Checkpointer(str(tmp_path / "all"), 2, trained={"lora_rank": 0, "freeze": "embeddings"},
                     weights=weights, optimizer=moments).restore_latest()
    assert Checkpointer(str(tmp_path / "all"), 2, trained={"lora_rank": 0}, weights=weights).restore_latest()
    Checkpointer(str(tmp_path / "imported"), 2, trained={"lora_rank": 0, "freeze": ""}, weights=weights).save(0)
    assert Checkpointer(str(tmp_path / "imported"), 2, trained={"lora_rank": 0, "freeze": "embeddings"},
                        weights=weights, optimizer=moments).restore_latest()
    Checkpointer(str(tmp_path / "old"), 2, trained={"lora_rank": 0}, weights=weights).save(1)
    assert Checkpointer(str(tmp_path / "old"), 2, trained={"lora_rank": 0, "freeze": "embeddings"},
                        weights=weights).restore_latest()
