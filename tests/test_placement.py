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
from tpu_llm.parallel.mesh import Mesh, Placement
from tpu_llm.harness import compiled_step, offline_tpu, placement_audit
from tpu_llm.tools import plan
from tpu_llm.harness.offline_tpu import build_step
from tpu_llm.training.build import build_run
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
    placement = Placement(Mesh(1, 2), tpu_strategy=strategy)
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


# ---- the whole train step compiled to HLO as a TPU would (harness/compiled_step.py) ---------------------

_steps: dict = {}


def step(stages, tensor, **kwargs):
    """One build (and trace) per layout and settings for the whole test process: the compiled and the
    traced audits read the same step."""
    key = (stages, tensor, tuple(sorted(kwargs.items())))
    if key not in _steps:
        _steps[key] = build_step(stages, tensor, **kwargs)
    return _steps[key]


_audits: dict = {}


def compiled(stages, tensor, **kwargs):
    key = (stages, tensor, tuple(sorted(kwargs.items())))
    if key not in _audits:
        _audits[key] = placement_audit.compiled(stages, tensor, step=step(stages, tensor, **kwargs))
    return _audits[key]


def report(audit, kinds=None):
    problems = [p for p in audit.problems() if kinds is None or p.kind in kinds]
    return problems, "\n".join(audit.table() + [str(p) for p in problems])


def test_the_compiler_keeps_a_core_directly_and_in_a_loop_and_drops_it_through_a_nested_function():
    """The instrument itself, on a hand-made TPUStrategy step: XlaCompiler keeps a matmul's core in the
    replica function and in a while loop's body, and loses it for a matmul inside a nested
    tf.function(jit_compile=False) called outside any core scope (the single-device inlining a TPU does).
    A variable read only inside that function still gets its core, as DistributedTPURewritePass gives it."""
    strategy = offline_tpu_strategy(cores_per_replica=2)
    homes = {}
    with offline_tpu.variables_on_the_cpu(homes, strategy), strategy.scope():
        with strategy.extended.experimental_logical_device(1):
            w = tf.Variable(tf.ones([8, 8]), name="w")
            hidden = tf.Variable(tf.ones([8, 8]), name="hidden")  # read only inside the nested function

    def on_core_1():
        return strategy.extended.experimental_logical_device(1)

    @tf.function(jit_compile=False)
    def nested(x):
        with on_core_1():
            return tf.matmul(x, hidden, name="nested")

    def replica(x):
        with on_core_1():
            direct = tf.matmul(x, w, name="direct")
            looped = tf.while_loop(lambda i, v: i < 2, lambda i, v: (i + 1, tf.matmul(v, w, name="looped")), (0, x))[1]
        return direct + nested(x) + looped

    @tf.function
    def loop(x):
        for _ in tf.range(1):
            strategy.run(replica, args=(x,))

    function = loop.get_concrete_function(tf.TensorSpec([4, 8]))
    cluster = compiled_step.cluster(function)
    args, owners = compiled_step.arguments(function, cluster, [w, hidden])
    cores = compiled_step.argument_cores(cluster)
    module = compiled_step.Module.parse(compiled_step.compile_hlo(cluster, args, cores))
    dots = {ins.op_name.rsplit("/", 1)[-1]: ins.core for ins in module.instructions.values() if ins.opcode == "dot"}
    assert dots == {"direct": 1, "looped": 1, "nested": None}
    assert {owner.name.split(":")[0]: core for owner, core in zip(owners, cores) if owner is not None} == \
        {"w": 1, "hidden": 1}
    assert homes[id(w.values[0])][1] == homes[id(hidden.values[0])][1] == 1
    for i, owner in enumerate(owners):  # the compiled parameters carry the cores given
        assert module.parameters[i].core == cores[i]


def test_the_compiled_audit_counts_every_matmul_of_the_step():
    """2 stages x 2 tensor groups, 2 accumulated micro-batches: each block's 6 matmuls per group (qkv,
    the two of attention, its projection, the MLP's two) and the head's one, per micro-batch, and two
    backward matmuls for each; every variable the step reads is an input of the program."""
    audit = compiled(2, 2)
    forward = 2 * (2 * 2 * 6 + 1)
    assert sum(audit.counts["forward matmuls"].values()) == forward, "\n".join(audit.table())
    assert sum(audit.counts["backward matmuls"].values()) == 2 * forward
    model_and_moments = 3 * len(step(2, 2).model.trainable_variables)
    assert len(audit.variables) >= model_and_moments
    assert sum(audit.counts["variables in/out"].values()) == len(audit.variables)


def test_one_core_per_replica_has_nothing_to_place():
    audit = compiled(1, 1)
    assert not audit.problems()
    assert set(audit.counts["forward matmuls"]) == {None}  # nothing is annotated with one core per replica


def test_every_stage_and_group_runs_its_forward_and_backward_matmuls_on_its_own_core():
    """2 x 2: no matmul without a core, each block's on its stage's cores, the stages and each stage's
    groups within 25% of an even split, forward and backward; gradient sums on their stage's core."""
    problems, text = report(compiled(2, 2), {"unplaced", "uneven", "off its stage"})
    assert not problems, text


def test_each_variable_is_read_and_written_on_the_core_it_lives_on():
    problems, text = report(compiled(2, 2), {"variable", "collective"})
    assert not problems, text


def test_tensor_groups_move_slices_not_whole_kernels():
    """A group core other than its stage's first does run matmuls, forward and backward, and computes no
    tensor of a whole kernel's shape (the kernel's cast, reshape or slice, or a full-size gradient)."""
    audit = compiled(2, 2)
    for core in (1, 3):
        assert audit.counts["forward matmuls"][core] and audit.counts["backward matmuls"][core], audit.table()
    problems, text = report(audit, {"full kernel"})
    assert not problems, text


def test_the_evaluation_step_runs_each_stage_on_its_own_core():
    audit = placement_audit.compiled(2, 2, which="eval", step=step(2, 2))
    assert sum(audit.counts["forward matmuls"].values()) == 2 * 2 * 6 + 1  # one batch, no backward
    problems, text = report(audit, {"unplaced", "uneven", "off its stage"})
    assert not problems, text


SETTINGS = {"bf16-accum2": {}, "fp32-accum1": {"precision": "float32", "grad_accum": 1}, "llama": {"family": "llama"}}
# Pairwise, not the whole cross product (which passed when issue 38 closed): every layout with float32 and
# no accumulation, and mixed_bfloat16 with accumulation and llama on stages alone, groups alone and both.
# What a setting changes (dtype casts, the accumulation loop, llama's projections) is placed per stage and
# group the same way at every size; the 4x1 and 2x4 compiles of the other settings cost ~4 CI-minutes.
COMPILED_CASES = [(p, t, "fp32-accum1") for p, t in placement_audit.LAYOUTS if (p, t) != (1, 1)] + \
    [(p, t, name) for name in ("bf16-accum2", "llama") for p, t in [(2, 1), (1, 2), (2, 2)]]


@pytest.mark.slow
@pytest.mark.parametrize("stages,tensor,name", COMPILED_CASES)
def test_the_compiled_step_places_every_layout(stages, tensor, name):
    settings = SETTINGS[name]
    problems, text = report(compiled(stages, tensor, **settings))
    assert not problems, text


# ---- the whole train step, traced through TPUStrategy.run (the second view: before XLA) --------------


@pytest.mark.parametrize("stages,tensor", placement_audit.LAYOUTS)
def test_the_traced_train_step_spreads_over_the_replicas_cores(stages, tensor):
    """The device attributes of the traced graph, before XLA (what the compiler keeps is the tests above):
    forward, backward, all-reduce, norm, clipping and AdamW's update (mixed_bfloat16, dropout, 2
    accumulated micro-batches): each stage's reductions and updates annotated for its own core, its
    tensor groups' forward and backward matmuls annotated evenly, and only the replica's shared scalars
    left without a core. The table is docs/pipeline-tensor.md's second one."""
    audit = placement_audit.traced(stages, tensor, step=step(stages, tensor))
    assert not audit.problems(), "\n".join(audit.table() + audit.problems())


def test_the_traced_audit_under_loss_scaling_and_for_llama():
    for audit in (placement_audit.traced(2, 2, loss_scaling=True), placement_audit.traced(2, 2, family="llama")):
        assert not audit.problems(), "\n".join(audit.table() + audit.problems())
        assert audit.shared["variable writes"] <= placement_audit.SHARED_ALLOWED["variable writes"]


def test_the_update_of_a_variable_no_stage_owns_is_an_error_naming_it_not_core_0():
    # the optimizer runs each variable's update on its stage's core (Trainer: placement_of); one the
    # stages do not know would have gone to core 0 unnoticed
    from tpu_llm.parallel.distribute import Distribution
    from tpu_llm.training.trainer import Trainer

    cfg = tiny_cfg(n_layer=2, **{"parallel.pipeline_stages": 2})
    strategy = offline_tpu.offline_tpu_strategy(2, 4)
    placement = Placement(Mesh(1, 2), tpu_strategy=strategy)
    parts = pipeline.partition(cfg.model, 64, 16, 2)
    with offline_tpu.variables_on_the_cpu(strategy=strategy), strategy.scope():
        model = pipeline.build_weights(GPT(cfg.model, 64), parts, placement)
        optimizer = make_optimizer(cfg.train, model)
        stray = tf.Variable(tf.zeros([3]), name="stray")
    dist = Distribution(strategy, "tpu", "offline", "TPU", jit_compile=False, placement=placement)
    Trainer(dist, model, optimizer, cfg.train, pipeline.Pipeline(model, parts, placement), execution="graph")
    for v in model.trainable_variables:  # each the scope of its stage (where the compiled audit checks it)
        with optimizer.placement_of(v.value):
            pass
    with pytest.raises(LookupError, match="internal error: variable stray.* belongs to no pipeline stage"):
        optimizer.placement_of(stray)
