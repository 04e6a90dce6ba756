"""The metrics record: what one host call of training steps did, defined once.

The controller makes one `CallRecord` per host call (`CallRecord.of`, from the trainer's `CallOutput`
and the call's wall time) and hands it to every train action (actions.py). metrics.jsonl and
TensorBoard take its `values()`, the progress line its `progress_text()`, and the end of the run its
`run_summary` and `done_line`, built from the records of the calls that ran steps.
"""

from __future__ import annotations

import dataclasses

from tpu_llm.platform import perf

NAN = float("nan")


@dataclasses.dataclass(frozen=True)
class Throughput:
    """What turns a call's steps and seconds into tokens per second and MFU."""

    tokens_per_step: int  # batch_size x seq_len
    flops_per_token: float
    peak: float  # the FLOP/s MFU divides by

    def tokens_per_sec(self, steps: int, seconds: float) -> float:
        return steps * self.tokens_per_step / seconds

    def mfu(self, tokens_per_sec: float) -> float:
        return tokens_per_sec * self.flops_per_token / self.peak


@dataclasses.dataclass(frozen=True)
class CallRecord:
    """One host call: where it left the run, and its figures (NaN for a call that ran no step)."""

    step: int  # where the run is: `end`, earlier after a signal, or the checkpoint's after a rollback (fault.py)
    end: int  # the step the call was cut at (controller: the next interval's end)
    total: int  # train.steps
    steps: int  # optimizer steps it ran (0: a signal came before the first)
    seconds: float  # its wall time
    first: bool  # no earlier call of this process ran steps: this one traced and compiled the loop
    loss: float = NAN  # the mean over its applied steps
    lr: float = NAN  # the learning rate after it
    grad_norm: float = NAN  # its last step's, before clipping
    tokens_per_sec: float = NAN
    mfu: float = NAN
    staleness: float | None = None  # asynchronous training: the mean and largest number of updates other
    staleness_max: float | None = None  # workers applied between a step's read and its write
    bad_steps: int = 0  # its steps that were not applied (non-finite loss or gradient)
    first_bad_step: int = -1  # the first of them, as a step number (-1: none)

    @classmethod
    def of(cls, out: dict, step: int, end: int, total: int, seconds: float, first: bool, lr: float,
           rates: Throughput, asynchronous: bool) -> "CallRecord":
        """The record of a call that started at `step`, from `out` (trainer.CallOutput)."""
        n = out["steps"]
        where = dict(step=step + n, end=end, total=total, steps=n, seconds=seconds, first=first,
                     bad_steps=out["bad_steps"], first_bad_step=out["first_bad_step"])
        if not n:
            return cls(**where)
        tokens_per_sec = rates.tokens_per_sec(n, seconds)
        stale = dict(staleness=out["staleness"], staleness_max=out["staleness_max"]) if asynchronous else {}
        return cls(**where, loss=out["loss"], lr=lr, grad_norm=out["grad_norm"], tokens_per_sec=tokens_per_sec,
                   mfu=rates.mfu(tokens_per_sec), **stale)

    @property
    def ms_per_step(self) -> float:
        return 1000 * self.seconds / self.steps

    def due(self, every: int) -> bool:
        """Whether what runs every `every` steps and at the end (every=0: at the end only) is due: the call
        ran all the steps it was cut for (no signal, no rollback) and reached a multiple or train.steps."""
        return self.step == self.end and (self.step == self.total or bool(every and self.step % every == 0))

    @property
    def last(self) -> bool:
        """The call reached train.steps (not a signal's or a rollback's stop on the way)."""
        return self.step == self.end == self.total

    def values(self) -> dict:
        """The "train" entry of metrics.jsonl and its TensorBoard scalars, in this order."""
        values = {"loss": self.loss, "lr": self.lr, "grad_norm": self.grad_norm,
                  "tokens_per_sec": self.tokens_per_sec, "mfu": self.mfu, "ms_per_step": self.ms_per_step}
        if self.staleness is not None:
            values.update(staleness=self.staleness, staleness_max=self.staleness_max)
        return values

    def progress_text(self) -> str:
        stale = "" if self.staleness is None else f" | stale {self.staleness:.1f} (max {self.staleness_max:.0f})"
        return (f"loss {self.loss:.4f} | lr {self.lr:.2e} | gnorm {self.grad_norm:.2f} | "
                f"{perf.format_count(self.tokens_per_sec)} tok/s | MFU {100 * self.mfu:.1f}%{stale}")


def run_summary(step: int, records: list[CallRecord], val_loss: float | None, rates: Throughput, about: dict,
                asynchronous: bool, comm: dict, fingerprint: str) -> dict:
    """What `train` returns and metrics.jsonl's "summary" entry holds (without run_dir): `records` are the
    calls that ran steps, `about` the run (params, run_dir, strategy, replicas), `comm` the gradient
    exchange's figures. Throughput leaves out the first call (tracing and compiling) when there are later
    ones."""
    last = records[-1] if records else None
    summary = {"step": step, "train_loss": last.loss if last else NAN, "val_loss": val_loss,
               "tokens_per_sec": None, "ms_per_step": None, **about}
    if asynchronous:
        summary.update(staleness=last.staleness if last else None, staleness_max=last.staleness_max if last else None)
    summary.update(comm)
    if records:
        timed = records[1:] or records
        timed_steps, timed_seconds = sum(r.steps for r in timed), sum(r.seconds for r in timed)
        summary.update(tokens_per_sec=rates.tokens_per_sec(timed_steps, timed_seconds),
                       ms_per_step=1000 * timed_seconds / timed_steps)
        summary["mfu"] = rates.mfu(summary["tokens_per_sec"])
    summary["fingerprint"] = fingerprint
    return summary


def done_line(summary: dict, calls: int, goodput_text: str) -> str:
    """The line after the last step (`calls`: how many host calls ran steps, at least one)."""
    val = summary["val_loss"]
    return (f"done      step {summary['step']}: train loss {summary['train_loss']:.4f}"
            + (f", validation loss {val:.4f}" if val is not None else "")
            + f"; {perf.format_count(summary['tokens_per_sec'])} tok/s, {summary['ms_per_step']:.1f} ms/step, "
              f"MFU {100 * summary['mfu']:.1f}% "
            + ("(after the first, compiling, call)" if calls > 1 else "(one call, compilation included)")
            + f"; {goodput_text}")
