"""The train actions: what follows each host call, as small callables that take the call's record
(record.CallRecord), like the `train_actions` of TF Model Garden's Orbit Controller.

controller._train runs a host call of up to train.steps_per_loop steps, cut where an interval ends
(evaluation, checkpoint, profile range), and hands its record

    to the call's reporters    RecordGoodput, CompiledLine, Summary, LogMetrics, ProgressLine
    to fault.Guard.after_call  non-finite steps: skipped, rolled back (the record's step moves back) or stop
    to what is due at its step ProfileTrace, SynchroniseAtEnd, Evaluation, EvalTasks, Checkpoint, GoodputAtSave

and, once the steps are done, the run's summary (record.run_summary) to the end actions: DoneLine,
RaisePeak, WeightsLine, LogSummary, Samples. Each writes to one place, in the order the lists give:
stdout (`say`), the progress stream, metrics.jsonl and TensorBoard (MetricsLog), goodput.jsonl (Ledger).
"""

from __future__ import annotations

import contextlib
import time

import tensorflow as tf

from tpu_llm.data import input_checks, sources
from tpu_llm.errors import UserError
from tpu_llm.platform import perf
from tpu_llm.training import goodput
from tpu_llm.training import progress as phases
from tpu_llm.training.build import Run
from tpu_llm.training.metrics_log import MetricsLog
from tpu_llm.training.profiler import StepProfiler
from tpu_llm.training.record import CallRecord, done_line
from tpu_llm.training.samples import local_copy, print_samples

# ---- TensorFlow's errors of a host call, as one line ---------------------------------------------


@contextlib.contextmanager
def user_errors(run: Run, step: int, split: str):
    """A host call of training steps (`split` "training") or of validation batches ("validation") whose
    data ran out, whose memory did not suffice, whose shard is damaged or whose batch failed one of the input
    pipeline's own checks (a token id past the vocabulary: input_checks.bounded_ids): one line, nothing saved."""
    source = run.sources[0 if split == "training" else 1]
    try:
        yield
    except tf.errors.OutOfRangeError:
        raise UserError(f"{split} data ({source.description}) holds less than one batch of "
                        f"{run.cfg.train.batch_size} x {run.cfg.data.seq_len + 1} tokens; add data or lower "
                        "train.batch_size / data.seq_len") from None
    except tf.errors.ResourceExhaustedError as e:  # nothing of this call is saved
        raise out_of_memory(e, run, step, "training" if split == "training" else "evaluating") from None
    except tf.errors.DataLossError as e:  # a damaged shard: one line naming it (nothing saved)
        raise sources.corrupt_record(e, source, split, True, run.checkpointer.latest) from None
    except tf.errors.InvalidArgumentError as e:
        line = input_checks.input_error(e, split, source, run.cfg.model.vocab_size)
        if line is None:
            raise
        raise line from None


def out_of_memory(error: tf.errors.ResourceExhaustedError, run: Run, step: int, doing: str = "training") -> UserError:
    """The one line for a step that did not fit in device memory (XLA's own error is a page of HLO).

    Raised straight from the failed call: the guard saves nothing on the way out, so the newest
    checkpoint stays the last one written before it, and no half-updated state is saved."""
    cfg = run.cfg
    first = (str(getattr(error, "message", "") or error).strip().splitlines() or [""])[0][:160]
    remat = "" if cfg.parallel.remat else ", set parallel.remat=true (recomputes activations)"
    latest = run.checkpointer.latest
    kept = f"the newest checkpoint, {latest}, is unchanged" if latest else "no checkpoint was saved yet"
    return UserError(f"out of device memory {doing} at step {step} ({type(error).__name__}: {first}); lower "
                     f"train.batch_size={cfg.train.batch_size} (or raise train.grad_accum={cfg.train.grad_accum}) or "
                     f"data.seq_len={cfg.data.seq_len}{remat}, and check the fit first with `tpu-llm plan "
                     f"--accelerator ...`; {kept}")


# ---- the call's reporters -------------------------------------------------------------------------


class RecordGoodput:
    """goodput.jsonl: the call's steps and seconds."""

    def __init__(self, ledger: goodput.Ledger):
        self.ledger = ledger

    def __call__(self, record: CallRecord) -> None:
        self.ledger.steps(record.step - record.steps, record.steps, record.seconds)


class CompiledLine:
    """After the first call that ran steps: how long tracing and compiling took (progress.compiled_line)."""

    def __init__(self, say):
        self.say = say

    def __call__(self, record: CallRecord) -> None:
        if record.first and record.steps:
            self.say(phases.compiled_line(record.seconds, record.steps))


class Summary:
    """The records of the calls that ran steps: the end-of-run summary is made of them."""

    def __init__(self):
        self.records: list[CallRecord] = []

    def __call__(self, record: CallRecord) -> None:
        if record.steps:
            self.records.append(record)


class LogMetrics:
    """metrics.jsonl and TensorBoard: the call's "train" entry at the step it reached."""

    def __init__(self, log: MetricsLog):
        self.log = log

    def __call__(self, record: CallRecord) -> None:
        if record.steps:
            self.log.write("train", record.step, record.values())


class ProgressLine:
    """The progress bar's line (stderr), with the time left from the calls after the compiling one."""

    def __init__(self, progress: perf.Progress, total: int):
        self.progress, self.total, self.eta = progress, total, phases.Eta()

    def __call__(self, record: CallRecord) -> None:
        if record.steps:
            self.eta.record(record.steps, record.seconds)
            self.progress.update(record.step, record.progress_text(), eta=self.eta.seconds_left(self.total - record.step))


# ---- what is due at the step reached --------------------------------------------------------------


class ProfileTrace:
    """train.profile_steps: the trace written once its last step is done (profiler.StepProfiler)."""

    def __init__(self, profiler: StepProfiler, ledger: goodput.Ledger, say, spec: str, run_dir: str):
        self.profiler, self.ledger, self.say, self.spec, self.run_dir = profiler, ledger, say, spec, run_dir

    def __call__(self, record: CallRecord) -> None:
        if self.profiler.stops_at(record.step):
            with self.ledger.timed("profiling", record.step):
                trace = self.profiler.stop()
            self.say(f"profile   steps {self.spec} traced: {trace} (tensorboard --logdir {self.run_dir}/logs)")


class SynchroniseAtEnd:
    """Local SGD: the final model (evaluated, saved, sampled) is the synchronised one, not replica 0's."""

    def __init__(self, trainer):
        self.trainer = trainer

    def __call__(self, record: CallRecord) -> None:
        if record.last:
            self.trainer.synchronise()


class Evaluation:
    """The validation loss every train.eval_every steps and at the end: metrics.jsonl, the progress
    stream (with a phase line before the first evaluation, which compiles, and after slow ones)."""

    def __init__(self, run: Run, log: MetricsLog, progress: perf.Progress, ledger: goodput.Ledger):
        self.run, self.log, self.progress, self.ledger = run, log, progress, ledger
        self.phase = phases.EvalPhase()
        self.loss: float | None = None  # the newest validation loss (the summary's)

    def __call__(self, record: CallRecord) -> None:
        t, step = self.run.cfg.train, record.step
        if not record.due(t.eval_every):
            return
        if line := self.phase.line(t.eval_steps):
            self.progress.message(line)
        began = time.perf_counter()
        with user_errors(self.run, step, "validation"), self.ledger.timed("evaluation", step):
            self.loss = self.run.trainer.evaluate(iter(self.run.val_dataset), t.eval_steps)
        self.phase.took(time.perf_counter() - began)
        self.log.write("validation", step, {"loss": self.loss})
        self.progress.message(f"eval      step {step}: validation loss {self.loss:.4f}")


class EvalTasks:
    """train.eval_tasks: lm-evaluation-harness tasks every train.eval_tasks_every steps and at the end, on the
    live weights (no checkpoint read back): metrics.jsonl's "tasks" split, a progress line, goodput's
    evaluation time. `tasks` is tpu_llm.eval.in_loop.Tasks (eval sits above training: the caller hands it
    in). Only the chief evaluates and logs, from its host copy of the weights (as Samples reads them); the
    other workers go on to the next host call, whose collectives wait for the chief."""

    def __init__(self, run: Run, log: MetricsLog, progress: perf.Progress, ledger: goodput.Ledger, tasks):
        self.run, self.log, self.progress, self.ledger = run, log, progress, ledger
        self.tasks = tasks if run.dist.is_chief else None
        self.evaluate = None  # built at the first evaluation, then kept: XLA compiles its scoring once

    def __call__(self, record: CallRecord) -> None:
        t = self.run.cfg.train
        if self.tasks is None or not record.due(t.eval_tasks_every):
            return
        if self.evaluate is None:
            self.progress.message(f"tasks     step {record.step}: {t.eval_tasks} (lm-eval, the first evaluation "
                                  "compiles its scoring) ...")
            self.evaluate = self.tasks.on_weights(self.run.cfg, self.run.tokenizer, self.progress.message)
        with self.ledger.timed("evaluation", record.step):
            values = self.evaluate(self.run.model)
        self.log.write("tasks", record.step, values)
        self.progress.message(self.tasks.line(record.step, values))


class Checkpoint:
    """A save every checkpoint.every_steps steps and at the end; fault.Guard adds the time-based ones and
    the save before a signal's stop."""

    def __init__(self, guard, ledger: goodput.Ledger, every_steps: int):
        self.guard, self.ledger, self.every_steps = guard, ledger, every_steps

    def __call__(self, record: CallRecord) -> None:
        with self.ledger.timed("checkpoint", record.step):
            self.guard.checkpoint(record.step, due=record.due(self.every_steps))


class GoodputAtSave:
    """With each save that was due: the goodput so far (metrics.jsonl and TensorBoard), and on gs:// the
    lines held back since the last save go out."""

    def __init__(self, log: MetricsLog, ledger: goodput.Ledger, every_steps: int):
        self.log, self.ledger, self.every_steps = log, ledger, every_steps

    def __call__(self, record: CallRecord) -> None:
        if record.due(self.every_steps):
            self.log.write("goodput", record.step, goodput.metrics(self.ledger.figures()))
            self.log.flush()
            self.ledger.flush()


# ---- the end of the run: the summary (record.run_summary) -----------------------------------------


class DoneLine:
    """The line after the last step: losses, throughput without the compiling call, goodput."""

    def __init__(self, say, calls: Summary, ledger: goodput.Ledger):
        self.say, self.calls, self.ledger = say, calls, ledger

    def __call__(self, summary: dict) -> None:
        if self.calls.records:
            self.say(done_line(summary, len(self.calls.records), goodput.summary(self.ledger.figures())))


class RaisePeak:
    """More than 100% MFU: the peak was measured low (a busy machine); the machine's cache takes this one."""

    def __init__(self, run: Run, peak: float, say):
        self.run, self.peak, self.say = run, peak, say

    def __call__(self, summary: dict) -> None:
        mfu = summary.get("mfu", 0.0)
        if mfu > 1 and self.run.dist.is_chief:
            old = self.run.dist.raise_peak(mfu * self.peak)
            if old:
                self.say(f"peak      this run reached {perf.format_count(mfu * self.peak)}FLOP/s, above the MFU peak "
                         f"of {perf.format_count(old)}FLOP/s measured on a busy machine: the cache holds the higher "
                         "one now")


class WeightsLine:
    """A cluster task's weights fingerprint (every process prints it: equal on the workers of a
    synchronous cluster, a check that they trained the same model)."""

    def __init__(self, tell, task: str):
        self.tell, self.task = tell, task

    def __call__(self, summary: dict) -> None:
        if self.task:
            self.tell(f"weights   {self.task} at step {summary['step']}: fingerprint {summary['fingerprint']}")


class LogSummary:
    """metrics.jsonl: the run's last entry, "summary" (without the run directory)."""

    def __init__(self, log: MetricsLog, calls: Summary):
        self.log, self.calls = log, calls

    def __call__(self, summary: dict) -> None:
        if self.calls.records:
            self.log.write("summary", summary["step"], {k: v for k, v in summary.items() if k != "run_dir"})


class Samples:
    """sample.num_samples texts of sample.max_new_tokens tokens (the chief's), from a host copy of the model."""

    def __init__(self, run: Run, say, ledger: goodput.Ledger, enabled: bool):
        self.run, self.say, self.ledger, self.enabled = run, say, ledger, enabled

    def __call__(self, summary: dict) -> None:
        cfg = self.run.cfg
        if self.enabled and self.run.dist.is_chief and cfg.sample.num_samples and cfg.sample.max_new_tokens:
            self.say(phases.sampling_line(cfg.sample.num_samples, cfg.sample.max_new_tokens))
            with self.ledger.timed("sampling", summary["step"]):
                print_samples(local_copy(self.run.model, cfg), self.run.tokenizer, cfg, self.say)
