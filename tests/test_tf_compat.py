"""tpu_llm/platform/tf_compat.py against the installed TensorFlow and Keras: each private attribute tpu-llm relies on
still exists and still means what tf_compat assumes. A TF/Keras upgrade that changes one fails here.

The exceptions to "private names live in tf_compat.py" are listed in its docstring, each with its check.
Three are checked here: ReducedGradientsAdamW (training/optimizer.py) subclasses Keras' AdamW and overrides
private methods, one a copy of Keras' own loop; the Keras optimizer canary below checks each of them, the
copy against the installed Keras, and what they still do, and pyproject.toml bounds keras to the minor
versions it passed with. The dropout-seed overrides (parallel/pipeline.py, parallel/tensor.py,
training/trainer.py) assume how Keras' Dropout draws its seeds: the dropout-seed canary checks it. GPT
(model/transformer.py) tracks its blocks with Keras' private `_track_trackable`: the checkpoint canary
checks that TF checkpoints still hold them."""

import ast
import inspect
import json
import os
import re
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.distribute import collective_all_reduce_strategy, multi_worker_util
from tensorflow.python.distribute.failure_handling import failure_handling, failure_handling_util

from tpu_llm.platform import tf_compat
from tpu_llm.training.optimizer import ReducedGradientsAdamW

CLUSTER = {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2", "127.0.0.1:3", "127.0.0.1:4"], "ps": ["127.0.0.1:5"]}


class FakeMultiWorker(tf.distribute.MultiWorkerMirroredStrategy):
    """isinstance-compatible stand-in: building a real one would start collectives in this process."""

    def __init__(self, resolver):  # noqa: D107 - no super().__init__: nothing is started
        self._resolver = resolver

    @property
    def cluster_resolver(self):
        return self._resolver


@pytest.mark.parametrize("task", [("chief", 0), ("worker", 0), ("worker", 2)])
def test_worker_index_is_tensorflows_id_in_cluster(task):
    spec = {k: v for k, v in CLUSTER.items() if k != "ps"}
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(spec), task_type=task[0], task_id=task[1])
    assert tf_compat.worker_index(FakeMultiWorker(resolver)) == multi_worker_util.id_in_cluster(spec, *task)
    # ... which is what MultiWorkerMirroredStrategy numbers its replicas by (`_id_in_cluster`)
    source = inspect.getsource(collective_all_reduce_strategy.CollectiveAllReduceExtended)
    assert "self._id_in_cluster = multi_worker_util.id_in_cluster(" in source
    assert tf_compat.worker_index(tf.distribute.get_strategy()) == 0


def test_parameter_server_worker_count_comes_from_tf_config_not_a_private_attribute():
    from tpu_llm.parallel.distribute import Distribution, Found

    found = Found(cluster=CLUSTER, task=("chief", 0))
    dist = Distribution(tf.distribute.get_strategy(), "parameter_server", "", "CPU", coordinator=object(),
                        workers=tuple(found.cluster["worker"]))
    assert dist.num_workers == 3 and dist.loops_per_call() == 6


def test_preemption_handler_platform_attribute_still_exists():
    # the handler stores the platform it detected in `_platform_device` and disables itself on GCE CPU/TPU
    init = inspect.getsource(failure_handling.PreemptionCheckpointHandler.__init__)
    assert "self._platform_device = failure_handling_util.detect_platform()" in init
    assert "PlatformDevice.GCE_TPU" in init and "PlatformDevice.GCE_CPU" in init
    names = {p.name for p in failure_handling_util.PlatformDevice}
    assert {"GCE_CPU", "GCE_TPU"} <= names
    assert isinstance(failure_handling_util.detect_platform(), failure_handling_util.PlatformDevice)

    class Handler:
        pass

    handler = Handler()
    for platform, active in ((failure_handling_util.PlatformDevice.GCE_TPU, False),
                             (failure_handling_util.PlatformDevice.GCE_CPU, False),
                             (failure_handling_util.PlatformDevice.INTERNAL_CPU, True)):
        handler._platform_device = platform
        assert tf_compat.preemption_handler_active(handler) is active


def test_loss_scale_overflow_is_what_keras_does_on_non_finite_gradients():
    def optimizer():
        var = keras.Variable(np.ones(3, np.float32))
        opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=2.0 ** 10)
        opt.build([var])
        opt.step_counter.assign(5)  # part-way through a growth interval
        return opt, var

    keras_opt, var = optimizer()
    keras_opt.apply([tf.constant([np.inf, 1.0, 1.0])], [var])  # Keras' own skip branch
    ours, _ = optimizer()
    tf_compat.loss_scale_overflowed(ours)
    assert float(ours.dynamic_scale) == float(keras_opt.dynamic_scale) == 2.0 ** 9
    assert int(ours.step_counter) == int(keras_opt.step_counter) == 0
    assert var.numpy().tolist() == [1.0, 1.0, 1.0]  # and Keras did skip the update
    source = inspect.getsource(keras.optimizers.LossScaleOptimizer)
    assert "def _stateful_handle_non_finite_grads" in source


def test_no_private_tensorflow_attribute_outside_tf_compat():
    # grep -n "\\._[a-z]" on TF/Keras objects: every one lives in tf_compat.py
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tpu_llm")
    offenders = []
    files = sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)
    assert "training/optimizer.py" in files  # the sub-packages too, not only the top level
    for name in files:
        if not name.endswith(".py") or name == os.path.join("platform", "tf_compat.py"):
            continue
        text = open(os.path.join(root, name), encoding="utf-8").read()
        for attr in ("_num_workers", "_id_in_cluster", "_platform_device", "_stateful_handle", "step_counter",
                     "dynamic_scale.assign", "tensorflow.python", "keras.src", "_flatten_layers", "._devices",
                     "__internal__", "_use_merge_call"):
            if attr in text:
                offenders.append(f"{name}: {attr}")
    assert not offenders, json.dumps(offenders)


def test_mirrored_variables_are_placed_by_colocate_with_devices():
    # MirroredStrategy's variable creator takes each replica's device from `colocate_with._devices`
    from tensorflow.python.distribute import mirrored_strategy

    source = inspect.getsource(mirrored_strategy.MirroredExtended._create_variable)
    assert "devices = colocate_with._devices" in source
    devices = tuple(d.name for d in tf.config.list_logical_devices("CPU")[:2])
    strategy = tf.distribute.MirroredStrategy(devices)
    with strategy.scope():
        v = tf.Variable(1.0, colocate_with=tf_compat.ReplicaDevices(devices[::-1]))  # noqa: F841
    placed = [x.device.split("device:")[-1] for x in strategy.experimental_local_results(v)]
    assert placed == [d.split("device:")[-1] for d in devices[::-1]] == ["CPU:1", "CPU:0"]


def test_no_merge_call_is_what_the_strategy_says():
    # training/fault.apply_if takes its cond in the replica context only where TF says no merge_call is needed
    assert tf_compat.supports_no_merge_call() is True  # the default strategy
    strategy = tf.distribute.MirroredStrategy([d.name for d in tf.config.list_logical_devices("CPU")[:2]])
    with strategy.scope():
        assert tf_compat.supports_no_merge_call() is False and strategy.extended._use_merge_call()
    source = inspect.getsource(tf.__internal__.distribute.strategy_supports_no_merge_call)
    assert "strategy.extended._use_merge_call()" in source


def test_track_trackable_puts_the_blocks_into_tf_checkpoints(tmp_path):
    # model/transformer.py: Keras 3 tracks the list of blocks for `weights`, but a TF checkpoint sees them only
    # through the private `_track_trackable` (without it tf.train.Checkpoint(model=...) saves no block)
    from helpers import tiny_model

    model = tiny_model(n_layer=2)
    path = tf.train.Checkpoint(model=model).write(str(tmp_path / "ckpt"))
    saved = {name.split("/")[1] for name, _ in tf.train.list_variables(path) if name.startswith("model/")}
    assert {"block_0", "block_1"} <= saved, sorted(saved)
    assert callable(getattr(keras.layers.Layer, "_track_trackable", None))


def test_all_layers_finds_nested_dropout():
    import keras

    inner = keras.Sequential([keras.layers.Dense(2), keras.layers.Dropout(0.5)])
    outer = keras.Sequential([keras.Input((3,)), inner, keras.layers.Dropout(0.1)])
    assert sum(isinstance(layer, keras.layers.Dropout) for layer in tf_compat.all_layers(outer)) == 2


# ---- Keras' private optimizer API (ReducedGradientsAdamW) ---------------------------------------------

# What tpu_llm/training/optimizer.py's ReducedGradientsAdamW overrides or calls on Keras' AdamW, with the
# parameters it assumes (self left out).
KERAS_OPTIMIZER_METHODS = {
    # overridden: Keras' own loop over the variables, copied (the copy is checked against Keras' below),
    # each update inside placement_of(variable): its pipeline stage's core
    "_distributed_tf_update_step": ("distribution", "grads_and_vars", "learning_rate"),
    "_all_reduce_sum_gradients": ("grads_and_vars",),  # overridden: the trainer has already summed them
    "_apply_weight_decay": ("variables",),  # overridden: decayed in update_step, where a skipped step leaves it out
    "update_step": ("gradient", "variable", "learning_rate"),  # overridden (public, the contract around it is not)
    "_get_variable_index": ("variable",),  # called: the index of the variable's moments
    "_use_weight_decay": ("variable",),  # called: exclude_from_weight_decay's answer
}
KERAS_OPTIMIZER_STATE = ("_momentums", "_velocities")  # read and restored: Adam's moments, by variable index
UPGRADE = ("ReducedGradientsAdamW (tpu_llm/training/optimizer.py) overrides Keras' private optimizer methods: fix it "
           "before widening the keras range in pyproject.toml")


def test_keras_private_optimizer_api_the_optimizer_overrides_is_still_there():
    for name, params in KERAS_OPTIMIZER_METHODS.items():
        method = getattr(keras.optimizers.AdamW, name, None)
        assert callable(method), f"keras {keras.__version__}: AdamW.{name} is gone; {UPGRADE}"
        got = tuple(inspect.signature(method).parameters)[1:]
        assert got == params, f"keras {keras.__version__}: AdamW.{name}{got}, expected {params}; {UPGRADE}"
        ours = tuple(inspect.signature(getattr(ReducedGradientsAdamW, name)).parameters)[1:]
        assert ours == params, f"ReducedGradientsAdamW.{name}{ours} differs from Keras' {params}"
    variables = [keras.Variable(np.zeros((2, 3), np.float32)), keras.Variable(np.zeros(4, np.float32))]
    optimizer = keras.optimizers.AdamW()
    optimizer.build(variables)
    for name in KERAS_OPTIMIZER_STATE:
        state = getattr(optimizer, name, None)
        assert isinstance(state, list) and len(state) == len(variables), \
            f"keras {keras.__version__}: AdamW.{name} is not a list of one slot per variable; {UPGRADE}"
        for variable in variables:
            slot = state[optimizer._get_variable_index(variable)]
            assert isinstance(slot.value, tf.Variable) and tuple(slot.shape) == tuple(variable.shape), (name, slot)


def _method_body(cls, name: str) -> list:
    """The statements of cls.name's source, its docstring left out."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(getattr(cls, name)))).body[0]
    return [n for n in tree.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]


def test_the_copied_keras_update_loop_is_still_keras_own():
    """ReducedGradientsAdamW._distributed_tf_update_step is Keras' loop over the variables with each update
    wrapped in `placement_of(variable)`: unwrapped, it must be the installed Keras' statement for
    statement, so a Keras that changes its loop (another argument to update, a grouped update, a step
    before or after) fails here rather than being silently replaced by the old copy."""
    ours = _method_body(ReducedGradientsAdamW, "_distributed_tf_update_step")
    loops = [n for n in ours if isinstance(n, ast.For)]
    assert len(loops) == 1 and len(loops[0].body) == 1 and isinstance(loops[0].body[0], ast.With), ast.dump(loops[0])
    placement = loops[0].body[0]
    assert "placement_of" in ast.unparse(placement.items[0].context_expr)
    loops[0].body = placement.body  # the copy as Keras wrote it
    keras_own = _method_body(keras.optimizers.AdamW, "_distributed_tf_update_step")
    assert [ast.dump(n) for n in ours] == [ast.dump(n) for n in keras_own], (
        f"keras {keras.__version__} changed the loop ReducedGradientsAdamW copies:\n"
        + "\n".join(ast.unparse(n) for n in keras_own) + f"\n{UPGRADE}")


def adamw_by_hand(w, m, v, g, t, lr, wd, beta_1, beta_2, epsilon, decay):
    """Keras' AdamW step t (1-based) in float64: decoupled weight decay first, then Adam."""
    w = w - w * wd * lr if decay else w
    m, v = m + (g - m) * (1 - beta_1), v + (g * g - v) * (1 - beta_2)
    alpha = lr * np.sqrt(1 - beta_2 ** t) / (1 - beta_1 ** t)
    return w - alpha * m / (np.sqrt(v) + epsilon), m, v


def test_keras_adamw_with_reduced_gradients_is_adamw_on_the_already_reduced_gradient():
    # Two replicas (MirroredStrategy over two logical CPUs) each apply the gradient the trainer has already
    # all-reduced: the update must be one AdamW step with it, weight decay once and on the kernel only. A Keras
    # that no longer calls _all_reduce_sum_gradients sums it again (twice the moments); one that no longer
    # calls _apply_weight_decay decays the kernel twice (its own and update_step's).
    hyper = dict(lr=0.1, wd=0.2, beta_1=0.9, beta_2=0.99, epsilon=1e-3)
    rng = np.random.default_rng(0)
    init = [rng.normal(size=(2, 3)).astype(np.float32), rng.normal(size=3).astype(np.float32)]  # kernel, bias
    grads = [[rng.normal(size=w.shape).astype(np.float32) for w in init] for _ in range(2)]  # two steps
    strategy = tf.distribute.MirroredStrategy([d.name for d in tf.config.list_logical_devices("CPU")[:2]])

    def run(optimizer_class):
        with strategy.scope():
            variables = [keras.Variable(w) for w in init]
            optimizer = optimizer_class(learning_rate=hyper["lr"], weight_decay=hyper["wd"], beta_1=hyper["beta_1"],
                                        beta_2=hyper["beta_2"], epsilon=hyper["epsilon"])
            optimizer.exclude_from_weight_decay(var_list=variables[1:])
            optimizer.build(variables)

        @tf.function
        def step(gradients):  # identity: a tensor on each replica's device, as the trainer's gradients are
            strategy.run(lambda: optimizer.apply([tf.identity(g) for g in gradients], variables))

        for gradients in grads:
            step([tf.constant(g) for g in gradients])
        assert optimizer.iterations.value.numpy() == len(grads)
        moments = [optimizer._momentums[optimizer._get_variable_index(v)].value.numpy() for v in variables]
        return [v.value.numpy() for v in variables], moments

    weights, moments = run(ReducedGradientsAdamW)
    for i, (w, decay) in enumerate(zip(init, (True, False))):
        w, m, v = w.astype(np.float64), 0.0, 0.0
        for t, gradients in enumerate(grads, 1):
            w, m, v = adamw_by_hand(w, m, v, gradients[i].astype(np.float64), t, **hyper, decay=decay)
        np.testing.assert_allclose(moments[i], m, rtol=0, atol=1e-6,
                                   err_msg=f"keras {keras.__version__}: the gradient was summed again; {UPGRADE}")
        np.testing.assert_allclose(weights[i], w, rtol=0, atol=1e-6,
                                   err_msg=f"keras {keras.__version__}: not one AdamW step; {UPGRADE}")
    # ... and the test can tell: Keras' own AdamW, in the same replica context, sums the two replicas' gradients
    _, summed = run(keras.optimizers.AdamW)
    for ours, theirs in zip(moments, summed):
        np.testing.assert_allclose(theirs, 2 * ours, rtol=1e-5, atol=1e-7,
                                   err_msg="Keras' AdamW no longer all-reduces in a replica context: is the "
                                           "_all_reduce_sum_gradients override still needed?")


# ---- Keras' dropout seeds (parallel/pipeline.py, parallel/tensor.py, training/trainer.py) ---------------

DROPOUT_UPGRADE = ("remat_with_dropout and _seeds_here (tpu_llm/parallel/pipeline.py), group_seeds "
                   "(parallel/tensor.py) and ReplicaSeedGenerator (training/trainer.py) rely on how Keras' Dropout "
                   "draws its seeds: fix them before widening the keras range in pyproject.toml")


def test_keras_dropout_draws_each_mask_from_one_next_of_its_seed_generator_as_the_overrides_assume():
    """What the dropout-seed overrides assume of Keras' Dropout and SeedGenerator, on the installed Keras:
    - a Dropout call in training draws exactly one seed, by `self.seed_generator.next()` looked up on
      the instance (so an instance attribute `next`, as remat_with_dropout and group_seeds set, replaces
      the draw; a class swapped in by `__class__`, as per_replica_dropout does, is called too), and its
      mask is a function of that seed alone;
    - Keras' own `next()` returns the state and then advances it by [0, 1] (remat_with_dropout replays
      draw i as state + [0, i] and advances the state by [0, n] after the forward);
    - the state is the generator's `state` attribute, read at each draw: a variable put there in its
      place (_seeds_here, on a stage's device) is the one drawn from and advanced;
    - its variable's path ends in `seed_generator_state` (training/build.py, interop/hf.py and
      harness/offline_tpu.py find the seeds by it)."""
    from tpu_llm.training.trainer import ReplicaSeedGenerator, per_replica_dropout

    dropout = keras.layers.Dropout(0.5, seed=7)
    x = tf.ones([4, 32])
    generator = dropout.seed_generator
    assert isinstance(generator, keras.random.SeedGenerator), f"keras {keras.__version__}; {DROPOUT_UPGRADE}"
    assert generator.state.path.endswith("seed_generator_state"), (generator.state.path, DROPOUT_UPGRADE)
    drawn = []

    def fixed(ordered=True, seed=(3, 4)):
        drawn.append(ordered)
        return tf.constant(seed, generator.state.dtype)
    generator.next = fixed
    try:
        first, second = dropout(x, training=True), dropout(x, training=True)
        generator.next = lambda ordered=True: fixed(ordered, (3, 5))
        other = dropout(x, training=True)
    finally:
        del generator.next
    assert len(drawn) == 3, f"keras {keras.__version__}: {len(drawn)} seeds drawn for 3 dropout calls; {DROPOUT_UPGRADE}"
    np.testing.assert_array_equal(first, second, err_msg=f"keras {keras.__version__}: the mask is not the drawn "
                                                         f"seed's alone; {DROPOUT_UPGRADE}")
    assert (first.numpy() != other.numpy()).any(), DROPOUT_UPGRADE
    assert generator.state.numpy().tolist() == [7, 0], "an instance `next` must leave Keras' state alone"
    # Keras' own draws: state, then state + [0, 1], ... read from whatever variable `state` is now
    generator.state = keras.Variable(np.array([5, 2]), dtype=generator.state.dtype, trainable=False,
                                     aggregation="none", name="seed_generator_state")
    seeds = [generator.next().numpy().tolist() for _ in range(3)]
    assert seeds == [[5, 2], [5, 3], [5, 4]] and generator.state.numpy().tolist() == [5, 5], \
        f"keras {keras.__version__}: SeedGenerator.next drew {seeds}; {DROPOUT_UPGRADE}"
    dropout(x, training=True)
    assert generator.state.numpy().tolist() == [5, 6], f"keras {keras.__version__}: Dropout no longer draws " \
                                                       f"through seed_generator.next; {DROPOUT_UPGRADE}"
    # the per-replica class, swapped in over Keras' own, is what Dropout calls (one replica: Keras' draws)
    model = keras.Sequential([keras.Input((32,)), dropout])
    assert per_replica_dropout(model) == 1 and type(generator) is ReplicaSeedGenerator
    assert ReplicaSeedGenerator.__init__ is keras.random.SeedGenerator.__init__  # no state of its own to miss
    calls = []
    fold = ReplicaSeedGenerator.fold
    try:
        ReplicaSeedGenerator.fold = lambda self, seed: calls.append(seed) or fold(self, seed)
        dropout(x, training=True)
    finally:
        ReplicaSeedGenerator.fold = fold
    assert len(calls) == 1 and calls[0].numpy().tolist() == [5, 6], (calls, DROPOUT_UPGRADE)


# ---- TensorFlow's TPU compile path, offline (harness/compiled_step.py) -----------------------------------

def test_a_function_body_round_trips_to_a_function_compiled_with_argument_and_op_cores():
    @tf.function
    def f(x, y):
        with tf.device("/device:TPU_REPLICATED_CORE:1"):
            return tf.matmul(x, y)

    body = f.get_concrete_function(tf.TensorSpec([4, 4]), tf.TensorSpec([4, 4])).function_def
    graph_def = tf_compat.function_graph_def(body)
    assert sum(n.op == "Placeholder" for n in graph_def.node) == 2  # the arguments
    assert tf_compat.function_graph(body).outputs[0].shape == [4, 4]
    graph = tf.Graph()
    with graph.as_default():
        x, y = tf.compat.v1.placeholder(tf.float32, [4, 4]), tf.compat.v1.placeholder(tf.float32, [4, 4])
        with tf.device("/device:TPU_REPLICATED_CORE:1"):
            out = tf_compat.assign_core(tf.matmul(x, y, name="product"), 1)
    fdef = tf_compat.graph_function_def(graph, [op for op in graph.get_operations() if op.type != "Placeholder"],
                                        [x, y], [out], "tf_compat_round_trip")
    for i in range(2):
        fdef.arg_attr[i].attr["_XlaSharding"].s = tf_compat.maximal_sharding(0)
    hlo = tf_compat.compiler_ir(fdef, tf.compat.v1.GraphDef().library, [tf.ones([4, 4])] * 2)
    assert re.search(r"parameter\(0\).*sharding=\{maximal device=0\}", hlo)
    assert re.search(r"dot\(.*sharding=\{maximal device=1\}", hlo)
    assert tf_compat.sharding_core(tf_compat.maximal_sharding(3)) == 3


def test_the_offline_tpu_strategys_cores_handles_and_the_adam_moments():
    from helpers import offline_resolver

    from tpu_llm.parallel import tpu

    resolver = offline_resolver()
    strategy = tf.distribute.TPUStrategy(resolver, experimental_device_assignment=tpu.device_assignment(
        resolver.topology, 2))
    cores = tf_compat.tpu_core_devices(strategy)
    assert len(cores) == 2 and len(set(cores)) == 2 and all("TPU:" in c for c in cores)
    seen = []

    def creator(next_creator, **kwargs):
        seen.append(tf_compat.current_device())
        with tf.device("/device:CPU:0"):
            return next_creator(**kwargs)

    with tf.variable_creator_scope(creator), strategy.scope():
        with strategy.extended.experimental_logical_device(1):
            v = tf.Variable(tf.ones([3]))
    assert seen[0].endswith(cores[1].split("device:")[-1])  # where TPUStrategy put the first replica's copy
    handles = tf_compat.replica_handles(v)
    assert len(handles) == len(v.values) + 1 and all(h.dtype == tf.resource for h in handles)
    variables = [keras.Variable(np.zeros((2, 3), np.float32)), keras.Variable(np.zeros(4, np.float32))]
    optimizer = keras.optimizers.AdamW()
    optimizer.build(variables)
    moments = tf_compat.adam_moments(keras.optimizers.LossScaleOptimizer(optimizer))
    assert [tuple(m.shape) for _, m, _ in moments] == [tuple(v.shape) for v, _, _ in moments] == [(2, 3), (4,)]
    assert [w for w, _, _ in moments] == variables


def test_mlir_bridge_forced_follows_the_public_switches():
    was = tf_compat.mlir_bridge_forced()
    try:
        tf.config.experimental.enable_mlir_bridge()
        assert tf_compat.mlir_bridge_forced()
        tf.config.experimental.disable_mlir_bridge()
        assert not tf_compat.mlir_bridge_forced()
    finally:
        (tf.config.experimental.enable_mlir_bridge if was else tf.config.experimental.disable_mlir_bridge)()
