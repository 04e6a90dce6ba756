"""How the job is distributed: the one place that chooses a tf.distribute strategy.

The trainer, data and model code ask this module for a `Distribution` and never branch on the
strategy themselves. For now every run uses TF's default strategy (one device); TPU, Mirrored,
multi-worker and parameter-server strategies plug in here.
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from tpu_llm import perf
from tpu_llm.config import Config


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
        device = "/GPU:0" if self.device_kind == "GPU" else "/CPU:0"
        flops = perf.measured_matmul_flops(device)
        return flops * self.num_replicas, f"measured {device} float32 matmul"


def get_strategy(cfg: Config) -> Distribution:
    """The distribution for this run. `auto` and `default` both use TF's default strategy for now."""
    gpus = tf.config.list_logical_devices("GPU")
    kind = "GPU" if gpus else "CPU"
    reason = ("strategy=default" if cfg.strategy == "default"
              else f"strategy=auto: no TPU or multi-device set-up requested; one {kind} device")
    return Distribution(tf.distribute.get_strategy(), "default", reason, kind)
