"""The decoder in Keras 3 layers, readable top to bottom; each family (`model.family`, model/families/)
picks its block's variant: the norm, the MLP, the q/k/v projections, the positions and the biases.

  gpt2:   token embedding (tied with the output head) + learned positions -> n_layer pre-LayerNorm blocks
          of causal multi-head attention (one fused q/k/v projection) and a GELU MLP -> final LayerNorm
  llama:  token embedding -> n_layer pre-RMSNorm blocks of grouped-query attention with rotary positions
          and a SwiGLU MLP, no biases -> final RMSNorm -> logits, the head tied to the embedding or its own
          (V, C) matrix (`model.tie_embeddings`); qwen2 adds q/k/v biases, qwen3 an RMSNorm over each head
          of q and k (and a head size of its own, model.head_dim), mistral is llama's layout

Variables (Keras paths; what `import`/`export --format hf` map Hugging Face tensors onto, the family's
`weights`), with C = n_embd, H = n_head, Hkv = n_kv_head (0: H), hd = model.head_dim (0: C / H), F = the
MLP's hidden size:
  every family  wte/embeddings (V, C); ln_f/gamma [beta] (LayerNorm) or ln_f/scale (RMSNorm), (C,)
  learned positions  wpe/embeddings (max_len, C)
  fused q/k/v   block_i/attn/qkv/kernel (C, 3C) [bias] (q, k, v side by side, each head-major)
  separate      block_i/attn/q/kernel (C, H hd), attn/k/kernel and attn/v/kernel (C, Hkv hd) [biases]
  q/k norms     block_i/attn/q_norm/scale, attn/k_norm/scale (hd,)
  both          block_i/ln1, ln2 (norms); block_i/attn/proj/kernel (H hd, C) [bias]
  GELU MLP      block_i/mlp/fc/kernel (C, F) [bias], block_i/mlp/proj/kernel (F, C) [bias]
  SwiGLU MLP    block_i/mlp/gate/kernel, mlp/up/kernel (C, F), block_i/mlp/down/kernel (F, C)
  untied head   lm_head/embeddings (V, C)
  adapters      (model/adapters.py) A (in, r) and B (r, out) beside each adapted kernel, e.g. in
                block_i/attn/q/; then only these are trainable
Keras Dense kernels are (in, out): the transpose of a torch Linear's weight. Rotary embeddings use
Hugging Face Llama's convention (rotate_half: dimension i pairs with i + hd/2, not interleaved), so
HF q/k weights need no permutation; query head h reads key/value head h // (H / Hkv) (HF repeat_kv).

One copy of each computation. The attention and the MLP each compute `part(x, project, ...)`, where
`project(name, x)` is one of their projections: the whole layer's call passes its Dense layers
(layers.whole), a tensor group its slices of their weights (layers.sliced: `group_weights(g, ways,
dtype)` cuts them), so Megatron's split by heads and hidden units runs the very same function on fewer
heads. `combine` turns the sum of the groups' parts into the layer's output (the output bias, once, and
dropout), and `Block.residual` holds the residual stream and the norms for both ways; where each group
runs is parallel/tensor.py's business. The model is also callable piecewise (`embed`, each of
`blocks`, `head` or `head_loss`) and says which layers a pipeline stage holds (`stage_layers`), so the
pipeline composes it without reaching into its weights. There is no device or strategy logic here.
Logits are always float32, whatever the compute dtype.

Attention takes an optional KV cache `(k, v)` of shape (B, Hkv, max_len, head_dim) and the position of
the first new token, which is how `sampling.py` decodes one token at a time.
"""

from __future__ import annotations

import functools
import math

import keras
import tensorflow as tf

from tpu_llm.model import attention, families, spec
from tpu_llm.model.adapters import adapters_for
from tpu_llm.model.adapters import merged as fold_adapters
from tpu_llm.model.layers import (RMSNorm, cache_write, columns, heads, matmul, norm, normal, output, rope,
                                  rope_scaling, rows, sliced, whole)
from tpu_llm.model.loss import chunked_loss, cross_entropy


def projection(cfg, block: families.Block, adapters, part: str, units: int, name: str,
               residual: bool = False) -> keras.layers.Dense:
    """The Dense layer `name` of layer `part` (attn or mlp), with the family's bias; with `adapters`
    (model/adapters.py), the kind of Dense they make for that path (an adapter, a frozen base)."""
    # GPT-2 init (every family): std 0.02, residual projections scaled by 1/sqrt(2 * n_layer)
    std = 0.02 / math.sqrt(2 * cfg.n_layer) if residual else 0.02
    options = dict(use_bias=block.dense_bias(name, cfg.bias), kernel_initializer=normal(std), name=name)
    if adapters is not None:
        return adapters.dense(units, f"{part}/{name}", **options)
    return keras.layers.Dense(units, **options)


def span(start: int, width: int):
    """Columns start..start+width of a tensor's last axis."""
    return lambda t: t[..., start:start + width]


class CausalSelfAttention(keras.layers.Layer):
    def __init__(self, cfg, block: families.Block, adapters=None, **kwargs):
        super().__init__(**kwargs)
        self.block, self.rope_theta, self.rope_scaling = block, cfg.rope_theta, rope_scaling(cfg)
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.kv_heads(), cfg.head_size()
        dense = functools.partial(projection, cfg, block, adapters, "attn")
        if block.qkv == "fused":
            self.qkv = dense(3 * cfg.n_embd, "qkv")
        else:  # separate projections: k and v have n_kv_head heads
            self.q = dense(self.n_head * self.head_dim, "q")
            self.k = dense(self.n_kv_head * self.head_dim, "k")
            self.v = dense(self.n_kv_head * self.head_dim, "v")
        if block.qk_norm:  # an RMSNorm over each head of q and of k (Qwen3), shared by the heads
            self.q_norm, self.k_norm = RMSNorm(cfg.norm_eps, name="q_norm"), RMSNorm(cfg.norm_eps, name="k_norm")
        self.proj = dense(cfg.n_embd, "proj", residual=True)
        self.attn_drop = keras.layers.Dropout(cfg.dropout)
        self.resid_drop = keras.layers.Dropout(cfg.dropout)
        self.attend = attention.for_config(cfg)  # model.attention: dense (attention.attend) or blockwise

    def call(self, x, training=False, cache=None, pos=0):
        y, cache = self.part(x, whole(self), training, pos, cache)
        return self.resid_drop(y, training=training), cache

    def part(self, x, project, training=False, pos=0, cache=None):
        """The attention of the heads whose projections `project` gives, from x (B, T, C) at positions pos..:
        ((B, T, C) before the output dropout, the cache with their keys and values written)."""
        q, k, v = self.qkv_heads(x, project, pos)
        if cache is not None:
            k, v = cache_write(cache[0], k, pos), cache_write(cache[1], v, pos)  # (B, Hkv, L, hd)
            cache = (k, v)
        y = self.attend(q, k, v, pos, self.attn_drop, training)  # (B, T, h * hd)
        return project("proj", y), cache  # (B, T, C)

    def qkv_heads(self, x, project, pos):
        """q (B, h, T, hd) and k, v (B, kv, T, hd) of the heads `project` gives, each head of q and k normed
        where the family norms them, and rotated where it uses rotary positions. (The norms' scales are read
        whole: a tensor group's backward returns their gradients as variables read inside its part.)"""
        hd = self.head_dim
        if self.block.qkv == "fused":
            qkv = project("qkv", x)  # (B, T, 3 h hd): q, k, v side by side
            qkv = tf.reshape(qkv, [tf.shape(x)[0], tf.shape(x)[1], 3, qkv.shape[-1] // (3 * hd), hd])  # (B, T, 3, h, hd)
            q, k, v = tf.unstack(tf.transpose(qkv, [2, 0, 3, 1, 4]))  # each (B, h, T, hd)
        else:
            q, k, v = (project(name, x) for name in ("q", "k", "v"))  # (B, T, h hd), (B, T, kv hd) twice
            q, k, v = heads(q, q.shape[-1] // hd), heads(k, k.shape[-1] // hd), heads(v, v.shape[-1] // hd)
        if self.block.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.block.rotary:
            q, k = rope(q, pos, self.rope_theta, self.rope_scaling), rope(k, pos, self.rope_theta, self.rope_scaling)
        return q, k, v

    # ---- tensor groups (parallel/tensor.py): the layer is the sum of `ways` parts -----------------

    def group_weights(self, g: int, ways: int, dtype) -> dict:
        """The weight slices tensor group g of `ways` reads, cast to `dtype`, by path below the layer
        (shapes: spec.group_shapes): the columns of q, k and v for kv heads g*Hkv/ways.. and the query
        heads that read them (heads g*H/ways..; fused q/k/v: Hkv = H), the matching rows of proj."""
        h, kv, hd = self.n_head // ways, self.n_kv_head // ways, self.head_dim
        if self.block.qkv == "fused":  # each of q, k and v: these heads' columns, side by side (C, 3 h hd)
            w = columns(self.qkv, "qkv", _heads_of(slice(g * h, (g + 1) * h), self.n_head, hd), dtype)
        else:
            w = columns(self.q, "q", span(g * h * hd, h * hd), dtype)  # (C, h hd)
            for name in ("k", "v"):  # (C, kv hd)
                w.update(columns(getattr(self, name), name, span(g * kv * hd, kv * hd), dtype))
        w.update(rows(self.proj, "proj", g * h * hd, h * hd, dtype))  # (h hd, C): matching rows
        return w

    def group_part(self, x, w: dict, training=False):
        """One group's share of the attention's output (B, T, C), before the proj bias and dropout, from
        its input x (B, T, C) and its slices `w` (group_weights) alone. Training positions: 0.. (no cache)."""
        return self.part(x, sliced(w), training)[0]

    def combine(self, total, training=False):
        """The layer's output from the sum of its groups' parts (B, T, C): the proj bias, then dropout."""
        return output(total, self.proj, self.resid_drop, training)

    def group_dropouts(self) -> list:
        """The dropout layers `group_part` draws masks from (once per group)."""
        return [self.attn_drop]


def _heads_of(chosen: slice, n_head: int, hd: int):
    """The columns of the heads `chosen` of each of q, k and v in a fused (.., 3 H hd) tensor: (.., 3 h hd)."""
    def cut(t):
        lead = list(t.shape[:-1])
        return tf.reshape(tf.reshape(t, lead + [3, n_head, hd])[..., chosen, :], lead + [-1])
    return cut


class MLP(keras.layers.Layer):
    """GELU: proj(gelu(fc(x))); SwiGLU: down(silu(gate(x)) * up(x)). Hidden size F."""

    def __init__(self, cfg, block: families.Block, adapters=None, **kwargs):
        super().__init__(**kwargs)
        self.block, hidden = block, cfg.hidden()
        dense = functools.partial(projection, cfg, block, adapters, "mlp")
        if block.mlp == "gelu":
            self.fc = dense(hidden, "fc")
            self.proj = dense(cfg.n_embd, "proj", residual=True)
        else:
            self.gate, self.up = dense(hidden, "gate"), dense(hidden, "up")
            self.down = dense(cfg.n_embd, "down", residual=True)
        self.drop = keras.layers.Dropout(cfg.dropout)
        # the projections into the hidden layer, and the one out of it
        self.into, self.out_of = (("fc",), "proj") if block.mlp == "gelu" else (("gate", "up"), "down")

    def call(self, x, training=False):
        return self.drop(self.part(x, whole(self)), training=training)

    def part(self, x, project):
        """The MLP of the hidden units whose projections `project` gives, from x (B, T, C): (B, T, C)."""
        if self.block.mlp == "gelu":
            return project("proj", tf.nn.gelu(project("fc", x), approximate=True))  # hidden (B, T, F)
        return project("down", tf.nn.silu(project("gate", x)) * project("up", x))  # hidden (B, T, F)

    # ---- tensor groups (parallel/tensor.py): the layer is the sum of `ways` parts -----------------

    def group_weights(self, g: int, ways: int, dtype) -> dict:
        """The weight slices tensor group g of `ways` reads, cast to `dtype`, by path below the layer
        (shapes: spec.group_shapes): units g*F/ways.. of the hidden layer, the columns of fc (SwiGLU: gate
        and up) and the matching rows of proj (SwiGLU: down)."""
        units = getattr(self, self.into[0]).kernel.shape[1] // ways
        w = {}
        for name in self.into:
            w.update(columns(getattr(self, name), name, span(g * units, units), dtype))  # (C, F/ways), (F/ways,)
        w.update(rows(getattr(self, self.out_of), self.out_of, g * units, units, dtype))  # (F/ways, C)
        return w

    def group_part(self, x, w: dict, training=False):
        """One group's share of the MLP's output (B, T, C), before the output bias and dropout, from its
        input x (B, T, C) and its slices `w` (group_weights) alone."""
        return self.part(x, sliced(w))

    def combine(self, total, training=False):
        """The layer's output from the sum of its groups' parts (B, T, C): the output bias, then dropout."""
        return output(total, getattr(self, self.out_of), self.drop, training)

    def group_dropouts(self) -> list:
        """The dropout layers `group_part` draws masks from: none (the MLP's dropout is in `combine`)."""
        return []


class Block(keras.layers.Layer):
    """x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, cfg, block: families.Block, adapters=None, **kwargs):
        super().__init__(**kwargs)
        self.ln1 = norm(cfg, block, "ln1")
        self.attn = CausalSelfAttention(cfg, block, adapters, name="attn")
        self.ln2 = norm(cfg, block, "ln2")
        self.mlp = MLP(cfg, block, adapters, name="mlp")

    def call(self, x, training=False, cache=None, pos=0):
        return self.residual(x, lambda h: self.attn(h, training=training, cache=cache, pos=pos),
                             lambda h: self.mlp(h, training=training))

    def residual(self, x, attn, mlp):
        """The block's residual stream and norms around `attn` (returning (y, cache)) and `mlp`, however
        those run (whole here; split over tensor groups in parallel/tensor.py): (x, cache)."""
        a, cache = attn(self.ln1(x))
        x = x + a
        return x + mlp(self.ln2(x)), cache


class GPT(keras.Model):
    """`adapters` (model/adapters.py's, `from_config`): adapters on the projections they name, every other
    weight frozen; None: no adapters, every weight trainable (train.freeze: optimizer.freeze)."""

    @classmethod
    def from_config(cls, cfg, vocab_size: int = 0) -> "GPT":
        """The model a run's config describes (model section, adapters), with `vocab_size` ids (default:
        model.vocab_size); not built yet."""
        return cls(cfg.model, vocab_size or cfg.model.vocab_size, adapters_for(cfg))

    def __init__(self, cfg, vocab_size: int, adapters=None, **kwargs):
        super().__init__(**kwargs)
        self.cfg, self.vocab_size, self.adapters = cfg, vocab_size, adapters
        block = families.of(cfg).block
        self.wte = keras.layers.Embedding(vocab_size, cfg.n_embd, embeddings_initializer=normal(0.02), name="wte")
        self.wpe = None  # rotary positions inside attention instead
        if block.positions == "learned":
            self.wpe = keras.layers.Embedding(cfg.max_len, cfg.n_embd, embeddings_initializer=normal(0.02), name="wpe")
        self.drop = keras.layers.Dropout(cfg.dropout)
        self.blocks = [Block(cfg, block, adapters, name=f"block_{i}") for i in range(cfg.n_layer)]
        for i, layer in enumerate(self.blocks):
            # Keras 3 tracks a list of layers for `weights`, but TF checkpoints do not see into it
            # (tf.train.Checkpoint(model=...) would save only the embeddings and the final norm)
            self._track_trackable(layer, name=f"block_{i}", overwrite=True)
        self.ln_f = norm(cfg, block, "ln_f")
        self.lm_head = None  # tied: the head is wte's table
        if not cfg.tie_embeddings:
            self.lm_head = keras.layers.Embedding(vocab_size, cfg.n_embd, embeddings_initializer=normal(0.02),
                                                  name="lm_head")

    def build_weights(self) -> "GPT":
        """Create every variable (call once, inside the strategy scope); with adapters, freeze the rest."""
        self(tf.zeros([1, 1], tf.int32))
        if self.adapters is not None:  # the embeddings, norms and head (the adapted layers froze their own)
            self.adapters.freeze_base(self)
        return self

    def embed(self, idx, training=False, pos=0):
        T = tf.shape(idx)[1]
        x = self.wte(idx)  # (B, T, C)
        if self.wpe is not None:  # learned positions
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

    def head_loss(self, x, targets, chunk: int = 0):
        """The mean loss of the last block's output x (B, T, C) against `targets` (B, T), float32: from the
        logits, or with `chunk` (train.loss_chunk) `chunk` tokens at a time, without the (B, T, V) logits."""
        if chunk:
            return chunked_loss(self.ln_f(x), self.head_weights(), targets, chunk)
        return loss_fn(self.head(x), targets)

    def stage_layers(self, embed: bool, blocks, head: bool) -> list:
        """The layers a pipeline stage holds and reads, in order: with `embed` the token table (learned
        positions, the embedding's dropout), the blocks numbered `blocks`, with `head` the final norm and
        the head's table (tied: wte, read again by the last stage unless it embeds too)."""
        layers = [self.wte, *[self.wpe] * (self.wpe is not None), self.drop] * embed
        layers += [self.blocks[b] for b in blocks]
        if head:
            layers += [self.ln_f] + ([self.lm_head] if self.lm_head is not None else [self.wte] * (not embed))
        return layers

    def merged(self) -> "GPT":
        """This model with every adapter folded into its kernel (float32), as a model without adapters; the
        model itself when it has none (model/adapters.py's `merged`)."""
        return fold_adapters(self)

    def by_path(self) -> dict:
        """{path below the model's own name (block_0/attn/q/kernel): variable} of every weight, dropout seeds
        left out. (A model built stage by stage, pipeline.build_weights, has paths without its name.)"""
        prefix = self.name + "/"
        return {v.path.removeprefix(prefix): v for v in self.weights if "seed_generator" not in v.path}

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
        shape = [batch, self.cfg.kv_heads(), self.cfg.max_len, self.cfg.head_size()]
        return [(tf.zeros(shape, self.compute_dtype), tf.zeros(shape, self.compute_dtype))
                for _ in self.blocks]

    # ---- size and cost ---------------------------------------------------------------------------

    def num_params(self, include_positions: bool = True) -> int:
        """The trainable parameters; with adapters, the base model's (the adapters are a small extra: the
        matmuls, and so the FLOPs, are the base model's)."""
        counted = self.trainable_variables if self.adapters is None else self.adapters.base_weights(self)
        n = sum(int(math.prod(v.shape)) for v in counted)
        return n if include_positions or self.wpe is None else n - self.cfg.max_len * self.cfg.n_embd

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6N (forward + backward matmuls; N the trainable parameters without
        the positions and, untied, without the input table: a lookup is no matmul) + 12 L C T
        (attention): spec.flops_per_token of this model's own variables."""
        return spec.flops_per_token(self.cfg, self.vocab_size, seq_len, n_params=self.num_params())


def loss_fn(logits, targets):
    """Mean next-token cross entropy, float32 (tpu_llm/model/loss.py: the gradient's memory)."""
    return cross_entropy(logits, targets)


def decay_mask(model: GPT) -> list:
    """Variables that get weight decay: the trained matrices but the embedding tables (Dense kernels and
    adapters; not norms, biases or embeddings; as transformers' Trainer decays a PEFT model's adapters)."""
    return [v for v in model.trainable_variables if len(v.shape) == 2 and not v.path.endswith("/embeddings")]
