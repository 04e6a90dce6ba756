"""The planner's time model and its accelerators: what each chip computes and how long a step takes
(GPipe's schedule played out), for tpu_llm/tools/plan.py.

Time. Model FLOPs per token are 6N + 12 L C T (spec.flops_per_token: N without positions and an
untied head's input table, lookups rather than matmuls); a frozen weight (train.freeze; with adapters every
weight but the adapters) has no weight gradient: 4N for those, 2N below the lowest trained layer, and
6 x the adapters' (spec.layer_flops_per_token); the trainer's MFU counts the same. A step
is B T tokens. remat executes one more forward of the blocks (x4/3 of their FLOPs). A stage's forward
on one micro-batch takes its FLOPs (pipeline.partition, / 3 for the forward, plus the adapters') over
t x peak x `mfu`, the fraction of peak a chip sustains while busy (an assumption: 0.4 by default); the
backward takes 2x that when every weight trains (about 1x for a frozen base under adapters; remat adds a forward). `simulate` plays GPipe's schedule on those times; a step is grad_accum
such pipelines. Not modelled: the gradient all-reduce, the optimizer update (~16 bytes of HBM traffic
per parameter), stage-to-stage transfers and input stalls: the time is optimistic for a given mfu.

Collectives, beside the step time (`collectives`): the bytes a chip sends per step between replicas
(float32 gradients and weights of its stage's trainable parameters G): a ring all-reduce of the
gradients, 2 (R-1)/R x 4G; parallel.shard_optimizer=state adds the all-gather of the updated rows,
(R-1)/R x 4G; grads reduces each of the grad_accum micro-batches (counted as an all-reduce each, as the
step is written; a reduce-scatter, which XLA may make of it on a TPU, sends half) plus the all-gather.
Their time is those bytes over half the chip's bidirectional ICI bandwidth (Cloud TPU documentation:
every port sending at once, so a lower bound), with no overlap with the backward pass, which XLA
gives in part: an upper bound on what they add to the step when the ICI bandwidth is reached.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Sequence

from tpu_llm.config import Config
from tpu_llm.config.checks import adapters_per_block
from tpu_llm.errors import UserError
from tpu_llm.model import spec
from tpu_llm.tools.plan_memory import GIB
from tpu_llm.training import progress

# HBM per chip, GiB (Cloud TPU documentation; ARCHITECTURE.md), keyed by device kind as tpu._TYPES spells it
HBM_GIB = {"TPU v4": 32, "TPU v5 lite": 16, "TPU v5p": 95, "TPU v6 lite": 32}
# bidirectional inter-chip interconnect bandwidth per chip, GB/s (the Cloud TPU documentation's v5e, v5p and v6e
# pages; its v4 page gives only the pod's all-reduce bandwidth, so v4's collectives are not timed)
ICI_GBPS = {"TPU v5 lite": 400, "TPU v5p": 1200, "TPU v6 lite": 800}


def collectives(cfg: Config, trainable: int, replicas: int, kind: str) -> tuple[dict[str, float], float | None]:
    """({collective: bytes one chip sends per step}, seconds at the ICI bandwidth of `kind`, or None where
    it is unknown) for `trainable` parameters over `replicas` replicas (the module docstring's formulas)."""
    if replicas < 2:
        return {}, 0.0
    share, grads = (replicas - 1) / replicas, 4.0 * trainable
    setting = cfg.parallel.shard_optimizer
    reductions = cfg.train.grad_accum if setting == "grads" else 1
    name = f"{reductions} gradient all-reduces" if reductions > 1 else "gradient all-reduce"
    sent = {name: reductions * 2 * share * grads}
    if setting in ("state", "grads"):
        sent["all-gather of the updated rows"] = share * grads
    bandwidth = ICI_GBPS.get(kind)
    return sent, (sum(sent.values()) / (bandwidth * 1e9 / 2) if bandwidth else None)


@dataclasses.dataclass(frozen=True)
class Accelerator:
    name: str  # as given: v5p-16, v4-8, cpu
    kind: str  # TPU v5p, TPU v5 lite, ..., CPU
    chips: int  # devices TensorFlow sees (TPU chips; 1 machine for cpu)
    peak_flops: float  # per chip: bf16 (TPU) or the measured float32 matmul rate (cpu)
    memory_bytes: float  # HBM per chip; RAM of the machine for cpu (0: unknown)
    note: str = ""

    @property
    def shared_memory(self) -> bool:  # logical CPU devices share one RAM
        return self.kind == "CPU"


def accelerator(name: str, cpu_peak_flops: float | None = None) -> Accelerator:
    """An accelerator type (v5p-16, v4-8, v5litepod-8, v6e-8) or "cpu" (measures the matmul peak)."""
    from tpu_llm.parallel import tpu
    from tpu_llm.platform import perf  # both import TensorFlow

    name = str(name).strip().lower()
    if name == "cpu":
        try:  # POSIX; elsewhere the RAM check is skipped
            ram = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        except (AttributeError, ValueError, OSError):
            ram = 0.0
        peak = cpu_peak_flops or perf.measured_matmul_flops()
        return Accelerator("cpu", "CPU", 1, peak, ram, "float32 matmul peak measured now")
    known = ", ".join(f"{p}-N" for p, kind, _ in tpu._TYPES if kind in HBM_GIB)
    match = re.fullmatch(r"([a-z0-9]+)-(\d+)", name)
    found = next((t for t in tpu._TYPES if match and t[0] == match.group(1)), None)
    if not found:
        raise UserError(f"--accelerator={name!r}: not an accelerator type; use cpu or one of {known} "
                        "(e.g. v5p-16, v4-8, v5litepod-8, v6e-8)")
    prefix, kind, per_chip = found
    if kind not in HBM_GIB:
        raise UserError(f"--accelerator={name}: no peak or HBM figures for {kind} here; plan for {known}")
    count = int(match.group(2))
    if count < per_chip or count % per_chip:
        raise UserError(f"--accelerator={name}: {prefix} types count TensorCores, 2 per chip; use an even "
                        f"number such as {prefix}-8")
    counts = "TensorCores, 2 per chip" if per_chip == 2 else "chips"
    return Accelerator(name, kind, count // per_chip, perf.tpu_peak_flops(kind), HBM_GIB[kind] * GIB,
                       f"{prefix} types count {counts}")


def simulate(stage_forward_seconds: Sequence[float], microbatches: int,
             backward_ratio: float | Sequence[float] = 2.0, transfer_seconds: float = 0.0,
             ) -> tuple[float, float, list[float]]:
    """GPipe's schedule played out: (step seconds, bubble fraction, busy fraction of each stage).

    Each stage's device runs its tasks in GPipe's order: forwards of micro-batches 0..M-1, then
    backwards M-1..0. A task starts once its device is free and its input has arrived: the previous
    stage's forward of that micro-batch (plus `transfer_seconds`), or the next stage's backward of it;
    the last stage turns straight from its last forward to the backwards. Backward time = forward
    time x `backward_ratio` (one number, or one per stage). The bubble is the idle share of all
    stages' time: (P-1)/(M+P-1) for equal stages. Compare with measured per-stage times to validate.
    """
    fwd = [float(t) for t in stage_forward_seconds]
    stages, m_count = len(fwd), int(microbatches)
    if not stages or m_count < 1 or min(fwd) < 0:
        raise ValueError("simulate needs >= 1 stage with non-negative times and >= 1 micro-batch")
    ratios = list(backward_ratio) if isinstance(backward_ratio, Sequence) else [backward_ratio] * stages
    bwd = [f * r for f, r in zip(fwd, ratios, strict=True)]
    free = [0.0] * stages  # when each stage's device is next idle
    fwd_done = [[0.0] * m_count for _ in range(stages)]
    bwd_done = [[0.0] * m_count for _ in range(stages)]
    # visiting tasks in this order, every task's inputs have already been timed
    for m in range(m_count):
        for s in range(stages):
            arrives = fwd_done[s - 1][m] + transfer_seconds if s else 0.0
            free[s] = fwd_done[s][m] = max(free[s], arrives) + fwd[s]
    for m in reversed(range(m_count)):
        for s in reversed(range(stages)):
            arrives = bwd_done[s + 1][m] + transfer_seconds if s < stages - 1 else fwd_done[s][m]
            free[s] = bwd_done[s][m] = max(free[s], arrives) + bwd[s]
    step = max(free)
    busy = [m_count * (f + b) / step if step else 1.0 for f, b in zip(fwd, bwd)]
    return step, 1.0 - sum(busy) / stages, busy


def step_time(cfg: Config, acc: Accelerator, mfu: float, stages: list, vocab: int, tokens_micro: float,
              ) -> tuple[float, float, float, float, list[float]]:
    """(model FLOPs per step, FLOPs executed, step seconds, GPipe's bubble, each stage's busy share) of
    `cfg` on `acc` at `mfu` while busy, its pipeline `stages` running micro-batches of `tokens_micro`."""
    p, t, seq = cfg.parallel, cfg.train, cfg.data.seq_len
    # a frozen weight (train.freeze, or all but the adapters) has no weight gradient: 4N, not 6N
    frozen = spec.frozen_layers(t.freeze, cfg.model.n_layer) if t.freeze else ((), ())
    adapters = adapters_per_block(cfg)
    layers, head = spec.layer_flops_per_token(cfg.model, vocab, seq, frozen, adapters)
    block_forward = spec.block_flops_per_token(cfg.model, seq) / 3 + 2 * adapters  # what remat repeats
    model_flops = progress.flops_per_token(cfg, vocab) * t.batch_size * seq
    executed = model_flops + (cfg.model.n_layer * block_forward * t.batch_size * seq if p.remat else 0.0)
    rate = acc.peak_flops * mfu * (p.tensor if not acc.shared_memory else 1)
    forward = [(s.flops_per_token / 3 + 2 * adapters * len(s.blocks)) * tokens_micro / rate for s in stages]
    # the backward over the forward: 2 when every weight trains, about 1 for a frozen base; remat adds the
    # blocks' forward again (the head is not recomputed)
    ratios = []
    for s, seconds in zip(stages, forward):
        parts = [layers[i] for i in s.blocks] + ([head] if s.head else [])
        ratio = sum(b for _, b in parts) / sum(f for f, _ in parts)
        ratios.append(ratio + (len(s.blocks) * block_forward * tokens_micro / rate / seconds if p.remat else 0.0))
    pipe_seconds, bubble, busy = simulate(forward, p.microbatches, ratios)
    step = t.grad_accum * pipe_seconds
    if acc.shared_memory:  # logical devices share the cores: idle stages leave them to the others
        step = executed / (acc.peak_flops * mfu)
    return model_flops, executed, step, bubble, busy
