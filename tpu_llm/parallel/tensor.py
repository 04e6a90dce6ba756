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

What a group computes is the model's own: CausalSelfAttention and MLP (model/transformer.py) give the
weight slices group g reads (`group_weights(g, ways, dtype)`), the group's share from its input and
those slices alone (`group_part(x, weights, training)`) and the layer's output from the sum of the
shares (`combine`: the output bias, then dropout). `SplitBlock` here keeps where each group runs, the
sum and the backward on each group's device; a new family or an adapter changes the model only.

Where group g runs is the `Placement`'s business (mesh.py: the `tensor` axis): off-TPU, a `tf.device` of its
own (logical CPUs or GPUs); on TPU, its tensors are annotated for logical core i*T + g of the
replica (i = the pipeline stage), the same mechanism that places pipeline stages, which is why the
two compose. `strategy.experimental_split_to_logical_devices` is not used: it requires the product
of its partition dimensions to equal a replica's whole core count (TF 2.20, tpu_strategy.py), so it
cannot split a block T ways inside one of P > 1 pipeline stages.

What is split is the work and the activations of the attention and MLP, forward AND backward, not
the weights: the variables, their gradients and AdamW's moments stay whole on the stage's first device
or logical core (group 0: `Placement.variables_at`, pipeline.build_weights); each group's slices are cut
there (in the stage's placement) and only the slices travel to the group, every step. TF2's GradientTape does not colocate gradient ops with their forward
ops (they run where `tape.gradient` is called, the stage's scope), so each group's forward is recorded
on a tape of its own and its backward replayed inside the group's placement (`SplitBlock._on_group`);
only the input's gradient and the weight slices' gradients travel back. The placement audit
(harness/placement_audit.py, `tpu-llm bench placement`) shows the T groups sharing forward and backward
matmuls evenly in the compiled program of an offline TPUStrategy, and no group core but the stage's
first computing a tensor of a whole kernel's shape. Sharding the variables themselves would need XLA's SPMD
partitioner to own the layout, which the per-core assignments used for stages do not give; so
`parallel.pipeline_stages` is what divides the weights, and whether T groups are faster than data
parallelism on a TPU (the copies of weight slices and activations between cores against the shared
matmuls) is not measured here.

The layer norms, residual adds and dropout on the summed output run on the stage's own device
(replicated work, as in Megatron). Attention dropout draws its own mask per group, so with dropout
the split model is equivalent in distribution, not bit-for-bit.
"""

from __future__ import annotations

import contextlib

import tensorflow as tf

from tpu_llm.model import Block


@contextlib.contextmanager
def group_seeds(dropouts: list):
    """Inside: seed_of_group(g), a context in which each of `dropouts` draws group g's own seed. Each
    generator draws once, here (in the stage's placement: its state is read and written where it lives,
    never from a group's core), and group g's seed is that draw folded with g
    (tf.random.experimental.stateless_fold_in): the groups' masks differ, and a rematerialised block
    replaying its draws (pipeline.remat_with_dropout) replays them too."""
    generators = [d.seed_generator for d in dropouts if d.rate > 0 and getattr(d, "seed_generator", None) is not None]
    bases = [generator.next() for generator in generators]  # (2,) each

    @contextlib.contextmanager
    def seed_of_group(g: int):
        saved = [generator.__dict__.get("next") for generator in generators]  # a replaying block's own
        for generator, base in zip(generators, bases):
            generator.next = lambda ordered=True, base=base: tf.random.experimental.stateless_fold_in(base, g)
        try:
            yield
        finally:
            for generator, previous in zip(generators, saved):
                if previous is None:
                    del generator.next
                else:
                    generator.next = previous
    yield seed_of_group


class SplitBlock:
    """`block`'s forward pass (training or not) with its heads and MLP units in `ways` groups, group g
    under `placement.at(layers=stage, heads=g)`. Call with x (B, T, C); returns (B, T, C). What a group computes
    is the layer's (`group_weights`, `group_part`, `combine` in model/transformer.py); here is only
    where it runs, the sum over the groups and the backward on each group's device."""

    def __init__(self, block: Block, placement, stage: int, training: bool):
        self.block, self.ways, self.training = block, placement.mesh.size_of("heads"), training
        self.placement, self.stage = placement, stage

    def __call__(self, x):
        b = self.block  # the block's own residual stream and norms, around its split attention and MLP
        return b.residual(x, lambda h: (self._split(b.attn, h), None), lambda h: self._split(b.mlp, h))[0]

    def _split(self, layer, x):
        """layer(x) as the sum over groups g of layer.group_part on g's slices, each on its group's
        device; the sum and layer.combine (output bias, dropout) on the stage's."""
        partials = []
        with group_seeds(layer.group_dropouts() if self.training else []) as seed_of_group:
            for g in range(self.ways):
                # sliced where the variables live (the stage's placement): only the slices travel to the group
                weights = layer.group_weights(g, self.ways, x.dtype)
                with self.placement.at(layers=self.stage, heads=g), seed_of_group(g):
                    x_g = self.placement.place(x, layers=self.stage, heads=g)
                    partials.append(self.placement.place(self._on_group(layer, x_g, weights, g), layers=self.stage, heads=g))
        return layer.combine(tf.add_n(partials), training=self.training)  # (B, T, C), on the stage's device

    def _on_group(self, layer, x, weights: dict, g: int):
        """layer.group_part(x, weights), whose backward also runs on group g. TF2's GradientTape does not
        colocate gradient ops with their forward ops: they run where `tape.gradient` is called, the
        stage's scope, which would put every group's backward on the stage's first device or core. Here
        the group's forward is recorded on a tape of its own, and its backward replayed from that tape
        inside the group's placement. The weight slices are inputs: the backward returns their
        gradients (slice-sized, what travels back), and the slicing's own gradient (a scatter into the
        variable's shape) runs with the stage's tape.gradient, on the stage's device."""
        names = sorted(weights)

        @tf.custom_gradient
        def run(x, *slices):
            with tf.GradientTape() as tape:
                tape.watch([x, *slices])
                y = layer.group_part(x, dict(zip(names, slices)), training=self.training)

            def backward(dy, variables=None):  # variables: read inside group_part (a dropout seed's state)
                variables = list(variables or [])
                with self.placement.at(layers=self.stage, heads=g):
                    dx, *rest = tape.gradient(y, [x, *slices, *variables], output_gradients=dy)
                    dx = self.placement.place(dx, layers=self.stage, heads=g)
                return (dx, *rest[:len(slices)]), rest[len(slices):]
            return y, backward
        return run(x, *(weights[name] for name in names))
