"""Pipeline parallelism, mixed precision and execution modes: the same training as the plain model."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import CPUS, LLAMA, loss_and_grads, quiet, tiny_config, tiny_model, tpu_cores, train_losses

from tpu_llm.model import spec
from tpu_llm.config import load_config
from tpu_llm.errors import UserError
from tpu_llm.parallel import pipeline
from tpu_llm.parallel.mesh import Placement
from tpu_llm.training.controller import build_run, train

# ---- partition ------------------------------------------------------------------------------------


@pytest.mark.parametrize("n_layer, stages", [(4, 2), (5, 2), (5, 3), (7, 4), (12, 4), (6, 6)])
def test_partition_covers_every_block_once_and_is_balanced(n_layer, stages):
    cfg = load_config(None, {"model.n_layer": n_layer, "model.n_embd": 256, "model.n_head": 4})
    parts = pipeline.partition(cfg.model, 512, 128, stages)
    assert [b for s in parts for b in s.blocks] == list(range(n_layer))
    assert parts[0].embed and parts[-1].head and all(s.blocks for s in parts)
    block_flops = spec.block_flops_per_token(cfg.model, 128)
    head_flops = 6.0 * 512 * 256
    # no other cut of the blocks has a faster slowest stage (brute force over every cut)
    import itertools
    best = min(max(((b - a) * block_flops + (head_flops if i == stages - 1 else 0))
                   for i, (a, b) in enumerate(zip((0,) + cuts, cuts + (n_layer,))))
               for cuts in itertools.combinations(range(1, n_layer), stages - 1))
    assert max(s.flops_per_token for s in parts) == pytest.approx(best)
    lines = pipeline.describe(parts)
    assert lines[0].startswith("stage 0: blocks 0-") and "embedding" in lines[0] and "imbalance" in lines[-1]


def test_partition_errors_name_the_fix():
    cfg = load_config(None, {"model.n_layer": 2})
    with pytest.raises(UserError, match="pipeline_stages=3 must be between 1 and model.n_layer=2"):
        pipeline.partition(cfg.model, 64, 16, 3)
    with pytest.raises(UserError, match="pipeline_stages=3 must be between 1 and model.n_layer=2"):
        load_config(None, {"model.n_layer": 2, "parallel.pipeline_stages": 3})
    with pytest.raises(UserError, match="1F1B cannot be ordered"):
        load_config(None, {"parallel.schedule": "1f1b"})


def test_gpipe_bubble_formula():
    assert pipeline.gpipe_bubble(1, 8) == 0 and pipeline.gpipe_bubble(4, 1) == 0.75
    assert pipeline.gpipe_bubble(4, 8) == pytest.approx(3 / 11)


def test_a_variable_no_stage_reads_is_an_error_naming_it_not_stage_0():
    # the trainer places each variable's reduction and update on its stage: a stray one would go to stage 0
    model = tiny_model()
    pipe = pipeline.Pipeline(model, pipeline.partition(model.cfg, 64, 16, 2), Placement())
    assert pipe.variable_stages([model.blocks[-1].trainable_variables[0], model.wte.trainable_variables[0]]) == [1, 0]
    stray = keras.Variable(np.zeros(3, np.float32), name="stray")
    with pytest.raises(LookupError, match="internal error: variable stray belongs to no pipeline stage"):
        pipe.variable_stages(model.trainable_variables + [stray])


# ---- equivalence ----------------------------------------------------------------------------------


@pytest.mark.parametrize("stages, microbatches, family", [(2, 1, "gpt2"), (2, 4, "gpt2"), (2, 8, "gpt2"),
                                                           (4, 1, "gpt2"), (4, 4, "gpt2"), (4, 8, "gpt2"),
                                                           (4, 2, "llama")])  # llama on 2 stages: test_tensor
def test_pipelined_loss_and_gradients_equal_the_plain_model(stages, microbatches, family):
    model = tiny_model(**(LLAMA if family == "llama" else {}))
    loss, grads, _ = loss_and_grads(model)
    p_loss, p_grads, fn = loss_and_grads(model, stages, microbatches, CPUS[:stages])
    np.testing.assert_allclose(float(p_loss), float(loss), rtol=1e-5)
    for g, pg in zip(grads, p_grads):
        np.testing.assert_allclose(pg.numpy(), g.numpy(), atol=1e-5)
    graph_devices = {op.device.split("device:")[-1] for op in fn.get_concrete_function().graph.get_operations()
                     if op.device}
    assert {f"CPU:{i}" for i in range(stages)} <= graph_devices  # every stage ran on its own device
    if family == "llama":  # and remat (gpt2's: the test below)
        r_loss, r_grads, _ = loss_and_grads(model, remat=True)
        np.testing.assert_allclose(float(r_loss), float(loss), rtol=1e-5)
        for g, rg in zip(grads, r_grads):
            np.testing.assert_allclose(rg.numpy(), g.numpy(), atol=1e-5)


def test_remat_and_the_xla_compiled_pipeline_give_the_same_gradients():
    model = tiny_model()
    loss, grads, _ = loss_and_grads(model)
    for kwargs in ({"remat": True}, {"stages": 2, "microbatches": 2, "remat": True, "jit": True}):
        other_loss, other_grads, fn = loss_and_grads(model, **kwargs)
        np.testing.assert_allclose(float(other_loss), float(loss), rtol=1e-5)
        for g, og in zip(grads, other_grads):
            np.testing.assert_allclose(og.numpy(), g.numpy(), atol=1e-5)
    assert "HloModule" in fn.experimental_get_compiler_ir()(stage="hlo")  # one XLA program, as on a TPU


def test_tpu_placement_annotates_stage_outputs_with_their_logical_core():
    # stage i of each micro-batch on logical core i
    assert tpu_cores(tiny_model(), stages=4, microbatches=2) == [0, 1, 2, 3, 0, 1, 2, 3]


def test_training_with_a_pipeline_and_mirrored_data_parallelism_matches_one_device(tmp_path):
    common = {"train.steps": 2, "train.batch_size": 8, "model.n_layer": 4}
    train(tiny_config(tmp_path / "one", **common), say=quiet, samples=False)
    piped = tiny_config(tmp_path / "piped", **common, cpu_devices=4, **{"parallel.pipeline_stages": 2,
                                                                      "parallel.microbatches": 2})
    summary = train(piped, say=quiet, samples=False)
    assert summary["strategy"] == "mirrored" and summary["replicas"] == 2
    np.testing.assert_allclose(train_losses(tmp_path / "piped" / "run"), train_losses(tmp_path / "one" / "run"),
                               rtol=1e-5)


def test_pipeline_device_errors(tmp_path):
    with pytest.raises(UserError, match="cpu_devices=3 must be a multiple of parallel.pipeline_stages=2"):
        build_run(tiny_config(tmp_path, cpu_devices=3, **{"parallel.pipeline_stages": 2}))
    with pytest.raises(UserError, match="parallel.microbatches=4; nearest valid values: 8 or 16"):
        build_run(tiny_config(tmp_path, **{"train.batch_size": 12, "parallel.microbatches": 4,
                                           "cpu_devices": 4, "parallel.pipeline_stages": 2}))


# ---- precision and execution modes ----------------------------------------------------------------


def test_bfloat16_trains_close_to_float32_with_float32_variables(tmp_path):
    # long and fast enough to learn: both runs fall by 0.5 nats (a bf16 run whose gradients vanish
    # stays at its start, about ln 257), and bf16 stays within 2% of float32 at every logged step
    common = {"train.steps": 12, "train.steps_per_loop": 4, "train.lr": 1e-2, "train.decay_steps": 12}
    x = tf.zeros([1, 4], tf.int32)
    try:
        train(tiny_config(tmp_path / "f32", **common, precision="float32"), say=quiet, samples=False)
        run = build_run(tiny_config(tmp_path / "bf16", **common, precision="mixed_bfloat16"))
        assert {v.dtype for v in run.model.weights} == {"float32"}
        assert run.model.blocks[0].attn.qkv.compute_dtype == "bfloat16"
        assert run.model(x).dtype == tf.float32  # logits (and so the loss) in float32 under every policy
        train(tiny_config(tmp_path / "bf16", **common, precision="mixed_bfloat16"), say=quiet, samples=False)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    bf16, f32 = train_losses(tmp_path / "bf16" / "run"), train_losses(tmp_path / "f32" / "run")
    print("float32", f32, "bfloat16", bf16)
    assert f32[-1] < f32[0] - 0.5 and bf16[-1] < bf16[0] - 0.5
    np.testing.assert_allclose(bf16, f32, rtol=0.02)


def test_float16_skips_an_overflowing_step_and_recovers(tmp_path):
    try:
        run = build_run(tiny_config(tmp_path, precision="mixed_float16"))
        optimizer = run.optimizer
        assert isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
        assert run.model(tf.zeros([1, 4], tf.int32)).dtype == tf.float32  # logits in float32 here too
        before = [w.numpy().copy() for w in run.model.trainable_variables]
        optimizer.dynamic_scale.assign(2.0 ** 40)  # float16 gradients overflow at this scale
        out = run.trainer.run(run.train_iterator, 1, 1)
        assert all(np.array_equal(a, w.numpy()) for a, w in zip(before, run.model.trainable_variables))
        assert float(optimizer.dynamic_scale.numpy()) == 2.0 ** 39 and np.isfinite(out["loss"])
        assert int(optimizer.iterations.numpy()) == 1  # a skipped step still counts: it consumed a batch
        run.trainer.run(run.train_iterator, 30, 10)  # halved on each overflow until the steps apply again
        assert float(optimizer.dynamic_scale.numpy()) < 2.0 ** 30 and int(optimizer.iterations.numpy()) == 31
        assert not all(np.array_equal(a, w.numpy()) for a, w in zip(before, run.model.trainable_variables))
    finally:
        keras.mixed_precision.set_global_policy("float32")


def test_eager_graph_and_xla_execution_train_alike(tmp_path):
    losses = {}
    try:
        for mode in ("xla", "graph", "eager"):
            train(tiny_config(tmp_path / mode, execution=mode, **{"train.steps": 2, "train.steps_per_loop": 1}),
                  say=quiet, samples=False)
            losses[mode] = train_losses(tmp_path / mode / "run")
    finally:
        tf.config.run_functions_eagerly(False)
    np.testing.assert_allclose(losses["graph"], losses["xla"], rtol=1e-5)
    np.testing.assert_allclose(losses["eager"], losses["xla"], rtol=1e-5)


def test_freezing_every_variable_of_a_stage_trains_the_others(tmp_path):
    """train.freeze may empty a pipeline stage (embeddings and its blocks): its gradient norm, clipping
    and update are skipped, the other stage trains, the frozen weights stay as they were."""
    run = build_run(tiny_config(tmp_path, cpu_devices=2, **{"model.n_layer": 4, "parallel.pipeline_stages": 2,
                                                             "train.freeze": "embeddings,blocks:0-1",
                                                             "train.clip_norm": 1.0}))
    assert run.trainer.pipeline.stages[0].blocks == (0, 1) and run.trainer.stage_groups[0] == []
    m = run.model
    frozen = [v.numpy() for v in m.wte.variables + m.blocks[0].variables + m.blocks[1].variables]
    trained = [v.numpy() for v in m.blocks[3].trainable_variables]
    out = run.trainer.run(run.train_iterator, 2, 2)
    assert out["steps"] == 2 and out["bad_steps"] == 0 and np.isfinite(out["loss"])
    for before, v in zip(frozen, m.wte.variables + m.blocks[0].variables + m.blocks[1].variables):
        np.testing.assert_array_equal(v.numpy(), before)
    assert all((v.numpy() != before).any() for before, v in zip(trained, m.blocks[3].trainable_variables))


def test_remat_with_dropout_recomputes_the_forwards_masks(tmp_path):
    """parallel.remat re-runs each block in the backward pass: its dropout masks must be the forward's
    (a new draw would differentiate another network), so remat on and off give the same losses."""
    common = {"model.dropout": 0.1, "train.steps": 6}
    train(tiny_config(tmp_path / "plain", **common), say=quiet, samples=False)
    train(tiny_config(tmp_path / "remat", **common, **{"parallel.remat": True}), say=quiet, samples=False)
    plain, remat = train_losses(tmp_path / "plain" / "run"), train_losses(tmp_path / "remat" / "run")
    assert len(plain) == 3 and remat == plain  # the mean of each loop of 2 steps
