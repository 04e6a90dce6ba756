"""Tensor parallelism: blocks split T ways compute the plain model's loss and gradients."""

import numpy as np
import pytest
import tensorflow as tf
from helpers import CPUS, LLAMA, loss_and_grads, quiet, tiny_config, tiny_model, tpu_cores, train_losses

from tpu_llm.config import load_config
from tpu_llm.errors import UserError
from tpu_llm.training.controller import train


def assert_same(a, b):
    np.testing.assert_allclose(float(a[0]), float(b[0]), rtol=1e-5)
    for g, other in zip(a[1], b[1]):
        np.testing.assert_allclose(other.numpy(), g.numpy(), atol=1e-5)


@pytest.mark.parametrize("stages, ways, microbatches, family", [(1, 4, 2, "gpt2"), (2, 2, 2, "gpt2"),
                                                                 (2, 2, 2, "llama"), (1, 2, 1, "qwen3")])
def test_split_blocks_give_the_plain_models_loss_and_gradients(stages, ways, microbatches, family):
    if family == "llama":  # 4 query heads over 2 kv heads: each group takes one kv head and its 2 query heads
        model = tiny_model(**{**LLAMA, "n_head": 4, "n_kv_head": 2})
    elif family == "qwen3":  # q/k norms read whole in each group's own backward (their gradients: variables')
        model = tiny_model(2, **{**ROTARY["qwen3"], "n_head": 4})
    else:
        model = tiny_model() if ways < 4 else tiny_model(2, n_head=4)
    plain = loss_and_grads(model)
    split = loss_and_grads(model, stages, microbatches, CPUS[:stages * ways], ways=ways)
    assert_same(plain, split)
    graph = split[2].get_concrete_function().graph
    used = {op.device.split("device:")[-1] for op in graph.get_operations() if op.device}
    assert {f"CPU:{i}" for i in range(stages * ways)} <= used  # every group ran on its own device
    matmuls = [op for op in graph.get_operations() if op.type in ("MatMul", "BatchMatMulV3")
               and op.device.endswith("CPU:1")]
    assert matmuls  # group 1 did matmuls of its own, not only copies


def test_split_blocks_without_biases_with_remat_compile_as_one_xla_program():
    model = tiny_model(2, bias=False)
    plain = loss_and_grads(model)
    split = loss_and_grads(model, ways=2, remat=True, jit=True)  # no devices: one program, as on a TPU
    assert_same(plain, split)
    assert "HloModule" in split[2].experimental_get_compiler_ir()(stage="hlo")


def test_tpu_placement_puts_each_group_on_its_logical_core():
    cores = tpu_cores(tiny_model(n_layer=2), stages=2, ways=2)
    # stage 0 (block 0): attention and MLP groups on cores 0 and 1 (input and output annotated), the
    # stage's output on core 0; stage 1 (block 1) the same on cores 2 and 3, its loss on core 2
    half_block = lambda first: [first, first, first + 1, first + 1]  # noqa: E731
    assert cores == half_block(0) * 2 + [0] + half_block(2) * 2 + [2]


ROTARY = {"llama": {**LLAMA, "n_kv_head": 2},  # qwen2: its q/k/v biases; llama3: the scaled rotary frequencies
          "qwen2": {**LLAMA, "family": "qwen2", "bias": True, "n_kv_head": 2},
          "llama3": {**LLAMA, "n_kv_head": 2, "rope_scaling": "llama3", "rope_original_max_len": 8},
          # q/k norms read whole by every group (their gradients summed over the groups), heads of 16
          "qwen3": {**LLAMA, "family": "qwen3", "n_kv_head": 2, "head_dim": 16}}


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2", "llama3", "qwen3"])
def test_the_layers_group_parts_sum_to_the_layer_with_gradients_through_the_slices(family):
    """What SplitBlock runs, without devices: each layer's combine(sum of group_part(x, group_weights(g)))
    is the layer's call, and the gradients reach the variables through the slices."""
    model = tiny_model(1, n_head=4, **ROTARY.get(family, {}))
    block = model.blocks[0]
    for v in block.trainable_variables:  # biases away from zero, so that one added per group (or lost) shows
        v.assign(v + tf.random.stateless_normal(v.shape, [7, 8], stddev=0.1))
    x = tf.random.stateless_normal([2, 8, 32], [5, 6])
    for layer in (block.attn, block.mlp):
        with tf.GradientTape(persistent=True) as tape:
            whole = layer(x)[0] if layer is block.attn else layer(x)
            parts = {ways: layer.combine(tf.add_n([layer.group_part(x, layer.group_weights(g, ways, x.dtype))
                                                   for g in range(ways)])) for ways in (1, 2)}
        want = tape.gradient(whole, layer.trainable_variables)
        for ways, part in parts.items():
            np.testing.assert_allclose(part.numpy(), whole.numpy(), atol=1e-5)
            for g, w in zip(tape.gradient(part, layer.trainable_variables), want):
                np.testing.assert_allclose(g.numpy(), w.numpy(), atol=1e-5)
    shapes = {f"{name}/{key}": tuple(t.shape) for name in ("attn", "mlp")
              for key, t in getattr(block, name).group_weights(1, 2, tf.float32).items()}
    if family == "gpt2":  # 2 of 4 heads of 8 dims of each of q, k and v, side by side; 64 of 128 MLP units
        assert shapes == {"attn/qkv/kernel": (32, 48), "attn/qkv/bias": (48,), "attn/proj/kernel": (16, 32),
                          "mlp/fc/kernel": (32, 64), "mlp/fc/bias": (64,), "mlp/proj/kernel": (64, 32)}
    else:  # 1 of 2 kv heads and its 2 query heads, 32 of 64 units (qwen2: q, k and v bias slices)
        hd = 16 if family == "qwen3" else 8  # (qwen3: its q/k norms are read whole, no slices)
        biases = {"attn/q/bias": (16,), "attn/k/bias": (8,), "attn/v/bias": (8,)} if family == "qwen2" else {}
        assert shapes == {"attn/q/kernel": (32, 2 * hd), "attn/k/kernel": (32, hd), "attn/v/kernel": (32, hd), **biases,
                          "attn/proj/kernel": (2 * hd, 32), "mlp/gate/kernel": (32, 32), "mlp/up/kernel": (32, 32),
                          "mlp/down/kernel": (32, 32)}


def test_tensor_ways_must_divide_heads_kv_heads_and_units():
    with pytest.raises(UserError, match=r"parallel.tensor=5 must divide model.n_head=12 .*valid values: 1, 2, 3, 4, 6, 12"):
        load_config("configs/gpt2_125m.yaml", {"parallel.tensor": 5})
    with pytest.raises(UserError, match=r"parallel.tensor=16 must divide model.n_kv_head=8 .*valid values: 1, 2, 4, 8$"):
        load_config("configs/llama_1b.yaml", {"parallel.tensor": 16})


def test_training_with_tensor_and_data_parallelism_matches_one_device(tmp_path):
    common = {"train.steps": 2, "train.batch_size": 8, "model.n_layer": 2}
    train(tiny_config(tmp_path / "one", **common), say=quiet, samples=False)
    lines = []
    split = tiny_config(tmp_path / "split", **common, cpu_devices=4, **{"parallel.tensor": 2})
    summary = train(split, say=lines.append, samples=False)
    assert summary["strategy"] == "mirrored" and summary["replicas"] == 2
    assert "tensor    heads and MLP units split 2 ways; 2 tensor groups per replica on CPU:0, CPU:1; CPU:2, CPU:3" \
        in lines, lines
    np.testing.assert_allclose(train_losses(tmp_path / "split" / "run"), train_losses(tmp_path / "one" / "run"),
                               rtol=1e-5)


def test_too_few_devices_for_the_groups_is_one_line():
    with pytest.raises(UserError, match=r"cpu_devices=3 must be a multiple of parallel.pipeline_stages x "
                                        r"parallel.tensor=4"):
        from tpu_llm.parallel.distribute import get_strategy
        get_strategy(load_config(None, {"cpu_devices": 3, "parallel.tensor": 2, "parallel.pipeline_stages": 2}))
