"""Every place tpu-llm depends on TensorFlow or Keras behaviour that no public API gives: one function each.

TensorFlow and Keras change their private attributes without notice. Where a public API gives the same
answer, it is used (and this module says which); where none does, the private access lives here, and
tests/test_tf_compat.py asserts on the installed TensorFlow/Keras that the attribute still exists and
still means what the function assumes, so an upgrade fails there, loudly, rather than in a run.
"""

from __future__ import annotations

import tensorflow as tf


def worker_index(strategy) -> int:
    """This process's index among the workers of a MultiWorkerMirroredStrategy cluster, in the order
    TensorFlow numbers the cluster's replicas (replica ids `worker_index * local replicas + i`): the chief
    first, then the workers. 0 for every other strategy, whose replicas are all in this process.

    TensorFlow keeps it as the private `strategy.extended._id_in_cluster`
    (`multi_worker_util.id_in_cluster`); this computes it from the public cluster resolver.
    """
    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return 0
    resolver = strategy.cluster_resolver
    if resolver is None or not resolver.task_type:
        return 0
    if resolver.task_type == "chief":
        return 0
    chiefs = len(resolver.cluster_spec().as_dict().get("chief", ()))
    return chiefs + int(resolver.task_id) if resolver.task_type == "worker" else int(resolver.task_id)


def preemption_handler_active(handler) -> bool:
    """Whether a `tf.distribute.experimental.PreemptionCheckpointHandler` watches for preemption here.

    TensorFlow disables it on Google Cloud CPU and TPU VMs (it installs no SIGTERM handler there) and
    says so only in a log line; the platform it detected is the private `handler._platform_device`
    (a `failure_handling_util.PlatformDevice`). No public API tells.
    """
    platform = getattr(handler, "_platform_device", None)
    return platform is None or getattr(platform, "name", "") not in ("GCE_CPU", "GCE_TPU")


def loss_scale_overflowed(optimizer) -> None:
    """What `keras.optimizers.LossScaleOptimizer` does when a step's gradients are not finite (Keras'
    private `_stateful_handle_non_finite_grads`): halve `dynamic_scale` and restart the growth count
    `step_counter` (both public variables). The trainer calls this in its own skip branch instead of
    letting the optimizer decide (see train.Trainer._overflowed)."""
    optimizer.step_counter.assign(0)
    optimizer.dynamic_scale.assign(optimizer.dynamic_scale * 0.5)


class ReplicaDevices:
    """A `colocate_with` value that makes MirroredStrategy put replica r's copy of a new variable on
    `devices[r]`: TF 2.20's `MirroredExtended._create_variable` reads the private `colocate_with._devices`
    (the attribute a MirroredVariable carries); no public API places one replica's copies per stage."""

    def __init__(self, devices: tuple):
        self._devices = devices


def all_layers(model) -> list:
    """Every layer inside `model`, nested ones included (Keras 3's private `Layer._flatten_layers`;
    `Model.layers` lists only the top level)."""
    return list(model._flatten_layers())  # noqa: SLF001
