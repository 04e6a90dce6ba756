"""Reliability defects found by fault injection (issue 20) and the divergence guard's structure on TPU
(issue 14): no control flow around the optimizer's cross-replica update, and what a skipped step
leaves unchanged, under the default and the Mirrored strategy."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tpu_llm.config import load_config
from tpu_llm.distribute import get_strategy
from tpu_llm.model import GPT
from tpu_llm.train import Trainer, make_optimizer

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
