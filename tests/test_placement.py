"""Where pipeline stages and tensor groups keep their variables and AdamW moments, and run their ops.

On TPU this runs TF's own TPUStrategy offline: a resolver hands it a hand-built topology of 4 TPU
devices that do not exist, and a variable creator entered outside the strategy's scope records the
TPU device the strategy chose for each variable (TF 2.20 tpu_strategy.py `_create_variable`: the top
of the logical-device stack, or `colocate_with`'s devices for Keras' optimizer moments) and creates it
on the logical CPU of the same number instead. Op placement is traced inside a stand-in TPU context
(only `enclosing_tpu_context` is faked, so `experimental_logical_device` puts ops on `tpu.core(k)` as
it does in a TPU computation). Not covered offline: compiling and running the step on real cores.
"""

import types

import numpy as np
import pytest
import tensorflow as tf
from helpers import offline_resolver, tiny_config
from tensorflow.python.distribute import tpu_strategy as tf_tpu_strategy
from tensorflow.python.eager import context

from tpu_llm.model import GPT
from tpu_llm.parallel import pipeline, tpu
from tpu_llm.parallel.distribute import Placement
from tpu_llm.tools import placement_audit, plan
from tpu_llm.training.controller import build_run
from tpu_llm.training.optimizer import make_optimizer


def offline_tpu_strategy(cores_per_replica):
    resolver = offline_resolver()
    return tf.distribute.TPUStrategy(resolver, experimental_device_assignment=tpu.device_assignment(
        resolver.topology, cores_per_replica))


def tpu_device_of_each_variable():
    """(variable creator, {variable name: the TPU device TPUStrategy chose}); each variable is made on
    the logical CPU of that device's number (conftest.py splits the CPU into 4)."""
    chosen = {}

    def creator(next_creator, **kwargs):
        device = context.context().device_name or ""
        with tf.device(device.replace("device:TPU:", "device:CPU:")):
            v = next_creator(**kwargs)
        # a moment is colocated with its variable, i.e. made on the CPU standing for that variable's core
        chosen[v.name] = device.split("device:")[-1].replace("CPU:", "TPU:")
        return v
    return creator, chosen


def size(v):
    return int(np.prod(v.shape))


def tiny_cfg(n_layer=4, **more):
    from tpu_llm.config import load_config
    return load_config(None, {"model.n_layer": n_layer, "model.n_head": 2, "model.n_embd": 32, "model.max_len": 16,
                              "data.seq_len": 16, "model.vocab_size": 64, **more})


def test_tpu_stages_keep_variables_moments_and_ops_on_their_logical_cores(monkeypatch):
    strategy = offline_tpu_strategy(cores_per_replica=2)  # 2 replicas x 2 pipeline stages
    cores = strategy.extended._tpu_devices  # noqa: SLF001 - [replica][logical core] -> TPU device
    cfg = tiny_cfg()
    parts = pipeline.partition(cfg.model, 64, 16, 2)
    placement = Placement(2, tpu_strategy=strategy)
    creator, chosen = tpu_device_of_each_variable()
    with tf.variable_creator_scope(creator), strategy.scope():
        model = pipeline.build_weights(GPT(cfg.model, 64), parts, placement)
        optimizer = make_optimizer(cfg.train, model)
    per_core = {}
    for v in model.trainable_variables + optimizer.variables:
        kind = "moment" if v.path.endswith(("_momentum", "_velocity")) else "variable"
        for replica, component in enumerate(v.value.values):
            device = chosen[component.name]
            core = [c.split("device:")[-1] for c in cores[replica]].index(device)  # KeyError: not its replica's
            per_core.setdefault((replica, core, kind), 0)
            per_core[(replica, core, kind)] += size(v) if len(v.shape) else 0
    for replica in (0, 1):
        for stage in parts:  # the planner's per-stage parameters, exactly, and AdamW's m and v beside them
            assert per_core[(replica, stage.index, "variable")] == stage.params
            assert per_core[(replica, stage.index, "moment")] == 2 * stage.params

    # ops: each stage's forward and backward on tpu.core(stage), as inside the TPU computation (traced on
    # plain variables: TPU variables read outside a TPU computation give no gradients)
    monkeypatch.setattr(tf_tpu_strategy, "tpu_util", types.SimpleNamespace(enclosing_tpu_context=lambda: object()))
    plain = pipeline.build_weights(GPT(cfg.model, 64), parts, Placement())
    pipe = pipeline.Pipeline(plain, parts, placement, microbatches=2)
    x = tf.zeros([4, 16], tf.int32)
    graph = tf.function(lambda: pipe.loss_and_grads(x, x, plain.trainable_variables)).get_concrete_function().graph
    matmuls = [op for op in graph.get_operations() if op.type in ("Einsum", "MatMul", "BatchMatMulV3")]
    where = {}
    for op in matmuls:
        backward = "gradient" in op.name.lower()
        where.setdefault((op.device.split("device:")[-1], backward), 0)
        where[(op.device.split("device:")[-1], backward)] += 1
    assert all(op.device for op in matmuls), [op.name for op in matmuls if not op.device]
    for core in (0, 1):
        assert where.get((f"TPU_REPLICATED_CORE:{core}", False)) and where.get((f"TPU_REPLICATED_CORE:{core}", True)), where


def devices_of(v):
    return [c.device.split("device:")[-1] for c in getattr(v.value, "values", [v.value])]


def check_stage_devices(run, stage_device):
    """Every model variable and AdamW moment on its stage's device in every replica, adding up to the
    planner's per-stage parameters; stage_device(replica, stage) -> 'CPU:k'."""
    parts = run.trainer.pipeline.stages
    replicas = run.dist.num_replicas
    count = {}
    moments = [v for v in run.optimizer.variables if v.path.endswith(("_momentum", "_velocity"))]
    assert len(moments) == 2 * len(run.model.trainable_variables)
    for kind, variables in (("variable", run.model.trainable_variables), ("moment", moments)):
        for v in variables:
            for replica, device in enumerate(devices_of(v)):
                count[(device, kind)] = count.get((device, kind), 0) + size(v)
    vocab = run.model.vocab_size
    memory = [plan.stage_memory(run.cfg, stage, vocab, 4, 64, 64, False) for stage in parts]
    for replica in range(replicas):
        for stage in parts:
            device = stage_device(replica, stage.index)
            assert count[(device, "variable")] == stage.params, (device, count)
            assert count[(device, "moment")] == 2 * stage.params
            assert memory[stage.index].parameters == 4 * count[(device, "variable")]
            assert memory[stage.index].optimizer == 4 * count[(device, "moment")]
    return count


def test_each_stage_keeps_its_variables_and_moments_on_its_own_cpu_device(tmp_path):
    # 2 replicas (MirroredStrategy) x 2 stages on CPU:0-3
    run = build_run(tiny_config(tmp_path / "mirrored", cpu_devices=4, **{"model.n_layer": 4,
                                                                       "parallel.pipeline_stages": 2}))
    assert run.dist.name == "mirrored"
    count = check_stage_devices(run, lambda r, s: f"CPU:{2 * r + s}")
    assert len({d for d, _ in count}) == 4
    # one replica (default strategy) of 2 stages x 2 tensor groups: a stage's weights on its group 0 device
    run = build_run(tiny_config(tmp_path / "default", cpu_devices=4, **{"model.n_layer": 2,
                                                                      "parallel.pipeline_stages": 2,
                                                                      "parallel.tensor": 2}))
    assert run.dist.name == "default"
    check_stage_devices(run, lambda r, s: f"CPU:{2 * s}")


# ---- the whole train step, traced through TPUStrategy.run ------------------------------------------


@pytest.mark.parametrize("stages,tensor", placement_audit.LAYOUTS)
def test_the_traced_train_step_spreads_over_the_replicas_cores(stages, tensor):
    """Forward, backward, all-reduce, norm, clipping and AdamW's update (under loss scaling, with dropout
    and 2 accumulated micro-batches): each stage's reductions and updates on its own core, its tensor
    groups sharing forward and backward matmuls evenly, and only the replica's shared scalars left
    without a core (which means core 0). The table is docs/pipeline-tensor.md's."""
    audit = placement_audit.audit(stages, tensor)
    assert not audit.problems(), "\n".join(audit.table() + audit.problems())


def test_the_audit_without_loss_scaling_and_for_llama():
    for audit in (placement_audit.audit(2, 2, loss_scaling=False), placement_audit.audit(2, 2, family="llama")):
        assert not audit.problems(), "\n".join(audit.table() + audit.problems())
        assert audit.shared["variable writes"] <= placement_audit.SHARED_ALLOWED["variable writes"]
