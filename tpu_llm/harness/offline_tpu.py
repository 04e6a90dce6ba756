"""TF's real TPUStrategy with no TPU, and the run's train step built on it: what the placement audits
(harness/placement_audit.py) trace and compile.

A resolver answers what TPUStrategy asks about N cores that do not exist (a hand-built one-host
topology), and a variable creator makes each TPU variable on the CPU instead, recording the logical
core TPUStrategy chose for it. `build_step` then builds a tiny model laid out as P pipeline stages x T
tensor groups per replica on two replicas' worth of cores (two: so that the gradients are
all-reduced), its optimizer and the run's own Trainer, and traces `Trainer.train_loop` (or
`eval_loop`) through `TPUStrategy.run`: forward and backward over the micro-batches, the all-reduce,
the global norm and clipping, the optimizer's update, loss scaling, dropout, the input stream's
position.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import keras
import numpy as np
import tensorflow as tf

from tpu_llm.config import load_config
from tpu_llm.data.lanes import POSITION_FIELDS
from tpu_llm.model import GPT, families
from tpu_llm.parallel import tpu
from tpu_llm.parallel.distribute import Distribution
from tpu_llm.parallel.mesh import Mesh, Placement
from tpu_llm.platform import tf_compat
from tpu_llm.training.assemble import assemble
from tpu_llm.training.trainer import Trainer

REPLICAS = 2
# with n_embd 32, one sequence of 16 per micro-batch and 32 positions, no activation has a weight's shape
SEQ_LEN, MAX_LEN = 16, 32


def topology(cores: int):
    """A one-host Topology of `cores` cores (2 per chip): mesh (2, 2, 1, 2) for 8."""
    chips = max(cores // 2, 1)
    mesh = [2, chips // 2, 1, 2] if chips >= 2 else [1, 1, 1, cores]
    coords = [(x, y, z, c) for z in range(mesh[2]) for y in range(mesh[1]) for x in range(mesh[0])
              for c in range(mesh[3])]
    return tf.tpu.experimental.Topology(mesh_shape=mesh, device_coordinates=np.array([coords], dtype=np.int32))


class _Device:
    def __init__(self, name: str):
        self.name = name


class OfflineTPUResolver(tf.distribute.cluster_resolver.ClusterResolver):
    """What TPUStrategy asks a resolver, answered for the cores of a hand-built one-host `topology` (no
    TPU needed). The tests build other topologies with it too (tests/helpers.py offline_resolver)."""

    def __init__(self, topology):
        self.topology = topology
        self.cores = topology.num_tasks * topology.num_tpus_per_task

    def cluster_spec(self):
        return tf.train.ClusterSpec({})

    def master(self, *_, **__):
        return ""

    def num_accelerators(self, *_, **__):
        return {"TPU": self.cores}

    def get_tpu_system_metadata(self):
        devices = [_Device(f"/job:localhost/replica:0/task:0/device:TPU:{i}") for i in range(self.cores)]
        return tf.tpu.experimental.TPUSystemMetadata(
            num_cores=self.cores, num_hosts=1, num_of_cores_per_host=self.cores, topology=self.topology,
            devices=devices + [_Device("/job:localhost/replica:0/task:0/device:CPU:0")])


def offline_tpu_strategy(cores_per_replica: int, cores: int) -> tf.distribute.TPUStrategy:
    resolver = OfflineTPUResolver(topology(cores))
    return tf.distribute.TPUStrategy(resolver, experimental_device_assignment=tpu.device_assignment(
        resolver.topology, cores_per_replica))


@contextlib.contextmanager
def variables_on_the_cpu(homes: dict | None = None, strategy=None):
    """TPU variables made on the CPU (they cannot exist on cores that do not), for tracing only. With
    `homes` and `strategy`: homes[id(copy)] = (the copy, the logical core TPUStrategy chose for it; None for
    a variable colocated with another, such as an optimizer's moment: it was not chosen). The copy is
    held so that its id is never another's."""
    cores = [d.split("device:")[-1] for d in tf_compat.tpu_core_devices(strategy)] if strategy else []

    def creator(next_creator, **kwargs):
        device = tf_compat.current_device().split("device:")[-1]
        with tf.device("/device:CPU:0"):
            v = next_creator(**kwargs)
        if homes is not None:
            homes[id(v)] = (v, cores.index(device) if device in cores else None)
        return v
    with tf.variable_creator_scope(creator):
        yield


@dataclasses.dataclass
class Step:
    """The traced step of one layout, and what the audits need to read it."""
    stages: int
    tensor: int
    precision: str
    grad_accum: int
    family: str
    dropout: float
    strategy: tf.distribute.TPUStrategy
    model: GPT
    optimizer: keras.optimizers.Optimizer
    trainer: Trainer
    parts: list  # pipeline.Stage per stage
    homes: dict  # id(first replica's copy of a variable) -> (that copy, the logical core it was created on)
    data_position: tf.Variable
    seconds: float = 0.0  # building the model and tracing both loops

    def variables(self) -> list:
        """Every TPU variable the step may use: the model's, the optimizer's, the input position."""
        keras_vars = list(self.model.variables) + list(self.optimizer.variables)
        # (Keras variables hold a TF one; ShardedAdamW's moments are TF variables themselves)
        return [v if isinstance(v, tf.Variable) else v.value for v in keras_vars] + [self.data_position]

    def path(self, variable) -> str:
        """A TPU variable's Keras path (`block_2/attn/qkv/kernel`, `adamw/..._momentum`)."""
        owners = [(block.name, block) for block in self.model.blocks] + [("", self.model)]
        for prefix, owner in owners:  # a dropout's seed, re-created on its stage (no path of its own)
            for layer in tf_compat.all_layers(owner):
                generator = getattr(layer, "seed_generator", None)
                if generator is not None and generator.state.value is variable:
                    return "/".join(filter(None, (prefix, layer.name, "seed_generator_state")))
        for v in list(self.model.variables) + list(self.optimizer.variables):
            if getattr(v, "value", None) is variable:
                return v.path
        return variable.name.split(":")[0]

    def home(self, variable) -> int | None:
        """The logical core `variable` (a TPU variable) was created on; an optimizer's moment: its
        model variable's (Keras colocates them)."""
        core = self.homes.get(id(variable.values[0]), (None, None))[1]
        if core is None:
            for v, *moments in tf_compat.adam_moments(self.optimizer):
                if any(m.value is variable for m in moments):
                    return self.homes.get(id(v.value.values[0]), (None, None))[1]
        return core

    def stage_cores(self, block: int) -> range:
        """The logical cores of the stage holding `block`."""
        stage = next(s.index for s in self.parts if block in s.blocks)
        return range(stage * self.tensor, (stage + 1) * self.tensor)

    def function(self, which: str = "train"):
        """The concrete train loop (one optimizer step per iteration) or evaluation loop."""
        k = self.grad_accum if which == "train" else 1
        replicas = self.strategy.num_replicas_in_sync  # (a replica spans stages x tensor cores)
        x = tf.zeros([replicas * k, SEQ_LEN], tf.int32)
        elements = (x, x, tf.zeros([replicas * k, len(POSITION_FIELDS)], tf.int64)) if which == "train" else (x, x)
        dataset = tf.data.Dataset.from_tensors(elements).repeat()
        batches = iter(self.strategy.experimental_distribute_dataset(dataset))
        loop = self.trainer.train_loop if which == "train" else self.trainer.eval_loop
        return loop.get_concrete_function(batches, tf.constant(1))


def build_step(stages: int, tensor: int, *, precision: str = "mixed_bfloat16", dropout: float = 0.1,
               grad_accum: int = 2, family: str = "gpt2", shard_optimizer: str = "none",
               replicas: int = REPLICAS) -> Step:
    """A tiny model laid out as `stages` x `tensor` per replica on `replicas` replicas' worth of offline TPU
    cores, with its optimizer (LossScaleOptimizer under mixed_float16; AdamW's moments divided over the
    replicas with `shard_optimizer="state"`) and Trainer, as a run assembles them (training/assemble.py).
    The global dtype policy is left as it was."""
    n_layer = max(2, stages)  # one block per stage at 2 stages: each stage's and group's placement is per block,
    # so more blocks only add compile time (4 blocks until 7 December 2026: the same verdicts)
    model_keys = {"model.family": family, "model.n_layer": n_layer, "model.n_head": 4, "model.n_embd": 32,
                  "model.max_len": MAX_LEN, "model.dropout": dropout, "model.vocab_size": 64}
    model_keys.update({f"model.{key}": value for key, value in families.get(family).defaults.items()})
    cfg = load_config(None, {**model_keys, "data.seq_len": SEQ_LEN, "train.grad_accum": grad_accum,
                             "parallel.pipeline_stages": stages, "parallel.tensor": tensor,
                             "parallel.shard_optimizer": shard_optimizer})
    strategy = offline_tpu_strategy(stages * tensor, replicas * stages * tensor)
    placement = Placement(Mesh(replicas, stages, tensor), tpu_strategy=strategy)
    dist = Distribution(strategy, "tpu", "offline audit", "TPU", jit_compile=False, placement=placement)
    policy = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy(precision)
    homes: dict = {}
    start = time.perf_counter()
    try:
        compute = assemble(cfg, dist, lambda: variables_on_the_cpu(homes, strategy))
        model, optimizer, parts = compute.model, compute.optimizer, compute.stages
        with variables_on_the_cpu(homes, strategy), strategy.scope():
            # each replica's element carries a (grad_accum, fields) position update (Step.function)
            position = tf.Variable(tf.zeros([grad_accum, len(POSITION_FIELDS)], tf.int64), trainable=False,
                                   name="data_position", synchronization=tf.VariableSynchronization.ON_READ,
                                   aggregation=tf.VariableAggregation.SUM)
        trainer = compute.trainer(position, execution="graph")
        step = Step(stages, tensor, precision, grad_accum, family, dropout, strategy, model, optimizer, trainer,
                    parts, homes, position)
        step.function("train")  # traced under the policy the model was built with
        step.function("eval")
        step.seconds = time.perf_counter() - start
        step.cfg = cfg  # what `tpu-llm plan` reads for the same model (tools/bench_shard.py)
    finally:
        keras.mixed_precision.set_global_policy(policy)
    return step
