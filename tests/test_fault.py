"""Fault tolerance in one process: corrupt checkpoints (and exact resume past them, dropout RNG and
data position included; those kept by the hour as a fallback), the divergence guard (and its step's
structure: no tf.cond around the optimizer's update, as TPUStrategy needs), SIGTERM, time-based
checkpoints and a failed save (also a worker's, which leaves the chief's checkpoints alone), and bad
input leaving the run directory untouched. Killed processes (also while saving) and lost cluster
tasks: test_fault_processes.py.

Most tests start from `base`, one uninterrupted run shared by the module, and compare with it."""

import os
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import metrics, quiet, snapshot, tiny_config

from tpu_llm import cli
from tpu_llm.config import load_config
from tpu_llm.errors import RunStopped, UserError
from tpu_llm.model import GPT
from tpu_llm.parallel.distribute import get_strategy
from tpu_llm.training import fault
from tpu_llm.training.checkpoint import Checkpointer, scratch_directory
from tpu_llm.training.controller import train
from tpu_llm.training.optimizer import make_optimizer
from tpu_llm.training.trainer import Trainer


def cfg_for(root, run="run", **overrides):
    """The tiny run of these tests (dropout on: its RNG state must survive a resume too), in root/run. Its
    step runs as a TF graph: what these tests check (checkpoints, signals, saves) does not depend on XLA,
    whose compile cost seconds per run; the divergence guard's tests, whose skip happens inside the
    step, keep XLA."""
    return tiny_config(root, **{"run_dir": str(root / run), "model.dropout": 0.1, "train.steps": 8,
                                "train.steps_per_loop": 2, "train.decay_steps": 8, "checkpoint.every_steps": 4,
                                "execution": "graph", **overrides})


WEIGHTS = ("model/", "optimizer/_trainable_variables/")  # TF names each variable by one path to it
ADAM = ("optimizer/_variables/",)  # the moments


def saved(path, *prefixes: str) -> dict:
    """What checkpoint `path` holds (weights, optimizer, RNG, data position), by name; or the names
    starting with `prefixes`."""
    reader = tf.train.load_checkpoint(str(path))
    return {n: reader.get_tensor(n) for n in reader.get_variable_to_shape_map()
            if n.startswith(prefixes or "") and n not in ("_CHECKPOINTABLE_OBJECT_GRAPH",
                                                          "save_counter/.ATTRIBUTES/VARIABLE_VALUE")}


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and len(a) > 10
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A directory with the corpus and `straight`: the tiny run, 8 steps uninterrupted (ckpt-4, ckpt-8)."""
    root = tmp_path_factory.mktemp("fault")
    train(cfg_for(root, "straight"), say=quiet)
    return root


def copy_of_straight(base, tmp_path):
    import shutil

    shutil.copytree(base / "straight", tmp_path / "run")
    return tmp_path / "run"


# ---- corrupt checkpoints --------------------------------------------------------------------------


def test_a_corrupt_newest_checkpoint_is_skipped_for_the_previous_one(base, tmp_path):
    run = copy_of_straight(base, tmp_path)
    ckpts = run / "checkpoints"
    data_file = ckpts / "ckpt-8.data-00000-of-00001"
    data_file.write_bytes(data_file.read_bytes()[:100])  # truncated, as by a disk or copy failure
    lines = []
    train(cfg_for(tmp_path), say=lines.append)  # resumes from ckpt-4 and trains steps 5-8 again
    warning = next((line for line in lines if line.startswith("warning")), lines)
    assert f"checkpoint {ckpts / 'ckpt-8'} cannot be read" in warning and f"resumed from {ckpts / 'ckpt-4'}" in warning
    assert f"resumed   from {ckpts / 'ckpt-4'} at step 4 (data position restored)" in lines
    assert_same(saved(ckpts / "ckpt-8"), saved(base / "straight" / "checkpoints" / "ckpt-8"))

    (ckpts / "checkpoint").write_text("garbage {")  # an unreadable state file: the files themselves are used
    checkpointer = Checkpointer(str(run), 3)
    assert checkpointer.candidates()[0] == str(ckpts / "ckpt-8") and "state file" in checkpointer.notes[0]

    for index in ckpts.glob("*.index"):  # nothing readable: an error, and nothing is touched
        index.write_bytes(b"not an index")
    before = snapshot(run)
    with pytest.raises(UserError, match="no checkpoint in .* can be read"):
        train(cfg_for(tmp_path), say=quiet)
    assert snapshot(run) == before


def test_checkpoints_kept_by_the_hour_are_tried_when_the_recorded_ones_cannot_be_read(tmp_path):
    """Issue 20 #5: TF leaves the checkpoints kept by keep_every_hours out of the state file; when
    the recorded ones cannot be read, the run resumes from the newest intact one of those."""
    run_dir = str(tmp_path / "run")
    step = tf.Variable(0)
    saver = Checkpointer(run_dir, 2, keep_every_hours=1e-9, step=step)
    for n in (10, 20, 30, 40):
        step.assign(n)
        saver.save(n)
    ckpts = tmp_path / "run" / "checkpoints"
    assert [os.path.basename(p) for p in saver.manager.checkpoints] == ["ckpt-30", "ckpt-40"]
    assert {p.name for p in ckpts.glob("*.index")} == {f"ckpt-{n}.index" for n in (10, 20, 30, 40)}
    for n in (30, 40):  # the recorded two: truncated data files
        data_file = next(ckpts.glob(f"ckpt-{n}.data-*"))
        data_file.write_bytes(data_file.read_bytes()[:5])
    before = snapshot(ckpts)
    step.assign(0)
    resumer = Checkpointer(run_dir, 2, keep_every_hours=1e-9, step=step)
    assert resumer.candidates() == [str(ckpts / f"ckpt-{n}") for n in (40, 30, 20, 10)]
    assert resumer.restore_latest() == str(ckpts / "ckpt-20") and int(step.numpy()) == 20
    assert [note.split(" cannot be read")[0] for note in resumer.notes] == \
        [f"checkpoint {ckpts / 'ckpt-40'}", f"checkpoint {ckpts / 'ckpt-30'}"]
    assert all(note.endswith(f"resumed from {ckpts / 'ckpt-20'} instead") for note in resumer.notes)
    assert snapshot(ckpts) == before


# ---- divergence guard -----------------------------------------------------------------------------


def test_non_finite_steps_are_skipped_then_stop_the_run_naming_the_last_good_checkpoint(tmp_path, poison):
    poison(3, 4, 5)  # steps 4, 5 and 6
    lines = []
    with pytest.raises(RunStopped) as stopped:  # a host call and a checkpoint after every step
        train(cfg_for(tmp_path, **{"train.max_bad_steps": 2, "train.steps_per_loop": 1, "checkpoint.every_steps": 1,
                                   "execution": "xla"}), say=lines.append)
    ckpts = tmp_path / "run" / "checkpoints"
    assert any("1 step(s) up to step 4 had a non-finite loss or gradient (first: step 4) and were not applied; "
               "1 of train.max_bad_steps=2 so far" in line for line in lines), lines
    assert [e["action"] for e in metrics(tmp_path / "run", "bad_steps")] == ["skip", "skip"]
    assert stopped.value.exit_code == fault.EXIT_DIVERGED == 3 and stopped.value.label == "error"
    assert str(stopped.value).startswith("step 6: non-finite loss or gradient on 3 step(s), more than "
                                         f"train.max_bad_steps=2 (none of them was applied); the last good "
                                         f"checkpoint is {ckpts / 'ckpt-5'} (step 5);")
    assert not (ckpts / "ckpt-6.index").exists()
    # the skipped steps counted (their batches were used) but changed nothing: the weights and Adam
    # moments after steps 4 and 5 are those after step 3
    assert saved(ckpts / "ckpt-5", "optimizer/_iter")["optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE"] == 5
    for step in (4, 5):
        assert_same(saved(ckpts / f"ckpt-{step}", *WEIGHTS, *ADAM), saved(ckpts / "ckpt-3", *WEIGHTS, *ADAM))


def test_rollback_restores_the_newest_checkpoint_and_skips_the_bad_batches(tmp_path, poison, monkeypatch):
    poison(5)  # step 6, in the call that runs steps 5-6
    after_call = fault.Guard.after_call

    def keep_state_after_rollback(guard, record):  # the weights and moments just after the rollback
        back = after_call(guard, record)
        if back.step < record.step:
            tf.train.Checkpoint(model=guard.run.model, optimizer=guard.run.optimizer).write(
                str(tmp_path / "rolled" / "state"))
        return back

    monkeypatch.setattr(fault.Guard, "after_call", keep_state_after_rollback)
    lines = []
    summary = train(cfg_for(tmp_path, **{"train.on_bad_step": "rollback", "checkpoint.every_steps": 2,
                                         "execution": "xla"}), say=lines.append)
    ckpt = tmp_path / "run" / "checkpoints" / "ckpt-4"
    assert any(f"rolled back to {ckpt}, continuing with the batches after the bad ones" in line for line in lines)
    assert summary["step"] == 8 and np.isfinite(summary["train_loss"])
    # 5-6 trained again, on new batches; the first try's entry was dropped (each step logged once)
    assert [m["step"] for m in metrics(tmp_path / "run")] == [2, 4, 6, 8]
    [event] = metrics(tmp_path / "run", "bad_steps")
    assert event["action"] == "rollback" and event["step"] == 4
    # what the rollback restored: exactly the checkpoint's weights, Adam moments and step counter
    assert_same(saved(tmp_path / "rolled" / "state", *WEIGHTS, *ADAM, "optimizer/_iter"),
                saved(ckpt, *WEIGHTS, *ADAM, "optimizer/_iter"))


SMALL = load_config(None, {"model.n_layer": 1, "model.n_head": 2, "model.n_embd": 16, "model.max_len": 16,
                           "data.seq_len": 16, "train.warmup_steps": 0, "train.weight_decay": 0.1})


def small_trainer(replicas: int):
    """A 1-layer model with the run's AdamW (weight decay on) under `replicas` replicas (1: the default
    strategy), and an iterator of its batches."""
    dist = get_strategy(load_config(None, {"cpu_devices": replicas, "strategy": "mirrored" if replicas > 1
                                           else "default"}))
    keras.utils.set_random_seed(0)
    with dist.strategy.scope():
        model = GPT(SMALL.model, 32).build_weights()
        optimizer = make_optimizer(SMALL.train, model)
    trainer = Trainer(dist, model, optimizer, SMALL.train, execution="graph")
    ids = tf.random.stateless_uniform([64, 17], [1, 2], maxval=32, dtype=tf.int32)
    data = tf.data.Dataset.from_tensor_slices((ids[:, :-1], ids[:, 1:])).batch(2 * replicas, drop_remainder=True)
    return trainer, iter(dist.distribute_dataset(lambda ctx: data.repeat()))


def replica_state(trainer) -> list:
    """Every replica's copy of every weight and AdamW moment."""
    return [c.numpy() for v in trainer.model.trainable_variables + trainer.optimizer.variables
            if v.dtype != "int64" for c in trainer.strategy.experimental_local_results(v.value)]


def _branch_writes(graph_def) -> list[str]:
    """Names of the functions, run as a branch of a tf.cond (If/StatelessIf), that assign a variable
    (directly or in a function they call)."""
    library = {f.signature.name: f for f in graph_def.library.function}

    def called(nodes):
        for node in nodes:
            if node.op in library:
                yield node.op
            for attr in node.attr.values():
                if attr.HasField("func"):
                    yield attr.func.name
                yield from (f.name for f in attr.list.func)

    def writes(name, seen):
        if name in seen or name not in library:
            return False
        seen.add(name)
        nodes = library[name].node_def
        return any(n.op.startswith(("Assign", "ResourceApply")) for n in nodes) or \
            any(writes(f, seen) for f in called(nodes))

    branches = set()
    for nodes in [graph_def.node] + [f.node_def for f in library.values()]:
        for node in nodes:
            if node.op in ("If", "StatelessIf"):
                branches |= {node.attr["then_branch"].func.name, node.attr["else_branch"].func.name}
    return sorted(b for b in branches if writes(b, set()))


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_skipped_step_changes_no_weight_or_moment_counts_the_step_and_no_cond_wraps_the_update(replicas,
                                                                                             poison):
    """Issue 14: under TPUStrategy a tf.cond around the optimizer's update nests merge_calls in the
    replicate context; the guard now always calls the optimizer and selects. A skipped step leaves
    weights and both AdamW moments bit-identical on every replica and still counts the step."""
    trainer, batches = small_trainer(replicas)
    assert trainer.run(batches, 2, 2)["bad_steps"] == 0  # moments non-zero, weight decay at work
    before = replica_state(trainer)
    poison(2)  # the third step: non-finite loss and gradients
    out = trainer.run(batches, 1, 1)
    assert out["bad_steps"] == 1 and out["first_bad_step"] == 3
    assert int(trainer.optimizer.iterations.numpy()) == 3
    after = replica_state(trainer)
    assert len(after) == len(before) > 10
    for a, b in zip(before, after):
        assert a.tobytes() == b.tobytes()
    good = trainer.run(batches, 1, 1)  # and the next step is applied as usual
    assert good["bad_steps"] == 0 and np.isfinite(good["loss"])
    assert any(a.tobytes() != b.tobytes() for a, b in zip(after, replica_state(trainer)))
    graph = trainer.train_loop.get_concrete_function(batches, tf.constant(1)).graph.as_graph_def()
    assert _branch_writes(graph) == []


# ---- stopping at a step boundary ------------------------------------------------------------------


def test_sigterm_stops_inside_the_host_call_saves_and_the_same_command_resumes(tmp_path):
    def preempt_once_handled():  # SIGTERM to this process as soon as training has its handler
        for _ in range(12000):
            if signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None):
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.01)

    cfg = cfg_for(tmp_path, **{"train.steps": 600, "train.steps_per_loop": 300, "checkpoint.every_steps": 0})
    threading.Thread(target=preempt_once_handled, daemon=True).start()
    sent = time.monotonic()
    with pytest.raises(RunStopped) as stopped:  # a host call of 300 steps: the signal lands inside it
        train(cfg, say=quiet)
    print(f"SIGTERM to stopped: {time.monotonic() - sent:.1f} s")
    step = int(str(stopped.value).split("at step ")[1].split(":")[0])
    ckpt = tmp_path / "run" / "checkpoints" / f"ckpt-{step}"
    assert stopped.value.exit_code == 143 and stopped.value.label == "stopped" and step < 300
    assert str(stopped.value) == f"SIGTERM at step {step}: saved {ckpt}; run the same command to resume"
    assert saved(ckpt, "optimizer/_iter")["optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE"] == step
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is gone after the run
    lines = []
    assert train(cfg, say=lines.append)["step"] == 600
    assert f"resumed   from {ckpt} at step {step} (data position restored)" in lines


def test_a_signal_before_the_first_resumed_step_keeps_the_checkpoint_and_its_data_position(base, tmp_path,
                                                                                             monkeypatch):
    """A SIGTERM while the first resumed host call compiles (no step done yet) must not save the step
    resumed from again: the position variable holds zeros until a step writes it, and that save
    replaced the checkpoint's data position with the start of the stream."""
    run = copy_of_straight(base, tmp_path)  # ckpt-4, ckpt-8
    ckpts = run / "checkpoints"
    before = snapshot(ckpts)
    position = saved(ckpts / "ckpt-8", "data_position")
    assert len(position) == 1 and next(iter(position.values())).any()
    real_run = Trainer.run

    def signalled_while_compiling(self, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # the handler sets the stop flag; no step runs
        return real_run(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "run", signalled_while_compiling)
    cfg = cfg_for(tmp_path, **{"train.steps": 12, "train.decay_steps": 12})
    with pytest.raises(RunStopped) as stopped:
        train(cfg, say=quiet)
    assert str(stopped.value) == f"SIGTERM at step 8: saved {ckpts / 'ckpt-8'}; run the same command to resume"
    assert stopped.value.exit_code == 143
    assert snapshot(ckpts) == before  # not written again: data position, weights, state file as they were
    # (so the next resume continues exactly, as from any intact checkpoint: tests above)


# ---- failed saves and bad input -------------------------------------------------------------------


def test_time_based_checkpoints_and_a_failed_save_that_leaves_the_checkpoints_as_they_were(base, tmp_path,
                                                                                            monkeypatch):
    ckpts = copy_of_straight(base, tmp_path) / "checkpoints"  # ckpt-4, ckpt-8
    real_save, before = tf.train.CheckpointManager.save, {}

    def disk_full_at_12(self, checkpoint_number=None, **kwargs):  # a part-written checkpoint, then ENOSPC
        if checkpoint_number != 12:
            return real_save(self, checkpoint_number=checkpoint_number, **kwargs)
        before.update(snapshot(ckpts))
        (ckpts / "ckpt-12_temp").mkdir()
        (ckpts / "ckpt-12_temp" / "part-00000-of-00001.data-00000-of-00001").write_bytes(b"x")
        (ckpts / "ckpt-12.index").write_bytes(b"half")
        raise tf.errors.ResourceExhaustedError(None, None, "{{function_node __wrapped__SaveV2_dtypes_95_device_/job:"
                                               f"localhost/replica:0/task:0/device:CPU:0}}}} {ckpts}/ckpt-12_temp/part-"
                                               "00000-of-00001.data-00000-of-00001.tempstate1; No space left on "
                                               "device [Op:SaveV2]")  # as TF words it

    monkeypatch.setattr(tf.train.CheckpointManager, "save", disk_full_at_12)
    cfg = cfg_for(tmp_path, **{"train.steps": 12, "checkpoint.every_steps": 0, "checkpoint.every_minutes": 1e-6,
                               "checkpoint.keep": 2, "checkpoint.keep_every_hours": 1e-6})
    with pytest.raises(UserError) as error:  # every host call (2 steps) is past the time: a save at 10, 12
        train(cfg, say=quiet)
    # issue 28 #4: the line named TF's internal function and never said the disk was full
    assert str(error.value) == (f"saving checkpoint ckpt-12 in {ckpts} failed: the disk is full (No space left on "
                                f"device); earlier checkpoints are intact, the newest is {ckpts / 'ckpt-10'}; free "
                                "space on the run directory's disk, then run the same command to resume")
    assert snapshot(ckpts) == before  # the partial files are gone, the rest as it was
    # keep=2 names the newest two; ckpt-4, older, is kept for good (keep_every_hours)
    assert {p.name for p in ckpts.glob("*.index")} == {"ckpt-4.index", "ckpt-8.index", "ckpt-10.index"}
    assert [os.path.basename(p) for p in Checkpointer(str(tmp_path / "run"), 2).manager.checkpoints] == \
        ["ckpt-8", "ckpt-10"]


@pytest.mark.parametrize("error, exit_code", [(tf.errors.ResourceExhaustedError, 2), (tf.errors.UnavailableError, 4)],
                         ids=["disk full", "peer lost"])
def test_a_failed_save_on_a_worker_leaves_the_chiefs_checkpoints_alone(tmp_path, monkeypatch, error, exit_code):
    """Issue 20 #3: a non-chief's failed save removed the chief's ckpt-N files (it cleaned up the run's
    checkpoints/ instead of its own scratch directory); a peer lost during a save was exit 2 "free
    space or fix permissions" instead of a lost cluster task (exit 4). Issue 20 risk: the scratch
    directory was inside the run directory (written twice on gs://, left there by a killed worker)."""
    run_dir = str(tmp_path / "run")
    weights = tf.Variable([1.0, 2.0])
    chief = Checkpointer(run_dir, 3, cluster=True, weights=weights)
    worker = Checkpointer(run_dir, 3, scratch="worker-1-of-2", cluster=True, weights=weights)
    for step in (10, 20):  # every worker takes part in every save
        chief.save(step)
        worker.save(step)
    ckpts = tmp_path / "run" / "checkpoints"
    before = snapshot(ckpts)
    assert "ckpt-20.index" in before and not os.path.exists(worker.scratch)
    real_save = tf.train.CheckpointManager.save

    def fails_in_the_scratch_directory(self, checkpoint_number=None, **kwargs):
        if os.path.normpath(self.directory) != os.path.normpath(worker.scratch):
            return real_save(self, checkpoint_number=checkpoint_number, **kwargs)
        os.makedirs(os.path.join(self.directory, f"ckpt-{checkpoint_number}_temp"))  # part-written
        raise error(None, None, "while saving")

    monkeypatch.setattr(tf.train.CheckpointManager, "save", fails_in_the_scratch_directory)
    guard = SimpleNamespace(run=SimpleNamespace(dist=SimpleNamespace(task="worker 1 of 2", asynchronous=False),
                                                checkpointer=worker))
    with pytest.raises(UserError if exit_code == 2 else RunStopped) as raised:
        fault.Guard.call(guard, lambda: worker.save(20))  # as the training loop calls a save
    assert getattr(raised.value, "exit_code", 2) == exit_code
    if exit_code == 4:
        assert str(raised.value).startswith("worker 1 of 2: the cluster lost a task (UnavailableError: it cannot be "
                                            f"reached); every task stops; restart the whole job with the same "
                                            f"command to resume from {ckpts / 'ckpt-20'}")
    assert snapshot(ckpts) == before  # the chief's checkpoints and state file as they were
    assert not os.path.exists(worker.scratch)  # the worker's part-written save is gone
    # the scratch directory is on the worker's own disk, not in the (possibly gs://) run directory
    assert not worker.scratch.startswith(run_dir) and not list((tmp_path / "run").glob(".scratch-*"))
    os.makedirs(os.path.join(worker.scratch, "ckpt-30_temp"))  # a worker killed while saving leaves this:
    Checkpointer(run_dir, 3, scratch="worker-1-of-2", cluster=True, weights=weights)
    assert not os.path.exists(worker.scratch)  # removed when the worker starts again


def test_a_workers_scratch_directory_is_its_own_and_a_planted_link_is_never_followed(tmp_path, monkeypatch):
    """Issue 28 #4: a non-chief worker deleted a predictable /tmp/tpu-llm-scratch-<hash>-<worker> at start:
    a symbolic link planted there had another directory's contents deleted. Each save now writes into
    a new private directory (mkdtemp); leftovers of killed workers go only if they are real directories
    of this user, never through a link."""
    run_dir = str(tmp_path / "run")
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("precious")
    prefix = scratch_directory(run_dir, "worker-1-of-2")
    planted = [Path(prefix), Path(f"{prefix}-planted")]  # the old fixed name, and one the leftovers' pattern matches
    for link in planted:
        link.symlink_to(victim)
    try:
        weights = tf.Variable([1.0])
        worker = Checkpointer(run_dir, 3, scratch="worker-1-of-2", cluster=True, weights=weights)
        seen = []
        real_save = tf.train.CheckpointManager.save

        def watched(self, *args, **kwargs):
            seen.append((self.directory, os.stat(self.directory).st_mode & 0o777))
            return real_save(self, *args, **kwargs)

        monkeypatch.setattr(tf.train.CheckpointManager, "save", watched)
        worker.save(10)
        assert (victim / "keep.txt").read_text() == "precious" and all(link.is_symlink() for link in planted)
        assert len(seen) == 1 and seen[0][0].startswith(f"{prefix}-") and seen[0][1] == 0o700  # private, unpredictable
        assert not os.path.exists(seen[0][0])  # deleted straight after the save
    finally:
        for link in planted:
            link.unlink()


def test_out_of_memory_is_one_line_and_leaves_the_checkpoints_as_they_were(base, tmp_path, monkeypatch, capsys):
    run_dir = copy_of_straight(base, tmp_path)  # ckpt-4, ckpt-8
    before, calls, real_run = snapshot(run_dir / "checkpoints"), [], Trainer.run

    def second_call_runs_out_of_memory(self, *args, **kwargs):  # steps 8-10 train, 10-12 do not fit
        calls.append(int(self.optimizer.iterations.numpy()))
        if len(calls) == 2:
            raise tf.errors.ResourceExhaustedError(None, None, "Out of memory while trying to allocate 8.00G.\n"
                                                   "%fusion.12 = bf16[...] ... (a page of HLO)")
        return real_run(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "run", second_call_runs_out_of_memory)
    config = tmp_path / "c.yaml"
    config.write_text(cfg_for(tmp_path).to_yaml())
    code = cli.main(["train", "--config", str(config), "--train.steps=12", "--parallel.remat=false"])
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the progress bar's lines
    assert code == 2 and calls == [8, 10]
    assert err == (f"error: out of device memory training at step 10 (ResourceExhaustedError: Out of memory while "
                   f"trying to allocate 8.00G.); lower train.batch_size=4 (or raise train.grad_accum=1) or "
                   f"data.seq_len=16, set parallel.remat=true (recomputes activations), and check the fit first with "
                   f"`tpu-llm plan --accelerator ...`; the newest checkpoint, {run_dir / 'checkpoints' / 'ckpt-8'}, "
                   "is unchanged")
    assert snapshot(run_dir / "checkpoints") == before  # step 10's weights, never saved, are not saved now


def test_a_corrupt_record_in_a_shard_is_one_line_naming_it_and_leaves_the_checkpoints_as_they_were(tmp_path,
                                                                                                    capsys):
    """One flipped byte inside a TFRecord shard (its size unchanged, so meta.json's check passes): its
    record fails its checksum when the stream reaches it, mid-run, or in the check before the run."""
    from helpers import write_corpus

    from tpu_llm.data import prepare, sources
    from tpu_llm.tokenizers import ByteTokenizer

    files = write_corpus(tmp_path / "corpus", files=12)  # 12 records in 2 shards
    prepare.write_shards(sources.Source(files, "text"), ByteTokenizer(), str(tmp_path / "shards"), num_shards=2)
    shard, validation = sorted((tmp_path / "shards").glob("*.tfrecord"))
    original = shard.read_bytes()

    def flipped(at: int) -> None:
        damaged = bytearray(original)
        damaged[at] ^= 0x01
        shard.write_bytes(bytes(damaged))

    def train_(run_dir):
        capsys.readouterr()
        code = cli.main(["train", f"--run_dir={run_dir}", f"--data.train={shard}", f"--data.validation={validation}",
                         "--model.n_layer=1", "--model.n_head=2", "--model.n_embd=16", "--model.max_len=16",
                         "--data.seq_len=8", "--train.batch_size=16", "--train.steps=400", "--train.steps_per_loop=10",
                         "--checkpoint.every_steps=10", "--train.eval_every=0", "--sample.num_samples=0",
                         "--execution=graph"])
        return code, capsys.readouterr().err.strip().splitlines()[-1]  # after the progress bar's lines

    at = len(original) * 3 // 4  # in a record's data: the stream reaches it after some checkpoints
    flipped(at)
    code, err = train_(tmp_path / "run")
    checkpoints = tmp_path / "run" / "checkpoints"
    newest = tf.train.latest_checkpoint(str(checkpoints))
    assert code == 2 and newest, err
    assert err.startswith(f"error: training data ({shard}: 1 files): shard {shard} has a corrupt record at byte ")
    assert err.endswith("its checksum does not match, so the file was damaged on disk or in a copy; copy the shard "
                        "again, or re-run `tpu-llm data prepare` to write the shards anew; the newest checkpoint, "
                        f"{newest}, is unchanged: run the same command again to resume from it")
    offset = int(err.split("corrupt record at byte ")[1].split(":")[0].replace(",", ""))
    assert offset <= at < offset + 4096  # TensorFlow's offset: the start of the record's data
    before = snapshot(checkpoints)
    code, again = train_(tmp_path / "run")  # resumed, the stream reaches the same record again
    assert code == 2 and again == err and snapshot(checkpoints) == before

    flipped(0)  # the first record's length: read by the check before the run, which writes nothing
    code, err = train_(tmp_path / "new")
    assert code == 2 and not (tmp_path / "new").exists()
    assert err.startswith(f"error: training data ({shard}: 1 files): shard {shard} has a corrupt record at byte 0: ")
    assert err.endswith("re-run `tpu-llm data prepare` to write the shards anew")


def _write(path, content: bytes) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    return str(path)


BAD_INPUT = [  # (case, extra command-line flags, the start of the one error line)
    ("unknown key", ["--model.n_layr=3"], "error: tpu-llm train: unknown flag --model.n_layr; did you mean "
                                         "--model.n_layer?"),
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
    ("unknown bad-step action", ["--train.on_bad_step=retry"],
     "error: config: train.on_bad_step='retry'; valid choices: skip, rollback"),
    ("unreachable bucket", ["--run_dir=gs://tpu-llm-test-no-such-bucket-0/run"],
     "error: run_dir 'gs://tpu-llm-test-no-such-bucket-0/run' cannot be reached ("),
]


@pytest.mark.parametrize("case, flags, message", BAD_INPUT, ids=[c[0] for c in BAD_INPUT])
def test_bad_input_is_one_line_exit_2_and_the_run_directory_is_untouched(case, flags, message, base, tmp_path,
                                                                         monkeypatch, capsys):
    run = copy_of_straight(base, tmp_path)
    paths = {"tmp": tmp_path, "run": run, "empty": _write(tmp_path / "e" / "empty.txt", b""),
             "binary": _write(tmp_path / "b" / "x.bin", b"\x00\x01\x02" * 50),
             "latin1": _write(tmp_path / "l" / "x.txt", "café crème\n".encode("latin-1") * 5)}
    args = ["train", f"--run_dir={run}", f"--data.train={base / 'corpus' / '*.txt'}",
            *(f"--{k}={v}" for k, v in (("model.n_layer", 2), ("model.n_head", 2), ("model.n_embd", 32),
                                        ("model.max_len", 32), ("model.dropout", 0.1), ("data.seq_len", 16),
                                        ("train.batch_size", 4), ("train.steps", 12), ("sample.num_samples", 0))),
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


def test_an_empty_checkpoint_state_file_resumes_from_the_checkpoint_files(base, tmp_path, capsys):
    """What a power loss can leave (TF does not fsync the state file): an empty `checkpoint` file. It was
    a ValueError traceback (exit 1); the checkpoints are found by their files, with a warning."""
    run = copy_of_straight(base, tmp_path)
    (run / "checkpoints" / "checkpoint").write_text("")
    args = ["train", f"--run_dir={run}", f"--data.train={base / 'corpus' / '*.txt'}",
            *(f"--{k}={v}" for k, v in (("model.n_layer", 2), ("model.n_head", 2), ("model.n_embd", 32),
                                        ("model.max_len", 32), ("model.dropout", 0.1), ("data.seq_len", 16),
                                        ("data.shuffle_buffer", 64), ("train.batch_size", 4), ("train.steps", 10),
                                        ("sample.num_samples", 0)))]
    capsys.readouterr()
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert f"warning   the checkpoint state file {run / 'checkpoints' / 'checkpoint'} is missing, empty or " \
           "unreadable; trying the checkpoint files themselves, newest first" in out
    assert f"resumed   from {run / 'checkpoints' / 'ckpt-8'} at step 8 (data position restored)" in out
    # the first save writes a new state file
    assert tf.train.latest_checkpoint(str(run / "checkpoints")) == str(run / "checkpoints" / "ckpt-10")


SIGNALLED = """
import sys, time
from tpu_llm.training import fault
with fault.StopSignals(flag=None) as signals:
    print("ready", flush=True)
    while signals.received is None:
        time.sleep(0.01)
    print("stopping", signals.name, flush=True)
    if sys.argv[1] == "slow":  # a long save: a second signal must not wait for it
        time.sleep(60)
    stopped = signals.stopped(5, "ckpt-5")
print(stopped, flush=True)
sys.exit(stopped.exit_code)
"""


@pytest.mark.slow
def test_a_second_signal_ends_the_process_at_once_and_sigint_exits_130():
    import subprocess
    import sys

    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    procs = {mode: subprocess.Popen([sys.executable, "-c", SIGNALLED, mode], stdout=subprocess.PIPE, text=True,
                                    stdin=subprocess.DEVNULL, env=env) for mode in ("once", "slow")}
    for proc in procs.values():
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGINT)
        assert proc.stdout.readline() == "stopping SIGINT\n"
    try:
        once = procs["once"]
        assert once.wait(timeout=30) == 130 and "SIGINT at step 5: saved ckpt-5" in once.stdout.read()
        slow, start = procs["slow"], time.monotonic()
        slow.send_signal(signal.SIGINT)  # again: ends the process now, as SIGINT without the handler would
        assert slow.wait(timeout=30) == -signal.SIGINT and time.monotonic() - start < 20
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_a_signal_sets_the_flag_while_the_main_thread_is_inside_a_tensorflow_call():
    """The Python handler runs only between bytecodes of the main thread; inside a host call (the
    training loop, a graph that reads the flag every step) only the watcher thread can set it."""
    flag, started = tf.Variable(0), tf.Variable(0)

    @tf.function
    def host_call():  # spins, as a training loop would, until the flag is set (at most 20 s)
        with tf.control_dependencies([started.assign(1)]):
            start = tf.timestamp()
        now = start
        while flag < 1 and now - start < 20.0:
            now = tf.timestamp()
        return now - start

    def preempt():
        while int(started.numpy()) == 0:
            time.sleep(0.01)
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGTERM)

    with fault.StopSignals(flag) as signals:
        threading.Thread(target=preempt, daemon=True).start()
        seconds = float(host_call())
    assert signals.received == signal.SIGTERM and int(flag.numpy()) == 1
    assert 0.2 <= seconds < 10  # stopped by the flag set during the call, not at its time limit


def test_a_signal_that_lands_while_a_function_traces_sets_the_flag_and_leaves_the_graph_alone():
    """Python runs a handler on the main thread between bytecodes, so a SIGTERM can arrive while the
    training loop is being traced: the flag must be set at once and no assign op added to the trace
    (CI saw `Input 'y' of 'Equal' Op has type resource` from exactly that)."""
    flag = tf.Variable(0)
    with fault.StopSignals(flag) as signals:

        @tf.function
        def traced():
            signals._handle(signal.SIGTERM, None)  # what the interpreter does when the signal lands here
            return flag > 0

        assert bool(traced())
        assert not [op.type for op in traced.get_concrete_function().graph.get_operations()
                    if op.type.startswith("Assign")]
    assert signals.received == signal.SIGTERM and int(flag.numpy()) == 1


def test_stop_signals_restore_the_handlers_they_replaced():
    before = signal.getsignal(signal.SIGINT)
    with fault.StopSignals(tf.Variable(0)) as signals:
        assert signal.getsignal(signal.SIGINT) == signals._handle
    assert signal.getsignal(signal.SIGINT) == before


def test_a_lost_task_is_named_and_the_reporting_task_is_not():
    # the error text of a lost ps names the chief's own device too (the op ran there): only the ps is lost
    error = tf.errors.UnavailableError(None, None, "failed to connect to all addresses; from "
                                       "/job:chief/replica:0/task:0/device:CPU:0 to /job:ps/replica:0/task:0")
    stopped = fault.cluster_failure(error, "chief 0 of 2 workers and 1 ps", "run/checkpoints/ckpt-40")
    assert str(stopped).startswith("chief 0 of 2 workers and 1 ps: the cluster lost ps 0 (UnavailableError: "
                                   "it cannot be reached); every task stops"), str(stopped)
    assert stopped.exit_code == fault.EXIT_CLUSTER
