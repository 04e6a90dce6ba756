"""GPT decoder in Keras 3 layers, readable top to bottom.

token embedding (tied with the output head) + learned positions -> n_layer pre-LayerNorm blocks of
causal multi-head attention and a GELU MLP -> final LayerNorm -> logits.

The blocks are an explicit list (`GPT.blocks`) and the model is also callable piecewise (`embed`,
each block, `head`) so a pipeline can group blocks into stages. There is no device or strategy logic
here. Logits are always float32, whatever the compute dtype.

Attention takes an optional KV cache `(k, v)` of shape (B, H, max_len, head_dim) and the position of
the first new token, which is how `generate.py` decodes one token at a time. Cache writes use a
one-hot mix rather than dynamic slicing so the shapes stay static and the decode step compiles with
XLA.
"""

from __future__ import annotations

import math

import keras
import tensorflow as tf

from tpu_llm import attention
from tpu_llm.config import ModelConfig


def _normal(std: float) -> keras.initializers.Initializer:
    return keras.initializers.RandomNormal(mean=0.0, stddev=std)


class CausalSelfAttention(keras.layers.Layer):
    def __init__(self, cfg: ModelConfig, **kwargs):
        super().__init__(**kwargs)
        self.n_head, self.head_dim = cfg.n_head, cfg.n_embd // cfg.n_head
        # GPT-2 init: residual projections scaled by 1/sqrt(2 * n_layer)
        self.qkv = keras.layers.Dense(3 * cfg.n_embd, use_bias=cfg.bias, kernel_initializer=_normal(0.02),
                                      name="qkv")
        self.proj = keras.layers.Dense(cfg.n_embd, use_bias=cfg.bias, name="proj",
                                       kernel_initializer=_normal(0.02 / math.sqrt(2 * cfg.n_layer)))
        self.attn_drop = keras.layers.Dropout(cfg.dropout)
        self.resid_drop = keras.layers.Dropout(cfg.dropout)
        self.attend = attention.for_config(cfg)  # model.attention: attend below, or blockwise (attention.py)

    def call(self, x, training=False, cache=None, pos=0):
        B, T = tf.shape(x)[0], tf.shape(x)[1]
        qkv = tf.reshape(self.qkv(x), [B, T, 3, self.n_head, self.head_dim])  # (B, T, 3, H, hd)
        q, k, v = tf.unstack(tf.transpose(qkv, [2, 0, 3, 1, 4]))  # each (B, H, T, hd)
        if cache is not None:
            k, v = _cache_write(cache[0], k, pos), _cache_write(cache[1], v, pos)  # (B, H, L, hd)
            cache = (k, v)
        y = self.attend(q, k, v, pos, self.attn_drop, training)  # (B, T, C)
        return self.resid_drop(self.proj(y), training=training), cache


def attend(q, k, v, pos, dropout, training):
    """Causal attention of queries q (B, H, T, hd) at positions pos.. over keys/values (B, H, S, hd);
    returns the heads side by side, (B, T, H * hd). Softmax in float32."""
    B, H, T, hd = tf.shape(q)[0], q.shape[1], tf.shape(q)[2], q.shape[3]
    scores = tf.einsum("bhtd,bhsd->bhts", q, k) * (1.0 / math.sqrt(hd))  # (B, H, T, S)
    # query i sits at position pos + i and may see keys at positions <= its own
    allowed = tf.range(tf.shape(k)[2])[None, :] <= (pos + tf.range(T))[:, None]  # (T, S)
    scores = tf.where(allowed, tf.cast(scores, tf.float32), -1e9)
    probs = dropout(tf.nn.softmax(scores, axis=-1), training=training)
    y = tf.einsum("bhts,bhsd->bhtd", tf.cast(probs, v.dtype), v)  # (B, H, T, hd)
    return tf.reshape(tf.transpose(y, [0, 2, 1, 3]), [B, T, H * hd])  # (B, T, H * hd)


def _cache_write(cache, new, pos):
    """cache (B, H, L, hd) with `new` (B, H, T, hd) written at positions pos..pos+T-1."""
    L, T = cache.shape[2], tf.shape(new)[2]
    onehot = tf.one_hot(pos + tf.range(T), L, dtype=cache.dtype)  # (T, L)
    keep = 1.0 - tf.reduce_sum(onehot, axis=0)[None, None, :, None]  # (1, 1, L, 1)
    return cache * keep + tf.einsum("bhtd,tl->bhld", new, onehot)


class MLP(keras.layers.Layer):
    def __init__(self, cfg: ModelConfig, **kwargs):
        super().__init__(**kwargs)
        self.fc = keras.layers.Dense(4 * cfg.n_embd, use_bias=cfg.bias, kernel_initializer=_normal(0.02),
                                     name="fc")
        self.proj = keras.layers.Dense(cfg.n_embd, use_bias=cfg.bias, name="proj",
                                       kernel_initializer=_normal(0.02 / math.sqrt(2 * cfg.n_layer)))
        self.drop = keras.layers.Dropout(cfg.dropout)

    def call(self, x, training=False):
        h = tf.nn.gelu(self.fc(x), approximate=True)  # (B, T, 4C)
        return self.drop(self.proj(h), training=training)  # (B, T, C)


class Block(keras.layers.Layer):
    """x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: ModelConfig, **kwargs):
        super().__init__(**kwargs)
        self.ln1 = keras.layers.LayerNormalization(epsilon=1e-5, center=cfg.bias, name="ln1")
        self.attn = CausalSelfAttention(cfg, name="attn")
        self.ln2 = keras.layers.LayerNormalization(epsilon=1e-5, center=cfg.bias, name="ln2")
        self.mlp = MLP(cfg, name="mlp")

    def call(self, x, training=False, cache=None, pos=0):
        a, cache = self.attn(self.ln1(x), training=training, cache=cache, pos=pos)
        x = x + a
        x = x + self.mlp(self.ln2(x), training=training)
        return x, cache


class GPT(keras.Model):
    def __init__(self, cfg: ModelConfig, vocab_size: int, **kwargs):
        super().__init__(**kwargs)
        self.cfg, self.vocab_size = cfg, vocab_size
        self.wte = keras.layers.Embedding(vocab_size, cfg.n_embd, embeddings_initializer=_normal(0.02),
                                          name="wte")
        self.wpe = keras.layers.Embedding(cfg.max_len, cfg.n_embd, embeddings_initializer=_normal(0.02),
                                          name="wpe")
        self.drop = keras.layers.Dropout(cfg.dropout)
        self.blocks = [Block(cfg, name=f"block_{i}") for i in range(cfg.n_layer)]
        for i, block in enumerate(self.blocks):
            # Keras 3 tracks a list of layers for `weights`, but TF checkpoints do not see into it
            # (tf.train.Checkpoint(model=...) would save only the embeddings and the final norm)
            self._track_trackable(block, name=f"block_{i}", overwrite=True)
        self.ln_f = keras.layers.LayerNormalization(epsilon=1e-5, center=cfg.bias, name="ln_f")

    def build_weights(self) -> "GPT":
        """Create every variable (call once, inside the strategy scope)."""
        self(tf.zeros([1, 1], tf.int32))
        return self

    def embed(self, idx, training=False, pos=0):
        T = tf.shape(idx)[1]
        x = self.wte(idx) + self.wpe(pos + tf.range(T))[None]  # (B, T, C)
        return self.drop(x, training=training)

    def head_weights(self):
        """The output matrix (V, C) the head multiplies by: the tied token embedding table."""
        return self.wte.embeddings

    def head(self, x):
        x = self.ln_f(x)
        # tied output head; logits in float32 even under mixed precision
        return tf.einsum("btc,vc->btv", tf.cast(x, tf.float32), tf.cast(self.head_weights(), tf.float32))

    def call(self, idx, training=False):
        x = self.embed(idx, training=training)
        for block in self.blocks:
            x, _ = block(x, training=training)
        return self.head(x)  # (B, T, vocab)

    def call_with_cache(self, idx, cache, pos):
        """Forward new tokens `idx` (B, T) at positions pos.. using and updating the per-layer cache."""
        x = self.embed(idx, pos=pos)
        new_cache = []
        for block, layer_cache in zip(self.blocks, cache):
            x, layer_cache = block(x, cache=layer_cache, pos=pos)
            new_cache.append(layer_cache)
        return self.head(x), new_cache

    def empty_cache(self, batch: int):
        shape = [batch, self.cfg.n_head, self.cfg.max_len, self.cfg.n_embd // self.cfg.n_head]
        return [(tf.zeros(shape, self.compute_dtype), tf.zeros(shape, self.compute_dtype))
                for _ in self.blocks]

    # ---- size and cost ---------------------------------------------------------------------------

    def num_params(self, include_positions: bool = True) -> int:
        n = sum(int(math.prod(v.shape)) for v in self.trainable_variables)
        return n if include_positions else n - self.cfg.max_len * self.cfg.n_embd

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6N (forward + backward matmuls) + 12 L d T (attention)."""
        c = self.cfg
        return 6 * self.num_params(include_positions=False) + 12 * c.n_layer * c.n_embd * seq_len


def loss_fn(logits, targets):
    """Mean next-token cross entropy, float32."""
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=targets, logits=tf.cast(logits, tf.float32)))


def decay_mask(model: GPT) -> list:
    """Variables that get weight decay: Dense kernels only (not norms, biases or embeddings)."""
    return [v for v in model.trainable_variables if len(v.shape) == 2 and v.path.endswith("kernel")]
