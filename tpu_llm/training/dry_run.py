"""`tpu-llm train --dry_run`: every check of a run that needs no model (config, data, tokenizer against
the data, run directory, strategy), the start-up header, and what the run would do (resume from which
checkpoint, or start a new run), without building the model, compiling or writing anything. Users run
it before paying for a TPU hour; scripts/docs_check.py runs the docs' long trainings this way."""

from __future__ import annotations

from tpu_llm.config import Config
from tpu_llm.parallel import pipeline
from tpu_llm.parallel.distribute import get_strategy
from tpu_llm.platform.run_layout import checkpoint_name, checkpoint_step
from tpu_llm.training.build import check_run
from tpu_llm.training.checkpoint import index_files
from tpu_llm.training.header import layout_lines, setup_lines


def layout(cfg: Config, dist, vocab_size: int) -> list[str]:
    """The pipeline or tensor lines of the start-up header, the stages from the partition (no model)."""
    p = cfg.parallel
    stages = pipeline.partition(cfg.model, vocab_size, cfg.data.seq_len, p.pipeline_stages) \
        if p.pipeline_stages > 1 else None
    return layout_lines(cfg, dist, stages)


def newest_checkpoint(run_dir: str) -> tuple[str, int] | None:
    """(name, step) of the newest checkpoint file in `run_dir` (by its step number; its readability is
    checked only when training restores it), or None."""
    steps = [step for step in (checkpoint_step(index, ".index") for index in index_files(run_dir)) if step is not None]
    return (checkpoint_name(max(steps)), max(steps)) if steps else None


def dry_run(cfg: Config, say=print, unstated: str = "") -> list[str]:
    """Check `cfg` as `train` would before its first step and print what it would do; returns the lines."""
    dist = get_strategy(cfg)
    srcs, tokenizer = check_run(cfg, dist, unstated)
    m, t, d = cfg.model, cfg.train, cfg.data
    lines = [*setup_lines(cfg, dist, srcs, tokenizer),
             *layout(cfg, dist, cfg.model.vocab_size),
             f"model     {m.family}: {m.n_layer} layers, {m.n_head} heads, width {m.n_embd} (not built: --dry_run)",
             f"batch     {t.batch_size} x {d.seq_len} tokens = {t.batch_size * d.seq_len:,} per step"]
    newest = newest_checkpoint(cfg.run_dir)
    if newest and newest[1] >= t.steps:
        plan = f"nothing to do: {newest[0]} is at step {newest[1]} of train.steps={t.steps}"
    elif newest:
        plan = f"resumes from {newest[0]} at step {newest[1]}, trains to step {t.steps}"
    elif t.init_from:
        plan = f"starts a new run from the weights of {t.init_from} (train.init_from), trains {t.steps} steps"
    else:
        plan = f"starts a new run, trains {t.steps} steps"
    lines.append(f"dry run   all checks passed; would: {plan}")
    for line in lines:
        say(line)
    return lines
