"""LoRA (train.lora_*, model/adapters.py) without the reference implementation: its settings, the adapters'
initial values, a frozen base through training, exact resume, a base run's weights (train.init_from),
and pipeline stages and tensor groups giving the plain model's loss and adapter gradients. Against
PEFT itself: tests/test_lora_peft.py."""

from __future__ import annotations

import json
import math
import re

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import CPUS, LLAMA, loss_and_grads, quiet, tiny_config

from tpu_llm.config import load_config
from tpu_llm.errors import UserError
from tpu_llm.model import GPT
from tpu_llm.model import adapters as lora
from tpu_llm.platform import perf
from tpu_llm.training import progress
from tpu_llm.training.controller import build_run, train

ALL = {"gpt2": "c_attn,c_proj,c_fc", "llama": "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"}


def lora_model(family="gpt2", n_layer=2, targets=None, **model) -> GPT:
    """A seeded tiny model (width 32, 4 heads) with rank-2 adapters on every projection, B random (non-zero)."""
    model = {**(LLAMA if family == "llama" else {}), "n_head": 4, **model}
    cfg = load_config(None, {"model.n_layer": n_layer, "model.n_embd": 32, "model.max_len": 16, "data.seq_len": 16,
                             "train.lora_rank": 2, "train.lora_targets": targets or ALL[family],
                             **{f"model.{k}": v for k, v in model.items()}})
    keras.utils.set_random_seed(0)
    net = GPT(cfg.model, 64, lora.adapters_for(cfg)).build_weights()
    for layer in lora.adapted(net):
        layer.lora_b.assign(tf.random.stateless_normal(layer.lora_b.shape, [1, 2], stddev=0.1))
    return net


# ---- settings --------------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, words", [
    ({"train.lora_targets": "q_proj"}, "train.lora_targets='q_proj': 'q_proj' is not a module of model.family=gpt2; "
                                       "valid targets: c_attn, c_proj, c_fc"),
    ({"model.family": "llama", "model.bias": False, "train.lora_targets": "c_attn,qkv"},
     "'c_attn' is not a module of model.family=llama; valid targets: q_proj, k_proj, v_proj, o_proj, gate_proj"),
    ({"train.lora_targets": " , "}, "train.lora_targets=' , ': no module is not a module"),
    ({"train.freeze": "embeddings"}, "train.freeze='embeddings' with train.lora_rank=2: LoRA freezes every weight"),
    ({"train.lora_dropout": 0.1, "parallel.tensor": 2}, "train.lora_dropout=0.1 is not supported with parallel.tensor=2"),
    ({"train.lora_alpha": 0}, "train.lora_alpha=0.0 must be > 0"),
    ({"train.lora_dropout": 1.0}, "train.lora_dropout=1.0 must be in [0, 1)"),
])
def test_bad_lora_settings_are_one_line(overrides, words):
    with pytest.raises(UserError) as e:
        load_config(None, {"train.lora_rank": 2, **overrides})
    assert words in str(e.value) and "\n" not in str(e.value)


def test_a_negative_rank_is_refused_and_0_is_off():
    with pytest.raises(UserError, match=r"train.lora_rank=-1 must be >= 0 \(0 = off\)"):
        load_config(None, {"train.lora_rank": -1})
    assert lora.adapters_for(load_config(None, {"train.lora_targets": "nonsense"})) is None  # off: the targets are not read


def test_peft_default_targets_and_module_names_map_onto_the_layers():
    gpt2 = lora.adapters_for(load_config(None, {"train.lora_rank": 8}))
    assert gpt2.layers == {"attn/qkv"} and gpt2.scale == 1.0  # PEFT's defaults: c_attn, alpha 8
    llama = lora.adapters_for(load_config(None, {"train.lora_rank": 4, "train.lora_alpha": 16, "model.family": "llama",
                                         "model.bias": False}))
    assert llama.layers == {"attn/q", "attn/v"} and llama.scale == 4.0
    both = lora.adapters_for(load_config(None, {"train.lora_rank": 4, "train.lora_targets": "c_proj"}))
    assert both.layers == {"attn/proj", "mlp/proj"}  # PEFT matches c_proj in the attention and the MLP


# ---- the layers ------------------------------------------------------------------------------------

def test_new_adapters_leave_the_model_as_it_was_and_a_is_kaiming_uniform_as_peft_draws_it():
    cfg = load_config(None, {"model.n_layer": 2, "model.n_embd": 32, "model.n_head": 4, "model.max_len": 16,
                             "data.seq_len": 16, "train.lora_rank": 4, "train.lora_targets": ALL["gpt2"]})
    keras.utils.set_random_seed(0)
    plain = GPT(cfg.model, 64).build_weights()
    adapted = GPT(cfg.model, 64, lora.adapters_for(cfg)).build_weights()
    lora.copy_base(plain, adapted)
    ids = tf.constant([[1, 5, 9, 2, 40]])
    np.testing.assert_array_equal(adapted(ids).numpy(), plain(ids).numpy())  # B = 0: nothing added
    for layer in lora.adapted(adapted):
        a, fan_in = layer.lora_a.numpy(), layer.lora_a.shape[0]
        assert np.abs(a).max() <= 1 / math.sqrt(fan_in) and np.abs(a).max() > 0.8 / math.sqrt(fan_in)
        assert not layer.lora_b.numpy().any()
    trainable = {v.path.split("/", 1)[1] for v in adapted.trainable_variables}
    assert len(trainable) == 2 * 4 * 2 and all(p.endswith(("/lora_a", "/lora_b")) for p in trainable)
    assert adapted.num_params() == plain.num_params()  # FLOPs and the header count the base model


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_adapter_adds_x_a_b_times_alpha_over_rank(family):
    net = lora_model(family, n_layer=1)
    for layer in lora.adapted(net):
        x = tf.random.stateless_normal([2, 5, layer.kernel.shape[0]], [3, 4])
        want = x @ layer.kernel + (x @ layer.lora_a @ layer.lora_b) * (8.0 / 2)
        if layer.bias is not None:
            want += layer.bias
        np.testing.assert_allclose(layer(x).numpy(), want.numpy(), atol=1e-5)


def test_adapter_dropout_drops_the_adapters_input_only_in_training():
    cfg = load_config(None, {"model.n_layer": 1, "model.n_embd": 32, "model.max_len": 16, "data.seq_len": 16,
                             "train.lora_rank": 2, "train.lora_dropout": 0.5})
    keras.utils.set_random_seed(0)
    net = GPT(cfg.model, 64, lora.adapters_for(cfg)).build_weights()
    layer = net.blocks[0].attn.qkv
    layer.lora_b.assign(tf.ones(layer.lora_b.shape))
    x = tf.random.stateless_normal([2, 5, 32], [3, 4])
    plain = x @ layer.kernel + layer.bias
    np.testing.assert_allclose(layer(x).numpy(), (plain + x @ layer.lora_a @ layer.lora_b * 4.0).numpy(), atol=1e-5)
    dropped = layer(x, training=True) - plain  # (dropout(x) A B) * 4: a different, rescaled input
    assert not np.allclose(dropped.numpy(), (x @ layer.lora_a @ layer.lora_b * 4.0).numpy(), atol=1e-3)


# ---- strategies ------------------------------------------------------------------------------------

@pytest.mark.parametrize("family, stages, ways", [("gpt2", 2, 2), ("llama", 2, 2), ("gpt2", 1, 4)])
def test_pipeline_stages_and_tensor_groups_give_the_plain_loss_and_adapter_gradients(family, stages, ways):
    net = lora_model(family, **({"n_kv_head": 2} if family == "llama" else {}))
    plain = loss_and_grads(net)
    split = loss_and_grads(net, stages, 2, CPUS[:stages * ways], ways=ways)
    np.testing.assert_allclose(float(split[0]), float(plain[0]), rtol=1e-5)
    assert len(plain[1]) == len(net.trainable_variables) == 2 * 2 * (4 if family == "gpt2" else 7)
    for g, other in zip(plain[1], split[1]):
        assert float(tf.reduce_max(tf.abs(g))) > 1e-5
        np.testing.assert_allclose(other.numpy(), g.numpy(), atol=1e-5)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_under_mixed_bfloat16_a_tensor_groups_adapter_computes_in_float32_as_the_layer_does(family):
    """LoraDense (and PEFT) compute x A B in float32 whatever the compute dtype; a group's share must too,
    not in bfloat16 (2^-8 relative per matmul). Every matmul of a group's part that reads an adapter is a
    float32 one."""
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        net = lora_model(family, n_layer=1, **({"n_kv_head": 2} if family == "llama" else {}))
        x = tf.cast(tf.random.stateless_normal([2, 16, 32], [5, 6]), tf.bfloat16)
        for part in (net.blocks[0].attn, net.blocks[0].mlp):
            weights = [part.group_weights(g, 2, tf.bfloat16) for g in range(2)]
            fn = tf.function(lambda x, w: part.group_part(x, w))
            graph = fn.get_concrete_function(x, weights[0]).graph
            matmuls = [op for op in graph.get_operations() if op.type in ("MatMul", "BatchMatMulV2")]
            adapted = sum(isinstance(layer, lora.LoraDense) for layer in part._layers)
            assert [op.get_attr("T") for op in matmuls].count(tf.float32) == 2 * adapted > 0
    finally:
        keras.mixed_precision.set_global_policy("float32")


# ---- training, checkpoints, resume -----------------------------------------------------------------

def lora_cfg(tmp_path, run, steps=8, **overrides):
    return tiny_config(tmp_path, **{"run_dir": str(tmp_path / run), "train.steps": steps, "train.decay_steps": 8,
                                    "train.steps_per_loop": 2, "checkpoint.every_steps": 4, "train.lora_rank": 2,
                                    "train.lora_alpha": 4.0, "train.lr": 1e-2, "train.lora_targets": ALL["gpt2"],
                                    "execution": "graph", **overrides})


def by_path(model) -> dict:
    return {path: v.numpy() for path, v in model.by_path().items()}


def test_training_moves_only_the_adapters_and_resume_is_exact(base_run):
    tmp = base_run
    base = by_path(build_run(tiny_config(tmp, **{"run_dir": str(tmp / "base"), "train.steps": 2,
                                                 "execution": "graph"})).model)
    init = {"train.init_from": str(tmp / "base")}
    said = []
    train(lora_cfg(tmp, "straight", **init), say=lambda *line: said.append(" ".join(map(str, line))))
    # the MFU counts no weight gradient for the frozen base (training/progress.py), as tpu-llm plan does
    flops = progress.flops_per_token(lora_cfg(tmp, "straight"), 257)
    assert any(f"); {perf.format_count(flops)}FLOP/token" in line for line in said), said
    number, unit = re.search(r"MFU peak: ([0-9.]+)([kMGT]?)FLOP/s", "\n".join(said)).groups()
    peak = float(number) * {"": 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}[unit]
    timed = [e for e in map(json.loads, open(tmp / "straight" / "metrics.jsonl"))
             if e["split"] == "train" and math.isfinite(e.get("mfu", math.nan))][-1]
    assert timed["mfu"] * peak / timed["tokens_per_sec"] == pytest.approx(flops, rel=0.01)  # 1 decimal of the peak
    train(lora_cfg(tmp, "resumed", steps=4, **init), say=quiet)  # stops at a checkpoint ...
    train(lora_cfg(tmp, "resumed", **init), say=quiet)  # ... and the same command with more steps resumes
    straight, resumed = (build_run(lora_cfg(tmp, run, **init)) for run in ("straight", "resumed"))
    assert straight.resumed_from.endswith("ckpt-8") and resumed.resumed_from.endswith("ckpt-8")

    def losses(run):
        return [e["loss"] for e in map(json.loads, open(tmp / run / "metrics.jsonl")) if e["split"] == "train"]
    assert losses("resumed") == losses("straight") and len(losses("straight")) == 4
    after, again = by_path(straight.model), by_path(resumed.model)
    assert after.keys() == again.keys()
    for path, value in after.items():
        np.testing.assert_array_equal(value, again[path], err_msg=path)
        if path.endswith(("lora_a", "lora_b")):
            assert path.endswith("lora_a") or value.any()  # B left zero: trained
        elif "seed_generator" not in path:
            np.testing.assert_array_equal(value, base[path], err_msg=path)  # the base: bit for bit


def test_a_run_with_other_lora_settings_is_refused(base_run):
    tmp = base_run
    train(lora_cfg(tmp, "run", steps=2, **{"train.init_from": str(tmp / "base")}), say=quiet)
    for overrides, words in (({"train.lora_rank": 0}, "train.lora_rank=2 (this config has 0)"),
                             ({"train.lora_targets": "c_attn"}, "train.lora_targets='c_attn,c_proj,c_fc' (this config "
                                                                "has 'c_attn')")):
        with pytest.raises(UserError, match=re.escape(words)):
            build_run(lora_cfg(tmp, "run", steps=2, **overrides))
    with pytest.raises(UserError, match=r"train.init_from=.* is a LoRA run \(train.lora_rank=2\); start from a copy "
                                        r"of it with its adapters merged in: `tpu-llm export --run_dir .* --format run"):
        build_run(lora_cfg(tmp, "next", **{"train.init_from": str(tmp / "run")}))
    assert_config_drift_is_refused(tmp / "run")


def assert_config_drift_is_refused(run):
    """Issue 50 #5: train.lora_targets (or rank, alpha) edited in the run's config.yaml, then a resume or a
    generate: the checkpoint's other adapters were dropped without a word (expect_partial). Each checkpoint
    records the keys that shape its trained state; every command that restores compares them."""
    import yaml

    from tpu_llm.training.checkpoint import load_for_generation

    saved = (run / "config.yaml").read_text()
    for key, value, theirs in (("lora_targets", "c_attn", "'c_attn,c_proj,c_fc'"), ("lora_alpha", 16.0, "4.0")):
        config = yaml.safe_load(saved)
        config["train"][key] = value
        (run / "config.yaml").write_text(yaml.safe_dump(config))
        words = re.escape(f"was trained with train.{key}={theirs}, this config has {value!r}")
        with pytest.raises(UserError, match=words):
            load_for_generation(str(run))  # generate, export
        with pytest.raises(UserError, match=words):
            build_run(lora_cfg(run.parent, "run", steps=2, **{f"train.{key}": value}))  # a resume
    (run / "config.yaml").write_text(saved)
    assert load_for_generation(str(run))[2].train.lora_targets == ALL["gpt2"]  # as it was: restored


# ---- the planner -----------------------------------------------------------------------------------

@pytest.mark.parametrize("family, stages", [("gpt2", 1), ("llama", 2)])
def test_the_plan_charges_optimizer_state_and_gradients_for_the_adapters_alone(tmp_path, family, stages):
    """As many AdamW slots and gradients as the built LoRA model has trainable variables, stage by stage
    summed; every weight still held, the adapters beside them."""
    from tpu_llm.model import spec
    from tpu_llm.tools import plan

    cfg = tiny_config(tmp_path, **{"train.lora_rank": 4, "train.lora_targets": ALL[family], "model.n_layer": 4,
                                   "parallel.pipeline_stages": stages, "cpu_devices": stages, "train.grad_accum": 1,
                                   **({"model.family": "llama", "model.bias": False} if family == "llama" else {})})
    model = GPT(cfg.model, 257, lora.adapters_for(cfg)).build_weights()
    trainable = sum(math.prod(v.shape) for v in model.trainable_variables)
    assert 0 < trainable < spec.params(cfg.model, 257) / 3
    memory = plan.plan(cfg, plan.Accelerator("cpu", "CPU", 1, 100e9, 16 * plan.GIB, "fixed")).memory
    assert sum(mem.parameters for mem in memory) == 4 * (spec.params(cfg.model, 257) + trainable)
    assert sum(mem.gradients for mem in memory) == 4 * trainable
    assert sum(mem.optimizer for mem in memory) == 8 * trainable


@pytest.mark.parametrize("layout", [{"parallel.pipeline_stages": 2, "parallel.tensor": 2, "cpu_devices": 4},
                                    {"cpu_devices": 2, "strategy": "mirrored"}])
def test_training_under_stages_and_groups_or_replicas_follows_the_single_device_run(base_run, layout):
    """The trainer's steps with adapters, placed by stage and group (4 logical CPUs) or mirrored over 2
    replicas: the single-device run's losses (float32 summation order apart), the base untouched."""
    tmp, init = base_run, {"train.init_from": str(base_run / "base"), "train.steps": 4}
    name = "-".join(str(v) for v in layout.values())
    if not (tmp / "one").is_dir():  # the single-device run: trained once for both layouts
        train(lora_cfg(tmp, "one", **init), say=quiet)
    train(lora_cfg(tmp, f"split-{name}", **init, **layout), say=quiet)

    def losses(run):
        return [e["loss"] for e in map(json.loads, open(tmp / run / "metrics.jsonl")) if e["split"] == "train"]
    np.testing.assert_allclose(losses(f"split-{name}"), losses("one"), rtol=1e-4)
    one = by_path(build_run(lora_cfg(tmp, "one", **init)).model)
    split = by_path(build_run(lora_cfg(tmp, f"split-{name}", **init, **layout)).model)
    for path, value in one.items():
        atol = 1e-4 if path.endswith(lora.ADAPTERS) else 0  # the base: bit for bit in both (Adam: 4 steps of 1e-2)
        np.testing.assert_allclose(split[path], value, atol=atol, rtol=0, err_msg=path)
