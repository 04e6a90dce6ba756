"""The start-up header: what a run prints before its first step (`describe_run`), and the lines
`tpu-llm train --dry_run` prints of it without building the model (`setup_lines`, `layout_lines`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import keras

from tpu_llm.config import Config
from tpu_llm.parallel import comm, pipeline
from tpu_llm.parallel.distribute import Distribution
from tpu_llm.platform import perf
from tpu_llm.training import progress as phases

if TYPE_CHECKING:
    from tpu_llm.training.build import Run


def setup_lines(cfg: Config, dist: Distribution, srcs, tokenizer) -> list[str]:
    """The header's first lines: run directory, strategy, data and tokenizer (train and --dry_run)."""
    xla = dist.xla if cfg.execution == "xla" else f"off (execution={cfg.execution})"
    return [f"run_dir   {cfg.run_dir}",
            f"strategy  {dist.name} ({dist.reason}); {dist.num_replicas} replica(s)"
            + (f" per step, {dist.num_workers} workers" if dist.asynchronous else "") + f"; XLA: {xla}",
            f"data      train: {srcs[0].description}; validation: {srcs[1].description}",
            f"tokenizer {tokenizer.kind}, {tokenizer.vocab_size} ids"]


def layout_lines(cfg: Config, dist: Distribution, stages) -> list[str]:
    """The header's pipeline lines (with the run's `stages`) or tensor line (train and --dry_run)."""
    p = cfg.parallel
    if p.pipeline_stages > 1:
        return [f"pipeline  GPipe, {p.pipeline_stages} stages x {p.microbatches} micro-batches (bubble "
                f"{pipeline.gpipe_bubble(p.pipeline_stages, p.microbatches):.0%}){', remat' if p.remat else ''}; "
                f"{dist.placement.describe()}"] + [f"          {line}" for line in pipeline.describe(stages)]
    if p.tensor > 1:
        return [f"tensor    heads and MLP units split {p.tensor} ways; {dist.placement.describe()}"]
    return []


def describe_run(run: Run, step: int, peak: float, peak_how: str) -> list[str]:
    """The start-up header of a run: where it writes, how it is distributed, its data, model and batch,
    and where it starts (resumed, initialised from another run, or new)."""
    cfg, t, d, dist = run.cfg, run.cfg.train, run.cfg.data, run.dist
    lines = setup_lines(cfg, dist, run.sources, run.tokenizer) + [
        f"precision {keras.mixed_precision.global_policy().name}; execution {cfg.execution}"]
    stages = run.trainer.pipeline.stages if cfg.parallel.pipeline_stages > 1 else None
    lines += layout_lines(cfg, dist, stages)
    if run.comm:
        lines.append(f"comm      {run.comm.describe()}")
    elif comm.active(cfg.comm):
        lines.append("comm      off: one replica, nothing to exchange")
    shards = getattr(run.optimizer, "replicas", 1)
    if shards > 1:
        what = "AdamW's moments and the accumulated gradients" if run.optimizer.takes_rows else "AdamW's moments"
        lines.append(f"optimizer {what} divided over {shards} replicas (parallel.shard_optimizer="
                     f"{cfg.parallel.shard_optimizer}): each keeps 1/{shards} of them")
    elif cfg.parallel.shard_optimizer != "none":
        lines.append(f"optimizer parallel.shard_optimizer={cfg.parallel.shard_optimizer} has no effect: one replica")
    m = cfg.model
    frozen = f"; frozen: {phases.frozen_layers(t.freeze, m.n_layer)}" if t.freeze else ""
    if run.model.adapters is not None:
        frozen = f"; {run.model.adapters.describe()}"
    lines += [f"model     {phases.parameters_text(run.model)} ({m.family}: {m.n_layer} layers, {m.n_head} heads, width "
              f"{m.n_embd}{frozen}); {perf.format_count(phases.flops_per_token(cfg, run.model.vocab_size))}FLOP/token",
              f"batch     {t.batch_size} x {d.seq_len} tokens = {t.batch_size * d.seq_len:,} per step; "
              f"{t.steps_per_loop} steps per host call; MFU peak: {perf.format_count(peak)}FLOP/s ({peak_how})"]
    # e.g. an unreadable newest checkpoint skipped for the previous one
    lines += [f"warning   {note}" for note in run.checkpointer.notes]
    if run.resumed_from:
        lines.append(f"resumed   from {run.resumed_from} at step {step} ({run.data_resume})")
    elif run.initialised_from:
        lines.append(f"weights   from {run.initialised_from} (train.init_from); a fresh optimizer at step 0")
    return lines
