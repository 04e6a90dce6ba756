"""The GPT model: causality, initial loss, KV cache, cost accounting, and the compiled gradient step."""

import math

import numpy as np
import pytest
import tensorflow as tf

from tpu_llm.config import ModelConfig, TrainConfig
from tpu_llm.distribute import Distribution
from tpu_llm.model import GPT, decay_mask, loss_fn
from tpu_llm.train import Trainer, WarmupCosine, make_optimizer

VOCAB = 61


def small_model(seed=0, **kw) -> GPT:
    tf.keras.utils.set_random_seed(seed)
    cfg = ModelConfig(**{"n_layer": 2, "n_head": 2, "n_embd": 32, "max_len": 16, **kw})
    return GPT(cfg, VOCAB).build_weights()


def tokens(shape, seed=0):
    return tf.random.stateless_uniform(shape, [seed, 1], 0, VOCAB, tf.int32)


def test_changing_a_later_token_never_changes_earlier_logits():
    model = small_model()
    x = tokens([2, 12]).numpy()
    base = model(x).numpy()
    for t in range(11):
        y = x.copy()
        y[:, t + 1:] = (y[:, t + 1:] + 7) % VOCAB
        out = model(y).numpy()
        np.testing.assert_array_equal(out[:, :t + 1], base[:, :t + 1])
        assert not np.allclose(out[:, t + 1:], base[:, t + 1:])


def test_untrained_loss_is_about_log_vocab():
    model = small_model()
    x = tokens([8, 16])
    assert abs(float(loss_fn(model(x), tokens([8, 16], seed=1))) - math.log(VOCAB)) < 0.1


def test_kv_cache_decoding_matches_the_full_forward_pass():
    model = small_model()
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


def test_warmup_then_cosine_schedule():
    lr = WarmupCosine(peak=1.0, floor=0.1, warmup_steps=10, decay_steps=110)
    assert float(lr(0)) == pytest.approx(0.1)
    assert float(lr(9)) == pytest.approx(1.0)
    assert float(lr(10)) == pytest.approx(1.0)
    assert float(lr(60)) == pytest.approx(0.55)
    assert float(lr(110)) == pytest.approx(0.1) and float(lr(500)) == pytest.approx(0.1)


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
