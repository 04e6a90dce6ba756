"""The optimizer and its schedule: AdamW with decoupled weight decay on Dense kernels, a linear warmup
then cosine decay, the layers train.freeze keeps as they are, and the guarded update that skips a
non-finite step (the divergence guard) while still counting it."""

from __future__ import annotations

import contextlib

import keras
import tensorflow as tf

from tpu_llm.config import TrainConfig
from tpu_llm.errors import UserError
from tpu_llm.model import GPT, decay_mask, spec
from tpu_llm.platform import tf_compat
from tpu_llm.training import fault
from tpu_llm.training.sharded_adamw import ShardedAdamW


def schedule(cfg: TrainConfig) -> keras.optimizers.schedules.CosineDecay:
    """The learning rate at each optimizer step: Keras' CosineDecay with its linear warmup. Warmup rises
    from lr / warmup_steps at step 0 to lr at step warmup_steps (Keras' warmup starts at its
    initial_learning_rate; starting above 0 keeps the first step from being wasted); the cosine decay
    then falls to min_lr at decay_steps, counted from step 0 like train.steps (0: train.steps), and the
    rate stays at min_lr after."""
    end = cfg.decay_steps or cfg.steps
    alpha = cfg.min_lr / cfg.lr  # the floor as a fraction of the peak (config: lr > 0)
    if cfg.warmup_steps == 0:
        return keras.optimizers.schedules.CosineDecay(cfg.lr, decay_steps=max(end, 1), alpha=alpha)
    return keras.optimizers.schedules.CosineDecay(cfg.lr / cfg.warmup_steps, decay_steps=max(end - cfg.warmup_steps, 1),
                                                  alpha=alpha, warmup_target=cfg.lr, warmup_steps=cfg.warmup_steps)


class ReducedGradientsAdamW(keras.optimizers.AdamW):
    """Keras AdamW for gradients the trainer has already all-reduced, which skips non-finite updates.

    Called in a replica context, Keras' TF optimizer sums the gradients across replicas itself. The
    trainer reduces them first (so that clipping sees the global gradient), so that second sum is
    switched off here.

    The divergence guard's skip (`GuardedUpdate`) needs no control flow around the update:
    a `tf.cond` whose branch holds the optimizer's cross-replica update (a merge_call) would nest
    merge_calls inside TPUStrategy's replicate context. Instead every step calls `apply`; when the
    trainer makes every gradient non-finite (the step is skipped), each variable's update keeps the
    weight, both moments and the weight decay as they were by a select, and Keras still counts the
    step (`iterations`), so the step number keeps matching the data consumed.

    The methods overridden and called here are Keras' private ones: the Keras optimizer canary in
    tests/test_tf_compat.py checks each of them, and pyproject.toml bounds keras to the minors it passed with.
    """

    skips_non_finite = True
    # TPU stages and tensor groups: tf.Variable -> the context its update runs in (its stage's logical
    # core). TPUStrategy puts an op without a core annotation on core 0 (tpu_strategy.py, TF 2.20), so
    # without it core 0 would read and write every stage's weights and moments. Set by the Trainer.
    placement_of = None

    def _distributed_tf_update_step(self, distribution, grads_and_vars, learning_rate):
        """Keras' own loop over the variables (keras/src/backend/tensorflow/optimizer.py), each update
        inside `placement_of(variable)` when set."""
        def apply_grad_to_update_var(var, grad, learning_rate):
            return self.update_step(grad, var, learning_rate)

        for grad, var in grads_and_vars:
            with self.placement_of(var) if self.placement_of else contextlib.nullcontext():
                distribution.extended.update(var, apply_grad_to_update_var, args=(grad, learning_rate), group=False)

    def _all_reduce_sum_gradients(self, grads_and_vars):
        return list(grads_and_vars)

    def _apply_weight_decay(self, variables):
        pass  # in update_step, where a skipped step leaves it out; the same arithmetic as Keras'

    def update_step(self, gradient, variable, learning_rate):
        applied = tf.reduce_all(tf.math.is_finite(gradient))
        i = self._get_variable_index(variable)
        state = [variable, self._momentums[i].value, self._velocities[i].value]
        old = [tf.identity(v) for v in state]
        gradient = tf.where(applied, gradient, tf.zeros_like(gradient))
        if self.weight_decay is not None and self._use_weight_decay(variable):  # decoupled, before the step
            lr = tf.cast(learning_rate, variable.dtype)
            variable.assign_sub(variable * tf.cast(self.weight_decay, variable.dtype) * lr)
        super().update_step(gradient, variable, learning_rate)
        for v, before in zip(state, old):
            v.assign(tf.where(applied, v, before))


def freeze(cfg: TrainConfig, model: GPT) -> list:
    """Mark the layers named by train.freeze not trainable (before the optimizer is made): they get no
    gradient, no optimizer slots, no weight decay, and keep their values bit for bit. Returns them."""
    named, blocks = spec.frozen_layers(cfg.freeze, len(model.blocks))
    layers = [model.blocks[i] for i in sorted(blocks)]
    if "embeddings" in named:
        layers += [layer for layer in (model.wte, getattr(model, "wpe", None)) if layer is not None]
    if "head" in named:
        head = getattr(model, "lm_head", None)
        if head is None:
            raise UserError("train.freeze=head: this model's output head is its embedding table (tied); freeze "
                            "embeddings instead")
        layers.append(head)
    for layer in layers:
        layer.trainable = False
    return layers


def make_optimizer(cfg: TrainConfig, model: GPT, shard_over: int = 1, takes_rows: bool = False):
    """AdamW with decoupled weight decay on Dense kernels only; create inside the strategy scope. With
    `shard_over` R > 1 replicas (parallel.shard_optimizer=state or grads), its moments are divided over them
    (sharded_adamw.ShardedAdamW); Keras' AdamW then builds none of its own. `takes_rows` (grads): the
    trainer hands it each replica's rows of the gradients, not whole ones."""
    optimizer = ReducedGradientsAdamW(learning_rate=schedule(cfg), weight_decay=cfg.weight_decay,
                                       beta_1=cfg.beta1, beta_2=cfg.beta2, epsilon=cfg.epsilon)
    decayed = {id(v) for v in decay_mask(model)}
    optimizer.exclude_from_weight_decay(var_list=[v for v in model.trainable_variables
                                                  if id(v) not in decayed])
    if shard_over > 1:
        return ShardedAdamW(optimizer, model.trainable_variables, shard_over, takes_rows)
    optimizer.build(model.trainable_variables)
    return optimizer


class GuardedUpdate:
    """The optimizer's update of the step's (reduced, clipped) gradients, unless the step is bad: then
    weights and moments stay as they were and the step is still counted, so that the step number keeps
    matching the data consumed. Also what the gradients' loss scale is, and what counts as a bad step.

    - AdamW (`ReducedGradientsAdamW.skips_non_finite`): no control flow around the update (a `tf.cond`
      whose branch holds the optimizer's cross-replica update would nest merge_calls inside TPUStrategy's
      replicate context): a bad step's gradients become NaN and the optimizer keeps every value by a select.
    - mixed_float16 (Keras' LossScaleOptimizer): the gradients carry the loss scale; an overflow (a
      non-finite gradient norm) is skipped as Keras would (the scale halves), and counted here; only a
      non-finite loss counts as a bad step.

    Any other optimizer is refused: it would apply a bad step's NaN gradients.
    """

    def __init__(self, optimizer, variables, by_stage=None):
        self.optimizer, self.variables = optimizer, variables
        self.loss_scaled = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
        if not self.loss_scaled and not getattr(optimizer, "skips_non_finite", False):
            raise TypeError(f"{type(optimizer).__name__} cannot skip a non-finite step: give an optimizer with "
                            "`skips_non_finite` (ReducedGradientsAdamW) or a LossScaleOptimizer")
        self.by_stage = by_stage or (lambda fn, grads: fn(grads))  # fn on each stage's share, where it lives

    @property
    def loss_scale(self):
        """What the gradients are scaled by (mixed_float16's dynamic loss scale, else 1)."""
        return self.optimizer.dynamic_scale if self.loss_scaled else 1.0

    def scale_loss(self, loss):
        return self.optimizer.scale_loss(loss) if self.loss_scaled else loss

    def finite(self, loss, grad_norm):
        """Whether the step is good: a finite loss and gradient norm (under loss scaling, only the loss:
        an overflow only lowers the scale)."""
        if self.loss_scaled:
            return tf.math.is_finite(loss)
        return tf.logical_and(tf.math.is_finite(loss), tf.math.is_finite(grad_norm))

    def apply(self, grads, finite, grad_norm) -> None:
        if self.loss_scaled:
            fault.apply_if(tf.math.is_finite(grad_norm), self._update, self._overflowed, grads)
        else:  # the optimizer keeps every value of a step whose gradients are NaN (skips_non_finite)
            nan = tf.constant(float("nan"), grads[0].dtype)
            self._update(self.by_stage(lambda gs: [tf.where(finite, g, nan) for g in gs], grads))

    def _update(self, grads):
        return self.optimizer.apply(grads, self.variables)

    def _overflowed(self):
        """A mixed_float16 step whose gradients overflowed: what LossScaleOptimizer does (halve the
        scale, restart its growth count), plus counting the step, which Keras does not do."""
        tf_compat.loss_scale_overflowed(self.optimizer)
        self.optimizer.iterations.assign_add(1)
