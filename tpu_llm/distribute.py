"""How the job is distributed: the one place that chooses a tf.distribute strategy.

The trainer, data and model code ask this module for a `Distribution` and never branch on the
strategy themselves. Implemented so far: TF's default strategy (one device) and MirroredStrategy
(synchronous data parallel) over several GPUs or over the CPU split into `cpu_devices` logical
devices. TPU, multi-worker and parameter-server strategies plug in here.

Splitting a 2-core CPU into 2 logical devices is not only for testing multi-device code: XLA:CPU
spends much of a small model's step in per-kernel overhead, and two replicas running side by side
overlap it (`make bench`: 13.4k-15.4k vs 10.0k tokens/s for the same global batch).
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from tpu_llm import perf
from tpu_llm.config import Config
from tpu_llm.errors import UserError


@dataclasses.dataclass
class Distribution:
    strategy: tf.distribute.Strategy
    name: str  # what was chosen
    reason: str  # why, in words, for `tpu-llm info` and the training log
    device_kind: str  # "CPU", "GPU" or the TPU's device kind, for the MFU peak
    jit_compile: bool = True  # compile the per-replica step with XLA

    @property
    def num_replicas(self) -> int:
        return self.strategy.num_replicas_in_sync

    def peak_flops(self) -> tuple[float, str]:
        """(peak FLOP/s of all replicas together, how it was obtained)."""
        tpu = perf.tpu_peak_flops(self.device_kind) if self.device_kind.startswith("TPU") else None
        if tpu:
            return tpu * self.num_replicas, f"{self.device_kind} bf16 peak (published)"
        if self.device_kind == "GPU":
            return perf.measured_matmul_flops("/GPU:0") * self.num_replicas, "measured /GPU:0 float32 matmul"
        # logical CPU devices share the same cores: the measured matmul already uses all of them
        return perf.measured_matmul_flops("/CPU:0"), "measured CPU float32 matmul"


def split_cpu(n: int) -> list[str]:
    """Names of `n` logical CPU devices, splitting the physical CPU if TensorFlow has not started yet."""
    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        if len(tf.config.get_logical_device_configuration(cpu) or []) < n:
            tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * n)
    except RuntimeError:  # the runtime is up: the split is fixed for this process
        pass
    have = tf.config.list_logical_devices("CPU")
    if len(have) < n:
        raise UserError(f"cpu_devices={n}, but TensorFlow already started in this process with {len(have)} "
                        "CPU device(s); set cpu_devices in the config or on the command line of a new run")
    return [d.name for d in have[:n]]


def get_strategy(cfg: Config) -> Distribution:
    """The distribution for this run (call before any other TensorFlow work: it may split the CPU)."""
    gpus = tf.config.list_physical_devices("GPU")  # (listing logical devices would start the runtime)
    if cfg.strategy == "default":
        if cfg.cpu_devices > 1:
            raise UserError(f"cpu_devices={cfg.cpu_devices} needs strategy=mirrored or auto; "
                            "strategy=default runs on one device")
        return Distribution(tf.distribute.get_strategy(), "default", "strategy=default",
                            "GPU" if gpus else "CPU")
    if len(gpus) > 1:
        return Distribution(tf.distribute.MirroredStrategy(), "mirrored",
                            f"strategy={cfg.strategy}: {len(gpus)} GPUs, synchronous data parallel", "GPU")
    if cfg.cpu_devices > 1:
        names = split_cpu(cfg.cpu_devices)
        # logical CPUs share one memory: reduce on the first of them. (The default, collective
        # all-reduce, also breaks when a process builds a second strategy of another size.)
        strategy = tf.distribute.MirroredStrategy(names, cross_device_ops=tf.distribute.ReductionToOneDevice())
        return Distribution(strategy, "mirrored",
                            f"strategy={cfg.strategy}: cpu_devices={cfg.cpu_devices} logical CPU devices, "
                            "synchronous data parallel", "CPU")
    if cfg.strategy == "mirrored" and len(gpus) < 2:
        raise UserError("strategy=mirrored found one device (no second GPU); set cpu_devices=N to mirror "
                        "over N logical CPU devices, or use strategy=auto / default")
    kind = "GPU" if gpus else "CPU"
    return Distribution(tf.distribute.get_strategy(), "default",
                        f"strategy=auto: one {kind} device and cpu_devices=1", kind)
