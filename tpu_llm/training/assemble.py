"""The run assembler: a validated config and a distribution -> the run's model, optimizer, gradient
exchange, stage pipeline and trainer, laid out on the distribution's mesh.

Every caller builds a run's compute here: `tpu-llm train` and the Python API (through build.py's
build_run, which adds the checks, the data, the checkpoints and the run directory), doctor and bench
(build_run too), and the offline compile harness (tpu_llm/harness/: the same step on an offline TPU, or
compiled for XLA's memory figures), so what those audit is what a run trains.
"""

from __future__ import annotations

import contextlib
import dataclasses

import keras

from tpu_llm.config import Config
from tpu_llm.config.checks import eval_tasks_refusal, shard_refusal
from tpu_llm.errors import UserError
from tpu_llm.model import GPT
from tpu_llm.parallel import comm, pipeline
from tpu_llm.parallel.distribute import Distribution
from tpu_llm.training.optimizer import freeze, make_optimizer
from tpu_llm.training.trainer import Trainer


@dataclasses.dataclass
class Assembly:
    """A run's compute, as `assemble` lays it out."""

    cfg: Config
    dist: Distribution
    model: GPT
    optimizer: object
    comm: comm.Comm | None  # gradient compression or local SGD (None: the plain all-reduce)
    stages: list  # pipeline.Stage per pipeline stage
    pipeline: pipeline.Pipeline

    def trainer(self, data_position=None, execution: str = "") -> Trainer:
        """The compiled loops over this compute (`data_position`: the variable the steps write the input
        stream's position to; `execution`: the config's unless given)."""
        return Trainer(self.dist, self.model, self.optimizer, self.cfg.train, self.pipeline,
                       execution or self.cfg.execution, self.comm, data_position)


def build_model(cfg: Config, dist: Distribution, stages: list) -> GPT:
    """The model of `cfg` (with its adapters, or train.freeze's layers not trainable), each stage's
    variables on its own device or logical TPU core (pipeline.build_weights); inside the strategy's scope."""
    model = pipeline.build_weights(GPT.from_config(cfg), stages, dist.placement)
    freeze(cfg.train, model)  # fine-tuning: layers that stay as they are (train.freeze)
    return model


def optimizer_shards(cfg: Config, dist: Distribution) -> int:
    """Over how many replicas AdamW's moments are divided (parallel.shard_optimizer=state: the rule that
    the optimizer's state follows the mesh's `replica` axis); 1 = each replica keeps them whole."""
    if cfg.parallel.shard_optimizer == "none":
        return 1
    why = shard_refusal(cfg, dist.name)  # (the config's strategy was checked; this is the one auto chose)
    if why:
        raise UserError(why)
    return dist.num_replicas


def assemble(cfg: Config, dist: Distribution, variables=contextlib.nullcontext) -> Assembly:
    """The compute of `cfg` on `dist`, under Keras' global dtype policy (build.set_precision's): the model,
    its optimizer (loss-scaled under mixed_float16), the gradient exchange and the stage pipeline.
    `variables`: a context entered around the creation of the model's and optimizer's variables."""
    if cfg.train.eval_tasks and eval_tasks_refusal(dist.name):  # (the strategy auto chose)
        raise UserError(eval_tasks_refusal(dist.name))
    local_sgd = comm.check(cfg.comm, dist)  # local SGD: per-replica copies of the weights and moments
    shard_over = optimizer_shards(cfg, dist)
    stages = pipeline.partition(cfg.model, cfg.model.vocab_size, cfg.data.seq_len, cfg.parallel.pipeline_stages)
    with variables(), dist.strategy.scope(), comm.variable_scope(local_sgd):
        model = build_model(cfg, dist, stages)
        optimizer = make_optimizer(cfg.train, model, shard_over, cfg.parallel.shard_optimizer == "grads")
        if keras.mixed_precision.global_policy().name == "mixed_float16":  # float16 gradients underflow unscaled
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
            optimizer.build(model.trainable_variables)
    with dist.strategy.scope():
        communication = comm.build(cfg.comm, dist, model, optimizer)
    pipe = pipeline.Pipeline(model, stages, dist.placement, cfg.parallel.microbatches, cfg.parallel.remat,
                             cfg.train.loss_chunk)
    return Assembly(cfg, dist, model, optimizer, communication, stages, pipe)
