"""AdamW with its moments divided over the replicas (ZeRO-1: `parallel.shard_optimizer=state`; ZeRO-2,
`grads`: the trainer also divides the accumulated gradients and hands this optimizer each replica's rows).

Every replica holds the whole model and gets the whole all-reduced gradient, as in plain data
parallelism, but keeps only its rows of each moment: rows [r*k, (r+1)*k) of every variable's first
dimension (k = ceil(rows / R), the last replicas' shards padded with zero rows that never leave it).
Each step a replica updates its rows of every weight with its rows of the moments (the same arithmetic
as Keras' AdamW and `ReducedGradientsAdamW`, element by element), the replicas all-gather the updated
rows (`ReplicaContext.all_gather`: TF's collective, on TPU and off it), and every replica writes the
whole updated weight. Per replica, AdamW's 8 bytes per parameter become 8/R.

The moments are per-replica variables (`synchronization=ON_READ`, one component per replica). They are
saved as slices of one logical tensor in the variable's own shape, under the key Keras' AdamW saves that
moment under (`optimizer/_variables/K`): a checkpoint made with R replicas restores into any other
number of replicas, and into or from a run with `shard_optimizer=none` (TF's checkpoint reader reads
any slice of a tensor saved whole or in slices). Keras' optimizer object stays the run's step counter,
schedule and weight-decay settings; it builds no moments.

Why not DTensor or TPUStrategy's SPMD sharding: docs/architecture.md ("Memory over cores").
"""

from __future__ import annotations

import math

import tensorflow as tf

from tpu_llm.platform import tf_compat

ON_READ, NONE = tf.VariableSynchronization.ON_READ, tf.VariableAggregation.NONE
Trackable, TrackableList, SaveableObject, SaveSpec, VARIABLE_VALUE_KEY = tf_compat.checkpoint_classes()


def shard_rows(rows: int, replicas: int) -> int:
    """Rows of a variable's first dimension each replica keeps (the last ones padded): ceil(rows / R)."""
    return max(1, math.ceil(rows / replicas))


def owned(rows: int, replicas: int, replica: int) -> int:
    """How many of replica `replica`'s shard rows are real (the rest are padding)."""
    k = shard_rows(rows, replicas)
    return min(k, max(0, rows - replica * k))


class ShardedMoment(Trackable):
    """One AdamW moment of one variable, each replica holding its rows, checkpointed as one tensor of the
    variable's shape (slices of it, one per replica that owns rows)."""

    def __init__(self, variable, name: str, replicas: int):
        self.shape = [int(d) for d in variable.shape] or [1]  # a scalar is kept as one row
        self.rows = shard_rows(self.shape[0], replicas)
        self.logical_shape = [int(d) for d in variable.shape]
        self.strategy = tf.distribute.get_strategy()  # (created in the run's strategy scope)
        self.value = tf.Variable(tf.zeros([self.rows, *self.shape[1:]], variable.dtype), trainable=False,
                                 name=name, synchronization=ON_READ, aggregation=NONE)

    def components(self) -> list:
        """This process's per-replica variables, in replica order."""
        return list(self.strategy.experimental_local_results(self.value))

    def _gather_saveables_for_checkpoint(self):
        return {VARIABLE_VALUE_KEY: lambda name: _MomentSlices(self, name)}


class _MomentSlices(SaveableObject):
    """A ShardedMoment saved as the slices the replicas own, restored from any slicing (or a whole tensor)."""

    def __init__(self, moment: ShardedMoment, name: str):
        self.moment = moment
        specs, self.owners = [], []
        components = moment.components()
        for r, component in enumerate(components):
            n = owned(moment.shape[0], len(components), r)
            if n == 0:
                continue
            rest = moment.shape[1:]
            spec = tf.Variable.SaveSliceInfo(name, moment.shape, [r * moment.rows] + [0] * len(rest), [n, *rest]).spec
            if not moment.logical_shape:  # a scalar: saved as a scalar, no slicing
                spec = ""
            specs.append(SaveSpec(_reader(component, n, moment.logical_shape), spec, name,
                                                  dtype=component.dtype, device=component.device))
            self.owners.append((component, n))
        super().__init__(moment.value, specs, name)

    def restore(self, restored_tensors, restored_shapes):
        ops = []
        for (component, n), value in zip(self.owners, restored_tensors):
            value = tf.reshape(value, [n, *self.moment.shape[1:]])
            pad = [[0, self.moment.rows - n]] + [[0, 0]] * (len(self.moment.shape) - 1)
            with tf.device(component.device):
                ops.append(component.assign(tf.pad(value, pad)))
        return tf.group(ops)


def _reader(component, n: int, logical_shape: list):
    def read():
        with tf.device(component.device):
            return tf.reshape(component.read_value()[:n], [n, *logical_shape[1:]] if logical_shape else [])
    return read


class ShardedAdamW(Trackable):
    """The run's optimizer under `parallel.shard_optimizer=state` or `grads`: `keras_adamw` (an unbuilt
    ReducedGradientsAdamW: step counter, schedule, betas, epsilon, weight decay and its exclusions) updating
    `variables` with moments divided over `replicas`. Create inside the strategy's scope.

    Checkpointed as Keras' AdamW is (`_iterations`, `_variables/K`: first what Keras made before its build,
    then variable i's first and second moment, `_trainable_variables/i`), so runs move between
    `shard_optimizer` settings and replica counts."""

    skips_non_finite = True  # optimizer.GuardedUpdate: a bad step's NaN gradients change nothing

    def __init__(self, keras_adamw, variables: list, replicas: int, takes_rows: bool = False):
        self.keras, self.replicas = keras_adamw, replicas
        # parallel.shard_optimizer=grads: `apply` gets each replica's rows of the reduced gradients (the
        # trainer's divided accumulation), else whole gradients it takes its rows of
        self.takes_rows = takes_rows
        self.var_list = list(variables)
        self.m = [ShardedMoment(v, f"{_name(v)}_momentum", replicas) for v in self.var_list]
        self.v = [ShardedMoment(v, f"{_name(v)}_velocity", replicas) for v in self.var_list]
        self.decays = [keras_adamw._use_weight_decay(v) for v in self.var_list]
        # Keras' list: what it made before its build (the step counter, a learning-rate variable when the
        # rate is a number), then each variable's two moments
        self._children = {"_iterations": keras_adamw.iterations,
                          "_variables": TrackableList(
                              list(keras_adamw.variables) + [s for pair in zip(self.m, self.v) for s in pair]),
                          "_trainable_variables": TrackableList(self.var_list)}

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        return dict(self._children)

    @property
    def iterations(self):
        return self.keras.iterations

    @property
    def learning_rate(self):
        return self.keras.learning_rate

    @property
    def variables(self) -> list:
        """The step counter and every replica-local moment variable (for audits of where state lives)."""
        return [self.keras.iterations] + [s.value for s in self.m + self.v]

    def apply(self, grads: list, variables: list) -> None:
        """One AdamW step, in the replica context (the trainer's replica step): each replica's rows, then
        every weight whole again."""
        ctx = tf.distribute.get_replica_context()
        replica = ctx.replica_id_in_sync_group
        k = self.keras
        lr = tf.convert_to_tensor(k.learning_rate)
        step = tf.cast(k.iterations + 1, tf.float32)
        new_weights = []
        for i, (grad, var) in enumerate(zip(grads, variables)):
            applied = tf.reduce_all(tf.math.is_finite(grad))  # a skipped step's gradients are NaN
            rows = self.m[i].rows
            w = my_rows(tf.convert_to_tensor(var), rows, replica)
            dtype = w.dtype
            g = tf.cast(grad if self.takes_rows else my_rows(grad, rows, replica), dtype)
            m, v = self.m[i].value, self.v[i].value
            lr_v = tf.cast(lr, dtype)
            if self.decays[i]:  # decoupled weight decay before the step (Keras' AdamW, as ReducedGradientsAdamW)
                w_new = w - w * tf.cast(k.weight_decay, dtype) * lr_v
            else:
                w_new = w
            # Keras' Adam.update_step, operation for operation (its `1 - beta` are Python floats)
            b1_power = tf.pow(tf.cast(k.beta_1, dtype), tf.cast(step, dtype))
            b2_power = tf.pow(tf.cast(k.beta_2, dtype), tf.cast(step, dtype))
            alpha = lr_v * tf.sqrt(1 - b2_power) / (1 - b1_power)
            m_new = m + (g - m) * (1 - k.beta_1)
            v_new = v + (tf.square(g) - v) * (1 - k.beta_2)
            w_new = w_new - (m_new * alpha) / (tf.sqrt(v_new) + k.epsilon)
            m.assign(tf.where(applied, m_new, m))
            v.assign(tf.where(applied, v_new, v))
            w_new = tf.where(applied, w_new, w)
            whole = ctx.all_gather(w_new, axis=0)  # (R k, ...): every replica's rows, in replica order
            new_weights.append(tf.reshape(whole[:_rows(var)], var.shape))
        _assign_everywhere(ctx, variables, new_weights, k.iterations)


def _name(variable) -> str:
    return variable.path.replace("/", "_") if hasattr(variable, "path") else variable.name.split(":")[0]


def _tf_variable(variable):
    """The TF variable (a MirroredVariable under a strategy) behind a Keras variable."""
    return getattr(variable, "value", variable) if not isinstance(variable, tf.Variable) else variable


def _rows(variable) -> int:
    return int(variable.shape[0]) if variable.shape.rank else 1


def my_rows(tensor, rows: int, replica):
    """Replica `replica`'s `rows` rows of `tensor` (a scalar as one row), zeros past its end: a gather of
    those rows alone (never a padded copy of the whole tensor), of a static shape whatever the replica id
    (a tensor on TPU)."""
    t = tf.reshape(tensor, [1]) if tensor.shape.rank == 0 else tensor
    index = replica * rows + tf.range(rows)
    inside = index < int(t.shape[0])
    picked = tf.gather(t, tf.minimum(index, int(t.shape[0]) - 1))
    return tf.where(tf.reshape(inside, [rows] + [1] * (t.shape.rank - 1)), picked, tf.zeros_like(picked))


def _assign_everywhere(ctx, variables, values, iterations) -> None:
    """Write each mirrored weight's new value on every replica (all replicas computed the same one) and
    count the step, in the cross-replica context Keras' own optimizer updates from."""
    def update(strategy, values):
        for var, value in zip(variables, values):
            strategy.extended.update(_tf_variable(var), lambda v, x: v.assign(x), args=(value,), group=False)
        strategy.extended.update(_tf_variable(iterations), lambda v: v.assign_add(1), group=False)

    ctx.merge_call(update, args=(values,))


def bytes_on(optimizer, strategy, device: str) -> int:
    """The bytes of the optimizer's state (`optimizer.variables`: AdamW's moments, whole or divided) that
    `device` holds, counted from the variables where TF placed them (the step counter, a scalar on every
    device, left out): what `tpu-llm bench memory --only shard` and the doctor's shard line compare with
    the planner's optimizer bytes."""
    held = 0
    for v in optimizer.variables:
        for part in strategy.experimental_local_results(_tf_variable(v)):
            if part.device == device and part.shape.rank:
                held += part.shape.num_elements() * part.dtype.size
    return held
