"""Communication-efficient data parallelism: gradient compression and semi-synchronous (local) SGD.

Configured under `comm:` (config.CommConfig); off by default, and then the trainer runs exactly its
plain `all_reduce(SUM)` path. Two families (docs/communication.md has the maths and the numbers):

* Compression, inside the replica step, in place of the trainer's gradient all-reduce (`Comm.exchange`;
  `Comm.commit` writes its state once the step is known to be applied): `bf16` (cast, all-reduce, cast
  back), `powersgd` (Vogels et al. 2019: rank-r factors P and Q all-reduced, error feedback, warm-started
  Q; vectors sent uncompressed) and `topk` (Deep Gradient Compression style: the k largest entries of
  gradient + residual, exchanged with an all-gather; the rest is carried to the next step).
* Local SGD (`sync_every: H > 1`): each replica steps its own copy of the weights and of the AdamW
  state on its own data; every H steps an outer step all-reduces the parameter deltas from the last
  sync (the anchor) and applies them with SGD (`outer_lr: 1` = plain averaging) or Nesterov momentum
  (DiLoCo). Per-replica copies under MirroredStrategy need another variable arrangement than mirrored
  variables (which must stay equal): `variable_scope` creates the model's and optimizer's float
  variables as SyncOnRead (ON_READ) variables whose components each replica reads and writes alone;
  a read outside the replicas (checkpoint, sampling) gives replica 0's copy, which at every sync is
  the averaged model.

State that must survive a restart (error-feedback residuals, PowerSGD's Q, the anchor and outer
momentum, and under local SGD every replica's own weights and AdamW moments) is in the checkpoint:
values equal on every replica once, values that differ per replica once per replica
(`PerReplicaState`), restored exactly by `Comm.restore` after the checkpointer's restore.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import tensorflow as tf

from tpu_llm.config import comm_refusal
from tpu_llm.errors import UserError
from tpu_llm.platform import tf_compat

SUM, MEAN = tf.distribute.ReduceOp.SUM, tf.distribute.ReduceOp.MEAN
FLOAT_BYTES = 4


def replica_variable(initial, name: str) -> tf.Variable:
    """A variable each replica reads and writes on its own (no synchronisation). Read outside the
    replicas (checkpoint, inspection) it gives replica 0's value; restored, every replica gets it."""
    return tf.Variable(initial, trainable=False, name=name, synchronization=tf.VariableSynchronization.ON_READ,
                       aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)


def _size(shape) -> int:
    return int(np.prod(shape)) if len(shape) else 1


# ---- gradient compression -------------------------------------------------------------------------


class Reducer:
    """Sums the replicas' gradients (pre-scaled by the trainer so that the sum is the mean)."""

    name = "none"

    def __init__(self, shapes):
        self.shapes = [tuple(int(d) for d in s) for s in shapes]
        self.dense_bytes = FLOAT_BYTES * sum(_size(s) for s in self.shapes)
        self.per_replica: list = []  # state that differs between replicas (saved once per replica)
        self.shared: list = []  # state equal on every replica (saved once)

    @property
    def bytes_per_step(self) -> float:
        return self.dense_bytes

    def describe(self) -> str:
        return "float32 all-reduce"

    def exchange(self, ctx, grads):
        """In the replica step: (the gradients to apply on this replica, the state updates
        [(variable, new value)] to commit only if the step is applied; see `commit`)."""
        return ctx.all_reduce(SUM, grads), []


class Bf16(Reducer):
    name = "bf16"

    @property
    def bytes_per_step(self) -> float:
        return self.dense_bytes / 2

    def describe(self) -> str:
        return "bfloat16 all-reduce (cast, reduce, cast back)"

    def exchange(self, ctx, grads):
        # the sum itself runs in bfloat16: 8 mantissa bits, so the error grows with the replica count
        summed = ctx.all_reduce(SUM, [tf.cast(g, tf.bfloat16) for g in grads])
        return [tf.cast(s, g.dtype) for s, g in zip(summed, grads)], []


class PowerSGD(Reducer):
    """Rank-r PowerSGD with error feedback (Vogels, Karimireddy, Jaggi 2019, Algorithm 1).

    Each gradient matrix M (n x m, after adding its residual) is approximated by P Q^T: P = M Q is
    all-reduced and orthonormalised, Q = M^T P is all-reduced, and P Q^T is the update applied on
    every replica. One power-iteration step per training step converges because Q is warm-started
    from the previous step. Only matrices whose factors are smaller are compressed (`compresses`); vectors
    and the rest are all-reduced as they are.
    """

    name = "powersgd"

    def __init__(self, shapes, rank: int, error_feedback: bool = True, seed: int = 0):
        super().__init__(shapes)
        self.rank, self.error_feedback = rank, error_feedback
        self.matrix: list = []  # per gradient: (n, m, r) if compressed, else None
        rng = np.random.default_rng(seed)  # Q starts equal on every replica: P = sum_i M_i Q needs that
        self.q, self.error = [], []
        for i, shape in enumerate(self.shapes):
            n, m = (shape[0], _size(shape[1:])) if len(shape) >= 2 else (0, 0)
            r = min(rank, n, m)
            if len(shape) >= 2 and self.compresses(n, m, r):
                self.matrix.append((n, m, r))
                self.q.append(replica_variable(rng.standard_normal((m, r)).astype(np.float32), f"powersgd_q_{i}"))
                if error_feedback:
                    self.error.append(replica_variable(tf.zeros(shape), f"powersgd_error_{i}"))
            else:
                self.matrix.append(None)
        self.shared, self.per_replica = list(self.q), list(self.error)

    def compresses(self, n: int, m: int, r: int) -> bool:
        """Whether an n x m gradient is sent as rank-r factors: where they are smaller, r (n + m) < n m."""
        return r * (n + m) < n * m

    @property
    def bytes_per_step(self) -> float:
        return FLOAT_BYTES * sum((mr[0] + mr[1]) * mr[2] if mr else _size(s)
                                 for s, mr in zip(self.shapes, self.matrix))

    def describe(self) -> str:
        compressed = sum(1 for m in self.matrix if m)
        return (f"PowerSGD rank {self.rank} on {compressed} of {len(self.shapes)} tensors"
                f"{' with error feedback' if self.error_feedback else ''}, warm-started Q")

    def exchange(self, ctx, grads):
        matrices, plain, errors, qs = [], [], iter(self.error), iter(self.q)
        for g, mr in zip(grads, self.matrix):
            if mr is None:
                plain.append(g)
                continue
            n, m, _ = mr
            e = next(errors) if self.error_feedback else None
            mat = tf.reshape(g + e if e is not None else g, [n, m])
            matrices.append((mat, next(qs), e))
        # first round: every P and every uncompressed tensor in one all-reduce
        first = ctx.all_reduce(SUM, [mat @ q for mat, q, _ in matrices] + plain)
        ps, plain = first[:len(matrices)], iter(first[len(matrices):])
        ps = [tf.linalg.qr(p).q for p in ps]  # orthonormal columns spanning P's (reduced QR)
        new_qs = ctx.all_reduce(SUM, [tf.transpose(mat) @ p for (mat, _, _), p in zip(matrices, ps)])
        out, it, updates = [], iter(zip(matrices, ps, new_qs)), []
        replicas = float(ctx.num_replicas_in_sync)
        for shape, mr in zip(self.shapes, self.matrix):  # static shapes: under multi_worker grads lack them
            if mr is None:
                out.append(next(plain))
                continue
            (mat, q, e), p, new_q = next(it)
            approx = p @ tf.transpose(new_q)
            updates.append((q, new_q))
            if e is not None:  # what this replica's share of the sum had that the shared update lacks:
                # summed over replicas, residuals + update = the exact sum (nothing is lost, only delayed)
                updates.append((e, tf.reshape(mat - approx / replicas, shape)))
            out.append(tf.reshape(approx, shape))
        return out, updates


class TopK(Reducer):
    """Top-k sparsification with error feedback (Lin et al. 2018, Deep Gradient Compression, without
    its momentum correction): each replica sends the k = ceil(ratio * size) largest-magnitude entries
    of gradient + residual of every tensor (values and int32 indices) by all-gather, keeps the rest as
    the next residual, and every replica scatter-adds all replicas' entries into a dense update."""

    name = "topk"

    def __init__(self, shapes, ratio: float, error_feedback: bool = True):
        super().__init__(shapes)
        self.ratio, self.error_feedback = ratio, error_feedback
        self.k = [max(1, math.ceil(ratio * _size(s))) for s in self.shapes]
        self.error = [replica_variable(tf.zeros(s), f"topk_error_{i}") for i, s in enumerate(self.shapes)] \
            if error_feedback else []
        self.per_replica = list(self.error)

    @property
    def bytes_per_step(self) -> float:
        return (FLOAT_BYTES + 4) * sum(self.k)  # a float32 value and an int32 index per entry

    def describe(self) -> str:
        return (f"top-k {100 * self.ratio:g}% of each tensor by all-gather"
                f"{' with error feedback' if self.error_feedback else ''}")

    def select(self, grads):
        """Per tensor: (values, indices) of the k entries sent, and the new residual."""
        out = []
        for i, g in enumerate(grads):
            flat = tf.reshape(g, [-1])
            if self.error_feedback:
                flat += tf.reshape(self.error[i], [-1])
            idx = tf.math.top_k(tf.abs(flat), self.k[i], sorted=False).indices
            residual = tf.tensor_scatter_nd_update(flat, idx[:, None], tf.zeros([self.k[i]], flat.dtype))
            out.append((tf.gather(flat, idx), idx, residual))
        return out

    def exchange(self, ctx, grads):
        chosen = self.select(grads)
        gathered = ctx.all_gather([t for v, i, _ in chosen for t in (v, i)], axis=0)  # [R * k] each
        updates = [(e, tf.reshape(r, e.shape)) for e, (_, _, r) in zip(self.error, chosen)]
        out = []
        for n, shape in enumerate(self.shapes):  # static shapes: under multi_worker grads lack them
            values, idx = gathered[2 * n], gathered[2 * n + 1]
            dense = tf.scatter_nd(idx[:, None], values, [_size(shape)])  # duplicates add up
            out.append(tf.reshape(dense, shape))
        return out, updates


def commit(pending, outputs, applied=None):
    """Write the state updates [(variable, new value)] of an exchange (residuals, PowerSGD's Q), or,
    where `applied` (a scalar bool, equal on every replica) is False, keep the old values: a step the
    divergence guard skips must not carry its non-finite values into every later step and checkpoint.
    A select, not a cond, so that no control flow surrounds the update; returns `outputs` once written."""
    updates = [v.assign(new if applied is None else tf.where(applied, new, v.read_value())) for v, new in pending]
    with tf.control_dependencies(updates):
        return [tf.identity(t) for t in outputs]


# ---- local SGD ------------------------------------------------------------------------------------


@contextlib.contextmanager
def variable_scope(local: bool):
    """While the model and optimizer are built under local SGD: their float variables become
    per-replica (SyncOnRead) variables. TF allows ON_READ only for non-trainable tf.Variables, so the
    underlying variable is marked non-trainable (Keras keeps its own trainable flag; the trainer
    watches the variables on the gradient tape itself)."""
    if not local:
        yield
        return

    def creator(next_creator, **kwargs):
        if tf.as_dtype(kwargs.get("dtype") or tf.float32).is_floating:
            kwargs.update(synchronization=tf.VariableSynchronization.ON_READ,
                          aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA, trainable=False)
        return next_creator(**kwargs)

    with tf.variable_creator_scope(creator):
        yield


class LocalSGD:
    """H local steps per replica, then an outer step on the averaged parameter delta.

    outer step (every replica, identical arithmetic on all-reduced values):
        delta = mean_r(anchor - w_r)
        sgd:      w = anchor - outer_lr * delta                     (outer_lr 1: w = mean_r w_r)
        nesterov: m = mu m + delta; w = anchor - outer_lr * (delta + mu m)        (DiLoCo)
        anchor = w
    """

    def __init__(self, weights, local_state, sync_every: int, outer: str = "sgd", outer_lr: float = 1.0,
                 momentum: float = 0.9):
        self.weights = list(weights)  # the model's trainable (Keras) variables
        self.sync_every, self.outer, self.outer_lr, self.momentum = sync_every, outer, outer_lr, momentum
        self.anchor = [replica_variable(w.value.read_value(), f"local_sgd_anchor_{i}")
                       for i, w in enumerate(self.weights)]
        self.velocity = [replica_variable(tf.zeros(w.shape), f"diloco_momentum_{i}")
                         for i, w in enumerate(self.weights)] if outer == "nesterov" else []
        self.shared = self.anchor + self.velocity  # equal on every replica (written after a sync)
        self.per_replica = list(local_state)  # the replicas' own weights and optimizer moments
        self.dense_bytes = FLOAT_BYTES * sum(_size(w.shape) for w in self.weights)

    @property
    def bytes_per_step(self) -> float:
        return self.dense_bytes / self.sync_every  # one float32 all-reduce of the deltas per H steps

    def describe(self) -> str:
        how = f"outer Nesterov (lr {self.outer_lr:g}, momentum {self.momentum:g}), DiLoCo" \
            if self.outer == "nesterov" else f"outer SGD (lr {self.outer_lr:g})"
        return f"local SGD: {self.sync_every} local steps per replica, then {how} on the averaged delta"

    def due(self, step):
        return tf.equal(step % self.sync_every, 0)

    def _outer(self):
        """In a replica function: the synchronised weights and outer momentum (not yet written)."""
        ctx = tf.distribute.get_replica_context()
        deltas = [a.read_value() - w.value.read_value() for a, w in zip(self.anchor, self.weights)]
        deltas = ctx.all_reduce(MEAN, deltas)
        weights, velocity = [], []
        for i, (a, d) in enumerate(zip(self.anchor, deltas)):
            if self.outer == "nesterov":
                m = self.velocity[i].read_value() * self.momentum + d
                velocity.append(m)
                d = d + self.momentum * m
            weights.append(a.read_value() - self.outer_lr * d)
        return weights, velocity

    def outer_step(self):
        """Replica function: the synchronisation every `sync_every` steps (and at the end of training)."""
        weights, velocity = self._outer()
        updates = [v.assign(m) for v, m in zip(self.velocity, velocity)]
        for a, w, new in zip(self.anchor, self.weights, weights):
            updates += [w.value.assign(new), a.assign(new)]
        with tf.control_dependencies(updates):
            return tf.constant(0)

    def swap_in_synchronised(self, backup):
        """Replica function: keep each replica's own weights in `backup` (replica variables shaped as
        the weights) and give every replica the weights a synchronisation would give now, leaving the
        anchor and momentum as they are (`swap_back` undoes it exactly): for an evaluation between
        synchronisations."""
        weights, _ = self._outer()
        updates = [b.assign(w.value.read_value()) for b, w in zip(backup, self.weights)]
        with tf.control_dependencies(updates):
            updates = [w.value.assign(new) for w, new in zip(self.weights, weights)]
        with tf.control_dependencies(updates):
            return tf.constant(0)

    def swap_back(self, backup):
        """Replica function: each replica's own weights again, bit for bit."""
        updates = [w.value.assign(b.read_value()) for b, w in zip(backup, self.weights)]
        with tf.control_dependencies(updates):
            return tf.constant(0)


# ---- what the trainer and the controller use ------------------------------------------------------


class AllReduce:
    """The plain exchange, when no comm setting is on: the gradients summed over the replicas in float32
    (pre-scaled by the trainer so that the sum is the mean) and the loss averaged; with one replica,
    nothing to exchange. Same interface as `Comm`."""

    def __init__(self, num_replicas: int, by_stage=None):
        self.num_replicas = num_replicas
        # fn(grads) on each pipeline stage's share, inside the stage's placement (Trainer.by_stage): each
        # stage's all-reduce runs on its own core rather than all of them on core 0
        self.by_stage = by_stage or (lambda fn, grads: fn(grads))

    def exchange(self, ctx, loss, grads):
        if self.num_replicas == 1:  # the reduction would be the identity: skip its copies
            return loss, grads, []
        grads = self.by_stage(lambda gs: ctx.all_reduce(SUM, gs), grads)
        return ctx.all_reduce(MEAN, loss), grads, []

    def commit(self, pending, applied) -> None:
        pass  # no state

    def agree(self, ctx, finite):
        return finite  # computed from all-reduced values: every replica decides alike

    def wrap(self, step, iterations):
        return step  # no outer step


class PerReplicaState(tf.Module):
    """Checkpoint node holding state once per replica (`replica_<global id>`: the local components of
    each per-replica variable) and once for state equal on all replicas (`shared`)."""


class Comm:
    def __init__(self, strategy, reducer: Reducer | None = None, local: LocalSGD | None = None):
        self.strategy, self.reducer, self.local = strategy, reducer, local
        part = local or reducer
        self.dense_bytes, self.bytes_per_step = part.dense_bytes, part.bytes_per_step
        self.ratio = self.dense_bytes / self.bytes_per_step
        # replica ids across the cluster: under multi_worker this process holds only its own replicas
        local_count = len(strategy.extended.worker_devices)
        self.first_replica = tf_compat.worker_index(strategy) * local_count
        self.state = PerReplicaState(name="comm")
        self.state.shared = list(part.shared)
        per_replica = [strategy.experimental_local_results(v) for v in part.per_replica]
        for i in range(local_count):
            setattr(self.state, f"replica_{self.first_replica + i}", [c[i] for c in per_replica])
        self.local_count = local_count

    @property
    def name(self) -> str:
        return self.reducer.name if self.reducer else ("diloco" if self.local.outer == "nesterov" else "local_sgd")

    def describe(self) -> str:
        what = self.local.describe() if self.local else self.reducer.describe()
        return (f"{what}; {_format_bytes(self.bytes_per_step)} sent per replica per step "
                f"(float32 all-reduce: {_format_bytes(self.dense_bytes)}; {self.ratio:.1f}x less)")

    def metrics(self) -> dict:
        return {"comm": self.name, "comm_bytes_per_step": self.bytes_per_step, "comm_ratio": self.ratio}

    def exchange(self, ctx, loss, grads):
        """In the replica step: (the mean loss, the gradients to apply on this replica, the state updates
        to `commit` once the step is known to be applied)."""
        if self.local:  # no exchange: the trainer pre-scaled for a sum over replicas; undo that
            grads, pending = [g * float(ctx.num_replicas_in_sync) for g in grads], []
        else:
            grads, pending = self.reducer.exchange(ctx, grads)
        return ctx.all_reduce(MEAN, loss), grads, pending

    def commit(self, pending, applied) -> None:
        """In the replica step: write `exchange`'s state updates if `applied` (all-reduced), else keep it."""
        if pending:
            commit(pending, [], applied)

    def agree(self, ctx, finite):
        """Local SGD checks its own gradients: every replica must still skip or apply alike."""
        if not self.local:  # the gradients were all-reduced: every replica already decided alike
            return finite
        bad = ctx.all_reduce(SUM, 1.0 - tf.cast(finite, tf.float32))
        return tf.equal(bad, 0.0)

    def wrap(self, step, iterations):
        """The training step, followed every sync_every steps by local SGD's outer step (as MaxText's
        DiLoCo trainer wraps its inner step); compression runs the step as it is. `iterations`: the
        optimizer's step counter, read after the step."""
        if not self.local:
            return step

        def outer_step():
            self.strategy.run(self.local.outer_step)

        def with_outer_step(element):
            out = step(element)
            tf.cond(self.local.due(iterations), outer_step, lambda: None)  # every sync_every steps: average
            return out
        return with_outer_step

    def trackables(self) -> dict:
        return {"comm": self.state}

    def restore(self, path: str | None) -> None:
        """After the checkpointer restored `path`: put each replica's own saved values back (the
        checkpointer's restore of a per-replica variable gives every replica replica 0's value).
        Replicas whose values the checkpoint lacks (a multi_worker peer: only the chief writes the
        checkpoint) keep replica 0's."""
        if not path:
            return
        reader = tf.train.load_checkpoint(path)
        for i in range(self.local_count):
            node = f"replica_{self.first_replica + i}"
            for j, component in enumerate(getattr(self.state, node)):
                key = f"comm/{node}/{j}/.ATTRIBUTES/VARIABLE_VALUE"
                if reader.has_tensor(key):
                    component.assign(reader.get_tensor(key))


def _format_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000


def check(cfg, dist) -> bool:
    """Before the model is built: a UserError if `cfg` (CommConfig) cannot run under `dist` (the strategy
    strategy=auto chose: config.comm_refusal), True when local SGD will run (build the model and optimizer
    inside `variable_scope(True)` then)."""
    why = comm_refusal(cfg, dist.name)
    if why:
        raise UserError(why)
    return cfg.sync_every > 1 and dist.num_replicas > 1


def build(cfg, dist, model, optimizer) -> Comm | None:
    """The run's communication scheme from `cfg` (CommConfig), or None for the plain all-reduce (also
    with one replica: nothing crosses a network). Create inside the strategy scope, after the model
    and optimizer."""
    if not active(cfg) or dist.num_replicas < 2:
        return None
    variables = model.trainable_variables
    shapes = [v.shape for v in variables]
    if cfg.sync_every > 1:
        mine = {id(v.value) for v in variables}
        moments = [v for v in optimizer.variables if isinstance(v.value, tf.distribute.DistributedValues)
                   and v.value.dtype.is_floating and id(v.value) not in mine]
        local = LocalSGD(variables, [v.value for v in variables] + [v.value for v in moments], cfg.sync_every,
                         cfg.outer_optimizer, cfg.outer_lr, cfg.outer_momentum)
        return Comm(dist.strategy, local=local)
    reducer = {"bf16": lambda: Bf16(shapes),
               "powersgd": lambda: PowerSGD(shapes, cfg.rank, cfg.error_feedback),
               "topk": lambda: TopK(shapes, cfg.topk_ratio, cfg.error_feedback)}[cfg.compression]()
    return Comm(dist.strategy, reducer=reducer)


def active(cfg) -> bool:
    return cfg.active()
