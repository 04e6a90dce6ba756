"""What a run's optimizer step does with its config, through the code a run uses (make_optimizer, the
Trainer that build_run makes), not a hand-built piece of it: the learning rate warms up from the config's
schedule, gradients are clipped at train.clip_norm, and validation runs in inference mode (no dropout)."""

import numpy as np
import pytest
import tensorflow as tf

from tpu_llm.config import ModelConfig, TrainConfig
from tpu_llm.model import GPT
from tpu_llm.parallel.distribute import Distribution
from tpu_llm.training.optimizer import make_optimizer
from tpu_llm.training.trainer import Trainer

VOCAB = 61


def small_model(seed=0, **kw) -> GPT:
    tf.keras.utils.set_random_seed(seed)
    return GPT(ModelConfig(**{"n_layer": 2, "n_head": 2, "n_embd": 32, "max_len": 16, **kw}), VOCAB).build_weights()


def tokens(shape, seed=0):
    return tf.random.stateless_uniform(shape, [seed, 1], 0, VOCAB, tf.int32)


def trainer(model, **train) -> Trainer:
    dist = Distribution(tf.distribute.get_strategy(), "default", "test", "CPU", jit_compile=False)
    cfg = TrainConfig(**train)
    return Trainer(dist, model, make_optimizer(cfg, model), cfg, execution="graph")


def batches(x, y):
    return iter(tf.data.Dataset.from_tensors((x, y)).repeat())


def learning_rates(optimizer, steps) -> list[float]:
    """The learning rate the optimizer applies at each optimizer step (its `iterations` before the update)."""
    out = []
    for step in steps:
        optimizer.iterations.assign(step)
        out.append(float(optimizer.learning_rate))
    return out


def test_the_learning_rate_warms_up_linearly_from_lr_over_warmup_steps_to_lr_then_decays_to_min_lr():
    """docs/configuration.md: warmup rises linearly from lr / warmup_steps at step 0 to lr at step
    warmup_steps; the cosine decay then reaches min_lr at decay_steps (counted from step 0) and stays."""
    cfg = TrainConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10, steps=110)
    optimizer = make_optimizer(cfg, small_model())
    warm = learning_rates(optimizer, range(0, 11))
    np.testing.assert_allclose(warm, [1e-4 + (1e-3 - 1e-4) * s / 10 for s in range(11)], rtol=1e-5)
    assert warm[0] == pytest.approx(cfg.lr / cfg.warmup_steps, rel=1e-5)  # not the peak: warmup is on
    later = learning_rates(optimizer, [60, 110, 500])
    np.testing.assert_allclose(later, [0.55e-3, 1e-4, 1e-4], rtol=1e-5)  # halfway down, then the floor


def test_without_warmup_the_first_step_takes_the_peak_and_decay_steps_counts_from_step_0():
    cfg = TrainConfig(lr=1e-3, min_lr=0.0, warmup_steps=0, steps=100, decay_steps=50)
    lrs = learning_rates(make_optimizer(cfg, small_model()), [0, 25, 50, 80])
    np.testing.assert_allclose(lrs, [1e-3, 0.5e-3, 0.0, 0.0], rtol=1e-5, atol=1e-9)


def update_size(clip_norm: float) -> float:
    """How far one step of a run's optimizer moves the weights (no weight decay), at train.clip_norm."""
    model = small_model()
    before = [v.numpy() for v in model.trainable_variables]
    t = trainer(model, lr=1e-3, warmup_steps=0, weight_decay=0.0, clip_norm=clip_norm)
    t.train_loop(batches(tokens([4, 16]), tokens([4, 16], seed=5)), tf.constant(1))
    return float(np.sqrt(sum(((v.numpy() - b) ** 2).sum() for v, b in zip(model.trainable_variables, before))))


def test_clip_norm_bounds_the_gradients_the_optimizer_sees():
    """AdamW divides by the gradient's own size, so clipping shows only where the clipped gradient sinks
    below AdamW's epsilon (1e-8): at clip_norm 1e-12 the step all but vanishes, while without clipping
    it is AdamW's usual lr-sized step."""
    off, clipped = update_size(0.0), update_size(1e-12)
    assert clipped < off / 100, (clipped, off)


def test_validation_runs_without_dropout():
    """With dropout 0.5 a training-mode forward pass differs from one call to the next; the validation
    loss must be the inference-mode loss, the same every time."""
    model = small_model(dropout=0.5)
    x, y = tokens([4, 16]), tokens([4, 16], seed=7)
    t = trainer(model)
    first, second = t.evaluate(batches(x, y), 2), t.evaluate(batches(x, y), 2)
    reference = float(t.pipeline.loss(x, y, training=False))
    assert first == pytest.approx(reference, rel=1e-6) and second == pytest.approx(reference, rel=1e-6)
    assert float(t.pipeline.loss(x, y, training=True)) != pytest.approx(reference, rel=1e-3)  # dropout is real
