"""Where the compiled train step's work runs on a replica's TPU cores, traced offline with no TPU
(`tpu-llm bench placement`; tests/test_placement.py asserts it).

TF's real `TPUStrategy` is built on a hand-built topology: a resolver answers what TPUStrategy asks
about N cores that do not exist, and a variable creator makes each TPU variable on the CPU instead
(recording the core TPUStrategy chose). The run's own Trainer is then traced through
`TPUStrategy.run`: forward and backward over the micro-batches, the all-reduce, the global norm and
clipping, the optimizer's update, loss scaling, dropout. The traced TPU computation says where each op
would run: `TPU_REPLICATED_CORE:k` is logical core k of every replica, and an op without a core
annotation runs on core 0 (tpu_strategy.py, TF 2.20: under model parallelism ops default to the
zero-th logical device). What this cannot show: XLA's own placement decisions after partitioning, the
copies between cores, and speed; only a real TPU measures those.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses

import keras
import numpy as np
import tensorflow as tf

from tpu_llm.config import load_config
from tpu_llm.model import GPT
from tpu_llm.parallel import pipeline, tpu
from tpu_llm.parallel.distribute import Distribution, Placement
from tpu_llm.training.optimizer import make_optimizer
from tpu_llm.training.trainer import Trainer

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (2, 4)]  # (pipeline stages P, tensor groups T)
KINDS = ("forward matmuls", "backward matmuls", "variable writes", "all-reduces")
MATMULS = ("MatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum")
# scalars the whole replica shares may stay on core 0: the loss's mean over replicas, the optimizer's
# step counter and LossScaleOptimizer's bookkeeping (its scale and growth counter: 8 writes)
SHARED_ALLOWED = {"forward matmuls": 0, "backward matmuls": 0, "variable writes": 10, "all-reduces": 1}
TOLERANCE = 0.35  # each core's share vs the mean of the cores that should share the work


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
def variables_on_the_cpu():
    """TPU variables made on the CPU (they cannot exist on cores that do not), for tracing only."""
    def creator(next_creator, **kwargs):
        with tf.device("/device:CPU:0"):
            return next_creator(**kwargs)
    with tf.variable_creator_scope(creator):
        yield


@dataclasses.dataclass
class Audit:
    stages: int
    tensor: int
    per_core: dict  # logical core -> Counter(kind -> ops)
    shared: collections.Counter  # kind -> ops without a core annotation (core 0)

    def problems(self) -> list[str]:
        """What is not spread as it should be: each stage's work on its own cores, its T groups sharing
        the matmuls, the stages sharing the updates and reductions (each of its own variables)."""
        P, T = self.stages, self.tensor
        if P * T == 1:  # one core per replica: nothing to spread (and nothing is annotated)
            return []
        # with one stage, core 0 is the stage's own core; with several, work left there is another stage's
        out = [f"{n} {kind} have no core annotation (they run on core 0); at most {SHARED_ALLOWED[kind]} may"
               for kind, n in self.shared.items() if P > 1 and n > SHARED_ALLOWED[kind]]

        def even(kind, cores, what):
            counts = [self.count(c, kind) for c in cores]
            mean = sum(counts) / len(counts)
            if mean == 0 or any(abs(n - mean) > TOLERANCE * mean for n in counts):
                out.append(f"{kind} of {what}: {counts} on cores {list(cores)} (not within {TOLERANCE:.0%} of "
                           "an even split)")

        for i in range(P):
            if T > 1:
                for kind in ("forward matmuls", "backward matmuls"):
                    even(kind, range(i * T, (i + 1) * T), f"stage {i}'s tensor groups")
        if P > 1:
            for kind in KINDS:
                groups = [i * T for i in range(P)]
                if kind in ("forward matmuls", "backward matmuls"):
                    groups = list(range(P * T))
                even(kind, groups, "the stages")
        return out

    def count(self, core: int, kind: str) -> int:
        """The ops of `kind` that run on `core`: those annotated for it, and for core 0 the unannotated."""
        return self.per_core.get(core, {}).get(kind, 0) + (self.shared.get(kind, 0) if core == 0 else 0)

    def table(self) -> list[str]:
        cores = range(self.stages * self.tensor)
        rows = [f"{'P x T = %d x %d' % (self.stages, self.tensor):<18}" + "".join(f"{'core %d' % c:>9}" for c in cores)
                + f"{'unplaced':>10}"]
        for kind in KINDS:
            rows.append(f"{kind:<18}" + "".join(f"{self.per_core.get(c, {}).get(kind, 0):>9}" for c in cores)
                        + f"{self.shared.get(kind, 0):>10}")
        return rows


def _kind(node) -> str | None:
    if node.op in MATMULS:
        return "backward matmuls" if "gradient" in node.name.lower() else "forward matmuls"
    if node.op.startswith("Assign") and node.op.endswith("VariableOp"):
        return "variable writes"
    if node.op == "CrossReplicaSum":
        return "all-reduces"
    return None


def audit(stages: int, tensor: int, *, loss_scaling: bool = True, dropout: float = 0.1, grad_accum: int = 2,
          family: str = "gpt2") -> Audit:
    """Trace the train step of a tiny model laid out as P x T per replica on two replicas' worth of TPU
    cores (two: so that the gradients are all-reduced) and count, per logical core, each kind of op."""
    cores = 2 * stages * tensor
    n_layer = max(4, stages)
    model_keys = {"model.family": family, "model.n_layer": n_layer, "model.n_head": 4, "model.n_embd": 32,
                  "model.max_len": 16, "model.dropout": dropout, "model.vocab_size": 64}
    if family == "llama":
        model_keys.update({"model.n_kv_head": 4, "model.bias": False})
    cfg = load_config(None, {**model_keys, "data.seq_len": 16, "train.grad_accum": grad_accum,
                             "parallel.pipeline_stages": stages, "parallel.tensor": tensor})
    strategy = offline_tpu_strategy(stages * tensor, cores)
    placement = Placement(stages, tpu_strategy=strategy, tensor=tensor)
    dist = Distribution(strategy, "tpu", "offline audit", "TPU", jit_compile=False, placement=placement)
    policy = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_float16" if loss_scaling else "float32")
    try:
        parts = pipeline.partition(cfg.model, 64, 16, stages)
        with variables_on_the_cpu(), strategy.scope():
            model = pipeline.build_weights(GPT(cfg.model, 64), parts, placement)
            optimizer = make_optimizer(cfg.train, model)
            if loss_scaling:
                optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
                optimizer.build(model.trainable_variables)
        trainer = Trainer(dist, model, optimizer, cfg.train, pipeline.Pipeline(model, parts, placement),
                          execution="graph")
        batch = strategy.num_replicas_in_sync * grad_accum
        x = tf.zeros([batch, 16], tf.int32)
        batches = iter(strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensors((x, x)).repeat()))
        graph = trainer.train_loop.get_concrete_function(batches, tf.constant(1)).graph
    finally:
        keras.mixed_precision.set_global_policy(policy)
    per_core: dict = {}
    shared: collections.Counter = collections.Counter()
    for function in graph.as_graph_def().library.function:
        for node in function.node_def:
            kind = _kind(node)
            if kind is None:
                continue
            if "TPU_REPLICATED_CORE:" in node.device:
                core = int(node.device.split("TPU_REPLICATED_CORE:")[-1])
                per_core.setdefault(core, collections.Counter())[kind] += 1
            else:
                shared[kind] += 1
    return Audit(stages, tensor, per_core, shared)


def run(say=print, layouts=LAYOUTS) -> list[Audit]:
    """`tpu-llm bench placement`: the table for every layout, and what is not spread."""
    audits = []
    for stages, tensor in layouts:
        a = audit(stages, tensor)
        audits.append(a)
        for line in a.table():
            say(line)
        for problem in a.problems():
            say(f"  NOT SPREAD: {problem}")
        say("")
    return audits
