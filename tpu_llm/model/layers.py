"""The layers every family's block is built from: projections, norms, rotary embeddings, and the
pieces the block's attention and MLP compose (heads, matmuls, a tensor group's weight slices).

A projection is called through a `project(name, x)` function, so that one composition serves both
paths of a layer (model/transformer.py): the whole layer calls its Keras Dense layer (`whole`), a tensor
group multiplies by its slices of that layer's weights (`sliced`, what `columns` and `rows` cut). The
slices of a frozen bfloat16 or int8 kernel are cast or dequantized one slice at a time, and an adapted
projection's adapter slices come from its layer (model/adapters.py's `group_slices`).
"""

from __future__ import annotations

import math

import keras
import tensorflow as tf


def normal(std: float) -> keras.initializers.Initializer:
    return keras.initializers.RandomNormal(mean=0.0, stddev=std)


class RMSNorm(keras.layers.Layer):
    """x / sqrt(mean(x^2) + eps) * scale, the mean in float32 (as HF Llama computes it)."""

    def __init__(self, eps: float, **kwargs):
        super().__init__(**kwargs)
        self.eps = eps

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(input_shape[-1],), initializer="ones", name="scale")

    def call(self, x):
        x32 = tf.cast(x, tf.float32)
        x32 = x32 * tf.math.rsqrt(tf.reduce_mean(tf.square(x32), axis=-1, keepdims=True) + self.eps)
        return tf.cast(x32, x.dtype) * tf.cast(self.scale, x.dtype)


def norm(cfg, block, name: str) -> keras.layers.Layer:
    """The family's norm (`block` a families.Block): RMSNorm, or LayerNorm with a beta where it has biases."""
    if block.norm == "rms":
        return RMSNorm(cfg.norm_eps, name=name)
    return keras.layers.LayerNormalization(epsilon=cfg.norm_eps, center=cfg.bias and block.bias == "all", name=name)


# ---- rotary position embeddings ------------------------------------------------------------------

def rope_scaling(cfg) -> tuple | None:
    """model.rope_scaling=llama3's (factor, low_freq_factor, high_freq_factor, original context), else None."""
    if cfg.rope_scaling == "none":
        return None
    return cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, cfg.rope_original_max_len


def llama3_frequencies(inv_freq, factor: float, low: float, high: float, original: int):
    """Llama 3.1's long-context rotary frequencies (hd/2,), as transformers' _compute_llama3_parameters:
    wavelengths under original/high are kept, those over original/low divided by `factor`, those between
    interpolated smoothly. Reciprocals where torch computes `scalar / tensor` as one (float32 alike)."""
    wavelen = tf.math.reciprocal(inv_freq) * (2 * math.pi)
    scaled = tf.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (tf.math.reciprocal(wavelen) * original - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return tf.where(medium, smoothed, scaled)


def rope(x, pos, theta: float, scaling: tuple | None = None):
    """Rotary position embedding of x (B, heads, T, hd) at positions pos..pos+T-1, HF Llama's layout:
    dimension i and i + hd/2 rotate together by angle position * theta^(-2i/hd) (`scaling`: those
    frequencies as llama3_frequencies rescales them)."""
    hd, T = x.shape[-1], tf.shape(x)[2]
    inv_freq = 1.0 / theta ** (tf.range(0, hd, 2, dtype=tf.float32) / hd)  # (hd/2,)
    if scaling is not None:
        inv_freq = llama3_frequencies(inv_freq, *scaling)
    angles = tf.cast(pos + tf.range(T), tf.float32)[:, None] * inv_freq[None, :]  # (T, hd/2)
    angles = tf.concat([angles, angles], axis=-1)  # (T, hd)
    cos, sin = tf.cast(tf.cos(angles), x.dtype), tf.cast(tf.sin(angles), x.dtype)
    x1, x2 = x[..., :hd // 2], x[..., hd // 2:]
    return x * cos + tf.concat([-x2, x1], axis=-1) * sin  # rotate_half(x) = (-x2, x1)


# ---- shapes and matmuls --------------------------------------------------------------------------

def heads(x, n: int):
    """(B, T, n * hd) -> (B, n, T, hd)."""
    B, T = tf.shape(x)[0], tf.shape(x)[1]
    return tf.transpose(tf.reshape(x, [B, T, n, x.shape[-1] // n]), [0, 2, 1, 3])


def matmul(x, kernel, transpose: bool = False):
    """x (B, T, K) times kernel (K, N), or kernel (N, K) transposed: (B, T, N), as a 2-D matmul of the
    (B T, K) rows, as Keras' Dense does. Not tf.einsum: TF's TPU compiler keeps a MatMul's core
    assignment (pipeline stages, tensor groups) and drops an Einsum's."""
    B, T = tf.shape(x)[0], tf.shape(x)[1]
    y = tf.matmul(tf.reshape(x, [-1, x.shape[-1]]), kernel, transpose_b=transpose)  # (B T, N)
    return tf.reshape(y, [B, T, y.shape[-1]])


def cache_write(cache, new, pos):
    """cache (B, Hkv, L, hd) with `new` (B, Hkv, T, hd) written at positions pos..pos+T-1: a one-hot mix,
    not a dynamic slice, so that the shapes stay static and the decode step compiles with XLA."""
    L, T = cache.shape[2], tf.shape(new)[2]
    onehot = tf.one_hot(pos + tf.range(T), L, dtype=cache.dtype)  # (T, L)
    keep = 1.0 - tf.reduce_sum(onehot, axis=0)[None, None, :, None]  # (1, 1, L, 1)
    return cache * keep + tf.einsum("bhtd,tl->bhld", new, onehot)


def low_rank(x, a, b, scale: float):
    """(x A B) * scale for x (B, T, in), A (in, r), B (r, out): (B, T, out) in A's dtype, as two 2-D
    matmuls of the (B T) rows (never the (in, out) product A B: r is small): an adapter's (model/adapters.py)."""
    rows = tf.reshape(tf.cast(x, a.dtype), [-1, x.shape[-1]])
    y = tf.matmul(tf.matmul(rows, a), b) * scale
    return tf.reshape(y, tf.concat([tf.shape(x)[:-1], [b.shape[-1]]], 0))


# ---- the two ways of projecting: the whole layer, or a tensor group's slices ------------------------

def whole(layer: keras.layers.Layer):
    """project(name, x) for the whole layer: its Dense sub-layer `name` (bias and adapter included)."""
    return lambda name, x: getattr(layer, name)(x)


def sliced(w: dict):
    """project(name, x) for a tensor group: x times the slice `name` of `w` (`columns`, `rows`), plus its
    bias slice and its adapter's share where `w` has them: (B, T, width)."""
    def project(name: str, x):
        y = matmul(x, w[f"{name}/kernel"])
        if f"{name}/bias" in w:
            y += w[f"{name}/bias"]
        if f"{name}/{ADAPTER_IN}" in w:  # the adapter's scale is in its B slice already (its layer's group_slices)
            y += tf.cast(low_rank(x, w[f"{name}/{ADAPTER_IN}"], w[f"{name}/{ADAPTER_OUT}"], 1.0), y.dtype)
        return y
    return project


ADAPTER_IN, ADAPTER_OUT = "adapter_in", "adapter_out"  # the keys of an adapter's A (in, r) and B (r, out) slices


def columns(dense: keras.layers.Dense, name: str, cut, dtype) -> dict:
    """The slice `cut` of `dense`'s output columns (cut: a function of a tensor whose last axis is the
    layer's output, e.g. `t[..., a:b]`), keyed by `name`: the kernel (C, width) and bias (width,) in
    `dtype`, and an adapter's (its layer's group_slices: A whole, B's columns)."""
    w = {f"{name}/kernel": kernel_slice(dense, dtype, cut)}
    if dense.bias is not None:
        w[f"{name}/bias"] = cut(tf.cast(dense.bias, dtype))
    if hasattr(dense, "group_slices"):
        w.update(dense.group_slices(name, columns=cut))
    return w


def rows(dense: keras.layers.Dense, name: str, start: int, width: int, dtype) -> dict:
    """Rows start..start+width of an output projection's kernel (width, C) (its bias: the layer's
    `combine`'s, added once), and an adapter's (A's rows, B whole): the groups' x_g A_g B sum to x A B."""
    w = {f"{name}/kernel": kernel_slice(dense, dtype, rows=slice(start, start + width))}
    if hasattr(dense, "group_slices"):
        w.update(dense.group_slices(name, rows=slice(start, start + width)))
    return w


def kernel_slice(dense: keras.layers.Dense, dtype, cut=lambda t: t, rows=slice(None)):
    """`dense`'s kernel rows `rows`, its columns cut by `cut` (applied to the kernel (in, out) and to the
    scales (out,) alike), in `dtype`: a bfloat16 kernel's slice cast, an int8 one's dequantized with its
    scales' slice (q / scale, as Keras computes), so only the slice is ever made float."""
    kernel = cut(tf.convert_to_tensor(dense.kernel)[rows])
    if dense.quantization_mode == "int8":
        kernel = tf.cast(kernel, tf.float32) / cut(tf.convert_to_tensor(dense.kernel_scale))
    return tf.cast(kernel, dtype)


def output(total, dense: keras.layers.Dense, dropout: keras.layers.Dropout, training):
    """A layer's output from the sum of its tensor groups' parts: `dense`'s bias added once, then dropout."""
    if dense.bias is not None:
        total = total + tf.cast(dense.bias, total.dtype)
    return dropout(total, training=training)
