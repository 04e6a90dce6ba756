"""Fault tolerance with real processes (`python -m tpu_llm ...`): SIGKILL mid-run, a kill during a save, a parameter-server worker and ps task killed, a multi-worker peer preempted and killed.

The processes of a test run side by side where they do not depend on each other. Time limits here are
hang guards for behaviour ("exits within the timeout"), not speed measurements.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from helpers import write_corpus

from tpu_llm.parallel import launch

pytestmark = pytest.mark.slow  # training processes, killed and restarted

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1"}
HANG = 300  # seconds: a process still running after this failed the test
TINY = ["--model.n_layer=2", "--model.n_head=2", "--model.n_embd=32", "--model.max_len=32", "--model.dropout=0.1",
        "--data.seq_len=16",
        "--data.shuffle_buffer=64", "--train.warmup_steps=1", "--train.eval_every=0", "--train.eval_steps=2",
        "--sample.num_samples=0",
        "--execution=graph"]  # what is tested is the processes' fate, not XLA: its compile cost ~6 s a process

# Dies the moment it records checkpoint STEP in the state file: the checkpoint's files are written,
# the run does not name it yet (TF writes the state file last; tpu_llm.checkpoint.Checkpointer).
KILL_IN_SAVE = """
import os, signal, sys
from tensorflow.python.checkpoint import checkpoint_management as cm
record = cm.update_checkpoint_state_internal
def dying(save_dir, model_checkpoint_path, *args, **kwargs):
    if model_checkpoint_path.endswith("ckpt-" + os.environ["KILL_AT_SAVE"]):
        os.kill(os.getpid(), signal.SIGKILL)
    return record(save_dir, model_checkpoint_path, *args, **kwargs)
cm.update_checkpoint_state_internal = dying
from tpu_llm.cli import main
sys.exit(main(sys.argv[1:]))
"""


class Proc:
    """A `python -m tpu_llm` (or `python -c`) process with its output in a file."""

    def __init__(self, log: Path, args: list[str], code: str | None = None, env: dict | None = None):
        self.log = log
        prefix = ["-c", code] if code else ["-m", "tpu_llm"]
        with open(log, "w") as out:
            self.proc = subprocess.Popen([sys.executable, *prefix, *args], cwd=REPO, env={**ENV, **(env or {})},
                                         stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    @property
    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, predicate, what: str) -> str:
        deadline = time.time() + HANG
        while time.time() < deadline:
            text = self.text
            if predicate(text):
                return text
            assert self.proc.poll() is None, f"exited ({self.proc.returncode}) before {what}:\n{text[-3000:]}"
            time.sleep(0.05)
        raise AssertionError(f"no {what} after {HANG} s:\n{self.text[-3000:]}")

    def wait(self) -> int:
        try:
            return self.proc.wait(timeout=HANG)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"still running after {HANG} s:\n{self.text[-3000:]}") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def procs():
    started: list[Proc] = []
    yield started
    for p in started:  # only our own processes, if a failure left any running
        p.kill()


def steps_logged(run_dir: Path) -> dict[int, float]:
    """step -> training loss, the last line logged for each step (a killed run logs some twice)."""
    return {m["step"]: m["loss"] for m in map(json.loads, open(run_dir / "metrics.jsonl")) if m["split"] == "train"}


def checkpoint_tensors(path: str) -> dict[str, np.ndarray]:
    """Everything a checkpoint holds: weights, optimizer state and step, RNG state, data position."""
    reader = tf.train.load_checkpoint(path)
    skip = ("_CHECKPOINTABLE_OBJECT_GRAPH", "save_counter/.ATTRIBUTES/VARIABLE_VALUE")  # saves by this process
    names = [n for n in reader.get_variable_to_shape_map() if n not in skip]
    assert len(names) > 30 and "data_position/.ATTRIBUTES/VARIABLE_VALUE" in names
    return {n: reader.get_tensor(n) for n in names}


def last_line(text: str, prefix: str) -> str:
    found = [line for line in text.splitlines() if line.startswith(prefix)]
    assert found, f"no line starting with {prefix!r}:\n{text[-3000:]}"
    return found[-1]


def progress_step(text: str) -> int:
    lines = [line for line in text.splitlines() if line.startswith("step ")]
    return int(lines[-1].split()[1].split("/")[0]) if lines else -1


# ---- one process: SIGKILL, kill during a save, SIGTERM --------------------------------------------


def test_runs_killed_mid_run_or_mid_save_resume_to_exactly_the_uninterrupted_result(tmp_path, procs):
    write_corpus(tmp_path / "corpus")
    common = [f"--data.train={tmp_path / 'corpus' / '*.txt'}", *TINY, "--train.batch_size=4", "--train.steps=200",
              "--train.steps_per_loop=4", "--checkpoint.every_steps=40"]

    def run(name, code=None, env=None):
        procs.append(Proc(tmp_path / f"{name}.log", ["train", f"--run_dir={tmp_path / name}", *common], code, env))
        return procs[-1]

    straight, killed = run("straight"), run("killed")
    in_save = run("in-save", code=KILL_IN_SAVE, env={"KILL_AT_SAVE": "80"})  # dies saving ckpt-80
    # SIGKILL at a step after the first checkpoint, drawn from a fixed seed so that a failure repeats
    kill_after = random.Random(21).randrange(44, 160, 4)
    killed.wait_for(lambda text: progress_step(text) >= kill_after, f"step {kill_after}")
    killed.kill()
    # the kill landed mid-run (not after a fast run had finished): the newest checkpoint is before the end
    assert killed.proc.returncode == -signal.SIGKILL, killed.text
    newest = tf.train.latest_checkpoint(str(tmp_path / "killed" / "checkpoints"))
    killed_at = int(newest.rsplit("-", 1)[1])
    assert 40 <= killed_at < 200 and progress_step(killed.text) < 200, (newest, killed.text[-2000:])
    assert in_save.wait() == -signal.SIGKILL, in_save.text
    assert (tmp_path / "in-save" / "checkpoints" / "ckpt-80.index").exists()  # written, but not recorded:
    assert tf.train.latest_checkpoint(str(tmp_path / "in-save" / "checkpoints")).endswith("ckpt-40")

    resumed = {"killed": run("killed"), "in-save": run("in-save")}  # the same command again
    for name, p in resumed.items():
        assert p.wait() == 0, p.text
        assert "(data position restored)" in p.text and "resumed   from" in p.text, p.text
    assert "ckpt-40 at step 40 (data position restored)" in resumed["in-save"].text
    assert f"ckpt-{killed_at} at step {killed_at} (data position restored)" in resumed["killed"].text
    assert straight.wait() == 0, straight.text

    reference = steps_logged(tmp_path / "straight")
    final = checkpoint_tensors(str(tmp_path / "straight" / "checkpoints" / "ckpt-200"))
    for name in resumed:
        assert steps_logged(tmp_path / name) == reference, name  # every step's loss, the redone ones too
        mine = checkpoint_tensors(str(tmp_path / name / "checkpoints" / "ckpt-200"))
        assert mine.keys() == final.keys()
        for key in final:  # weights, optimizer moments and step, RNG and data position: bit for bit
            np.testing.assert_array_equal(mine[key], final[key], err_msg=f"{name}: {key}")


# ---- parameter server: a worker killed, then a ps task --------------------------------------------


def chief_step(text: str) -> int:
    lines = [line for line in text.splitlines() if line.startswith("[chief 0] step ")]
    return int(lines[-1].split()[3].split("/")[0]) if lines else -1


def test_parameter_server_training_survives_a_lost_worker_and_stops_cleanly_without_workers_or_ps(tmp_path, procs):
    write_corpus(tmp_path / "corpus")
    common = ["train", f"--run_dir={tmp_path / 'run'}", f"--data.train={tmp_path / 'corpus' / '*.txt'}", *TINY,
              "--train.batch_size=8", "--train.steps_per_loop=2", "--checkpoint.every_steps=10",
              "--cluster.timeout_seconds=5"]  # how long the chief waits for a worker to answer again

    def cluster(name, steps):
        procs.append(Proc(tmp_path / f"{name}.log", ["launch", "--workers", "2", "--ps", "1", "--", *common,
                                                      f"--train.steps={steps}"]))
        return procs[-1]

    def pids(text):
        line = next(line for line in text.splitlines() if line.startswith("launch    pids "))
        return dict(item.split("=") for item in line[len("launch    pids "):].split(", "))

    def errors(text):
        return [line for line in text.splitlines() if line.startswith("[chief 0] error: ")]

    first = cluster("first", 4000)  # one worker killed: the other goes on; then the last one: the chief stops
    text = first.wait_for(lambda t: "[chief 0] step" in t, "the chief's first steps")
    os.kill(int(pids(text)["worker 1"]), signal.SIGKILL)
    killed_at = chief_step(first.wait_for(lambda t: "launch    worker 1 exited" in t, "worker 1's end"))
    assert "launch    worker 1 exited with status -9; the chief's coordinator goes on" in first.text
    first.wait_for(lambda t: chief_step(t) >= killed_at + 20, "steps with one worker left")
    os.kill(int(pids(text)["worker 0"]), signal.SIGKILL)
    lost = time.monotonic()
    assert first.wait() == 4, first.text[-5000:]
    assert time.monotonic() - lost < 60, "the chief did not notice that no worker was left"
    assert "launch    worker 0 exited with status -9: no worker is left; the chief stops (exit 4)" in first.text
    latest = tf.train.latest_checkpoint(str(tmp_path / "run" / "checkpoints"))
    [error] = errors(first.text)
    assert "the cluster lost worker 0, worker 1 (UnavailableError: no worker is left to run steps)" in error, error
    assert error.endswith(f"every task stops; restart the whole job with the same command to resume from {latest}")

    second = cluster("second", 4000)  # resumes; then its ps task is killed
    text = second.wait_for(lambda t: "[chief 0] step" in t, "the chief's first steps")
    assert f"resumed   from {latest} at step {latest.rsplit('-', 1)[1]}" in text
    os.kill(int(pids(text)["ps 0"]), signal.SIGKILL)
    assert second.wait() == 4, second.text[-5000:]
    [error] = errors(second.text)
    assert "the cluster lost ps 0" in error, second.text[-5000:]
    assert "every task stops; restart the whole job with the same command to resume from " in error


# ---- multi-worker: a peer preempted, then a peer killed -------------------------------------------


def test_multi_worker_preemption_saves_on_every_worker_and_a_dead_peer_stops_the_others(tmp_path, procs):
    write_corpus(tmp_path / "corpus")
    cluster = launch.cluster_spec(2)
    timeout = 60
    args = ["train", f"--run_dir={tmp_path / 'run'}", f"--data.train={tmp_path / 'corpus' / '*.txt'}", *TINY,
            "--train.batch_size=8", "--train.steps=1000", "--train.steps_per_loop=2", "--checkpoint.every_steps=0",
            f"--cluster.timeout_seconds={timeout}"]

    def workers(name):
        started = [Proc(tmp_path / f"{name}-{i}.log", args, env={"TF_CONFIG": launch.tf_config(cluster, "worker", i)})
                   for i in range(2)]
        procs.extend(started)
        return started

    chief, other = workers("first")
    chief.wait_for(lambda t: progress_step(t) >= 2, "training")
    other.proc.send_signal(signal.SIGTERM)  # preempt the non-chief: both save at the same step and stop
    assert other.wait() == 143 and chief.wait() == 143, chief.text[-3000:] + other.text[-3000:]
    lines = [last_line(p.text, "stopped:") for p in (chief, other)]
    step = int(lines[0].split("at step ")[1].split(":")[0])
    ckpt = tmp_path / "run" / "checkpoints" / f"ckpt-{step}"
    assert all(line == f"stopped: SIGTERM on a worker of the cluster at step {step}: every worker saved {ckpt}; "
                       "run the same command on every worker to resume" for line in lines), lines
    assert tf.train.latest_checkpoint(str(ckpt.parent)) == str(ckpt)

    chief, other = workers("second")  # the same command resumes; then a worker dies
    chief.wait_for(lambda t: progress_step(t) > step, "training after the resume")
    assert f"resumed   from {ckpt} at step {step} (data position restored)" in chief.text
    other.kill()
    killed = time.monotonic()
    assert chief.wait() == 4, chief.text[-3000:]
    assert time.monotonic() - killed < timeout, "the surviving worker did not stop within cluster.timeout_seconds"
    error = last_line(chief.text, "error:")
    assert error.startswith("error: worker 0 of 2 workers: the cluster lost worker 1 ("), error
    assert error.endswith(f"every task stops; restart the whole job with the same command to resume from {ckpt}")
