"""The run directory as a guarded space (issue 28): no file of a run is read or written through a
symbolic link, one writer at a time (the lock, refused with the holder named; released when the
holder dies), unfinished saves of a killed run cleaned up, and the checkpoint's own record of the
model section checked on resume. The gs:// lock runs against the storage emulator in test_cloud.py;
`export --overwrite` through a link in test_export.py; a worker's scratch directory in test_fault.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tensorflow as tf
import yaml
from helpers import PAUSED, metrics, quiet, snapshot, tiny_config

from tpu_llm import cli
from tpu_llm.errors import UserError
from tpu_llm.training import run_lock
from tpu_llm.training.checkpoint import Checkpointer
from tpu_llm.training.controller import train
from tpu_llm.training.trainer import Trainer

REPO = Path(__file__).resolve().parent.parent


def cfg_for(root, run="run", **overrides):
    """A tiny run in root/run: 8 steps of 2 per call, checkpoints at 4 and 8, its step a TF graph (the
    subject here is the run directory, not the compiled step)."""
    return tiny_config(root, **{"run_dir": str(Path(root) / run), "train.steps": 8, "train.steps_per_loop": 2,
                                "train.decay_steps": 8, "checkpoint.every_steps": 4, "execution": "graph",
                                **overrides})


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A directory with the corpus and `straight`: the tiny run, 8 steps (ckpt-4, ckpt-8)."""
    root = tmp_path_factory.mktemp("rundir")
    train(cfg_for(root, "straight"), say=quiet)
    return root


def copy_of_straight(base, tmp_path) -> Path:
    shutil.copytree(base / "straight", tmp_path / "run")
    return tmp_path / "run"


def train_args(base, run, steps=12) -> list[str]:
    return ["train", f"--run_dir={run}", f"--data.train={base / 'corpus' / '*.txt'}", "--execution=graph",
            *(f"--{k}={v}" for k, v in (("model.n_layer", 2), ("model.n_head", 2), ("model.n_embd", 32),
                                        ("model.max_len", 32), ("data.seq_len", 16), ("data.shuffle_buffer", 64),
                                        ("train.batch_size", 4), ("train.steps", steps),
                                        ("train.steps_per_loop", 2), ("train.decay_steps", 8),
                                        ("checkpoint.every_steps", 4), ("train.eval_every", 0),
                                        ("train.eval_steps", 2), ("sample.num_samples", 0)))]


def plant_link(run: Path, name: str, outside: Path) -> Path:
    """Replace run/name with a symbolic link to `outside`, a copy of what it held ("precious" for the
    newest checkpoint's index: then it is unreadable, so the run falls back to ckpt-4 and saves ckpt-8
    again, which wrote its index through the link)."""
    inside = run / name
    if name.endswith("ckpt-8.index"):
        outside.write_text("precious: not a checkpoint index")
    elif inside.is_dir():
        shutil.copytree(inside, outside)
    else:
        shutil.copy(inside, outside)
    shutil.rmtree(inside) if inside.is_dir() and not inside.is_symlink() else inside.unlink()
    inside.symlink_to(outside)
    return inside


# ---- symbolic links ----------------------------------------------------------------------------------

LINKED = ["checkpoints/ckpt-8.index", "metrics.jsonl", "logs/train", "checkpoints", "config.yaml", "tokenizer.json",
          ".tpu-llm-run"]


@pytest.mark.parametrize("name", LINKED)
def test_a_symlink_in_the_run_directory_is_refused_and_nothing_is_written_through_it(name, base, tmp_path, capsys):
    """Issue 28 #1: the next save wrote ckpt-8's index through a link into its target (any file, as
    root), metrics.jsonl's lines were appended to a linked file's target, a linked logs/train got a
    new event file."""
    run = copy_of_straight(base, tmp_path)
    link = plant_link(run, name, tmp_path / "outside")
    before, outside = snapshot(run), snapshot(tmp_path / "outside") or (tmp_path / "outside").read_bytes()
    capsys.readouterr()
    assert cli.main(train_args(base, run)) == 2
    err = capsys.readouterr().err
    assert err == (f"error: run_dir {str(run)!r} holds a symbolic link, {name} -> {tmp_path / 'outside'}; tpu-llm "
                   "never reads or writes a run's files through a link (it could lead anywhere): replace the link "
                   "with the file or directory itself, or use another --run_dir\n"), err
    assert snapshot(run) == before and link.is_symlink()
    assert (snapshot(tmp_path / "outside") or (tmp_path / "outside").read_bytes()) == outside


@pytest.mark.parametrize("name", ["checkpoints/ckpt-4.index", "metrics.jsonl", "goodput.jsonl"])
def test_a_symlink_planted_during_the_run_is_refused_before_the_next_write(name, tmp_path, monkeypatch):
    """The check runs before each save and each metrics or goodput line, not only at the start: a link made
    while the run trains is never written through. (goodput.jsonl: issue 50, its check had no test.)"""
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    real_run = Trainer.run

    def planting(self, *args, **kwargs):  # after the first host call (steps 1-2), before ckpt-4 and its log line
        out = real_run(self, *args, **kwargs)
        link = tmp_path / "run" / name
        if not link.is_symlink():
            if link.exists():
                link.unlink()
            link.parent.mkdir(exist_ok=True)  # checkpoints/: before the first save
            link.symlink_to(victim)
        return out

    monkeypatch.setattr(Trainer, "run", planting)
    with pytest.raises(UserError, match=f"holds a symbolic link, {name} -> {victim}"):
        train(cfg_for(tmp_path), say=quiet)
    assert victim.read_text() == "precious\n"


# ---- one writer at a time ---------------------------------------------------------------------------


def test_a_second_lock_on_a_run_directory_is_refused_naming_the_holder(tmp_path):
    run = tmp_path / "run"
    first = run_lock.LocalLock(str(run))
    first.acquire()
    holder = json.loads((run / run_lock.LOCK_FILE).read_text())
    assert holder["pid"] == os.getpid() and holder["host"] == run_lock.HOST
    with pytest.raises(UserError) as refused:
        run_lock.LocalLock(str(run)).acquire()  # another open file: flock refuses it, even in this process
    assert str(refused.value) == (
        f"run_dir {str(run)!r} is in use by another tpu-llm process (host {run_lock.HOST}, pid {os.getpid()}, "
        f"since {holder['since']}); wait for it to finish or stop it, or use another --run_dir")
    with pytest.raises(UserError, match="is in use by another tpu-llm process"):
        run_lock.check_unlocked(str(run))  # the early check, which writes nothing
    first.release()
    assert (run / run_lock.LOCK_FILE).read_text() == ""  # nobody holds it: no holder named
    run_lock.check_unlocked(str(run))
    again = run_lock.LocalLock(str(run))
    again.acquire()
    again.release()


def test_one_process_may_open_its_run_directory_twice(tmp_path):
    """A notebook (or a test) builds a run, then trains it: the lock is per process."""
    one = run_lock.acquire(str(tmp_path / "run"))
    two = run_lock.acquire(str(tmp_path / "run"))
    run_lock.check_unlocked(str(tmp_path / "run"))
    two.release()
    one.check()
    one.release()
    assert (tmp_path / "run" / run_lock.LOCK_FILE).read_text() == ""


def start(log: Path, args: list[str], code: str | None = None, **env) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, *(["-c", code] if code else ["-m", "tpu_llm"]), *args], cwd=REPO,
                                env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1", **env},
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def wait_for(proc: subprocess.Popen, log: Path, text: str, seconds: float = 300) -> None:
    deadline = time.time() + seconds
    while text not in log.read_text():
        assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)


@pytest.mark.slow
def test_two_trainers_on_one_run_directory_the_second_is_refused_and_a_killed_one_leaves_no_lock(base, tmp_path):
    """Issue 28 #2: two `tpu-llm train` on one run_dir both exited 0, every step logged twice (or, with
    other settings, the first run's checkpoints silently replaced by the second's)."""
    run = tmp_path / "run"
    first = start(tmp_path / "first.log", train_args(base, run, 8), PAUSED, PAUSE_AT_CALL="2", PAUSE_UNTIL=str(tmp_path / "go"))
    try:
        wait_for(first, tmp_path / "first.log", "paused")  # it holds the lock, between steps 2 and 3
        second = subprocess.run([sys.executable, "-m", "tpu_llm", *train_args(base, run, 8), "--train.lr=1e-3"],
                                cwd=REPO, capture_output=True, text=True, timeout=300,
                                env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
        assert second.returncode == 2, second.stderr
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: run_dir {str(run)!r} is in use by another tpu-llm "
                                                       f"process (host {run_lock.HOST}, pid {first.pid}, since "), lines
        (tmp_path / "go").write_text("")
        assert first.wait(timeout=300) == 0, (tmp_path / "first.log").read_text()[-3000:]
    finally:
        first.kill()
    assert [m["step"] for m in metrics(run)] == [2, 4, 6, 8]  # each step once: the second run wrote nothing

    # a holder killed with SIGKILL (no clean-up at all): the kernel releases its lock
    killed = start(tmp_path / "killed.log", train_args(base, run, 12), PAUSED, PAUSE_AT_CALL="2", PAUSE_UNTIL=str(tmp_path / "never"))
    try:
        wait_for(killed, tmp_path / "killed.log", "paused")
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=60)
    finally:
        killed.kill()
    again = subprocess.run([sys.executable, "-m", "tpu_llm", *train_args(base, run, 12)], cwd=REPO,
                           capture_output=True, text=True, timeout=300, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert again.returncode == 0, again.stderr[-3000:]
    assert [m["step"] for m in metrics(run)] == [2, 4, 6, 8, 10, 12]


# ---- what a resume trusts --------------------------------------------------------------------------------


def test_an_edited_model_section_with_the_same_shapes_is_refused_on_resume(base, tmp_path, capsys):
    """Issue 28 #4: n_head 2 -> 4 in the run's config.yaml (the same tensor shapes) resumed silently with
    another model. Each checkpoint records the model section it was made with."""
    run = copy_of_straight(base, tmp_path)
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["model"]["n_head"] = 4
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    before = snapshot(run)
    capsys.readouterr()
    assert cli.main(["train", "--config", str(run / "config.yaml"), f"--run_dir={run}", "--train.steps=12"]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: checkpoint {run / 'checkpoints' / 'ckpt-8'} does not fit this model (it was made with "
                   "model.n_head=2, this config has 4): the model section changed since it was saved (an edited "
                   "config.yaml?); resume with the model section it was made with, or use another --run_dir\n"), err
    assert snapshot(run) == before
    assert cli.main(["generate", "--run_dir", str(run), "--max_new_tokens=2"]) == 2  # nor sampled from
    assert "it was made with model.n_head=2, this config has 4" in capsys.readouterr().err


def test_save_counter_and_unfinished_saves_on_resume(base, tmp_path):
    """Issue 28 #4: save_counter restarted at 0 after each resume; a `ckpt-N_temp/` left by a save killed
    with SIGKILL stayed forever. Only unrecorded ones inside checkpoints/ go."""
    run = copy_of_straight(base, tmp_path)
    ckpts = run / "checkpoints"
    for leftover in ("ckpt-10_temp", "ckpt-99_temp", "ckpt-8_temp"):  # ckpt-8 is recorded: its _temp is kept
        (ckpts / leftover).mkdir()
        (ckpts / leftover / "part-00000-of-00001.data-00000-of-00001").write_bytes(b"half")
    (ckpts / "notes_temp").mkdir()  # not a checkpoint's name
    (run / "ckpt-5_temp").mkdir()  # not inside checkpoints/
    said = []
    train(cfg_for(tmp_path, **{"train.steps": 12}), say=said.append)
    assert sorted(p.name for p in ckpts.iterdir() if p.is_dir()) == ["ckpt-8_temp", "notes_temp"]
    assert (run / "ckpt-5_temp").is_dir()
    assert f"warning   removed {ckpts / 'ckpt-10_temp'}, {ckpts / 'ckpt-99_temp'}: unfinished saves of a killed " \
           "run (no checkpoint state names them)" in said, said
    counts = {n: tf.train.load_checkpoint(str(ckpts / f"ckpt-{n}")).get_tensor(
        "save_counter/.ATTRIBUTES/VARIABLE_VALUE") for n in (4, 8, 12)}
    assert counts == {4: 1, 8: 2, 12: 3}  # the resumed run's save is the run's third


def test_a_checkpointer_without_the_model_section_reads_older_checkpoints(tmp_path):
    """A checkpoint written before the model section was recorded (or by `tpu-llm import`) resumes as before."""
    weights = tf.Variable([1.0, 2.0])
    Checkpointer(str(tmp_path / "run"), 2, weights=weights).save(3)
    from tpu_llm.config import load_config

    model = load_config(None, {}).model
    reader = Checkpointer(str(tmp_path / "run"), 2, model_config=model, weights=weights)
    assert reader.restore_latest().endswith("ckpt-3")
