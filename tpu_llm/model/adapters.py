"""LoRA (Hu et al. 2021) as Hugging Face PEFT computes it: low-rank adapters on chosen projections.

A projection y = x W + b with an adapter of rank r becomes

    y = x W + b + (dropout(x) A B) * alpha / r        A: (in, r), B: (r, out)

PEFT's `LoraLayer` with its defaults: A initialised as torch's kaiming_uniform_(a=sqrt(5)) on its
(r, in) weight (uniform in +-1/sqrt(in)), B zero (a new adapter leaves the model as it was), dropout
on the adapter's input only, the adapter computed in float32 (PEFT casts the input to lora_A's dtype)
and added to the base projection's output. Keras kernels are (in, out), so A and B here are the
transposes of PEFT's lora_A.weight (r, in) and lora_B.weight (out, r).

Which projections get one is `train.lora_targets` in PEFT's module names (each family's `peft_targets`):
one adapter per PEFT module. Our layouts hold the modules Hugging Face's models hold (llama: separate q,
k, v; gpt2: the fused c_attn, a single Conv1D in transformers too, whose adapter PEFT fits to the
whole (C, 3C) matrix), so each adapter is PEFT's, weight for weight: no fused kernel needs splitting.

Every other weight is frozen (not trainable: no gradient, no optimizer slots, bit-identical after
training); the adapters are the variables `.../lora_a` and `.../lora_b` beside the kernel they adapt
(e.g. block_0/attn/q/lora_a), saved in the checkpoints with the rest of the model.

The frozen base (train.lora_base_dtype): every projection kernel of the blocks is stored as float32,
bfloat16, or int8 as Keras' own int8 Dense holds it (Dense.quantize("int8")'s variables: one float32
scale per output column, `.../kernel_scale`, W ~ q / scale), weight-only: the input is not quantized, so
the int8 kernel saves memory without rounding the activations. The embeddings, head, norms and biases stay float32 (see
docs/lora.md for why). The adapters are float32 in every case.
"""

from __future__ import annotations

import dataclasses
import math

import keras
import tensorflow as tf

from tpu_llm.config import Config
from tpu_llm.config.checks import adapted_layers, lora_targets
from tpu_llm.model.layers import ADAPTER_IN, ADAPTER_OUT, low_rank

ADAPTERS = ("/lora_a", "/lora_b")  # how an adapter's variables' paths end
SCALE = "/kernel_scale"  # an int8 kernel's per-output-channel scales (Keras' int8 Dense)
# Keras' int8 with no activation quantizer: the input stays in the compute dtype (weight-only int8)
WEIGHT_ONLY_INT8 = keras.quantizers.Int8QuantizationConfig(activation_quantizer=None)


@dataclasses.dataclass(frozen=True)
class Lora:
    """The adapters of a model: rank, scale (alpha / rank), dropout and the layers (paths below a block,
    e.g. attn/q) that get one. The model (model/transformer.py's GPT, its `adapters`) asks it which Dense
    layer each projection is, which weights to freeze and which are the base model's."""

    rank: int
    alpha: float
    dropout: float
    layers: frozenset
    base_dtype: str = "float32"  # train.lora_base_dtype: how the frozen projection kernels are stored
    targets: tuple = ()  # train.lora_targets: PEFT's module names (the layers' names there)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def dense(self, units: int, path: str, **options) -> keras.layers.Dense:
        """The projection at `path` (attn/q): with an adapter where the run names it; else frozen, in the
        base's dtype (a plain Dense for a float32 base)."""
        if path in self.layers:
            return LoraDense(units, self, **options)
        if self.base_dtype != "float32":  # a frozen kernel in bfloat16 or int8 all the same
            return FrozenDense(units, self.base_dtype, **options)
        return keras.layers.Dense(units, **options)

    def freeze_base(self, model) -> None:
        """Every weight of the built `model` but the adapters made non-trainable (the embeddings, norms and
        head: LoraDense froze its own kernel and bias)."""
        for v in model.weights:
            if not v.path.endswith(ADAPTERS):
                v.trainable = False

    def describe(self) -> str:
        """For the run's header: 'LoRA rank 8, alpha 16 on q_proj, v_proj, the rest frozen'."""
        base = f", the base stored in {self.base_dtype}" if self.base_dtype != "float32" else ""
        return f"LoRA rank {self.rank}, alpha {self.alpha:g} on {', '.join(self.targets)}, the rest frozen{base}"

    def base_weights(self, model) -> list:
        """The base model's weights: neither the adapters nor an int8 kernel's scales (no parameters)."""
        return [v for v in model.weights if not v.path.endswith((*ADAPTERS, SCALE))]


def adapters_for(cfg: Config) -> Lora | None:
    """The adapters the run's train.lora_* ask for (None: lora_rank 0, no adapters)."""
    train = cfg.train
    if not train.lora_rank:
        return None
    return Lora(train.lora_rank, train.lora_alpha, train.lora_dropout, frozenset(adapted_layers(cfg)),
                train.lora_base_dtype, tuple(lora_targets(train.lora_targets, cfg.model.family)))


class FrozenDense(keras.layers.Dense):
    """A frozen Dense layer whose kernel is stored as `base_dtype`: float32 (a plain Dense), bfloat16, or
    int8 as Keras' own int8 Dense (its dtype policy int8_from_<the global policy>: an int8 `kernel` and a
    float32 `kernel_scale` per output column, computed by Keras' _int8_call; weight-only: WEIGHT_ONLY_INT8).
    The kernel keeps its path (and its checkpoint key, the attribute `_kernel`). A bfloat16 kernel is cast
    to the compute dtype by Keras' Dense. Built in its stored dtype directly: no float32 kernel is made and
    dropped (Keras' Dense.quantize would, and its `del` runs a gc.collect per layer: ~0.3 s each)."""

    def __init__(self, units: int, base_dtype: str = "float32", **kwargs):
        if base_dtype == "int8":
            kwargs.update(dtype=f"int8_from_{keras.config.dtype_policy().name}", quantization_config=WEIGHT_ONLY_INT8)
        super().__init__(units, **kwargs)
        self.base_dtype = base_dtype

    def add_weight(self, *args, name=None, **kwargs):
        if name == "kernel" and self.base_dtype == "bfloat16":  # Dense.build's kernel, made bfloat16 and frozen
            kwargs.update(dtype="bfloat16", trainable=False)
        return super().add_weight(*args, name=name, **kwargs)

    def build(self, input_shape):
        super().build(input_shape)
        if self.base_dtype == "int8":  # Keras made it zeros: the initializer's draw, quantized as Dense.quantize does
            with tf.init_scope():  # eagerly: Keras builds a layer inside a scratch graph
                q, scale = quantized(self.kernel_initializer(self._kernel.shape, "float32"))
                self._kernel.assign(q)
                self.kernel_scale.assign(scale)
        self.add_adapter(input_shape)

    def add_adapter(self, input_shape) -> None:
        """A subclass's further variables (LoraDense: the adapter)."""


def quantized(kernel) -> tuple:
    """(int8 kernel, float32 scales (out,)) of a float `kernel` (in, out), as Keras' Dense.quantize("int8")
    computes them: abs-max per output column, q = round(w * scale), scale = 127 / max|w_col|; on the host."""
    q, scale = keras.quantizers.abs_max_quantize(tf.convert_to_tensor(kernel, tf.float32), axis=0, to_numpy=True)
    return q, tf.squeeze(scale, 0)


class LoraDense(FrozenDense):
    """A Dense layer (its kernel and bias at their paths, the kernel stored as `lora.base_dtype`) with a
    trainable float32 adapter."""

    def __init__(self, units: int, lora: Lora, **kwargs):
        super().__init__(units, lora.base_dtype, **kwargs)
        self.rank, self.scale = lora.rank, lora.scale
        self.lora_drop = keras.layers.Dropout(lora.dropout) if lora.dropout else None

    def add_adapter(self, input_shape) -> None:
        fan_in = int(input_shape[-1])
        bound = 1.0 / math.sqrt(fan_in)  # kaiming_uniform_(a=sqrt(5)): gain sqrt(1/3) * sqrt(3 / fan_in)
        # autocast off: read in float32 under mixed precision too (the adapter computes in float32)
        self.lora_a = self.add_weight(shape=(fan_in, self.rank), name="lora_a", autocast=False,
                                      initializer=keras.initializers.RandomUniform(-bound, bound))
        self.lora_b = self.add_weight(shape=(self.rank, self.units), name="lora_b", initializer="zeros",
                                      autocast=False)  # (the kernel and bias: frozen by GPT.build_weights)

    def call(self, inputs, training=None):
        return self._adapted(inputs, super().call(inputs), training)

    def _int8_call(self, inputs, training=None):
        """An int8 layer's call (Keras' Layer.__call__ calls this, not `call`), with the adapter."""
        return self._adapted(inputs, super()._int8_call(inputs), training)

    def _adapted(self, inputs, y, training):
        """The base projection's output `y` plus the adapter's, in y's dtype."""
        if self.lora_drop is not None:
            inputs = self.lora_drop(inputs, training=training)
        return y + tf.cast(adapter(inputs, self.lora_a, self.lora_b, self.scale), y.dtype)

    def group_slices(self, name: str, columns=None, rows: slice = slice(None)) -> dict:
        """A tensor group's share of the adapter (model/layers.py's `columns` and `rows`): A's rows `rows`
        and B * scale's columns cut by `columns` (the scale applied here, once, so that a group's slices are
        all it needs), in float32 under any precision: a group computes its adapter share in float32, as
        this layer and PEFT do, and adds it in the compute dtype. Groups draw no adapter dropout (config
        refuses train.lora_dropout with tensor groups)."""
        b = tf.convert_to_tensor(self.lora_b) * self.scale
        return {f"{name}/{ADAPTER_IN}": tf.convert_to_tensor(self.lora_a)[rows],
                f"{name}/{ADAPTER_OUT}": columns(b) if columns is not None else b}


def adapter(x, a, b, scale: float):
    """(x A B) * scale for x (B, T, in), A (in, r), B (r, out): (B, T, out) in A's dtype."""
    return low_rank(x, a, b, scale)


def adapted(model) -> list:
    """The model's LoraDense layers, by their path (block_i/attn/q, ...)."""
    return [layer for block in model.blocks for part in (block.attn, block.mlp)
            for layer in part._layers if isinstance(layer, LoraDense)]


def float_kernel(dense: keras.layers.Dense):
    """`dense`'s kernel in float32; an int8 one dequantized as Keras computes with it, q / scale."""
    kernel = tf.cast(tf.convert_to_tensor(dense.kernel), tf.float32)
    if dense.quantization_mode == "int8":
        kernel = kernel / tf.convert_to_tensor(dense.kernel_scale)
    return kernel


def merged_kernel(layer: LoraDense):
    """The layer's kernel with its adapter folded in, W + A B scale (float32): what `export` writes."""
    return float_kernel(layer) + tf.matmul(layer.lora_a, layer.lora_b) * layer.scale


def copy_base(base, model) -> None:
    """Assign every weight of `base` but its adapters (the same model without adapters, restored from a base
    run: train.init_from; or the reverse, `merged`) to `model`'s variable of that path, in that variable's
    dtype: cast to a bfloat16 base, quantized into an int8 one, an int8 kernel dequantized (q / scale)."""
    ours, theirs = model.by_path(), base.by_path()
    for path, variable in theirs.items():
        if path.endswith(ADAPTERS + (SCALE,)):
            continue
        value = variable
        if path + "_scale" in theirs:  # an int8 kernel (.../kernel and .../kernel_scale): W = q / scale
            value = tf.cast(variable, tf.float32) / theirs[path + "_scale"]
        if path + "_scale" in ours:  # quantized as Dense.quantize("int8") does: abs-max per output channel
            q, scale = quantized(value)
            ours[path].assign(q)
            ours[path + "_scale"].assign(scale)
        else:  # float32, or cast to a bfloat16 base
            ours[path].assign(tf.cast(value, ours[path].dtype))


def merged(model):
    """A model without adapters whose kernels are `model`'s with each adapter folded in (W + A B scale),
    every other weight the same: what `export` writes (SavedModel, model.weights.h5, --format hf), a model
    that loads without tpu-llm's or PEFT's adapter code. `model` itself without adapters is returned as it is."""
    if model.adapters is None:
        return model
    plain = type(model)(model.cfg, model.vocab_size).build_weights()
    copy_base(model, plain)  # the base weights; the adapters have no place in it ...
    prefix = model.name + "/"
    kernels = plain.by_path()
    for layer in adapted(model):  # ... but in its kernels
        kernels[f"{layer.path.removeprefix(prefix)}/kernel"].assign(merged_kernel(layer))
    return plain
