"""Tensor parallelism (Megatron-LM style): each block's attention heads and MLP units split T ways.

Group g of a block computes heads g*H/T .. (g+1)*H/T - 1 of the attention and units g*F/T ..
(g+1)*F/T - 1 of the MLP's hidden layer (F = 4C for gpt2), from column slices of the qkv and fc
kernels (llama: q, k, v, gate and up), and multiplies its share by the matching row slice of each
output projection. With grouped-query attention (llama, Hkv key/value heads) the split is by
key/value head groups: group g takes kv heads g*Hkv/T .. (g+1)*Hkv/T - 1 and exactly the query
heads that read them (query head h reads kv head h // (H/Hkv)), which are again heads g*H/T ..; so T
must divide Hkv (config validation). The block's output is
the sum of the T partial products plus the projection bias: exactly the unsplit block (up to
float32 summation order), with nothing but that sum crossing between groups (Megatron's one
all-reduce per half-block, here an add that TensorFlow or XLA turns into copies between devices).

Where group g runs is the `Placement`'s business (distribute.py): off-TPU, a `tf.device` of its
own (logical CPUs or GPUs); on TPU, its tensors are annotated for logical core i*T + g of the
replica (i = the pipeline stage), the same mechanism that places pipeline stages, which is why the
two compose. `strategy.experimental_split_to_logical_devices` is not used: it requires the product
of its partition dimensions to equal a replica's whole core count (TF 2.20, tpu_strategy.py), so it
cannot split a block T ways inside one of P > 1 pipeline stages.

What is split is the work and the activations of the attention and MLP, forward AND backward, not
the weights: the variables, their gradients and AdamW's moments stay whole on the stage's first device
or logical core (group 0: `Placement.variables`, pipeline.build_weights), and each group reads its
slices from there every step. TF2's GradientTape does not colocate gradient ops with their forward
ops (they run where `tape.gradient` is called, the stage's scope), so each group's forward is recorded
on a tape of its own and its backward replayed inside the group's placement (`SplitBlock._on_group`);
only the input's gradient and the weight slices' gradients travel back. The placement audit
(tools/placement_audit.py, `tpu-llm bench placement`) shows the T groups sharing forward and backward
matmuls evenly on an offline TPUStrategy. Sharding the variables themselves would need XLA's SPMD
partitioner to own the layout, which the per-core assignments used for stages do not give; so
`parallel.pipeline_stages` is what divides the weights, and whether T groups are faster than data
parallelism on a TPU (the copies of weight slices and activations between cores against the shared
matmuls) is not measured here.

The layer norms, residual adds and dropout on the summed output run on the stage's own device
(replicated work, as in Megatron). Attention dropout draws its own mask per group, so with dropout
the split model is equivalent in distribution, not bit-for-bit.
"""

from __future__ import annotations

import tensorflow as tf

from tpu_llm.config import ModelConfig
from tpu_llm.model import Block, heads, rope


def split_shapes(cfg: ModelConfig, ways: int) -> dict[str, tuple[int, ...]]:
    """The weight slice one group holds, per kernel (config validation ensures T divides n_head,
    n_kv_head and the MLP's hidden size)."""
    c, hd = cfg.n_embd, cfg.n_embd // cfg.n_head
    heads, kv, units = cfg.n_head // ways, cfg.kv_heads() // ways, cfg.hidden() // ways
    if cfg.family == "llama":
        return {"attn/q": (c, heads * hd), "attn/k": (c, kv * hd), "attn/v": (c, kv * hd),
                "attn/proj": (heads * hd, c), "mlp/gate": (c, units), "mlp/up": (c, units), "mlp/down": (units, c)}
    return {"attn/qkv": (c, 3, heads, hd), "attn/proj": (heads * hd, c), "mlp/fc": (c, units), "mlp/proj": (units, c)}


class SplitBlock:
    """`block`'s forward pass (training or not) with its heads and MLP units in `ways` groups, group g
    under `placement.shard(stage, g)`. Call with x (B, T, C); returns (B, T, C)."""

    def __init__(self, block: Block, ways: int, placement, stage: int, training: bool):
        self.block, self.ways, self.training = block, ways, training
        self.placement, self.stage = placement, stage

    def __call__(self, x):
        b, training = self.block, self.training
        x = x + b.attn.resid_drop(self._sum(self._attention, b.ln1(x), b.attn.proj.bias), training=training)
        if b.mlp.family == "llama":
            return x + b.mlp.drop(self._sum(self._swiglu, b.ln2(x), None), training=training)
        return x + b.mlp.drop(self._sum(self._mlp, b.ln2(x), b.mlp.proj.bias), training=training)

    def _sum(self, part, x, bias):
        """sum over groups g of part(x, g), each on its group's device, plus the output bias."""
        partials = []
        for g in range(self.ways):
            with self.placement.shard(self.stage, g):
                x_g = self.placement.place_shard(x, self.stage, g)
                partials.append(self.placement.place_shard(self._on_group(part, x_g, g), self.stage, g))
        out = tf.add_n(partials)  # (B, T, C), back on the stage's device
        return out if bias is None else out + tf.cast(bias, out.dtype)

    def _on_group(self, part, x, g):
        """part(x, g), whose backward also runs on group g. TF2's GradientTape does not colocate gradient
        ops with their forward ops: they run where `tape.gradient` is called, the stage's scope, which
        would put every group's backward on the stage's first device or core. Here the group's forward
        is recorded on a tape of its own, and its backward replayed from that tape inside the group's
        placement; the gradients with respect to the weight slices are sent back to the stage's device,
        where the variables live."""
        @tf.custom_gradient
        def run(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = part(x, g)

            def backward(dy, variables=None):
                variables = list(variables or [])
                with self.placement.shard(self.stage, g):
                    dx, *dv = tape.gradient(y, [x] + variables, output_gradients=dy)
                    dx = self.placement.place_shard(dx, self.stage, g)
                return dx, dv
            return y, backward
        return run(x)

    def _attention(self, x, g):
        attn = self.block.attn
        if attn.family == "llama":
            return self._gqa(x, g)
        h, hd = attn.n_head // self.ways, attn.head_dim
        heads = slice(g * h, (g + 1) * h)
        kernel = tf.reshape(tf.cast(attn.qkv.kernel, x.dtype), [-1, 3, attn.n_head, hd])[:, :, heads]  # (C, 3, h, hd)
        qkv = tf.einsum("btc,cjhd->jbhtd", x, kernel)  # (3, B, h, T, hd)
        if attn.qkv.bias is not None:
            bias = tf.reshape(tf.cast(attn.qkv.bias, x.dtype), [3, attn.n_head, hd])[:, heads]  # (3, h, hd)
            qkv += bias[:, None, :, None, :]
        q, k, v = tf.unstack(qkv)  # each (B, h, T, hd)
        y = attn.attend(q, k, v, 0, attn.attn_drop, self.training)  # (B, T, h * hd)
        proj = tf.cast(attn.proj.kernel, x.dtype)[g * h * hd:(g + 1) * h * hd]  # (h * hd, C): matching rows
        return tf.einsum("btk,kc->btc", y, proj)  # (B, T, C), this group's share

    def _mlp(self, x, g):
        mlp = self.block.mlp
        units = mlp.fc.kernel.shape[1] // self.ways
        cols = slice(g * units, (g + 1) * units)
        hidden = tf.einsum("btc,cu->btu", x, tf.cast(mlp.fc.kernel, x.dtype)[:, cols])  # (B, T, 4C/T)
        if mlp.fc.bias is not None:
            hidden += tf.cast(mlp.fc.bias, x.dtype)[cols]
        hidden = tf.nn.gelu(hidden, approximate=True)
        return tf.einsum("btu,uc->btc", hidden, tf.cast(mlp.proj.kernel, x.dtype)[cols])  # (B, T, C)

    def _gqa(self, x, g):
        """llama attention of kv heads g*Hkv/T.. and their query heads g*H/T.. (rotary, no biases)."""
        attn = self.block.attn
        h, kv, hd = attn.n_head // self.ways, attn.n_kv_head // self.ways, attn.head_dim

        def columns(dense, n):  # this group's n heads of a (C, heads * hd) kernel
            return tf.cast(dense.kernel, x.dtype)[:, g * n * hd:(g + 1) * n * hd]

        q = heads(tf.einsum("btc,ck->btk", x, columns(attn.q, h)), h)  # (B, h, T, hd)
        k = heads(tf.einsum("btc,ck->btk", x, columns(attn.k, kv)), kv)  # (B, kv, T, hd)
        v = heads(tf.einsum("btc,ck->btk", x, columns(attn.v, kv)), kv)
        q, k = rope(q, 0, attn.rope_theta), rope(k, 0, attn.rope_theta)
        y = attn.attend(q, k, v, 0, attn.attn_drop, self.training)  # (B, T, h * hd)
        proj = tf.cast(attn.proj.kernel, x.dtype)[g * h * hd:(g + 1) * h * hd]  # (h * hd, C): matching rows
        return tf.einsum("btk,kc->btc", y, proj)

    def _swiglu(self, x, g):
        mlp = self.block.mlp
        units = mlp.gate.kernel.shape[1] // self.ways
        cols = slice(g * units, (g + 1) * units)
        gate = tf.einsum("btc,cu->btu", x, tf.cast(mlp.gate.kernel, x.dtype)[:, cols])  # (B, T, F/T)
        up = tf.einsum("btc,cu->btu", x, tf.cast(mlp.up.kernel, x.dtype)[:, cols])
        return tf.einsum("btu,uc->btc", tf.nn.silu(gate) * up, tf.cast(mlp.down.kernel, x.dtype)[cols])  # (B, T, C)
