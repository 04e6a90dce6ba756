"""A LoRA run's frozen base stored in bfloat16 or int8 (train.lora_base_dtype, model/adapters.py's FrozenDense):
the variables' dtypes, the quantized model's logits against the float32 one, training that moves only the
float32 adapters (the stored base bit for bit the same), exact resume, pipeline stages x tensor groups and
mirrored replicas following the single-device run, the float32 merged export, and the planner's bytes."""

from __future__ import annotations

import json
import math
import re

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import CPUS, LLAMA, loss_and_grads, quiet, tiny_config

from tpu_llm.config import load_config, validate
from tpu_llm.errors import UserError
from tpu_llm.interop.export import load_float32
from tpu_llm.model import GPT
from tpu_llm.model import adapters as lora
from tpu_llm.training.checkpoint import load_for_generation
from tpu_llm.training.controller import build_run, train

ALL = {"gpt2": "c_attn,c_proj,c_fc", "llama": "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"}
SOME = {"gpt2": "c_attn", "llama": "q_proj,v_proj"}  # PEFT's defaults: the other projections frozen plain Dense


def pair(family: str, base_dtype: str, targets: str):
    """(float32 model, the same weights with the base stored as `base_dtype`), tiny (2 layers, width 32),
    the adapters' B random (non-zero) and equal in both."""
    model = {**(LLAMA if family == "llama" else {}), "n_head": 4, **({"n_kv_head": 2} if family == "llama" else {})}
    values = {"model.n_layer": 2, "model.n_embd": 32, "model.max_len": 16, "data.seq_len": 16, "train.lora_rank": 2,
              "train.lora_targets": targets, **{f"model.{k}": v for k, v in model.items()}}
    keras.utils.set_random_seed(0)
    full = GPT((cfg := load_config(None, values)).model, 64, lora.adapters_for(cfg)).build_weights()
    stored = GPT(cfg.model, 64, lora.adapters_for(load_config(None, {**values, "train.lora_base_dtype": base_dtype})))
    stored = stored.build_weights()
    lora.copy_base(full, stored)
    for ours, theirs in zip(lora.adapted(full), lora.adapted(stored)):
        ours.lora_b.assign(tf.random.stateless_normal(ours.lora_b.shape, [1, 2], stddev=0.1))
        theirs.lora_a.assign(ours.lora_a)
        theirs.lora_b.assign(ours.lora_b)
    return full, stored


def kernels(model) -> dict:
    """{path: the Dense layer} of every projection of the blocks."""
    return {layer.path.split("/", 1)[1]: layer for block in model.blocks for part in (block.attn, block.mlp)
            for layer in part._layers if isinstance(layer, keras.layers.Dense)}


def test_the_setting_needs_lora_and_a_known_dtype():
    for overrides, words in (({"train.lora_base_dtype": "int8"},
                              "train.lora_base_dtype=int8 needs train.lora_rank > 0"),
                             ({"train.lora_rank": 2, "train.lora_base_dtype": "fp8"},
                              "train.lora_base_dtype='fp8'; valid choices: float32, bfloat16, int8")):
        with pytest.raises(UserError) as e:
            load_config(None, overrides)
        assert words in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("base_dtype", ["bfloat16", "int8"])
def test_the_base_is_stored_in_its_dtype_and_computes_with_its_values(family, base_dtype):
    full, stored = pair(family, base_dtype, SOME[family])
    layers, plain = kernels(stored), kernels(full)
    assert len(layers) == 2 * (4 if family == "gpt2" else 7)
    for path, layer in layers.items():  # adapted or not, every projection kernel of the blocks
        assert layer.kernel.dtype == base_dtype and not layer.kernel.trainable, path
        assert (layer.quantization_mode == "int8") == (base_dtype == "int8"), path
        w, got = plain[path].kernel.numpy(), lora.float_kernel(layer).numpy()
        if base_dtype == "bfloat16":  # rounded to nearest, 7 stored bits: within 2^-8 relative (unit roundoff)
            assert np.all(np.abs(got - w) <= 2.0**-8 * np.abs(w)), path
        else:  # Keras' abs-max int8 per output column: steps of max|w_col| / 127, within half a step
            assert layer.kernel_scale.shape == (w.shape[1],) and layer.kernel_scale.dtype == "float32"
            assert np.all(np.abs(got - w) <= np.abs(w).max(axis=0) / 254 * (1 + 1e-5)), path
    for v in stored.weights:  # everything else: float32 as before, the adapters the only trainable ones
        if not v.path.endswith(("/kernel", lora.SCALE)) and "seed_generator" not in v.path:
            assert v.dtype == "float32" and v.trainable == v.path.endswith(lora.ADAPTERS), v.path
    assert stored.num_params() == full.num_params()  # the scales are no parameters
    # the quantized model is the float32 model of its dequantized weights: float32 rounding apart ...
    dequantized = lora.merged(stored)  # float32, adapters folded in
    ids = tf.constant([[1, 5, 9, 2, 40, 7, 3]])
    np.testing.assert_allclose(stored(ids).numpy(), dequantized(ids).numpy(), atol=2e-6)
    # ... and within its weights' error of the float32 model's logits: each weight is off by at most 2^-9
    # relative (bf16) or half a 1/127 step of its column's largest (int8, ~0.4% of typical weights), which
    # a few matmuls of the 2 blocks and the head compound, not multiply
    logits, want = stored(ids).numpy(), full(ids).numpy()
    bound = (2.0**-7 if base_dtype == "bfloat16" else 2.0**-5) * np.abs(want).max()
    assert 0 < np.abs(logits - want).max() < bound


@pytest.mark.parametrize("base_dtype", ["bfloat16", "int8"])
def test_stages_and_groups_give_the_single_device_loss_and_adapter_gradients(base_dtype):
    """The tensor groups' slices of a bfloat16 or int8 kernel (an int8 slice dequantized with its scales'
    slice) compute the whole layer's: 2 stages x 2 groups on 4 logical CPUs."""
    _, stored = pair("llama", base_dtype, ALL["llama"])
    one = loss_and_grads(stored)
    split = loss_and_grads(stored, 2, 2, CPUS[:4], ways=2)
    np.testing.assert_allclose(float(split[0]), float(one[0]), rtol=1e-5)
    assert len(one[1]) == len(stored.trainable_variables) == 2 * 2 * 7
    for g, other in zip(one[1], split[1]):
        assert float(tf.reduce_max(tf.abs(g))) > 1e-5
        np.testing.assert_allclose(other.numpy(), g.numpy(), atol=1e-5)


# ---- training, checkpoints, resume, export ---------------------------------------------------------

def lora_cfg(tmp_path, run, base_dtype, steps=4, **overrides):
    return tiny_config(tmp_path, **{"run_dir": str(tmp_path / run), "train.steps": steps, "train.decay_steps": 4,
                                    "train.steps_per_loop": 2, "checkpoint.every_steps": 2, "train.lora_rank": 2,
                                    "train.lora_alpha": 4.0, "train.lr": 1e-2, "train.lora_targets": "c_attn",
                                    "train.lora_base_dtype": base_dtype, "execution": "graph", **overrides})


def by_path(model) -> dict:
    return {path: v.numpy() for path, v in model.by_path().items()}


def losses(run_dir) -> list:
    return [e["loss"] for e in map(json.loads, open(run_dir / "metrics.jsonl")) if e["split"] == "train"]


_trained = set()


def straight_run(tmp, base_dtype: str) -> str:
    """`straight-DTYPE`: 4 steps with adapters on the base run's weights stored in `base_dtype`, on one
    device; trained once per module (the resume test's reference and the layouts' single-device run)."""
    run = f"straight-{base_dtype}"
    if (tmp, run) not in _trained:
        train(lora_cfg(tmp, run, base_dtype, **{"train.init_from": str(tmp / "base")}), say=quiet)
        _trained.add((tmp, run))
    return run


@pytest.mark.parametrize("base_dtype", ["bfloat16", "int8"])
def test_training_moves_only_the_adapters_resume_is_exact_and_export_is_float32(base_run, base_dtype):
    tmp, init = base_run, {"train.init_from": str(base_run / "base")}
    # the base as init_from leaves it: the base run's float32 weights, cast or quantized
    base = build_run(lora_cfg(tmp, f"fresh-{base_dtype}", base_dtype, **init)).model
    assert {v.dtype for v in base.weights if v.path.endswith("/kernel")} == {base_dtype}
    stored = by_path(base)
    straight_run(tmp, base_dtype)
    train(lora_cfg(tmp, f"resumed-{base_dtype}", base_dtype, steps=2, **init), say=quiet)  # stops at a checkpoint ...
    train(lora_cfg(tmp, f"resumed-{base_dtype}", base_dtype, **init), say=quiet)  # ... and resumes
    assert losses(tmp / f"resumed-{base_dtype}") == losses(tmp / f"straight-{base_dtype}")
    straight, _, _ = load_for_generation(str(tmp / f"straight-{base_dtype}"))  # as generate and export read it
    resumed, _, _ = load_for_generation(str(tmp / f"resumed-{base_dtype}"))
    after, again = by_path(straight), by_path(resumed)
    assert after.keys() == again.keys() == stored.keys()
    for path, value in after.items():
        np.testing.assert_array_equal(value, again[path], err_msg=path)
        if path.endswith("lora_b"):
            assert value.any(), path  # B left zero: trained
        elif not path.endswith(lora.ADAPTERS) and "seed_generator" not in path:
            assert value.dtype == stored[path].dtype  # the base: bit for bit, in its dtype
            np.testing.assert_array_equal(value, stored[path], err_msg=path)
    # what --format hf and the SavedModel write: float32, W + A B scale, and a config valid without adapters
    merged, _, cfg, _, _ = load_float32(str(tmp / f"straight-{base_dtype}"))
    assert {v.dtype for v in merged.weights} == {"float32"} and merged.adapters is None
    validate(cfg)
    ids = tf.constant([[1, 5, 9, 2, 40]])
    np.testing.assert_allclose(merged(ids).numpy(), straight(ids).numpy(), atol=2e-6)
    # a resume with another stored base is refused in one line, naming the setting
    other = "int8" if base_dtype == "bfloat16" else "bfloat16"
    with pytest.raises(UserError, match=re.escape(f"train.lora_base_dtype={base_dtype!r} (this config has {other!r})")):
        build_run(lora_cfg(tmp, f"straight-{base_dtype}", other))


@pytest.mark.parametrize("layout", [{"parallel.pipeline_stages": 2, "parallel.tensor": 2, "cpu_devices": 4},
                                    {"cpu_devices": 2, "strategy": "mirrored"}])
def test_an_int8_base_trains_under_stages_and_groups_or_replicas_as_on_one_device(base_run, layout):
    tmp, init = base_run, {"train.init_from": str(base_run / "base")}
    name = "-".join(str(v) for v in layout.values())
    one_device = straight_run(tmp, "int8")
    train(lora_cfg(tmp, f"split-{name}", "int8", **init, **layout), say=quiet)
    np.testing.assert_allclose(losses(tmp / f"split-{name}"), losses(tmp / one_device), rtol=1e-4)
    one, split = (by_path(load_for_generation(str(tmp / run))[0]) for run in (one_device, f"split-{name}"))
    for path, value in one.items():
        atol = 1e-4 if path.endswith(lora.ADAPTERS) else 0  # the base: bit for bit in both
        np.testing.assert_allclose(split[path], value, atol=atol, rtol=0, err_msg=path)


# ---- the planner -----------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_plan_holds_the_stored_base_at_its_bytes(family):
    """The planned parameter bytes (one stage: plan_memory.stage_memory's) are the built model's variables' bytes,
    each at its dtype's size: the base's kernels at 2 or 1 (+ 4 per scale), everything else at 4."""
    from tpu_llm.parallel import pipeline
    from tpu_llm.tools import plan_memory

    for base_dtype in ("float32", "bfloat16", "int8"):
        cfg = load_config(None, {"train.lora_rank": 4, "train.lora_targets": SOME[family], "model.n_layer": 2,
                                 "model.n_embd": 32, "model.n_head": 4, "model.max_len": 16, "data.seq_len": 16,
                                 "train.lora_base_dtype": base_dtype,
                                 **({"model.family": "llama", "model.bias": False} if family == "llama" else {})})
        model = GPT(cfg.model, 64, lora.adapters_for(cfg)).build_weights()
        held = sum(math.prod(v.shape) * tf.as_dtype(v.dtype).size for v in model.weights
                   if "seed_generator" not in v.path)
        [stage] = pipeline.partition(cfg.model, 64, 16, 1)
        assert plan_memory.parameter_bytes(cfg, stage, plan_memory.adapter_params(cfg, stage)) == held, base_dtype
