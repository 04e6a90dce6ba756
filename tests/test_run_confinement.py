"""Trust 3 (issue 50): nothing outside a run directory is touched through a path read from one of its
files, and what TensorFlow opens itself in a run directory is checked before it does. Each refusal is one
UserError and leaves every byte as it was (`state` hashes the whole tree, outside files included); each
test failed before its fix. In-process and TF-light: a Checkpointer of one small variable, no training
(the CLI-level cases, on a trained run, are in test_trust_boundaries.py).
"""

from __future__ import annotations

import re
import time

import pytest
import tensorflow as tf
from helpers import state

from tpu_llm.errors import UserError
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
