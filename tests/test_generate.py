"""Sampling: the filters do what they say, seeds make it deterministic, the cache matches recompute."""

import numpy as np
import tensorflow as tf
from helpers import tiny_config

from tpu_llm.config import ModelConfig
from tpu_llm.model import GPT
from tpu_llm.model.sampling import Sampler, sample_logits

SEED = tf.constant([7, 0], tf.int64)


def draws(logits, n=200, **kw):
    kw = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, **kw}
    return {int(sample_logits(logits, seed=tf.constant([i, 0], tf.int64), **kw)[0]) for i in range(n)}


def test_temperature_zero_is_greedy():
    logits = tf.constant([[0.1, 2.0, -1.0, 1.9]])
    assert int(sample_logits(logits, 0.0, 0, 1.0, SEED)[0]) == 1


def test_top_k_keeps_only_the_k_most_likely_tokens():
    logits = tf.constant([[1.0, 1.1, 1.2, 5.0, 4.9, 0.0]])
    assert draws(logits, top_k=2) == {3, 4}
    assert draws(tf.zeros([1, 6]), top_k=0) == set(range(6))


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = np.array([[0.5, 0.3, 0.15, 0.05]])
    logits = tf.constant(np.log(probs), tf.float32)
    assert draws(logits, top_p=0.75) == {0, 1}
    assert draws(logits, top_p=0.1) == {0}  # the top token always survives


def test_same_seed_same_sample_different_seed_different_sample():
    logits = tf.zeros([1, 50])
    a = [int(sample_logits(logits, 1.0, 0, 1.0, tf.constant([s, 3], tf.int64))[0]) for s in range(20)]
    b = [int(sample_logits(logits, 1.0, 0, 1.0, tf.constant([s, 3], tf.int64))[0]) for s in range(20)]
    assert a == b and len(set(a)) > 5


def naive_greedy(model, prompt, n):
    """Greedy decoding by re-running the whole window for every token, no cache: the window is the newest
    max_len tokens of the prompt, grows by each new token, and when it would pass max_len starts again
    from the newest half of the context (the sampler's cache refill)."""
    L = model.cfg.max_len
    context = list(prompt)
    start = max(len(context) - L, 0)
    for _ in range(n):
        context.append(int(tf.argmax(model(tf.constant([context[start:]]))[0, -1])))
        if len(context) - start > L:
            start = len(context) - L // 2
    return context[len(prompt):]


def test_cached_generation_matches_recompute_and_runs_past_the_context():
    tf.keras.utils.set_random_seed(0)
    model = GPT(ModelConfig(n_layer=2, n_head=2, n_embd=32, max_len=8), 40).build_weights()
    rng = np.random.default_rng(0)  # an initialised model repeats one token, whatever its window
    model.set_weights([w + rng.normal(0, 0.5, w.shape).astype(w.dtype) for w in model.get_weights()])
    sampler = Sampler(model, eos_id=39, vocab_size=40)
    prompt = [3, 1, 4, 1, 5]
    cached = sampler.generate(prompt, 3, temperature=0.0)
    assert cached == naive_greedy(model, prompt, 3)
    long = sampler.generate(prompt, 20, temperature=0.0)  # beyond max_len=8: the cache is refilled, twice
    assert long == naive_greedy(model, prompt, 20) and long[:3] == cached
    assert sampler.generate(prompt * 3, 4, temperature=0.0) == naive_greedy(model, prompt * 3, 4)  # cropped
    assert sampler.generate(prompt, 20, temperature=1.0, seed=5) == sampler.generate(prompt, 20, temperature=1.0,
                                                                                      seed=5)


def test_stop_at_eos_ends_the_sample_before_the_first_end_of_text():
    tf.keras.utils.set_random_seed(0)
    model = GPT(ModelConfig(n_layer=1, n_head=1, n_embd=16, max_len=8), 10).build_weights()
    sampler = Sampler(model, eos_id=0, vocab_size=10)
    seed = next(seed for seed in range(50) if 0 in sampler.generate([1], 12, temperature=3.0, seed=seed)[1:])
    ids = sampler.generate([1], 12, temperature=3.0, seed=seed)
    stopped = sampler.generate([1], 12, temperature=3.0, seed=seed, stop_at_eos=True)
    assert stopped == ids[:ids.index(0)] and len(stopped) < 12
    assert sampler.generate([], 0) == [] and len(sampler.generate([], 5, temperature=1.0)) == 5  # empty prompt


def test_padded_vocabulary_ids_are_never_sampled():
    tf.keras.utils.set_random_seed(0)
    model = GPT(ModelConfig(n_layer=1, n_head=1, n_embd=16, max_len=8), 64).build_weights()
    sampler = Sampler(model, eos_id=9, vocab_size=10)  # table padded from 10 to 64 ids
    assert max(sampler.generate([1, 2], 30, temperature=2.0, seed=1)) < 10


def test_generation_loads_every_trained_weight(tmp_path):
    # regression: Keras 3 keeps the blocks in a list TF checkpoints did not see into, so generation
    # restored only the embeddings and sampled from untrained blocks
    from tpu_llm.training.checkpoint import load_for_generation
    from tpu_llm.training.controller import train, weights_fingerprint

    summary = train(tiny_config(tmp_path, **{"train.steps": 2}, execution="graph"),  # the checkpoint is the subject
                    say=lambda *_: None, samples=False)
    model, _, _ = load_for_generation(str(tmp_path / "run"))
    assert weights_fingerprint(model) == summary["fingerprint"]
    assert len(tf.train.list_variables(str(tmp_path / "run" / "checkpoints" / "ckpt-2"))) > len(model.weights)
