"""Fault tolerance in one process: exact resume (dropout RNG included), corrupt checkpoints, the
divergence guard, stopping at a step boundary, failed saves, and bad input leaving the run directory
untouched. Killed processes and lost cluster tasks: tests/test_fault_processes.py."""

import hashlib
import json
import os
import signal
import threading
import time

import numpy as np
import pytest
import tensorflow as tf
from conftest import tiny_config, write_corpus

from tpu_llm import cli, fault
from tpu_llm.controller import build_run, train
from tpu_llm.errors import RunStopped, UserError
from tpu_llm.train import Trainer


def quiet(*_):
    pass


def cfg_for(tmp_path, run="run", **overrides):
    return tiny_config(tmp_path, **{"run_dir": str(tmp_path / run), "train.steps": 8, "train.steps_per_loop": 2,
                                    "train.decay_steps": 8, "checkpoint.every_steps": 4, **overrides})


def weights(model):
    return [v.numpy() for v in model.weights]


def metrics(run_dir, split="train"):
    return [m for m in map(json.loads, open(run_dir / "metrics.jsonl")) if m["split"] == split]


def snapshot(root) -> dict:
    """Every file under `root` by content hash (and every directory)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        out.update({os.path.relpath(os.path.join(dirpath, d), root) + "/": "dir" for d in dirnames})
        for name in filenames:
            with open(os.path.join(dirpath, name), "rb") as f:
                out[os.path.relpath(os.path.join(dirpath, name), root)] = hashlib.sha256(f.read()).hexdigest()
    return out


# ---- exact resume ---------------------------------------------------------------------------------


def test_resume_with_dropout_is_exact_and_does_not_replay_the_stream(tmp_path):
    drop = {"model.dropout": 0.1}  # the dropout RNG state must be in the checkpoint too
    train(cfg_for(tmp_path, "straight", **drop), say=quiet)
    train(cfg_for(tmp_path, "resumed", **{**drop, "train.steps": 4}), say=quiet)
    lines = []
    train(cfg_for(tmp_path, "resumed", **drop), say=lines.append)
    assert any(line.startswith("resumed   from") and "ckpt-4 at step 4 (data position restored)" in line
               for line in lines), lines
    assert [m["loss"] for m in metrics(tmp_path / "resumed")] == [m["loss"] for m in metrics(tmp_path / "straight")]
    straight, resumed = build_run(cfg_for(tmp_path, "straight", **drop)), build_run(cfg_for(tmp_path, "resumed", **drop))
    assert len(resumed.checkpointer.held(resumed.resumed_from) & {"rng", "data_position"}) == 2
    for a, b in zip(weights(straight.model), weights(resumed.model)):
        np.testing.assert_array_equal(a, b)


# ---- corrupt checkpoints --------------------------------------------------------------------------


def test_a_corrupt_newest_checkpoint_is_skipped_for_the_previous_one(tmp_path):
    train(cfg_for(tmp_path, "straight"), say=quiet)
    train(cfg_for(tmp_path), say=quiet)
    ckpts = tmp_path / "run" / "checkpoints"
    data_file = ckpts / "ckpt-8.data-00000-of-00001"
    data_file.write_bytes(data_file.read_bytes()[:100])  # truncated, as by a disk or copy failure
    lines = []
    train(cfg_for(tmp_path), say=lines.append)  # resumes from ckpt-4 and trains steps 5-8 again
    warning = next(line for line in lines if line.startswith("warning"))
    assert f"checkpoint {ckpts / 'ckpt-8'} cannot be read" in warning and f"resumed from {ckpts / 'ckpt-4'}" in warning
    assert any(line.startswith("resumed   from") and "ckpt-4 at step 4" in line for line in lines)
    for a, b in zip(weights(build_run(cfg_for(tmp_path, "straight")).model), weights(build_run(cfg_for(tmp_path)).model)):
        np.testing.assert_array_equal(a, b)  # and then it ends exactly where an uninterrupted run does

    (ckpts / "checkpoint").write_text("garbage {")  # an unreadable state file: the files themselves are used
    run = build_run(cfg_for(tmp_path))
    assert run.resumed_from == str(ckpts / "ckpt-8") and "state file" in run.checkpointer.notes[0]

    for index in ckpts.glob("*.index"):  # nothing readable: an error, and nothing is touched
        index.write_bytes(b"not an index")
    before = snapshot(tmp_path / "run")
    with pytest.raises(UserError, match="no checkpoint in .* can be read"):
        train(cfg_for(tmp_path), say=quiet)
    assert snapshot(tmp_path / "run") == before


# ---- divergence guard -----------------------------------------------------------------------------


@pytest.fixture
def poison(monkeypatch):
    """poison(*steps): the loss and gradients become NaN at those optimizer steps (0-based), once each
    (a rolled-back run passes the same step number again)."""
    armed = tf.Variable(tf.zeros([64], tf.int32), trainable=False)
    original = Trainer._loss_and_grads_fn

    def loss_and_grads(self, inputs, targets):
        loss, grads = original(self, inputs, targets)
        step = tf.cast(self.optimizer.iterations, tf.int32)
        bad = tf.gather(armed, step) > 0
        armed.scatter_nd_update([[step]], [0])  # after the read (TF orders ops on a variable as written)
        nan = tf.constant(float("nan"))
        return tf.where(bad, nan, loss), [tf.where(bad, nan, g) for g in grads]

    monkeypatch.setattr(Trainer, "_loss_and_grads_fn", loss_and_grads)
    return lambda *steps: [armed[s].assign(1) for s in steps]


def test_a_non_finite_step_is_skipped_and_not_applied(tmp_path, poison):
    train(cfg_for(tmp_path, "clean", **{"train.steps": 3}), say=quiet)  # steps 1-3
    poison(3)  # the 4th step
    lines = []
    summary = train(cfg_for(tmp_path, **{"train.steps": 4}), say=lines.append)
    assert any("1 step(s) up to step 4 had a non-finite loss or gradient (first: step 4)" in line for line in lines)
    [event] = metrics(tmp_path / "run", "bad_steps")
    assert event["first_bad_step"] == 4 and event["action"] == "skip" and np.isfinite(summary["train_loss"])
    run, clean = build_run(cfg_for(tmp_path, **{"train.steps": 4})), build_run(cfg_for(tmp_path, "clean"))
    assert int(run.optimizer.iterations.numpy()) == 4  # the step counted (its batch was consumed) ...
    for a, b in zip(weights(run.model), weights(clean.model)):
        np.testing.assert_array_equal(a, b)  # ... but changed nothing: the weights of 3 clean steps


def test_too_many_non_finite_steps_stop_the_run_naming_the_last_good_checkpoint(tmp_path, poison):
    poison(4, 5)  # steps 5 and 6, in one host call
    cfg = cfg_for(tmp_path, **{"train.max_bad_steps": 1, "checkpoint.every_steps": 2})
    with pytest.raises(RunStopped) as stopped:
        train(cfg, say=quiet)
    ckpt = tmp_path / "run" / "checkpoints" / "ckpt-4"
    assert stopped.value.exit_code == fault.EXIT_DIVERGED == 3
    assert str(stopped.value).startswith("step 5: non-finite loss or gradient on 2 step(s), more than "
                                         "train.max_bad_steps=1")
    assert f"the last good checkpoint is {ckpt} (step 4)" in str(stopped.value)
    assert sorted(p.name for p in ckpt.parent.glob("*.index")) == ["ckpt-2.index", "ckpt-4.index"]


def test_rollback_restores_the_newest_checkpoint_and_skips_the_bad_batches(tmp_path, poison):
    poison(5)  # step 6, in the call that runs steps 5-6
    lines = []
    summary = train(cfg_for(tmp_path, **{"train.on_bad_step": "rollback", "checkpoint.every_steps": 2}),
                    say=lines.append)
    ckpt = tmp_path / "run" / "checkpoints" / "ckpt-4"
    assert any(f"rolled back to {ckpt}, continuing with the batches after the bad ones" in line for line in lines)
    assert summary["step"] == 8 and np.isfinite(summary["train_loss"])
    assert [m["step"] for m in metrics(tmp_path / "run")] == [2, 4, 6, 6, 8]  # 5-6 trained again, on new batches
    [event] = metrics(tmp_path / "run", "bad_steps")
    assert event["action"] == "rollback" and event["step"] == 4


# ---- stopping at a step boundary ------------------------------------------------------------------


def test_the_stop_flag_ends_a_host_call_at_the_next_step(tmp_path):
    run = build_run(cfg_for(tmp_path))
    run.trainer.stop_flag = tf.Variable(1)
    assert run.trainer.run(run.train_iterator, 6, 6)["steps"] == 0  # set before the call: no step runs
    assert int(run.optimizer.iterations.numpy()) == 0
    run.trainer.stop_flag.assign(0)
    assert run.trainer.run(run.train_iterator, 6, 6)["steps"] == 6


def test_sigterm_stops_inside_the_host_call_and_saves_the_step_reached(tmp_path):
    def preempt_once_handled():  # SIGTERM to this process as soon as training has its handler
        for _ in range(12000):
            if signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None):
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.01)

    threading.Thread(target=preempt_once_handled, daemon=True).start()
    with pytest.raises(RunStopped) as stopped:  # one host call of 1000 steps: the signal lands inside it
        train(cfg_for(tmp_path, **{"train.steps": 2000, "train.steps_per_loop": 1000, "checkpoint.every_steps": 0}),
              say=quiet)
    step = int(str(stopped.value).split("at step ")[1].split(":")[0])
    ckpt = tmp_path / "run" / "checkpoints" / f"ckpt-{step}"
    assert stopped.value.exit_code == 143 and stopped.value.label == "stopped" and step < 1000
    assert str(stopped.value) == f"SIGTERM at step {step}: saved {ckpt}; run the same command to resume"
    assert tf.train.load_checkpoint(str(ckpt)).get_tensor("optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE") == step
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is gone after the run


# ---- failed saves and bad input -------------------------------------------------------------------


def test_a_failed_save_leaves_the_checkpoints_as_they_were(tmp_path, monkeypatch):
    train(cfg_for(tmp_path, **{"train.steps": 4}), say=quiet)
    ckpts = tmp_path / "run" / "checkpoints"
    before = snapshot(ckpts)
    real_save = tf.train.CheckpointManager.save

    def disk_full(self, checkpoint_number=None, **kwargs):  # a part-written checkpoint, then ENOSPC
        (ckpts / f"ckpt-{checkpoint_number}_temp").mkdir()
        (ckpts / f"ckpt-{checkpoint_number}_temp" / "part-00000-of-00001.data-00000-of-00001").write_bytes(b"x")
        (ckpts / f"ckpt-{checkpoint_number}.index").write_bytes(b"half")
        raise tf.errors.ResourceExhaustedError(None, None, f"ckpt-{checkpoint_number}.index; No space left on device")

    monkeypatch.setattr(tf.train.CheckpointManager, "save", disk_full)
    with pytest.raises(UserError) as error:
        train(cfg_for(tmp_path), say=quiet)
    assert str(error.value) == (f"saving checkpoint ckpt-8 in {ckpts} failed (ckpt-8.index; No space left on "
                                f"device); the newest usable checkpoint is {ckpts / 'ckpt-4'}; free space or fix "
                                "permissions in the run directory, then run the same command to resume")
    assert snapshot(ckpts) == before
    monkeypatch.setattr(tf.train.CheckpointManager, "save", real_save)
    assert build_run(cfg_for(tmp_path)).resumed_from == str(ckpts / "ckpt-4")


@pytest.fixture(scope="module")
def made_run(tmp_path_factory):
    """A trained run directory (2 steps), copied by each bad-input case."""
    tmp = tmp_path_factory.mktemp("made")
    cfg = tiny_config(tmp, **{"train.steps": 2})
    train(cfg, say=quiet)
    return tmp


def _write(path, content: bytes) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    return str(path)


BAD_INPUT = [  # (case, extra command-line flags, the start of the one error line)
    ("unknown key", ["--model.n_layr=3"], "error: command line: unknown config key 'model.n_layr'; did you mean "
                                         "'model.n_layer'?"),
    ("wrong type", ["--train.steps=many"], "error: command line: 'train.steps' must be int, got 'many'"),
    ("impossible shape", ["--model.n_head=3"], "error: config: model.n_embd=32 is not divisible by model.n_head=3"),
    ("window longer than the context", ["--data.seq_len=64"], "error: config: data.seq_len=64 exceeds model.max_len=32"),
    ("batch that does not split", ["--cpu_devices=3", "--train.batch_size=4"],
     "error: train.batch_size=4 does not split evenly into 3 replica(s)"),
    ("missing data", ["--data.train={tmp}/nothing/*.txt"], "error: data.train: no files match"),
    ("empty data", ["--data.train={empty}"], "error: data.train: every file matching"),
    ("binary data", ["--data.train={binary}"], "error: data.train: {binary} looks binary (NUL bytes)"),
    ("non-UTF-8 data", ["--data.train={latin1}"], "error: data.train: {latin1} is not UTF-8 text (byte 0xe9"),
    ("another model's run directory", ["--model.n_layer=3"],
     "error: run_dir '{run}' holds a run made with model.n_layer=2 (this config has 3)"),
    ("another tokenizer", ["--data.tokenizer=char"], "error: run_dir '{run}' was trained with data.tokenizer=byte"),
    ("read-only run directory", [], "error: run_dir '{run}' is not writable ("),
    ("full disk", [], "error: run_dir '{run}' is not writable (No space left on device)"),
    ("unreachable bucket", ["--run_dir=gs://tpu-llm-test-no-such-bucket-0/run"],
     "error: run_dir 'gs://tpu-llm-test-no-such-bucket-0/run' cannot be reached ("),
]


@pytest.mark.parametrize("case, flags, message", BAD_INPUT, ids=[c[0] for c in BAD_INPUT])
def test_bad_input_is_one_line_exit_2_and_the_run_directory_is_untouched(case, flags, message, made_run, tmp_path,
                                                                         monkeypatch, capsys):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(made_run / "run", run)
    paths = {"tmp": tmp_path, "run": run, "empty": _write(tmp_path / "e" / "empty.txt", b""),
             "binary": _write(tmp_path / "b" / "x.bin", b"\x00\x01\x02" * 50),
             "latin1": _write(tmp_path / "l" / "x.txt", "café crème\n".encode("latin-1") * 5)}
    args = ["train", f"--run_dir={run}", f"--data.train={made_run / 'corpus' / '*.txt'}",
            *(f"--{k}={v}" for k, v in (("model.n_layer", 2), ("model.n_head", 2), ("model.n_embd", 32),
                                        ("model.max_len", 32), ("data.seq_len", 16), ("train.batch_size", 4),
                                        ("train.steps", 4), ("sample.num_samples", 0))),
            *(flag.format(**paths) for flag in flags)]
    monkeypatch.setenv("NO_GCE_CHECK", "true")  # TF's gs:// client: no metadata-server probe for credentials
    read_only = case == "read-only run directory" and os.geteuid() != 0  # root writes anyway: refused below
    if read_only:
        os.chmod(run, 0o555)
    elif case in ("read-only run directory", "full disk"):
        _refuse_writes(run, monkeypatch, "Permission denied" if case.startswith("read") else "No space left on device")
    before = snapshot(run)
    capsys.readouterr()
    try:
        assert cli.main(args) == 2
    finally:
        if read_only:
            os.chmod(run, 0o755)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(message.format(**paths)), err
    assert "Traceback" not in err
    monkeypatch.undo()
    assert snapshot(run) == before and len(before) > 5


def _refuse_writes(run_dir, monkeypatch, reason: str) -> None:
    """Writes into `run_dir` fail with `reason`, raised by TensorFlow's file layer as a read-only (for
    root, who may write anyway) or full disk makes it fail."""
    real = tf.io.gfile.GFile

    class Refusing(real):
        def __init__(self, name, mode="r"):
            if ("w" in mode or "a" in mode) and str(name).startswith(str(run_dir)):
                if reason == "Permission denied":
                    raise tf.errors.PermissionDeniedError(None, None, f"{name}; {reason}")
                raise OSError(28, reason)
            super().__init__(name, mode)

    monkeypatch.setattr(tf.io.gfile, "GFile", Refusing)


def test_stop_signals_restore_the_handlers_they_replaced():
    before = signal.getsignal(signal.SIGINT)
    with fault.StopSignals(tf.Variable(0)) as signals:
        assert signal.getsignal(signal.SIGINT) == signals._handle
    assert signal.getsignal(signal.SIGINT) == before
