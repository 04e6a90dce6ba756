"""Where the work of a step runs, by named axes: the mesh, its rules, and the Placement built on it.

A run's devices form a mesh of named axes with sizes (MaxText's `mesh_axes`, in tf.distribute terms):

  replica   data parallel: the strategy's replicas, each with its share of the batch (TF's own runtime:
            MirroredStrategy, MultiWorkerMirrored, TPUStrategy, parameter servers)
  stage     pipeline stages: parallel.pipeline_stages, each a contiguous run of blocks (pipeline.py)
  tensor    tensor groups: parallel.tensor, each some heads and MLP units of every block (tensor.py)

A replica spans the devices (or TPU logical cores) of its `stage` x `tensor` sub-mesh, numbered in the
order the axes are listed: stage-major, so stage i's group g is device i * tensor + g.

What is split over which axis is a rule (MaxText's `logical_axis_rules`): RULES maps each logical
dimension of the model and its data to the axis that splits it, and the code asks the mesh for an axis
by its logical name (`mesh.size_of("heads")`, `placement.at(layers=i, heads=g)`). Where each kind of
variable and activation lives follows:

  batch -> replica     each replica computes on its slice of the batch; weights are replicated over it
  layers -> stage      a block's variables, their gradients and AdamW's moments live on its stage (the
                       first device of the stage's groups); the token embedding on the first stage, the
                       final norm and an untied head on the last; a micro-batch's hidden state crosses
                       from one stage to the next
  heads, mlp -> tensor a block's heads and hidden units are divided over the groups: each group computes
                       with its slices of the weights (cut on the stage's device) and its activations

A new kind of split is an axis (say `expert` or `sequence`) and a rule naming what it splits; dividing
the optimizer's state over replicas is a rule on `replica`. Placement below turns coordinates on the
mesh into device scopes; nothing else in the package computes a device index.
"""

from __future__ import annotations

import contextlib
import dataclasses

import tensorflow as tf

from tpu_llm.platform import tf_compat

AXES = ("replica", "stage", "tensor")  # in the order of the mesh: a replica's devices are stage-major
RULES = {"batch": "replica", "layers": "stage", "heads": "tensor", "mlp": "tensor"}  # logical dimension -> axis


@dataclasses.dataclass(frozen=True)
class Mesh:
    """The sizes of the named axes (AXES)."""

    replica: int = 1
    stage: int = 1
    tensor: int = 1

    def size(self, axis: str) -> int:
        return getattr(self, axis)

    def size_of(self, logical: str) -> int:
        """The size of the axis that splits the logical dimension `logical` (RULES): heads -> tensor."""
        return self.size(RULES[logical])

    @property
    def per_replica(self) -> int:
        """Devices (or TPU cores) one replica spans: the product of the axes inside a replica."""
        return self.stage * self.tensor

    def index(self, **coords: int) -> int:
        """The device, counted within a replica, at `coords` (axis or logical names; an axis not given
        is at 0): stage i's tensor group g is i * tensor + g."""
        at = {axis: 0 for axis in AXES[1:]}
        for name, value in coords.items():
            axis = RULES.get(name, name)
            if axis not in at:
                raise ValueError(f"internal error: {name} is no axis inside a replica ({', '.join(at)})")
            at[axis] = value
        flat = 0
        for axis in AXES[1:]:
            flat = flat * self.size(axis) + at[axis]
        return flat

    def describe(self) -> str:
        """'2 stages x 2 tensor groups' (the axes inside a replica larger than 1), for messages."""
        parts = [f"{self.stage} stages"] * (self.stage > 1) + [f"{self.tensor} tensor groups"] * (self.tensor > 1)
        return " x ".join(parts) or "1 stage"


@dataclasses.dataclass
class Placement:
    """Where the work at a mesh coordinate runs: the one thing pipeline.py and tensor.py ask about devices.

    Off-TPU: `devices[r]` lists replica r's devices in mesh order, entered with tf.device. On TPU: logical
    core `mesh.index(...)` of the replica (the DeviceAssignment gives each replica neighbouring cores),
    entered with `strategy.extended.experimental_logical_device`, which both places variables created
    inside it (TPUStrategy creates variables on the top of its logical-device stack, which is core 0
    unless this scope is entered) and, inside the TPU computation, puts ops on `tpu.core(k)`; tensors
    crossing devices are also annotated (`place`).

    `at(...)` is where ops run, `variables_at(...)` where variables are created (pipeline.build_weights).
    Keras creates AdamW's moments with `colocate_vars_with(variable)`, so they land beside their variable.
    """

    mesh: Mesh = dataclasses.field(default_factory=Mesh)
    devices: tuple = ()  # per replica: its mesh.per_replica device names (off-TPU); () = wherever TF puts it
    tpu_strategy: object = None  # TPUStrategy when the devices of a replica are logical TPU cores

    @property
    def spread(self) -> bool:
        """Whether a replica spans more than one device (stages or tensor groups)."""
        return self.mesh.per_replica > 1

    def at(self, **coords: int):
        """The scope in which ops at `coords` run (e.g. at(layers=i) for stage i, at(layers=i, heads=g))."""
        k = self.mesh.index(**coords)
        if self.tpu_strategy is not None:
            return self._logical_core(k)
        if not self.devices:
            return contextlib.nullcontext()
        replica = tf.get_static_value(tf.distribute.get_replica_context().replica_id_in_sync_group)
        return tf.device(self.devices[int(replica or 0)][k])

    def variables_at(self, **coords: int):
        """The scope in which the variables at `coords` are created (inside the strategy's scope): the
        logical core on TPU; off-TPU that device in every replica (MirroredStrategy would otherwise put
        all of a replica's variables on the replica's first device)."""
        k = self.mesh.index(**coords)
        if self.tpu_strategy is not None:
            return self._logical_core(k)
        if not self.devices:
            return contextlib.nullcontext()
        if not tf.distribute.has_strategy():  # one replica under the default strategy
            return tf.device(self.devices[0][k])
        return tf.variable_creator_scope(_create_on(tuple(replica[k] for replica in self.devices)))

    def place(self, tensor, **coords: int):
        """Annotate `tensor` for the logical TPU core at `coords` (off-TPU a no-op: tf.device placed it)."""
        if self.tpu_strategy is not None and self.spread:
            return self.tpu_strategy.experimental_assign_to_logical_device(tensor, self.mesh.index(**coords))
        return tensor

    def _logical_core(self, k: int):
        if not self.spread:  # one core per replica: TPUStrategy's default placement
            return contextlib.nullcontext()
        return self.tpu_strategy.extended.experimental_logical_device(k)

    def describe(self) -> str:
        if not self.spread:
            return "no pipeline"
        what = self.mesh.describe()
        if self.tpu_strategy is not None:
            return f"{what} on logical TPU cores 0-{self.mesh.per_replica - 1} of each replica"
        return f"{what} per replica on " + "; ".join(", ".join(d.split("device:")[-1] for d in r)
                                                     for r in self.devices)


def _create_on(devices: tuple):
    """A variable creator putting replica r's copy of each new variable on devices[r]."""
    def creator(next_creator, **kwargs):
        if kwargs.get("colocate_with") is None:
            kwargs["colocate_with"] = tf_compat.ReplicaDevices(devices)
        return next_creator(**kwargs)
    return creator
