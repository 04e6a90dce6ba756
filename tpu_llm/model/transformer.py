"""GPT decoder in Keras 3 layers, readable top to bottom, in two layouts (`model.family`).

gpt2:  token embedding (tied with the output head) + learned positions -> n_layer pre-LayerNorm
       blocks of causal multi-head attention and a GELU MLP -> final LayerNorm -> logits.
llama: token embedding -> n_layer pre-RMSNorm blocks of grouped-query attention with rotary
       positions (no learned positions; Llama 3.1's rescaled frequencies with model.rope_scaling=llama3)
       and a SwiGLU MLP, no biases -> final RMSNorm -> logits, with the output head tied to the
       embedding or its own (V, C) matrix (`model.tie_embeddings`). qwen2 is this layout with biases on
       q, k and v; mistral is this layout under Mistral's name (`ModelConfig.rotary`: all three).

Variables (Keras paths; what `import`/`export --format hf` map Hugging Face tensors onto), with
C = n_embd, H = n_head, Hkv = n_kv_head (0: H), hd = C / H, F = the MLP's hidden size (model.mlp_hidden):
  both       wte/embeddings (V, C); ln_f/gamma (gpt2) or ln_f/scale (llama layout), (C,)
  gpt2       wpe/embeddings (max_len, C); block_i/ln1, ln2: LayerNormalization gamma [beta];
             block_i/attn/qkv/kernel (C, 3C) [bias] (q, k, v side by side, each head-major),
             block_i/attn/proj/kernel (C, C) [bias]; block_i/mlp/fc/kernel (C, F) [bias],
             block_i/mlp/proj/kernel (F, C) [bias]
  llama      block_i/ln1/scale, block_i/ln2/scale (C,): RMSNorm;
             block_i/attn/q/kernel (C, H hd), block_i/attn/k/kernel and attn/v/kernel (C, Hkv hd)
             (qwen2: and attn/q/bias, attn/k/bias, attn/v/bias),
             block_i/attn/proj/kernel (H hd, C); block_i/mlp/gate/kernel, mlp/up/kernel (C, F),
             block_i/mlp/down/kernel (F, C); untied head: lm_head/embeddings (V, C)
  LoRA       (train.lora_*, model/lora.py) beside each adapted kernel, e.g. block_i/attn/q/lora_a (in, r) and
             block_i/attn/q/lora_b (r, out); then only these are trainable
Keras Dense kernels are (in, out): the transpose of a torch Linear's weight. Rotary embeddings use
Hugging Face Llama's convention (rotate_half: dimension i pairs with i + hd/2, not interleaved), so
HF q/k weights need no permutation; query head h reads key/value head h // (H / Hkv) (HF repeat_kv).

The blocks are an explicit list (`GPT.blocks`) and the model is also callable piecewise (`embed`,
each block, `head`) so a pipeline can group blocks into stages. There is no device or strategy logic
here. Logits are always float32, whatever the compute dtype.

Tensor groups: CausalSelfAttention and MLP are also the sum of `ways` parts (Megatron's split by heads
and hidden units). `group_weights(g, ways, dtype)` cuts the weight slices group g reads,
`group_part(x, weights, training)` computes the group's (B, T, C) share from its input and those slices
alone, and `combine(total, training)` turns the sum of the shares into the layer's output (output bias,
dropout). Where each group runs, the sum and the per-group backward are parallel/tensor.py's.

Attention takes an optional KV cache `(k, v)` of shape (B, Hkv, max_len, head_dim) and the position of
the first new token, which is how `sampling.py` decodes one token at a time. Cache writes use a
one-hot mix rather than dynamic slicing so the shapes stay static and the decode step compiles with
XLA.
"""

from __future__ import annotations

import math

import keras
import tensorflow as tf

from tpu_llm import model_spec
from tpu_llm.config import ModelConfig
from tpu_llm.model import attention
from tpu_llm.model.lora import SCALE, FrozenDense, Lora, LoraDense, adapter
from tpu_llm.model.loss import cross_entropy


def _normal(std: float) -> keras.initializers.Initializer:
    return keras.initializers.RandomNormal(mean=0.0, stddev=std)


def _dense(units: int, cfg: ModelConfig, name: str, residual: bool = False, lora: Lora | None = None,
           part: str = "") -> keras.layers.Dense:
    """A projection of layer `part` (attn or mlp): with an adapter (LoraDense) when `lora` names it."""
    # GPT-2 init (every family): std 0.02, residual projections scaled by 1/sqrt(2 * n_layer)
    std = 0.02 / math.sqrt(2 * cfg.n_layer) if residual else 0.02
    # biases (model_spec._dense): every gpt2 layer with model.bias; of the rotary families, qwen2's q, k, v
    bias = cfg.bias if not cfg.rotary() else name in ("q", "k", "v") and cfg.qkv_bias()
    if lora is not None and f"{part}/{name}" in lora.layers:
        return LoraDense(units, lora, use_bias=bias, kernel_initializer=_normal(std), name=name)
    if lora is not None and lora.base_dtype != "float32":  # a frozen kernel in bfloat16 or int8 all the same
        return FrozenDense(units, lora.base_dtype, use_bias=bias, kernel_initializer=_normal(std), name=name)
    return keras.layers.Dense(units, use_bias=bias, kernel_initializer=_normal(std), name=name)


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


def norm(cfg: ModelConfig, name: str) -> keras.layers.Layer:
    if cfg.rotary():
        return RMSNorm(cfg.norm_eps, name=name)
    return keras.layers.LayerNormalization(epsilon=cfg.norm_eps, center=cfg.bias, name=name)


def rope_scaling(cfg: ModelConfig) -> tuple | None:
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


class CausalSelfAttention(keras.layers.Layer):
    def __init__(self, cfg: ModelConfig, lora: Lora | None = None, **kwargs):
        super().__init__(**kwargs)
        self.family, self.rope_theta, self.rope_scaling = cfg.family, cfg.rope_theta, rope_scaling(cfg)
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.kv_heads(), cfg.n_embd // cfg.n_head
        if cfg.family == "gpt2":
            self.qkv = _dense(3 * cfg.n_embd, cfg, "qkv", lora=lora, part="attn")
        else:  # separate projections: k and v have n_kv_head heads
            self.q = _dense(self.n_head * self.head_dim, cfg, "q", lora=lora, part="attn")
            self.k = _dense(self.n_kv_head * self.head_dim, cfg, "k", lora=lora, part="attn")
            self.v = _dense(self.n_kv_head * self.head_dim, cfg, "v", lora=lora, part="attn")
        self.proj = _dense(cfg.n_embd, cfg, "proj", residual=True, lora=lora, part="attn")
        self.attn_drop = keras.layers.Dropout(cfg.dropout)
        self.resid_drop = keras.layers.Dropout(cfg.dropout)
        self.attend = attention.for_config(cfg)  # model.attention: dense (attention.attend) or blockwise

    def call(self, x, training=False, cache=None, pos=0):
        B, T = tf.shape(x)[0], tf.shape(x)[1]
        if self.family == "gpt2":
            qkv = tf.reshape(self.qkv(x), [B, T, 3, self.n_head, self.head_dim])  # (B, T, 3, H, hd)
            q, k, v = tf.unstack(tf.transpose(qkv, [2, 0, 3, 1, 4]))  # each (B, H, T, hd)
        else:
            q = heads(self.q(x), self.n_head)  # (B, H, T, hd)
            k, v = heads(self.k(x), self.n_kv_head), heads(self.v(x), self.n_kv_head)  # (B, Hkv, T, hd)
            q, k = rope(q, pos, self.rope_theta, self.rope_scaling), rope(k, pos, self.rope_theta, self.rope_scaling)
        if cache is not None:
            k, v = _cache_write(cache[0], k, pos), _cache_write(cache[1], v, pos)  # (B, Hkv, L, hd)
            cache = (k, v)
        y = self.attend(q, k, v, pos, self.attn_drop, training)  # (B, T, C)
        return self.resid_drop(self.proj(y), training=training), cache

    # ---- tensor groups (parallel/tensor.py): the layer is the sum of `ways` parts -----------------

    def group_weights(self, g: int, ways: int, dtype) -> dict:
        """The weight slices tensor group g of `ways` reads, cast to `dtype`, by path below the layer
        (shapes: model_spec.group_shapes): the columns of q, k and v for kv heads g*Hkv/ways.. and the
        query heads that read them (heads g*H/ways..; gpt2: Hkv = H), the matching rows of proj."""
        h, hd = self.n_head // ways, self.head_dim
        if self.family == "gpt2":
            heads = slice(g * h, (g + 1) * h)
            w = {"qkv/kernel": _kernel_slice(self.qkv, dtype,  # (C, 3, h, hd); an int8 one's scales (1, 3, h, hd)
                                             lambda t: tf.reshape(t, [-1, 3, self.n_head, hd])[..., heads, :])}
            if self.qkv.bias is not None:  # (C, 3, h, hd) and (3, h, hd)
                w["qkv/bias"] = tf.reshape(tf.cast(self.qkv.bias, dtype), [3, self.n_head, hd])[:, heads]
            if isinstance(self.qkv, LoraDense):  # A whole (C, r), B's columns of these heads (r, 3, h, hd)
                w.update(_adapter_slices(self.qkv, "qkv"))
                w["qkv/lora_b"] = tf.reshape(w["qkv/lora_b"], [-1, 3, self.n_head, hd])[:, :, heads]
        else:
            kv = self.n_kv_head // ways
            w = _columns(self.q, "q", g * h * hd, h * hd, dtype)  # (C, h hd)
            for name in ("k", "v"):  # (C, kv hd)
                w.update(_columns(getattr(self, name), name, g * kv * hd, kv * hd, dtype))
        w.update(_rows(self.proj, "proj", g * h * hd, h * hd, dtype))  # (h hd, C): matching rows
        return w

    def group_part(self, x, w: dict, training=False):
        """One group's share of the attention's output (B, T, C), before the proj bias and dropout, from
        its input x (B, T, C) and its slices `w` (group_weights) alone. Training positions: 0.. (no cache)."""
        if self.family == "gpt2":
            kernel = w["qkv/kernel"]  # (C, 3, h, hd)
            qkv = matmul(x, tf.reshape(kernel, [kernel.shape[0], -1]))  # (B, T, 3 h hd)
            if "qkv/bias" in w:
                qkv += tf.reshape(w["qkv/bias"], [-1])
            if "qkv/lora_a" in w:
                b = tf.reshape(w["qkv/lora_b"], [w["qkv/lora_b"].shape[0], -1])
                qkv += tf.cast(adapter(x, w["qkv/lora_a"], b, 1.0), qkv.dtype)
            qkv = tf.reshape(qkv, [tf.shape(x)[0], tf.shape(x)[1], *kernel.shape[1:]])  # (B, T, 3, h, hd)
            q, k, v = tf.unstack(tf.transpose(qkv, [2, 0, 3, 1, 4]))  # each (B, h, T, hd)
        else:  # llama layout: kv heads of this group and their query heads (with their q/k/v bias slices), rotary
            q = heads(_project(x, w, "q"), w["q/kernel"].shape[1] // self.head_dim)  # (B, h, T, hd)
            kv = w["k/kernel"].shape[1] // self.head_dim
            k, v = heads(_project(x, w, "k"), kv), heads(_project(x, w, "v"), kv)  # (B, kv, T, hd)
            q, k = rope(q, 0, self.rope_theta, self.rope_scaling), rope(k, 0, self.rope_theta, self.rope_scaling)
        y = self.attend(q, k, v, 0, self.attn_drop, training)  # (B, T, h * hd)
        return _project(y, w, "proj")  # (B, T, C), this group's share (its bias: combine's)

    def combine(self, total, training=False):
        """The layer's output from the sum of its groups' parts (B, T, C): the proj bias, then dropout."""
        return _output(total, self.proj, self.resid_drop, training)

    def group_dropouts(self) -> list:
        """The dropout layers `group_part` draws masks from (once per group)."""
        return [self.attn_drop]


def heads(x, n: int):
    """(B, T, n * hd) -> (B, n, T, hd)."""
    B, T = tf.shape(x)[0], tf.shape(x)[1]
    return tf.transpose(tf.reshape(x, [B, T, n, x.shape[-1] // n]), [0, 2, 1, 3])


def _columns(dense: keras.layers.Dense, name: str, start: int, width: int, dtype) -> dict:
    """Columns start..start+width of `dense`'s kernel (C, width) and bias (width,), cast to `dtype`; with an
    adapter, its whole A (C, r) and those columns of B (r, width)."""
    w = {f"{name}/kernel": _kernel_slice(dense, dtype, lambda t: t[..., start:start + width])}
    if dense.bias is not None:
        w[f"{name}/bias"] = tf.cast(dense.bias, dtype)[start:start + width]
    if isinstance(dense, LoraDense):
        w.update(_adapter_slices(dense, name))
        w[f"{name}/lora_b"] = w[f"{name}/lora_b"][:, start:start + width]
    return w


def _rows(dense: keras.layers.Dense, name: str, start: int, width: int, dtype) -> dict:
    """Rows start..start+width of an output projection's kernel (width, C) (its bias: `combine`'s); with an
    adapter, those rows of A (width, r) and the whole B (r, C): the groups' x_g A_g B sum to x A B."""
    w = {f"{name}/kernel": _kernel_slice(dense, dtype, rows=slice(start, start + width))}
    if isinstance(dense, LoraDense):
        w.update(_adapter_slices(dense, name))
        w[f"{name}/lora_a"] = w[f"{name}/lora_a"][start:start + width]
    return w


def _kernel_slice(dense: keras.layers.Dense, dtype, columns=lambda t: t, rows=slice(None)):
    """`dense`'s kernel rows `rows`, its columns cut by `columns` (applied to the kernel (in, out) and to the
    scales (out,) alike), in `dtype`: a bfloat16 kernel's slice cast, an int8 one's dequantized with its
    scales' slice (q / scale, as Keras computes), so only the slice is ever made float."""
    kernel = columns(tf.convert_to_tensor(dense.kernel)[rows])
    if dense.quantization_mode == "int8":
        kernel = tf.cast(kernel, tf.float32) / columns(tf.convert_to_tensor(dense.kernel_scale))
    return tf.cast(kernel, dtype)


def _adapter_slices(dense: LoraDense, name: str) -> dict:
    """`dense`'s adapter A and B * scale (the scale applied here, once, so that a group's slices are all it
    needs), in float32 under any precision: a group computes its adapter share in float32, as LoraDense and
    PEFT do, and adds it in the compute dtype (`adapter`'s callers cast). Groups draw no adapter dropout
    (config refuses train.lora_dropout with tensor groups)."""
    return {f"{name}/lora_a": tf.convert_to_tensor(dense.lora_a),
            f"{name}/lora_b": tf.convert_to_tensor(dense.lora_b) * dense.scale}


def matmul(x, kernel, transpose: bool = False):
    """x (B, T, K) times kernel (K, N), or kernel (N, K) transposed: (B, T, N), as a 2-D matmul of the
    (B T, K) rows, as Keras' Dense does. Not tf.einsum: TF's TPU compiler keeps a MatMul's core
    assignment (pipeline stages, tensor groups) and drops an Einsum's."""
    B, T = tf.shape(x)[0], tf.shape(x)[1]
    y = tf.matmul(tf.reshape(x, [-1, x.shape[-1]]), kernel, transpose_b=transpose)  # (B T, N)
    return tf.reshape(y, [B, T, y.shape[-1]])


def _project(x, w: dict, name: str):
    """x (B, T, C) times the slice `name` of `w` (plus its bias slice and its adapter's share): (B, T, width)."""
    y = matmul(x, w[f"{name}/kernel"])
    if f"{name}/bias" in w:
        y += w[f"{name}/bias"]
    if f"{name}/lora_a" in w:
        y += tf.cast(adapter(x, w[f"{name}/lora_a"], w[f"{name}/lora_b"], 1.0), y.dtype)
    return y


def _output(total, dense: keras.layers.Dense, dropout: keras.layers.Dropout, training):
    """A layer's output from the sum of its tensor groups' parts: `dense`'s bias added once, then dropout."""
    if dense.bias is not None:
        total = total + tf.cast(dense.bias, total.dtype)
    return dropout(total, training=training)


def _cache_write(cache, new, pos):
    """cache (B, Hkv, L, hd) with `new` (B, Hkv, T, hd) written at positions pos..pos+T-1."""
    L, T = cache.shape[2], tf.shape(new)[2]
    onehot = tf.one_hot(pos + tf.range(T), L, dtype=cache.dtype)  # (T, L)
    keep = 1.0 - tf.reduce_sum(onehot, axis=0)[None, None, :, None]  # (1, 1, L, 1)
    return cache * keep + tf.einsum("bhtd,tl->bhld", new, onehot)


class MLP(keras.layers.Layer):
    """gpt2: proj(gelu(fc(x))); llama: down(silu(gate(x)) * up(x)) (SwiGLU). Hidden size F."""

    def __init__(self, cfg: ModelConfig, lora: Lora | None = None, **kwargs):
        super().__init__(**kwargs)
        self.family, hidden = cfg.family, cfg.hidden()
        if cfg.family == "gpt2":
            self.fc = _dense(hidden, cfg, "fc", lora=lora, part="mlp")
            self.proj = _dense(cfg.n_embd, cfg, "proj", residual=True, lora=lora, part="mlp")
        else:
            self.gate, self.up = (_dense(hidden, cfg, name, lora=lora, part="mlp") for name in ("gate", "up"))
            self.down = _dense(cfg.n_embd, cfg, "down", residual=True, lora=lora, part="mlp")
        self.drop = keras.layers.Dropout(cfg.dropout)

    def call(self, x, training=False):
        if self.family == "gpt2":
            h = tf.nn.gelu(self.fc(x), approximate=True)  # (B, T, F)
            return self.drop(self.proj(h), training=training)  # (B, T, C)
        h = tf.nn.silu(self.gate(x)) * self.up(x)  # (B, T, F)
        return self.drop(self.down(h), training=training)  # (B, T, C)

    # ---- tensor groups (parallel/tensor.py): the layer is the sum of `ways` parts -----------------

    def group_weights(self, g: int, ways: int, dtype) -> dict:
        """The weight slices tensor group g of `ways` reads, cast to `dtype`, by path below the layer
        (shapes: model_spec.group_shapes): units g*F/ways.. of the hidden layer, the columns of fc (llama:
        gate and up) and the matching rows of proj (llama: down)."""
        first, last = (("fc",), "proj") if self.family == "gpt2" else (("gate", "up"), "down")
        units = getattr(self, first[0]).kernel.shape[1] // ways
        w = {}
        for name in first:
            w.update(_columns(getattr(self, name), name, g * units, units, dtype))  # (C, F/ways), (F/ways,)
        w.update(_rows(getattr(self, last), last, g * units, units, dtype))  # (F/ways, C)
        return w

    def group_part(self, x, w: dict, training=False):
        """One group's share of the MLP's output (B, T, C), before the output bias and dropout, from its
        input x (B, T, C) and its slices `w` (group_weights) alone."""
        if self.family == "gpt2":
            hidden = tf.nn.gelu(_project(x, w, "fc"), approximate=True)  # (B, T, F/ways)
            return _project(hidden, w, "proj")  # (B, T, C)
        gate, up = _project(x, w, "gate"), _project(x, w, "up")  # (B, T, F/ways)
        return _project(tf.nn.silu(gate) * up, w, "down")  # (B, T, C)

    def combine(self, total, training=False):
        """The layer's output from the sum of its groups' parts (B, T, C): the output bias, then dropout."""
        return _output(total, self.proj if self.family == "gpt2" else self.down, self.drop, training)

    def group_dropouts(self) -> list:
        """The dropout layers `group_part` draws masks from: none (the MLP's dropout is in `combine`)."""
        return []


class Block(keras.layers.Layer):
    """x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: ModelConfig, lora: Lora | None = None, **kwargs):
        super().__init__(**kwargs)
        self.ln1 = norm(cfg, "ln1")
        self.attn = CausalSelfAttention(cfg, lora, name="attn")
        self.ln2 = norm(cfg, "ln2")
        self.mlp = MLP(cfg, lora, name="mlp")

    def call(self, x, training=False, cache=None, pos=0):
        a, cache = self.attn(self.ln1(x), training=training, cache=cache, pos=pos)
        x = x + a
        x = x + self.mlp(self.ln2(x), training=training)
        return x, cache


class GPT(keras.Model):
    """`lora`: adapters on the projections it names (model/lora.py: train.lora_*), every other weight
    frozen; None: no adapters, every weight trainable (train.freeze: optimizer.freeze)."""

    def __init__(self, cfg: ModelConfig, vocab_size: int, lora: Lora | None = None, **kwargs):
        super().__init__(**kwargs)
        self.cfg, self.vocab_size, self.lora = cfg, vocab_size, lora
        self.wte = keras.layers.Embedding(vocab_size, cfg.n_embd, embeddings_initializer=_normal(0.02),
                                          name="wte")
        self.wpe = None  # llama: rotary positions inside attention instead
        if cfg.family == "gpt2":
            self.wpe = keras.layers.Embedding(cfg.max_len, cfg.n_embd, embeddings_initializer=_normal(0.02),
                                              name="wpe")
        self.drop = keras.layers.Dropout(cfg.dropout)
        self.blocks = [Block(cfg, lora, name=f"block_{i}") for i in range(cfg.n_layer)]
        for i, block in enumerate(self.blocks):
            # Keras 3 tracks a list of layers for `weights`, but TF checkpoints do not see into it
            # (tf.train.Checkpoint(model=...) would save only the embeddings and the final norm)
            self._track_trackable(block, name=f"block_{i}", overwrite=True)
        self.ln_f = norm(cfg, "ln_f")
        self.lm_head = None  # tied: the head is wte's table
        if not cfg.tie_embeddings:
            self.lm_head = keras.layers.Embedding(vocab_size, cfg.n_embd, embeddings_initializer=_normal(0.02),
                                                  name="lm_head")

    def build_weights(self) -> "GPT":
        """Create every variable (call once, inside the strategy scope); with adapters, freeze the rest."""
        self(tf.zeros([1, 1], tf.int32))
        if self.lora is not None:  # the embeddings, norms and head (LoraDense froze its own kernel and bias)
            for v in self.weights:
                if not v.path.endswith(("/lora_a", "/lora_b")):
                    v.trainable = False
        return self

    def embed(self, idx, training=False, pos=0):
        T = tf.shape(idx)[1]
        x = self.wte(idx)  # (B, T, C)
        if self.wpe is not None:  # gpt2: learned positions
            x = x + self.wpe(pos + tf.range(T))[None]
        return self.drop(x, training=training)

    def head_weights(self):
        """The output head's (V, C) matrix: the embedding table (tied) or lm_head's own."""
        if self.lm_head is None:
            return self.wte.embeddings
        if not self.lm_head.built:
            self.lm_head.build()
        return self.lm_head.embeddings

    def head(self, x):
        x = self.ln_f(x)
        # logits in float32 even under mixed precision
        return matmul(tf.cast(x, tf.float32), tf.cast(self.head_weights(), tf.float32), transpose=True)  # (B, T, V)

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
        shape = [batch, self.cfg.kv_heads(), self.cfg.max_len, self.cfg.n_embd // self.cfg.n_head]
        return [(tf.zeros(shape, self.compute_dtype), tf.zeros(shape, self.compute_dtype))
                for _ in self.blocks]

    # ---- size and cost ---------------------------------------------------------------------------

    def num_params(self, include_positions: bool = True) -> int:
        """The trainable parameters; with adapters, the base model's (the adapters are a small extra: the
        matmuls, and so the FLOPs, are the base model's)."""
        counted = self.trainable_variables if self.lora is None else [  # (an int8 base's scales: no parameters)
            v for v in self.weights if not v.path.endswith(("/lora_a", "/lora_b", SCALE))]
        n = sum(int(math.prod(v.shape)) for v in counted)
        return n if include_positions or self.wpe is None else n - self.cfg.max_len * self.cfg.n_embd

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6N (forward + backward matmuls; N the trainable parameters without
        the positions and, untied, without the input table: a lookup is no matmul) + 12 L C T
        (attention): model_spec.flops_per_token of this model's own variables."""
        return model_spec.flops_per_token(self.cfg, self.vocab_size, seq_len, n_params=self.num_params())


def loss_fn(logits, targets):
    """Mean next-token cross entropy, float32 (tpu_llm/model/loss.py: the gradient's memory)."""
    return cross_entropy(logits, targets)


def decay_mask(model: GPT) -> list:
    """Variables that get weight decay: Dense kernels and LoRA's A and B (not norms, biases or embeddings; as
    transformers' Trainer decays a PEFT model's adapters)."""
    decayed = ("kernel", "lora_a", "lora_b")
    return [v for v in model.trainable_variables if len(v.shape) == 2 and v.path.endswith(decayed)]
