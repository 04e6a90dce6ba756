"""TensorFlow and Keras behaviour that no public API gives: one function each.

TensorFlow and Keras change their private attributes without notice. Where a public API gives the same
answer, it is used (and this module says which); where none does, the private access lives here, and
tests/test_tf_compat.py asserts on the installed TensorFlow/Keras that the attribute still exists and
still means what the function assumes, so an upgrade fails there, loudly, rather than in a run.

Every other module that depends on private TF/Keras behaviour stays where it is, each with its check
(tests/test_tf_compat.py unless named):
- training/optimizer.py: `ReducedGradientsAdamW` subclasses Keras' AdamW and overrides its private
  `_distributed_tf_update_step` (a copy of Keras' own loop, each update in its stage's placement),
  `_all_reduce_sum_gradients` and `_apply_weight_decay` (and reads `_momentums`, `_velocities`,
  `_get_variable_index`, `_use_weight_decay`); the Keras optimizer canary checks each one, that the
  copied loop is still Keras' statement for statement, and what AdamW still does with them.
- parallel/pipeline.py (`remat_with_dropout`, `_seeds_here`), parallel/tensor.py (`group_seeds`) and
  training/trainer.py (`ReplicaSeedGenerator`, swapped in by `__class__`): Keras' Dropout draws each
  mask by one `self.seed_generator.next()` (state, then state + [0, 1]) from the generator's `state`
  variable; they replace `next` on the instance, the class, or the `state` variable. training/build.py,
  interop/hf.py and harness/offline_tpu.py find those variables by their Keras path
  (`.../seed_generator_state`). The Keras dropout-seed canary checks all of it.
- model/transformer.py: `GPT` tracks its blocks with Keras' private `_track_trackable`, without which
  a TF checkpoint would hold no block; the checkpoint canary checks that it still puts them there.
- native_log.py: absl's `SetMinLogLevel` in TensorFlow's framework library, called by its mangled C++
  name (TF exports no Python setter for absl's level); tests/test_progress.py checks that the lines go.
- training/sharded_adamw.py: its divided moments are checkpointed through TF's trackable and legacy
  SaveableObject classes (`checkpoint_classes` below, with why); tests/test_shard_optimizer.py checks them.
- harness/offline_tpu.py: `OfflineTPUResolver` answers what TPUStrategy asks a TPU cluster resolver
  (`num_accelerators`, `get_tpu_system_metadata`), so that TF's own TPUStrategy is built on a hand-built
  topology without a TPU; tests/test_placement.py and tests/test_doctor.py build it on several.
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


def supports_no_merge_call() -> bool:
    """Whether the current strategy's replicas may update variables without a `merge_call` (the default
    strategy, TPUStrategy), so that a `tf.cond` in the replica context may hold the optimizer's update;
    MirroredStrategy on CPUs needs the merge_call (training/fault.apply_if). TensorFlow exports the answer
    only as the internal `tf.__internal__.distribute.strategy_supports_no_merge_call`, which reads the
    private `strategy.extended._use_merge_call()`; Keras' LossScaleOptimizer asks it the same way."""
    return tf.__internal__.distribute.strategy_supports_no_merge_call()


def all_layers(model) -> list:
    """Every layer inside `model`, nested ones included (Keras 3's private `Layer._flatten_layers`;
    `Model.layers` lists only the top level)."""
    return list(model._flatten_layers())  # noqa: SLF001


# ---- TensorFlow's TPU compile path, offline (the placement audit: harness/compiled_step.py) --------------
# TF exports no API to turn a function's body into a graph and back, to mark an XLA argument's core, or
# to compile a function by name for its HLO; `experimental_get_compiler_ir` does the last for a
# tf.function only, through the same private context call used here.

def function_graph_def(function_def):
    """A FunctionDef's body as a GraphDef, its arguments as placeholders (function_def_to_graph)."""
    from tensorflow.python.framework import function_def_to_graph

    return function_def_to_graph.function_def_to_graph_def(function_def)[0]


def function_graph(function_def):
    """A FunctionDef's body as a graph whose tensors carry their inferred shapes."""
    from tensorflow.python.framework import function_def_to_graph

    return function_def_to_graph.function_def_to_graph(function_def)


def graph_function_def(graph, operations, inputs, outputs, name: str):
    """`operations` of `graph` as a FunctionDef named `name` taking `inputs`, returning `outputs`."""
    from tensorflow.python.framework import graph_to_function_def

    fdef = graph_to_function_def.graph_to_function_def(graph, operations, inputs, outputs)
    fdef.signature.name = name
    return fdef


def maximal_sharding(core: int) -> bytes:
    """The serialized XLA OpSharding that puts a value on one logical core (`_XlaSharding`'s value)."""
    from tensorflow.compiler.xla import xla_data_pb2

    return xla_data_pb2.OpSharding(type=xla_data_pb2.OpSharding.MAXIMAL, tile_assignment_dimensions=[1],
                                   tile_assignment_devices=[core]).SerializeToString()


def sharding_core(serialized: bytes) -> int | None:
    """The core of a serialized maximal OpSharding; None for any other sharding."""
    from tensorflow.compiler.xla import xla_data_pb2

    sharding = xla_data_pb2.OpSharding.FromString(serialized)
    return sharding.tile_assignment_devices[0] if sharding.type == xla_data_pb2.OpSharding.MAXIMAL else None


def assign_core(tensor, core: int):
    """`tensor` through an XlaSharding op for logical `core` (xla_sharding.assign_device)."""
    from tensorflow.python.compiler.xla.experimental import xla_sharding

    return xla_sharding.assign_device(tensor, core, use_sharding_op=True)


def compiler_ir(function_def, library, args, stage: str = "hlo", replaced=()) -> str:
    """What XLA's compiler makes of `function_def` (calling functions of `library`, a
    FunctionDefLibrary) for `args` on this process's CPU: `stage` "hlo" is tf2xla's output before XLA's
    own passes. The function is registered for the call only; the functions of `library` named in
    `replaced` take the place of the process's own of that name (edited copies of a traced step's)."""
    from tensorflow.python.eager import context

    ctx = context.context()
    ctx.ensure_initialized()
    for f in library.function:
        if f.signature.name in replaced and ctx.has_function(f.signature.name):
            ctx.remove_function(f.signature.name)
        if not ctx.has_function(f.signature.name):
            ctx.add_function_def(f)
    ctx.add_function_def(function_def)
    try:
        ir = ctx.get_compiler_ir(device_name="/job:localhost/replica:0/task:0/device:CPU:0", platform_name=None,
                                 function_name=function_def.signature.name, flat_args=args, captured_inputs=[],
                                 stage=stage)
    finally:
        ctx.remove_function(function_def.signature.name)
    return ir.decode() if isinstance(ir, bytes) else ir


def current_device() -> str:
    """The device the innermost `tf.device` scope (or a strategy's variable placement) names now."""
    from tensorflow.python.eager import context

    return context.context().device_name or ""


def tpu_core_devices(strategy) -> list[str]:
    """The device of each logical core of a TPUStrategy's first replica (TF 2.20's private
    `extended._tpu_devices[replica][core]`)."""
    return [str(d) for d in strategy.extended._tpu_devices[0]]  # noqa: SLF001


def replica_handles(variable) -> list:
    """The resource handles a TPU (or mirrored) variable reaches a traced function by: each replica's
    copy's, and the packed handle of all of them (TF 2.20's private `_packed_var.packed_handle`, which
    TPUStrategy passes to a replicated computation)."""
    handles = [c.handle for c in variable.values]
    packed = getattr(variable, "_packed_var", None)
    return handles + ([packed.packed_handle] if packed is not None else [])


def adam_moments(optimizer) -> list[tuple]:
    """(variable, first moment, second moment) per trainable variable of a Keras Adam/AdamW (its private
    `_trainable_variables`, `_momentums` and `_velocities`, one per variable in that order; Keras
    variables)."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)  # under LossScaleOptimizer
    return list(zip(inner._trainable_variables, inner._momentums, inner._velocities))  # noqa: SLF001


def mlir_bridge_forced() -> bool:
    """Whether the MLIR bridge is forced on in this process (TF_XLA_FLAGS=--tf_mlir_enable_mlir_bridge=true
    or tf.config.experimental.enable_mlir_bridge): TF's `TF_IsMlirBridgeEnabled` state, 1 for enabled (0 is
    unspecified, 2 disabled); TF has no public getter."""
    from tensorflow.python.eager import context

    return int(context.context().enable_mlir_bridge) == 1


# ---- checkpointing state that is not a tf.Variable (training/sharded_adamw.py) -----------------------
# TensorFlow's checkpoint machinery for objects of our own: a node whose children we name
# (`Trackable._trackable_children`, so that a divided moment sits at the key Keras' AdamW uses), a
# trackable list (its children are "0", "1", ...) and the legacy SaveableObject, whose SaveSpecs carry
# a slice spec each: the one path on which slices saved by R replicas restore into any other slicing
# (TF 2.20's `_serialize_to_tensors` path saved slices but did not restore them, when tried).
# tests/test_shard_optimizer.py restores across 4, 2 and 1 replicas and from and into Keras' own AdamW.
def checkpoint_classes():
    """(Trackable, TrackableList, SaveableObject, SaveSpec, VARIABLE_VALUE_KEY), from TF's private modules."""
    from tensorflow.python.trackable import base, data_structures
    from tensorflow.python.training.saving import saveable_object

    return (base.Trackable, data_structures.List, saveable_object.SaveableObject, saveable_object.SaveSpec,
            base.VARIABLE_VALUE_KEY)
