"""The compiled training and evaluation loops (Orbit-style: many steps per host call).

`Trainer.train_loop(iterator, n)` is one `tf.function` that runs n optimizer steps in a `tf.while_loop`
(written out: autograph is off, see `__init__`). Each step is `strategy.run(replica_step)`, which reads as one line: loss and gradients (the stage
pipeline's forward and backward over the micro-batches, a `tf.function(jit_compile=True)`: the program
a TPU compiles; on CPU the same code compiles with XLA) -> the gradient exchange (parallel/comm.py) ->
global norm -> clip -> finite check -> compression state committed -> guarded update
(optimizer.GuardedUpdate) -> the input stream's position. Gradients are reduced here rather than inside
the optimizer so that clipping sees the global gradient. Asynchronous training (staleness) and local
SGD (its outer step) wrap the step rather than branch inside it.
"""

from __future__ import annotations

from typing import TypedDict

import keras
import tensorflow as tf

from tpu_llm.config import TrainConfig
from tpu_llm.model import GPT
from tpu_llm.parallel.comm import MEAN, SUM, AllReduce, replica_variable
from tpu_llm.parallel.distribute import Distribution
from tpu_llm.parallel.pipeline import Pipeline, owning_stage, partition
from tpu_llm.platform import tf_compat
from tpu_llm.training.optimizer import GuardedUpdate
from tpu_llm.training.sharded_adamw import my_rows


class ReplicaSeedGenerator(keras.random.SeedGenerator):
    """A dropout layer's seed generator that gives every replica its own masks.

    Keras keeps a SeedGenerator's state in a variable with aggregation NONE: under a distribution
    strategy each replica holds a copy and advances it identically, so every replica would draw the
    same masks for its different examples. Here the replica id is folded into each drawn seed
    (tf.random.experimental.stateless_fold_in, XLA-compilable), while the state itself stays the one
    counter that is checkpointed: masks stay reproducible on resume. With one replica the draws are
    Keras' own, unchanged.
    """

    def next(self, ordered=True):
        return self.fold(super().next(ordered))

    def fold(self, seed):
        """A drawn seed, made this replica's (also applied to the seeds a rematerialised block replays:
        parallel/pipeline.py remat_with_dropout)."""
        ctx = tf.distribute.get_replica_context()
        if ctx is None or ctx.num_replicas_in_sync == 1:
            return seed
        return tf.random.experimental.stateless_fold_in(seed, ctx.replica_id_in_sync_group)


def per_replica_dropout(model) -> int:
    """Switch the dropout layers of `model` with a non-zero rate to ReplicaSeedGenerator (their state
    variables, and so checkpoints, stay as they are); returns how many were switched."""
    layers = [layer for layer in tf_compat.all_layers(model) if isinstance(layer, keras.layers.Dropout)
              and layer.rate > 0 and getattr(layer, "seed_generator", None) is not None]
    for layer in layers:
        layer.seed_generator.__class__ = ReplicaSeedGenerator
    return len(layers)


class Trainer:
    """The compiled loops of one run: `train_loop` (N optimizer steps in one host call) and `eval_loop`.

    Built once per run, with everything it needs: the distribution, model, optimizer, the stage pipeline
    (the whole model as one stage by default), the gradient exchange (`comm`: compression or local SGD;
    None: the plain all-reduce) and the variable recording the input stream's position. It owns the
    flag a signal sets to end a host call at the next step boundary (`stop_flag`; None where the
    compiled loop cannot read it: parameter-server steps run on the workers, and multi-worker runs
    agree on stopping by an all-reduce instead).
    """

    def __init__(self, dist: Distribution, model: GPT, optimizer, cfg: TrainConfig, pipeline: Pipeline | None = None,
                 execution: str = "xla", comm=None, data_position: tf.Variable | None = None):
        self.dist, self.strategy = dist, dist.strategy
        self.model, self.optimizer = model, optimizer
        self.grad_accum, self.clip_norm = cfg.grad_accum, cfg.clip_norm
        self.num_replicas = dist.num_replicas
        # stages or tensor groups on their own devices, or the whole model as one stage on the replica's
        self.pipeline = pipeline or Pipeline(model, partition(model.cfg, model.vocab_size, 1, 1), dist.placement,
                                             loss_chunk=cfg.loss_chunk)
        # per pipeline stage: the indices of the trainable variables living there; the step's reduction,
        # norm, clipping and update of a stage run in its placement (on TPU: its logical core)
        stage_of = self.pipeline.variable_stages(model.trainable_variables)
        self.stage_groups = [[k for k, s in enumerate(stage_of) if s == i] for i in range(max(stage_of) + 1)]
        self.comm = comm  # comm.Comm, or None for the plain all-reduce
        self.exchange = comm or AllReduce(self.num_replicas, self.by_stage)
        self.local_sgd = comm.local if comm is not None else None
        self.update = GuardedUpdate(optimizer, model.trainable_variables, self.by_stage)
        # parallel.shard_optimizer=grads: the optimizer (ShardedAdamW) takes each replica's rows of the
        # gradients, which the step reduces micro-batch by micro-batch (divided_loss_and_grads)
        self.divided = optimizer if getattr(optimizer, "takes_rows", False) else None
        if dist.placement.tpu_strategy is not None and len(self.stage_groups) > 1:
            where = {id(v.value): s for v, s in zip(model.trainable_variables, stage_of)}
            inner = getattr(optimizer, "inner_optimizer", optimizer)  # under LossScaleOptimizer
            inner.placement_of = lambda var: dist.placement.at(layers=owning_stage(where, var))
        self.data_position = data_position  # SUM on read: each replica writes its input pipeline's row
        self.stop_flag = None if dist.asynchronous or dist.name == "multi_worker" else \
            tf.Variable(0, trainable=False, name="stop")
        if self.num_replicas > 1:  # identical dropout masks on every replica otherwise
            per_replica_dropout(model)
        jit = dist.jit_compile and execution == "xla"
        # On TPU the whole replica step is one XLA program already, and a nested tf.function would be
        # inlined by TF's TPU compiler with the single-device body placer (every inlined op gets the
        # device of the call, outside any core scope): the stages' and groups' core annotations would be
        # lost. So there the functions are plain Python inside the replica step; elsewhere a nested
        # function, XLA-compiled where the strategy allows it.
        nested = (lambda fn: fn) if dist.placement.tpu_strategy is not None else \
            (lambda fn: tf.function(fn, jit_compile=jit, autograph=False))
        self._loss_and_grads = nested(self._loss_and_grads_fn)
        self._micro_grads = nested(self._micro_fn)  # (shard_optimizer=grads: one micro-batch per call)
        # asynchronous workers also measure how stale their gradients were when applied
        self.loss_and_grads = Staleness(self.strategy, self._loss_and_grads) if dist.asynchronous else \
            _not_stale(self._loss_and_grads)
        # one optimizer step on every replica; local SGD adds its outer step every sync_every steps
        self.step = self.exchange.wrap(lambda element: self.strategy.run(self.replica_step, args=element),
                                       optimizer.iterations)
        self._eval_loss = nested(self._eval_loss_fn)
        # autograph off: the loops are tf.while_loops already, and converting every function the step
        # calls (ours and Keras') cost seconds of each process's start (5.4 s of a 29 s tiny run)
        self.train_loop = tf.function(self._train_loop, autograph=False)
        self.eval_loop = tf.function(self._eval_loop, autograph=False)

    # ---- per replica -----------------------------------------------------------------------------

    def replica_step(self, inputs, targets, position=None):
        """One optimizer step on this replica; returns (loss, gradient norm, staleness, 1.0 if applied)."""
        ctx = tf.distribute.get_replica_context()
        if self.divided is None:
            loss, grads, staleness = self.loss_and_grads(inputs, targets)  # this replica's, scaled for a SUM
            loss, grads, pending = self.exchange.exchange(ctx, loss, grads)  # summed over the replicas (or not)
            grad_norm = self.global_norm(grads)
        else:  # this replica's rows of the summed gradients; the norm from every replica's rows
            loss, grads = self.divided_loss_and_grads(ctx, inputs, targets)
            staleness, pending = tf.constant(0.0), []
            grad_norm = tf.sqrt(ctx.all_reduce(SUM, tf.add_n([tf.reduce_sum(tf.square(g)) for g in grads])))
        if self.clip_norm > 0:  # an overflow (inf norm) gives NaN grads: the guarded update skips them
            clip = self.clip_norm * self.update.loss_scale
            grads = self.by_stage(lambda gs: tf.clip_by_global_norm(gs, clip, use_norm=grad_norm)[0], grads)
        grad_norm = grad_norm / self.update.loss_scale
        # divergence guard: a non-finite loss or gradient is not applied; every replica decides alike
        finite = self.exchange.agree(ctx, self.update.finite(loss, grad_norm))
        self.exchange.commit(pending, tf.logical_and(finite, tf.math.is_finite(grad_norm)))  # compression state
        self.update.apply(grads, finite, grad_norm)
        if position is not None and self.data_position is not None:  # where the input stream now is
            self.data_position.assign(position)
        return loss, grad_norm, staleness, tf.cast(finite, tf.float32)

    def by_stage(self, fn, grads: list) -> list:
        """fn(a stage's gradients) -> new gradients, run inside each stage's placement, reassembled in
        order; with one stage, fn(grads) as it is."""
        if len(self.stage_groups) == 1:
            return fn(grads)
        out = list(grads)
        for i, indices in enumerate(self.stage_groups):
            if not indices:  # train.freeze left this stage nothing to train
                continue
            with self.pipeline.placement.at(layers=i):
                for k, g in zip(indices, fn([grads[k] for k in indices])):
                    out[k] = g
        return out

    def global_norm(self, grads):
        """tf.linalg.global_norm of all the gradients, as a sum of each stage's part computed where the
        stage lives (only scalars cross between stages)."""
        if len(self.stage_groups) == 1:
            return tf.linalg.global_norm(grads)
        parts = []
        for i, indices in enumerate(self.stage_groups):
            if not indices:  # a stage train.freeze left nothing to train
                continue
            with self.pipeline.placement.at(layers=i):
                parts.append(tf.add_n([tf.reduce_sum(tf.square(grads[k])) for k in indices]))
        return tf.sqrt(tf.add_n(parts))

    def _micro_fn(self, inputs, targets):
        """One micro-batch's loss, and its gradients pre-scaled for a SUM over the replicas and the
        micro-batches (and by the loss scale under mixed_float16). The stage pipeline runs each stage's
        forward and backward where the stage lives (one stage: the replica's device)."""
        scale = 1.0 / (self.grad_accum * self.num_replicas)
        # per-replica variables (local SGD) are not trainable tf.Variables: watched
        return self.pipeline.loss_and_grads(inputs, targets, self.model.trainable_variables,
                                            seed=lambda loss: self.update.scale_loss(loss * scale),
                                            watch=self.local_sgd is not None)

    def _loss_and_grads_fn(self, inputs, targets):
        """Mean loss over this replica's micro-batches, and the sum of their gradients (_micro_fn's)."""
        k, micro = self.grad_accum, self._micro_fn

        if k == 1:
            return micro(inputs, targets)
        xs = tf.reshape(inputs, [k, -1, inputs.shape[-1]])  # (k, b/k, T)
        ys = tf.reshape(targets, [k, -1, targets.shape[-1]])
        loss_sum, grads = micro(xs[0], ys[0])
        last = len(self.pipeline.stages) - 1  # the stage computing the loss

        def accumulate(i, loss_sum, grads):
            loss_i, grads_i = micro(xs[i], ys[i])
            with self.pipeline.placement.at(layers=last):
                loss_sum += loss_i
            # each stage's gradients summed where the stage lives (on TPU: its logical core), not on core 0
            grads = self.by_stage(lambda pairs: [g + gi for g, gi in pairs], list(zip(grads, grads_i)))
            return i + 1, loss_sum, grads

        _, loss_sum, grads = tf.while_loop(lambda i, *_: i < k, accumulate, (tf.constant(1), loss_sum, grads))
        return loss_sum / k, grads

    def divided_loss_and_grads(self, ctx, inputs, targets):
        """parallel.shard_optimizer=grads (ZeRO-2): the loss averaged over the replicas, and this replica's
        rows of the gradients summed over the replicas and its micro-batches. Each micro-batch's gradients
        are all-reduced and only this replica's rows kept (an all-reduce then a slice, which XLA's
        reduce-scatter pass can fuse), so the running sum holds 1/R of the gradients. The micro-batches
        run as a Python loop (one compiled call each): under MirroredStrategy a collective is a
        merge_call, which a tf.while_loop's body (a graph of its own) cannot hold. On TPU the collective is
        part of the replica's XLA program, and the loop a tf.while_loop (one copy of the step's program)."""
        rows = [m.rows for m in self.divided.m]
        replica, k = ctx.replica_id_in_sync_group, self.grad_accum

        def reduced(grads):
            return [my_rows(g, n, replica) for g, n in zip(ctx.all_reduce(SUM, grads), rows)]

        xs = tf.reshape(inputs, [k, -1, inputs.shape[-1]])  # (k, b/k, T)
        ys = tf.reshape(targets, [k, -1, targets.shape[-1]])
        loss_sum, grads = self._micro_grads(xs[0], ys[0])
        grads = reduced(grads)

        def accumulate(i, loss_sum, grads):
            loss_i, grads_i = self._micro_grads(xs[i], ys[i])
            return i + 1, loss_sum + loss_i, [g + gi for g, gi in zip(grads, reduced(grads_i))]

        if self.dist.placement.tpu_strategy is not None:
            _, loss_sum, grads = tf.while_loop(lambda i, *_: i < k, accumulate, (tf.constant(1), loss_sum, grads))
        else:
            for i in range(1, k):
                _, loss_sum, grads = accumulate(i, loss_sum, grads)
        return ctx.all_reduce(MEAN, loss_sum / k), grads

    def _eval_step(self, inputs, targets):
        # the compiled function is called from a plain replica function, as in training: passed to
        # MirroredStrategy.run directly, its variable captures cross devices (CPU:1 from CPU:0)
        return self._eval_loss(inputs, targets)

    def _eval_loss_fn(self, inputs, targets):
        return self.pipeline.loss(inputs, targets, training=False)

    # ---- host side --------------------------------------------------------------------------------

    def run(self, iterator, num_steps: int, steps_per_loop: int) -> CallOutput:
        """Train `num_steps` steps (one host call); waits for them to finish."""
        start = int(self.optimizer.iterations.numpy())
        out = call_output([r for _, r in self.dist.run_loops(self.train_loop, iterator, num_steps, steps_per_loop)])
        if self.dist.asynchronous:
            # concurrent workers' increments of the step counter can race: the steps the chief
            # scheduled and saw finish are the count that is saved and resumed from
            self.optimizer.iterations.assign(start + num_steps)
        return out

    def evaluate(self, iterator, num_steps: int) -> float:
        """The mean validation loss of `num_steps` batches. Under local SGD between synchronisations,
        of the model a synchronisation would give now (each replica's own weights are put back after)."""
        if not self.unsynchronised():
            [(_, loss)] = self.dist.run_loops(self.eval_loop, iterator, num_steps, num_steps)
            return float(loss)
        if self._backup is None:
            with self.strategy.scope():
                self._backup = [replica_variable(tf.zeros(w.shape, w.dtype), f"local_sgd_backup_{i}")
                                for i, w in enumerate(self.local_sgd.weights)]
            self._swap_in = tf.function(lambda: self.strategy.run(self.local_sgd.swap_in_synchronised,
                                                                  args=(self._backup,)))
            self._swap_back = tf.function(lambda: self.strategy.run(self.local_sgd.swap_back, args=(self._backup,)))
        self._swap_in()
        try:
            [(_, loss)] = self.dist.run_loops(self.eval_loop, iterator, num_steps, num_steps)
        finally:
            self._swap_back()
        return float(loss)

    _backup = None  # local SGD: each replica's weights while an evaluation uses the synchronised ones

    _synchronised_at = None  # the step of the last `synchronise`

    def unsynchronised(self) -> bool:
        """Under local SGD: whether the replicas stepped on their own since the last synchronisation."""
        if self.local_sgd is None:
            return False
        step = int(self.optimizer.iterations.numpy())
        return step % self.local_sgd.sync_every != 0 and step != self._synchronised_at

    def synchronise(self) -> None:
        """Under local SGD: an outer step now (at the end of training, so that the final checkpoint,
        export, evaluation and samples are the synchronised model, not replica 0's own copy)."""
        if self.unsynchronised():
            tf.function(lambda: self.strategy.run(self.local_sgd.outer_step))()
            self._synchronised_at = int(self.optimizer.iterations.numpy())

    # ---- loops (one host call each) --------------------------------------------------------------

    def _first(self, per_replica):
        return self.strategy.experimental_local_results(per_replica)[0]

    def _train_loop(self, iterator, num_steps):
        zero = tf.constant(0.0)
        # (done, loss_sum, bad, first_bad, grad_norm, staleness_sum, staleness_max); first_bad: the optimizer
        # step (0-based) of the first skipped step, -1 if none
        start = (tf.constant(0), zero, zero, tf.constant(-1, tf.int64), zero, zero, zero)

        # a signal stops the loop at the next step boundary: tested in the loop's condition, never by a
        # branch around the step (the whole step, optimizer update included, would run inside a cond)
        def more(done, *_):
            return tf.logical_and(done < num_steps, tf.logical_not(self._stopping()))

        def one_step(done, loss_sum, bad, first_bad, grad_norm, staleness_sum, staleness_max):
            step = tf.identity(self.optimizer.iterations)
            element = next(iterator)  # (inputs, targets[, data position update])
            loss, norm, staleness, ok = self.step(element)
            ok = self._first(ok)
            loss_sum += tf.where(ok > 0, self._first(loss), 0.0)  # a skipped step's loss may be NaN
            first_bad = tf.where(tf.logical_and(first_bad < 0, ok < 1), step, first_bad)
            staleness = self._first(staleness)
            return (done + 1, loss_sum, bad + 1.0 - ok, first_bad, self._first(norm), staleness_sum + staleness,
                    tf.maximum(staleness_max, staleness))

        done, loss_sum, bad, first_bad, grad_norm, staleness_sum, staleness_max = tf.while_loop(more, one_step, start)
        good = tf.maximum(tf.cast(done, tf.float32) - bad, 1.0)
        # one loop's figures, as tensors: `call_output` makes a host call's CallOutput of its loops'
        return {"loss": loss_sum / good, "grad_norm": grad_norm,
                "staleness": staleness_sum / tf.maximum(tf.cast(done, tf.float32), 1.0),
                "staleness_max": staleness_max, "steps": done, "bad_steps": bad, "first_bad_step": first_bad}

    def _stopping(self):
        return self.stop_flag > 0 if self.stop_flag is not None else tf.constant(False)

    def _eval_loop(self, iterator, num_steps):
        def one_batch(i, total):
            inputs, targets = next(iterator)
            loss = self.strategy.run(self._eval_step, args=(inputs, targets))
            return i + 1, total + self.strategy.reduce(tf.distribute.ReduceOp.MEAN, loss, axis=None)

        _, total = tf.while_loop(lambda i, _: i < num_steps, one_batch, (tf.constant(0), tf.constant(0.0)))
        return total / tf.cast(num_steps, tf.float32)


class CallOutput(TypedDict):
    """What `Trainer.run` returns for one host call, as Python numbers (controller: its CallRecord)."""

    steps: int  # optimizer steps run: fewer than asked if stop_flag ended the call early
    bad_steps: int  # of them, not applied (a non-finite loss or gradient)
    loss: float  # the mean over the applied steps (NaN if none was)
    staleness: float  # the mean over the steps (asynchronous training; 0 otherwise)
    grad_norm: float  # the last step's, before clipping
    staleness_max: float
    first_bad_step: int  # as a step number (1 = the first step), -1 if none


def call_output(loops: list[dict]) -> CallOutput:
    """A host call's output from its loops' (`_train_loop`'s tensors; parameter-server training runs
    several loops per call, one whole under the other strategies)."""
    done = [(int(r["steps"]), r) for r in loops]
    steps = sum(n for n, _ in done)
    good = [(n - int(r["bad_steps"]), float(r["loss"])) for n, r in done]
    applied = sum(g for g, _ in good)
    bad = [int(r["first_bad_step"]) for _, r in done if int(r["first_bad_step"]) >= 0]  # 0-based optimizer steps
    return CallOutput(steps=steps, bad_steps=steps - applied,
                      loss=sum(g * loss for g, loss in good if g) / applied if applied else float("nan"),
                      staleness=sum(n * float(r["staleness"]) for n, r in done) / max(steps, 1),
                      grad_norm=float(done[-1][1]["grad_norm"]),
                      staleness_max=max(float(r["staleness_max"]) for _, r in done),
                      first_bad_step=min(bad) + 1 if bad else -1)


def _not_stale(loss_and_grads):
    """Synchronous training: loss_and_grads(inputs, targets) plus a staleness of 0."""
    return lambda inputs, targets: (*loss_and_grads(inputs, targets), tf.constant(0.0))


class Staleness:
    """Asynchronous (parameter-server) training: loss_and_grads(inputs, targets), plus how many updates
    other workers applied between this step reading the variables and applying its gradients."""

    def __init__(self, strategy, loss_and_grads):
        self.loss_and_grads = loss_and_grads
        with strategy.scope():  # on a ps task; atomic increments, unlike the optimizer's step
            self.updates = tf.Variable(0, dtype=tf.int64, trainable=False,
                                       aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)

    def __call__(self, inputs, targets):
        version = self.updates.read_value()
        with tf.control_dependencies([version]):  # read before the forward pass reads the weights
            loss, grads = self.loss_and_grads(inputs, targets)
        with tf.control_dependencies([loss]):  # count once the gradients exist
            after = self.updates.assign_add(1)
        return loss, grads, tf.cast(after - version - 1, tf.float32)
