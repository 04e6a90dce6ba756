"""Reliability defects found by fault injection (issue 20) and the divergence guard's structure on TPU
(issue 14): no control flow around the optimizer's cross-replica update, and what a skipped step
leaves unchanged, under the default and the Mirrored strategy."""

import hashlib
import os
from types import SimpleNamespace

import keras
import numpy as np
import pytest
import tensorflow as tf

from tpu_llm.config import load_config
from tpu_llm.errors import RunStopped, UserError
from tpu_llm.model import GPT
from tpu_llm.parallel.distribute import get_strategy
from tpu_llm.training import fault
from tpu_llm.training.checkpoint import Checkpointer
from tpu_llm.training.optimizer import make_optimizer
from tpu_llm.training.trainer import Trainer

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


def state(trainer) -> list:
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
    before = state(trainer)
    poison(2)  # the third step: non-finite loss and gradients
    out = trainer.run(batches, 1, 1)
    assert out["bad_steps"] == 1 and out["first_bad_step"] == 3
    assert int(trainer.optimizer.iterations.numpy()) == 3
    after = state(trainer)
    assert len(after) == len(before) > 10
    for a, b in zip(before, after):
        assert a.tobytes() == b.tobytes()
    good = trainer.run(batches, 1, 1)  # and the next step is applied as usual
    assert good["bad_steps"] == 0 and np.isfinite(good["loss"])
    assert any(a.tobytes() != b.tobytes() for a, b in zip(after, state(trainer)))
    graph = trainer.train_loop.get_concrete_function(batches, tf.constant(1)).graph.as_graph_def()
    assert _branch_writes(graph) == []


def snapshot(root) -> dict:
    """Every file under `root` by content hash."""
    out = {}
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            with open(os.path.join(dirpath, name), "rb") as f:
                out[os.path.relpath(os.path.join(dirpath, name), root)] = hashlib.sha256(f.read()).hexdigest()
    return out


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
