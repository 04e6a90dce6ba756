"""Dropout under data parallelism: every replica draws its own masks, reproducibly across a resume."""

import numpy as np
import tensorflow as tf
from helpers import tiny_config

from tpu_llm.training.controller import build_run
from tpu_llm.training.trainer import ReplicaSeedGenerator


def test_replicas_draw_different_dropout_masks_that_a_restore_reproduces(tmp_path):
    run = build_run(tiny_config(tmp_path, cpu_devices=2, **{"model.dropout": 0.5, "train.batch_size": 4}))
    assert run.dist.name == "mirrored" and run.dist.num_replicas == 2
    drop = run.model.drop  # the embedding dropout, drawn like every other dropout of the step
    assert isinstance(drop.seed_generator, ReplicaSeedGenerator)
    compiled = tf.function(lambda x: drop(x, training=True), jit_compile=True)  # as the step compiles it

    @tf.function
    def masks():
        return run.dist.strategy.run(lambda: tf.cast(compiled(tf.ones([2, 16, 32])) != 0, tf.int8))

    def draw():
        return [m.numpy() for m in run.dist.strategy.experimental_local_results(masks())]

    first = draw()
    assert 0.3 < first[0].mean() < 0.7  # a dropout mask at rate 0.5
    assert not np.array_equal(first[0], first[1])  # replicas see different examples: different masks
    saved = run.checkpointer.save(0)
    after_save = draw()
    assert not np.array_equal(after_save[0], first[0])  # the stream moves on
    run.checkpointer.restore(saved)
    again = draw()
    for a, b in zip(after_save, again):  # same state, same replica: the same masks
        np.testing.assert_array_equal(a, b)
