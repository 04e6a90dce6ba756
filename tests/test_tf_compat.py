"""tpu_llm/tf_compat.py against the installed TensorFlow and Keras: each private attribute tpu-llm relies on
still exists and still means what tf_compat assumes. A TF/Keras upgrade that changes one fails here."""

import inspect
import json
import os

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.distribute import collective_all_reduce_strategy, multi_worker_util
from tensorflow.python.distribute.failure_handling import failure_handling, failure_handling_util

from tpu_llm import tf_compat

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
    for name in sorted(os.listdir(root)):
        if not name.endswith(".py") or name == "tf_compat.py":
            continue
        text = open(os.path.join(root, name), encoding="utf-8").read()
        for attr in ("_num_workers", "_id_in_cluster", "_platform_device", "_stateful_handle", "step_counter",
                     "dynamic_scale.assign", "tensorflow.python", "keras.src", "_flatten_layers", "._devices"):
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


def test_all_layers_finds_nested_dropout():
    import keras

    inner = keras.Sequential([keras.layers.Dense(2), keras.layers.Dropout(0.5)])
    outer = keras.Sequential([keras.Input((3,)), inner, keras.layers.Dropout(0.1)])
    assert sum(isinstance(layer, keras.layers.Dropout) for layer in tf_compat.all_layers(outer)) == 2
