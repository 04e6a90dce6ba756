"""Sampling with a KV cache: temperature, top-k, top-p; deterministic for a given seed.

`generate_ids` is the whole algorithm as one graph, written once for `tpu-llm generate` (Sampler) and
the exported SavedModel's `generate` signature (interop/export.py): the prompt (its newest max_len
tokens; an empty prompt starts after end-of-text) is run once to fill the cache (prefill), then each new
token costs one single-token forward pass (decode). When the cache is full (max_len), the newest half
of the context is re-run to refill it, so samples can be longer than the context. Random draws use
stateless ops keyed by (seed, i): the same seed gives the same text. Every tensor in the loop has a
static shape (the cache is [batch, heads, max_len, head_dim]), and the loop is a tf.while_loop, so a
sample is one call from Python rather than one per token (3x faster for 200 tokens of the tiny model,
and the first sample's tracing too: `Sampler`'s docstring).
"""

from __future__ import annotations

import tensorflow as tf

from tpu_llm.model.transformer import GPT


def sample_logits(logits, temperature, top_k, top_p, seed):
    """One token id per row of `logits` (B, V); temperature 0 is greedy, top_k 0 / top_p 1 are off.
    The settings may be Python numbers or scalar tensors (the exported `generate` signature passes
    tensors), so every filter is a tf.where rather than a Python branch."""
    logits = tf.cast(logits, tf.float32)
    temperature = tf.convert_to_tensor(temperature, tf.float32)
    top_k, top_p = tf.convert_to_tensor(top_k, tf.int32), tf.convert_to_tensor(top_p, tf.float32)
    greedy = tf.argmax(logits, axis=-1, output_type=tf.int32)
    scaled = logits / tf.maximum(temperature, 1e-6)  # temperature 0 takes `greedy` below
    ordered = tf.sort(scaled, axis=-1, direction="DESCENDING")  # (B, V)
    kth = ordered[:, tf.clip_by_value(top_k, 1, tf.shape(scaled)[-1]) - 1][:, None]
    scaled = tf.where((top_k > 0) & (scaled < kth), -1e9, scaled)
    ordered = tf.where((top_k > 0) & (ordered < kth), -1e9, ordered)
    # top-p: keep the smallest prefix whose mass reaches top_p (always at least the top token)
    before = tf.cumsum(tf.nn.softmax(ordered, axis=-1), axis=-1, exclusive=True)
    cutoff = tf.reduce_min(tf.where(before < top_p, ordered, 1e9), axis=-1, keepdims=True)
    scaled = tf.where((top_p < 1.0) & (scaled < cutoff), -1e9, scaled)
    sampled = tf.cast(tf.random.stateless_categorical(scaled, 1, seed)[:, 0], tf.int32)
    return tf.where(temperature > 0, sampled, greedy)


def prefill(model: GPT, tokens, vocab_size: int):
    """The last position's logits (B, vocab_size) and the KV cache filled with `tokens` (B, T) from position 0."""
    cache = model.empty_cache(tf.shape(tokens)[0])
    logits, cache = model.call_with_cache(tokens, cache, 0)
    return logits[:, -1, :vocab_size], cache


def generate_ids(model: GPT, tokens, max_new_tokens, temperature, top_k, top_p, seed, eos_id: int,
                 vocab_size: int):
    """(batch, max_new_tokens) int32 ids that follow `tokens` (batch, time), drawn one at a time with
    `sample_logits`, draw i keyed by (seed, i). Written with tf.while_loop / tf.cond: trace it with
    autograph off. Logits are cropped to `vocab_size` (the tokenizer's), so ids past it, which only pad
    the embedding table, are never drawn."""
    L = model.cfg.max_len
    half = max(L // 2, 1)
    batch = tf.shape(tokens)[0]
    tokens = tf.cond(tf.shape(tokens)[1] > 0, lambda: tokens[:, -L:],
                     lambda: tf.fill([batch, 1], tf.constant(eos_id, tf.int32)))
    # the newest L tokens of the context, left-padded; a refill reads only its newest `half`,
    # which are real tokens by then (the cache holds L of them when it is full)
    pad = tf.fill([batch, L], tf.constant(eos_id, tf.int32))
    context = tf.concat([pad, tokens], axis=1)[:, -L:]
    context.set_shape([None, L])

    logits, cache = prefill(model, tokens, vocab_size)
    pos = tf.shape(tokens)[1]
    max_new_tokens = tf.maximum(max_new_tokens, 0)
    out = tf.TensorArray(tf.int32, size=max_new_tokens, element_shape=tf.TensorShape([None]))

    def body(i, logits, cache, pos, context, out):
        token = sample_logits(logits, temperature, top_k, top_p, tf.stack([tf.cast(seed, tf.int64),
                                                                          tf.cast(i, tf.int64)]))
        out = out.write(i, token)
        context = tf.concat([context[:, 1:], token[:, None]], axis=1)

        def refill():  # the cache is full: re-run the newest half of the context
            logits, cache = prefill(model, context[:, -half:], vocab_size)
            return logits, cache, tf.constant(half, tf.int32)

        def decode():
            logits, new = model.call_with_cache(token[:, None], cache, pos)
            return logits[:, -1, :vocab_size], new, pos + 1

        logits, cache, pos = tf.cond(pos >= L, refill, decode)
        return i + 1, logits, cache, pos, context, out

    loop = tf.while_loop(lambda i, *_: i < max_new_tokens, body,
                         (tf.constant(0), logits, cache, pos, context, out))
    # (max_new_tokens, batch); TensorArray cannot stack zero elements of a shape unknown when traced
    ids = tf.cond(max_new_tokens > 0, loop[-1].stack, lambda: tf.zeros([0, batch], tf.int32))
    return tf.transpose(tf.reshape(ids, [max_new_tokens, batch]))


# generate_ids' arguments after the model, as the exported signature and Sampler trace them
GENERATE_SIGNATURE = (
    tf.TensorSpec([None, None], tf.int32, name="tokens"),
    tf.TensorSpec([], tf.int32, name="max_new_tokens"),
    tf.TensorSpec([], tf.float32, name="temperature"),
    tf.TensorSpec([], tf.int32, name="top_k"),
    tf.TensorSpec([], tf.float32, name="top_p"),
    tf.TensorSpec([], tf.int64, name="seed"),
)


class Sampler:
    """`generate_ids` for one prompt at a time, traced once per Sampler (every argument is a tensor of a
    fixed signature, so a new prompt length, length or setting reuses the graph). Autograph is off: the
    loop and branches are tf.while_loop / tf.cond already, and converting every Keras call made tracing
    several times slower. Measured on 2 CPU cores, the tiny config (4 layers, width 128), 200 tokens:
    first sample 4.5 s (was 6.8 s as a Python loop over an XLA-compiled decode), each next 0.5 s (was
    1.4 s). It is not XLA-compiled: XLA has no kernel for the categorical draw (StatelessMultinomial)."""

    def __init__(self, model: GPT, eos_id: int, vocab_size: int):
        self.model, self.eos_id = model, eos_id
        self.vocab_size = vocab_size  # the tokenizer's; ids past it only pad the embedding table
        self._generate = tf.function(
            lambda *args: generate_ids(model, *args, eos_id=eos_id, vocab_size=vocab_size),
            input_signature=GENERATE_SIGNATURE, autograph=False)

    def generate(self, prompt: list[int], max_new_tokens: int, temperature: float = 1.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int = 0, stop_at_eos: bool = False) -> list[int]:
        """The new token ids that follow `prompt` (which may be empty: starts after end-of-text); with
        `stop_at_eos`, those before the first end-of-text."""
        tokens = tf.constant([list(prompt)], tf.int32, shape=[1, len(prompt)])
        ids = self._generate(tokens, tf.constant(max_new_tokens, tf.int32), tf.constant(temperature, tf.float32),
                             tf.constant(top_k, tf.int32), tf.constant(top_p, tf.float32),
                             tf.constant(seed, tf.int64))
        out = ids[0].numpy().tolist()
        if stop_at_eos and self.eos_id in out:
            out = out[:out.index(self.eos_id)]
        return out


def continuation(tokenizer, prompt: list[int], ids: list[int]) -> str:
    """The text that `ids` add after `prompt`: decoded together, so that a tokenizer whose decoding
    depends on the position (Llama's drops the space its first word begins with) joins them right."""
    head, whole = tokenizer.decode(prompt), tokenizer.decode(list(prompt) + list(ids))
    return whole[len(head):] if whole.startswith(head) else tokenizer.decode(ids)
