"""The GPT model: causality, initial loss, KV cache, cost accounting, and the compiled gradient step."""

import math

import numpy as np
import pytest
import tensorflow as tf
from helpers import ReducedSGD

from tpu_llm.config import ModelConfig, TrainConfig
from tpu_llm.model import GPT, decay_mask, loss_fn
from tpu_llm.parallel.distribute import Distribution
from tpu_llm.training.optimizer import make_optimizer
from tpu_llm.training.trainer import Trainer

VOCAB = 61


# the llama family with grouped-query attention (2 query heads per kv head) and an untied head
LLAMA = {"family": "llama", "n_head": 4, "n_kv_head": 2, "bias": False, "mlp_hidden": 48, "tie_embeddings": False}


def small_model(seed=0, family="gpt2", **kw) -> GPT:
    tf.keras.utils.set_random_seed(seed)
    cfg = ModelConfig(**{"n_layer": 2, "n_head": 2, "n_embd": 32, "max_len": 16,
                         **(LLAMA if family == "llama" else {}), **kw})
    return GPT(cfg, VOCAB).build_weights()


def tokens(shape, seed=0):
    return tf.random.stateless_uniform(shape, [seed, 1], 0, VOCAB, tf.int32)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_changing_a_later_token_never_changes_earlier_logits(family):
    model = small_model(family=family)
    x = tokens([2, 12]).numpy()
    base = model(x).numpy()
    for t in range(11):
        y = x.copy()
        y[:, t + 1:] = (y[:, t + 1:] + 7) % VOCAB
        out = model(y).numpy()
        np.testing.assert_array_equal(out[:, :t + 1], base[:, :t + 1])
        assert not np.allclose(out[:, t + 1:], base[:, t + 1:])


def test_the_last_position_sees_the_first_token_and_attend_matches_a_numpy_masked_softmax():
    model = small_model()
    x = tokens([2, 12]).numpy()
    y = x.copy()
    y[:, 0] = (y[:, 0] + 7) % VOCAB  # only token 0 differs: every later position must notice
    base, out = model(x).numpy(), model(y).numpy()
    assert all(not np.allclose(out[:, t], base[:, t], atol=1e-4) for t in range(12))

    from tpu_llm.model.attention import attend

    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(2, 3, 5, 4)).astype(np.float32) for _ in range(3))
    pos = 2  # queries at positions 2..6 over keys 0..4 (a KV cache's view): query i sees keys <= 2 + i
    scores = np.einsum("bhtd,bhsd->bhts", q, k) / math.sqrt(4)
    scores = np.where(np.arange(5)[None, :] <= (pos + np.arange(5))[:, None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    want = np.einsum("bhts,bhsd->bhtd", probs, v).transpose(0, 2, 1, 3).reshape(2, 5, 12)
    got = attend(tf.constant(q), tf.constant(k), tf.constant(v), pos, lambda p, training: p, False)
    np.testing.assert_allclose(got.numpy(), want, atol=1e-5)
    got0 = attend(tf.constant(q), tf.constant(k), tf.constant(v), 0, lambda p, training: p, False)
    assert not np.allclose(got0.numpy(), want, atol=1e-3)  # the position offset matters too


def test_untrained_loss_is_about_log_vocab():
    model = small_model()
    x = tokens([8, 16])
    assert abs(float(loss_fn(model(x), tokens([8, 16], seed=1))) - math.log(VOCAB)) < 0.1


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_kv_cache_decoding_matches_the_full_forward_pass(family):
    model = small_model(family=family)
    x = tokens([1, 12])
    full = model(x).numpy()
    logits, cache = model.call_with_cache(x[:, :5], model.empty_cache(1), 0)  # prefill 5 tokens
    steps = [logits.numpy()]
    for pos in range(5, 12):
        logits, cache = model.call_with_cache(x[:, pos:pos + 1], cache, pos)
        steps.append(logits.numpy())
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=1e-5)


def test_parameter_count_and_flops_per_token():
    model = small_model(bias=False)
    C, L = 32, 2
    per_block = C + C * 3 * C + C * C + C + C * 4 * C + 4 * C * C  # ln1 (no beta), qkv, proj, ln2, fc, proj
    expected = VOCAB * C + 16 * C + L * per_block + C  # wte, wpe, blocks, ln_f
    assert model.num_params() == expected
    assert model.flops_per_token(16) == 6 * (expected - 16 * C) + 12 * L * C * 16


def test_weight_decay_applies_to_dense_kernels_only():
    model = small_model()
    optimizer = make_optimizer(TrainConfig(lr=0.1, min_lr=0.1, warmup_steps=0, weight_decay=0.5), model)
    before = {v.path: v.numpy() for v in model.trainable_variables}
    optimizer.apply([tf.zeros(v.shape) for v in model.trainable_variables], model.trainable_variables)
    decayed = {v.path for v in model.trainable_variables if (v.numpy() != before[v.path]).any()}
    assert decayed == {v.path for v in decay_mask(model)}
    assert decayed and all(p.endswith("kernel") for p in decayed)  # not norms, biases, embeddings


def _trainer(model, jit=True, **train):
    dist = Distribution(tf.distribute.get_strategy(), "default", "test", "CPU", jit_compile=jit)
    cfg = TrainConfig(**train)
    return Trainer(dist, model, make_optimizer(cfg, model), cfg)


def test_per_replica_step_compiles_with_xla_and_matches_graph_mode():
    model = small_model()
    x, y = tokens([4, 16]), tokens([4, 16], seed=2)
    jitted = _trainer(model, jit=True)
    hlo = jitted._loss_and_grads.experimental_get_compiler_ir(x, y)(stage="hlo")
    assert "HloModule" in hlo
    loss_xla, grads_xla = jitted._loss_and_grads(x, y)
    loss_graph, grads_graph = _trainer(model, jit=False)._loss_and_grads(x, y)
    assert float(loss_xla) == pytest.approx(float(loss_graph), abs=1e-5)
    for a, b in zip(grads_xla, grads_graph):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-5)


@pytest.mark.parametrize("clip", [0.0, 0.5])  # off, and a threshold at half the gradient's norm
def test_logged_gradient_norm_is_the_global_norm_and_clipping_scales_the_update(clip):
    model = small_model()
    x, y = tokens([4, 16]), tokens([4, 16], seed=5)
    with tf.GradientTape() as tape:
        loss = loss_fn(model(x, training=True), y)
    ref = [tf.convert_to_tensor(g).numpy() for g in tape.gradient(loss, model.trainable_variables)]
    norm = math.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in ref))
    before = [v.numpy() for v in model.trainable_variables]
    dist = Distribution(tf.distribute.get_strategy(), "default", "test", "CPU", jit_compile=False)
    cfg = TrainConfig(clip_norm=clip * norm)
    # plain SGD with lr 1: the update is minus the (clipped) gradient, so its size is visible
    trainer = Trainer(dist, model, ReducedSGD(learning_rate=1.0), cfg)
    out = trainer.train_loop(iter(tf.data.Dataset.from_tensors((x, y)).repeat()), tf.constant(1))
    assert float(out["grad_norm"]) == pytest.approx(norm, rel=1e-4)  # logged before clipping
    factor = clip if clip else 1.0
    for b, v, g in zip(before, model.trainable_variables, ref):
        np.testing.assert_allclose(b - v.numpy(), factor * g, atol=1e-5, rtol=1e-3)


def test_gradient_accumulation_equals_one_big_batch():
    model = small_model()
    x, y = tokens([8, 16]), tokens([8, 16], seed=3)
    loss1, grads1 = _trainer(model, grad_accum=1)._loss_and_grads(x, y)
    loss4, grads4 = _trainer(model, grad_accum=4)._loss_and_grads(x, y)
    assert float(loss4) == pytest.approx(float(loss1), abs=1e-5)
    for a, b in zip(grads1, grads4):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-5)


def test_overfits_one_batch():
    model = small_model(n_embd=64)
    x, y = tokens([4, 16]), tokens([4, 16], seed=4)
    trainer = _trainer(model, lr=3e-3, min_lr=3e-3, warmup_steps=0, weight_decay=0.0, steps=300)
    batches = iter(tf.data.Dataset.from_tensors((x, y)).repeat())
    out = trainer.train_loop(batches, tf.constant(300))
    assert float(out["loss"]) < math.log(VOCAB)
    assert float(loss_fn(model(x), y)) < 0.05


def test_a_copy_task_is_learned_only_by_attending_to_the_past():
    """Sequences of random tokens whose second half repeats the first. The tokens of the second half
    are predictable from 7 positions back, and from nothing else: a model whose tokens see only
    themselves (or no context at all) stays at chance, log(VOCAB) = 4.11. A fresh batch every step,
    so nothing is memorised from (token, position) as in the one-batch overfit above."""
    half = 8

    def copies(seed, batch=32):
        first = tf.random.stateless_uniform([batch, half], [seed, 7], 0, VOCAB, tf.int32)
        sequence = tf.concat([first, first], axis=1)  # (batch, 2 * half)
        return sequence[:, :-1], sequence[:, 1:]

    model = small_model()
    steps = 200  # 8 seeds all ended below 0.03 nats on the copies (100 steps: up to 0.85)
    trainer = _trainer(model, lr=1e-2, min_lr=1e-2, warmup_steps=0, weight_decay=0.0, steps=steps)
    batches = tf.data.Dataset.range(1, steps + 1).map(lambda i: copies(tf.cast(i, tf.int32)))
    trainer.train_loop(iter(batches), tf.constant(steps))
    x, y = copies(0, batch=64)  # held out: seed 0 was not trained on
    per_token = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=model(x)).numpy()  # (64, 15)
    # the first half's targets are fresh random tokens: only a look at the future could predict them
    assert per_token[:, :half - 1].mean() > math.log(VOCAB) - 0.2
    # targets half.. repeat tokens 1..: copied from the past (target half - 1, token 0, is learned last)
    assert per_token[:, half:].mean() < 1.0
