"""tpu_llm/model/spec.py, the one account of what a model holds and costs, against built models: every
variable's shape for every family, tied and untied, with and without biases, with grouped-query
attention, and each tensor group's slices against what the layers cut."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys

import keras
import pytest
import tensorflow as tf

from tpu_llm.config import approx_params, load_config
from tpu_llm.model import GPT, spec

VOCAB = 61
CASES = {
    "gpt2": {},
    "gpt2 without biases": {"bias": False},
    "llama tied, multi-head": {"family": "llama", "bias": False},
    "llama untied, grouped-query": {"family": "llama", "bias": False, "n_kv_head": 2, "tie_embeddings": False,
                                    "mlp_hidden": 48},
    "qwen2 tied, grouped-query (q/k/v biases)": {"family": "qwen2", "n_kv_head": 2, "mlp_hidden": 48},
    "mistral untied": {"family": "mistral", "bias": False, "tie_embeddings": False},
    "qwen3 q/k norms, heads wider than C / H": {"family": "qwen3", "n_kv_head": 2, "head_dim": 16, "mlp_hidden": 48},
}


def build(**model) -> GPT:
    cfg = load_config(None, {"model.n_layer": 2, "model.n_head": 4, "model.n_embd": 32, "model.max_len": 16,
                             "data.seq_len": 16, **{f"model.{k}": v for k, v in model.items()}})
    keras.utils.set_random_seed(0)
    return GPT(cfg.model, VOCAB).build_weights()


def shapes(variables, below: str = "") -> dict[str, tuple[int, ...]]:
    """{Keras path below the model (and `below`): shape}."""
    out = {v.path.split("/", 1)[1]: tuple(v.shape) for v in variables}
    return {k.removeprefix(below): s for k, s in out.items() if k.startswith(below)}


@pytest.mark.parametrize("case", CASES)
def test_the_spec_has_every_variable_of_the_built_model_and_each_groups_slices(case):
    model = build(**CASES[case])
    m = model.cfg
    variables = shapes(model.trainable_variables)
    for i in range(m.n_layer):
        assert shapes(model.blocks[i].trainable_variables, f"block_{i}/") == spec.block_shapes(m)
    outside = {k: s for k, s in variables.items() if not k.startswith("block_")}
    assert outside == {**spec.embedding_shapes(m, VOCAB), **spec.head_shapes(m, VOCAB)}
    assert model.num_params() == spec.params(m, VOCAB) == sum(math.prod(s) for s in variables.values())
    matrices = sum(math.prod(s) for s in variables.values() if len(s) == 2)  # kernels and tables
    assert approx_params(dataclasses.replace(m, vocab_size=VOCAB)) == spec.matrix_params(m, VOCAB) == matrices
    assert model.flops_per_token(16) == spec.flops_per_token(m, VOCAB, 16)
    block = model.blocks[1]
    for ways in [w for w in (1, 2, 4) if m.kv_heads() % w == 0 and m.hidden() % w == 0]:  # what validation allows
        want = spec.group_shapes(m, ways)
        for g in range(ways):
            got = {f"{name}/{key}": tuple(t.shape) for name in ("attn", "mlp")
                   for key, t in getattr(block, name).group_weights(g, ways, tf.float32).items()}
            assert got == want, (ways, g)


def test_group_shapes_of_the_shipped_configs():
    cfg = load_config("configs/gpt2_125m.yaml").model
    for ways in (1, 2, 4, 12):
        shapes = spec.group_shapes(cfg, ways)
        heads = 3 * 12 // ways * 64  # the group's heads of each of q, k and v, side by side
        assert shapes["attn/qkv/kernel"] == (768, heads) and shapes["attn/qkv/bias"] == (heads,)
        assert shapes["mlp/fc/kernel"] == (768, 3072 // ways) and shapes["mlp/proj/kernel"] == (3072 // ways, 768)
        assert shapes["attn/proj/kernel"][0] * ways == 768
    llama = load_config("configs/llama_1b.yaml").model  # 32 query heads over 8 kv heads, hidden 8192
    assert spec.group_shapes(llama, 8) == {
        "attn/q/kernel": (2048, 4 * 64), "attn/k/kernel": (2048, 64), "attn/v/kernel": (2048, 64),
        "attn/proj/kernel": (4 * 64, 2048), "mlp/gate/kernel": (2048, 1024), "mlp/up/kernel": (2048, 1024),
        "mlp/down/kernel": (1024, 2048)}


def test_the_spec_the_families_and_the_config_load_no_tensorflow():
    """The CLI checks a config (config.py, which asks the spec and the families) before TensorFlow loads."""
    code = ("import sys, tpu_llm.model.spec, tpu_llm.model.families, tpu_llm.config\n"
            "print('tensorflow' in sys.modules, 'keras' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split() == ["False", "False"], done.stderr[-2000:]
