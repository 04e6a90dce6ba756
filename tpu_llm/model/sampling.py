"""Sampling with a KV cache: temperature, top-k, top-p; deterministic for a given seed.

The prompt is run once to fill the cache (prefill), then each new token costs one single-token
forward pass (`decode`, compiled with XLA, static shapes). When the cache is full (max_len), the
newest half of the context is re-run to refill it, so samples can be longer than the context.
Random draws use stateless ops keyed by (seed, position): the same seed gives the same text.
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


class Sampler:
    def __init__(self, model: GPT, eos_id: int, vocab_size: int):
        self.model, self.eos_id = model, eos_id
        self.vocab_size = vocab_size  # the tokenizer's; ids past it only pad the embedding table
        self.max_len = model.cfg.max_len
        self._prefill = tf.function(self._prefill_fn, reduce_retracing=True)
        self._decode = tf.function(self._decode_fn, jit_compile=True)

    def _prefill_fn(self, tokens):
        return prefill(self.model, tokens, self.vocab_size)

    def _decode_fn(self, token, cache, pos):
        logits, cache = self.model.call_with_cache(token[:, None], cache, pos)
        return logits[:, -1, :self.vocab_size], cache

    def generate(self, prompt: list[int], max_new_tokens: int, temperature: float = 1.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int = 0, stop_at_eos: bool = False) -> list[int]:
        """The new token ids that follow `prompt` (which may be empty: starts after end-of-text)."""
        context = list(prompt) or [self.eos_id]
        out: list[int] = []
        logits, cache = self._prefill(tf.constant([context[-self.max_len:]], tf.int32))
        pos = min(len(context), self.max_len)
        for i in range(max_new_tokens):
            token = sample_logits(logits, temperature, top_k, top_p, tf.constant([seed, i], tf.int64))
            token_id = int(token[0])
            if stop_at_eos and token_id == self.eos_id:
                break
            out.append(token_id)
            context.append(token_id)
            if i == max_new_tokens - 1:
                break
            if pos == self.max_len:  # cache full: re-run the newest half of the context
                keep = context[-(self.max_len // 2 or 1):]
                logits, cache = self._prefill(tf.constant([keep], tf.int32))
                pos = len(keep)
            else:
                logits, cache = self._decode(token, cache, tf.constant(pos, tf.int32))
                pos += 1
        return out


def continuation(tokenizer, prompt: list[int], ids: list[int]) -> str:
    """The text that `ids` add after `prompt`: decoded together, so that a tokenizer whose decoding
    depends on the position (Llama's drops the space its first word begins with) joins them right."""
    head, whole = tokenizer.decode(prompt), tokenizer.decode(list(prompt) + list(ids))
    return whole[len(head):] if whole.startswith(head) else tokenizer.decode(ids)
