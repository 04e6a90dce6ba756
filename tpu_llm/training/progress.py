"""What a training run tells while it runs, honestly: the time left (compilation left out), one line per
slow phase (compiling, the first evaluation, sampling), the model's trainable and total parameters, and
the FLOPs per token its MFU counts."""

from __future__ import annotations

import math

from tpu_llm.config import Config
from tpu_llm.config.checks import adapters_per_block
from tpu_llm.model import spec

SLOW_EVAL_SECONDS = 5.0  # an evaluation that took this long gets its phase line again the next time
STARTING = ("starting  choosing the strategy, checking data and tokenizer, building the model, restoring the newest "
            "checkpoint if there is one ...")


class Eta:
    """Seconds left, from the host calls after the first: the first traces and compiles the step (tens
    of seconds against a fraction of a second per step), so it would inflate the estimate several
    times over (9m35s shown for a 4m26s run). None until a later call has been timed."""

    def __init__(self):
        self.calls, self.steps, self.seconds = 0, 0, 0.0

    def record(self, steps: int, seconds: float) -> None:
        self.calls += 1
        if self.calls > 1:
            self.steps += steps
            self.seconds += seconds

    def seconds_left(self, steps_left: int) -> float | None:
        return steps_left * self.seconds / self.steps if self.steps else None


def compile_line(execution: str, jit_compile: bool, steps: int) -> str:
    """The line before the first call: what it spends its first seconds on."""
    what = ("compiling the train step (XLA)" if execution == "xla" and jit_compile else
            "tracing the train step (TF graph)" if execution != "eager" else "running the train step eagerly")
    return f"compile   {what} and running its first {steps} step(s) ..."


def compiled_line(seconds: float, steps: int) -> str:
    return f"compile   done in {seconds:.1f}s (the first {steps} step(s) included; left out of eta and the done line)"


class EvalPhase:
    """Whether an evaluation gets a line before it: the first (it compiles the evaluation step) and any
    after one that took SLOW_EVAL_SECONDS or more; quick ones would only double the eval lines."""

    def __init__(self):
        self.last: float | None = None

    def line(self, batches: int) -> str | None:
        if self.last is None:
            return f"eval      compiling the evaluation step and running {batches} validation batch(es) ..."
        if self.last >= SLOW_EVAL_SECONDS:
            return f"eval      running {batches} validation batch(es) ..."
        return None

    def took(self, seconds: float) -> None:
        self.last = seconds


def sampling_line(samples: int, tokens: int) -> str:
    return f"sampling  {samples} sample(s) of {tokens} tokens (compiling the decoding step first) ..."


def parameters_text(model) -> str:
    """'N trainable of M total parameters' (frozen layers count in the total only; an int8 base's
    quantization scales, .../kernel_scale, are no parameters)."""
    total = sum(int(math.prod(v.shape)) for v in model.weights if not v.path.endswith("/kernel_scale"))
    trainable = sum(int(math.prod(v.shape)) for v in model.trainable_weights)
    return f"{trainable:,} trainable of {total:,} total parameters"


def frozen_layers(freeze: str, n_layer: int) -> str:
    """train.freeze in words: 'embeddings, head, blocks 0-3 and 6'."""
    named, blocks = spec.frozen_layers(freeze, n_layer)
    ranges, blocks = [], sorted(blocks)
    for b in blocks:
        if ranges and ranges[-1][1] == b - 1:
            ranges[-1][1] = b
        else:
            ranges.append([b, b])
    spans = [f"{a}-{b}" if b > a else str(a) for a, b in ranges]
    parts = [name for name in ("embeddings", "head") if name in named]
    if spans:
        parts.append(("block " if len(blocks) == 1 else "blocks ") + (", ".join(spans[:-1]) + " and " + spans[-1]
                                                                       if len(spans) > 1 else spans[0]))
    return ", ".join(parts)


def flops_per_token(cfg: Config, vocab: int) -> int:
    """Training FLOPs per token of the run, the MFU numerator (model/spec.py's run_flops_per_token: what
    trains under train.freeze or with adapters)."""
    return spec.run_flops_per_token(cfg.model, vocab, cfg.data.seq_len, cfg.train.freeze, adapters_per_block(cfg))