"""The training controller: drives a built run to train.steps (Orbit's Controller role).

`train` builds the run (build.py), prints its header (header.py) and loops: a host call of up to
train.steps_per_loop steps (trainer.py), cut where an interval ends, whose one record (record.py) goes
to the train actions (actions.py): goodput, the metrics log, the progress line, then, at the step
reached, the profiler, evaluation, checkpoint and goodput's saved figures. The end of the run hands its
summary to the done line, the MFU peak, the metrics log and the samples.
"""

from __future__ import annotations

import hashlib
import time

from tpu_llm.config import Config
from tpu_llm.model import GPT
from tpu_llm.parallel.distribute import serve_if_cluster_server
from tpu_llm.platform import perf
from tpu_llm.training import actions, fault, goodput
from tpu_llm.training import progress as phases
from tpu_llm.training.build import Run, build_run
from tpu_llm.training.header import describe_run
from tpu_llm.training.metrics_log import MetricsLog
from tpu_llm.training.profiler import StepProfiler
from tpu_llm.training.record import CallRecord, Throughput, run_summary


def say_now(text: str) -> None:
    """print, flushed: progress must show up as it happens when stdout is a pipe or a file."""
    print(text, flush=True)


def train(cfg: Config, say=None, samples: bool = True, started: float | None = None, unstated: str = "",
          tasks=None) -> dict:
    """Train `cfg` to `cfg.train.steps` (resuming from its run directory); returns a summary. `started`:
    the Unix time this run's wall time counts from (goodput.py; `tpu-llm train`: its process's start);
    `unstated`: what the command left out (no --config, no --run_dir), named if the run directory refuses;
    `tasks`: train.eval_tasks checked against lm-eval (tpu_llm.eval.in_loop.check, a layer above this one;
    tpu_llm.train passes it), or None when there are none."""
    if cfg.train.eval_tasks and tasks is None:
        raise ValueError("train.eval_tasks is set: pass tasks=tpu_llm.eval.in_loop.check(cfg) (tpu_llm.train does)")
    if serve_if_cluster_server(cfg):  # a parameter-server cluster's worker or ps task: serves, never returns
        return {}
    say = say or say_now
    started = started or time.time()
    say(phases.STARTING)
    run = build_run(cfg, unstated=unstated)
    ledger = goodput.Ledger(cfg.run_dir, started, run.dist.is_chief, run.lock)
    try:
        return _train(run, say, samples, ledger, tasks)
    finally:
        ledger.close()  # (a killed process writes no end: the next one accounts for it)
        run.release()  # the run directory's lock (the process's end would release it too)


def _train(run: Run, say, samples: bool, ledger: goodput.Ledger, tasks=None) -> dict:
    """The host loop: each call's record to the reporters, to the fault guard, then to what is due."""
    cfg, t = run.cfg, run.cfg.train
    tell = say  # the lines every process prints, chief or not
    if not run.dist.is_chief:  # the chief prints and logs for the whole cluster
        say(f"worker    {run.dist.task}: training in step with the chief, which prints the progress")
        say = _quiet
    step = int(run.optimizer.iterations.numpy())
    rates, log, progress, profiler = _start(run, say, step)
    ledger.start(step)  # the start-up ends here (goodput.py)
    calls, evaluation = actions.Summary(), actions.Evaluation(run, log, progress, ledger)
    with fault.Guard(run, say, log) as guard:  # signals, non-finite steps, lost tasks, time-based saves
        host_call = HostCall(run, guard, profiler, say, rates)
        reporters = [actions.RecordGoodput(ledger), actions.CompiledLine(say), calls, actions.LogMetrics(log),
                     actions.ProgressLine(progress, t.steps)]
        due = [actions.ProfileTrace(profiler, ledger, say, t.profile_steps, cfg.run_dir),
               actions.SynchroniseAtEnd(run.trainer), evaluation, actions.EvalTasks(run, log, progress, ledger, tasks),
               actions.Checkpoint(guard, ledger, cfg.checkpoint.every_steps),
               actions.GoodputAtSave(log, ledger, cfg.checkpoint.every_steps)]
        try:
            while step < t.steps:
                record = host_call(step)
                for action in reporters:
                    action(record)
                record = guard.after_call(record)  # non-finite steps: skipped, rolled back, or the run stops
                for action in due:
                    action(record)
                step = record.step
        finally:
            profiler.close()
            progress.close()
            log.flush()
            ledger.flush()
    about = {"params": run.model.num_params(), "run_dir": cfg.run_dir, "strategy": run.dist.name,
             "replicas": run.dist.num_replicas}
    summary = run_summary(step, calls.records, evaluation.loss, rates, about, run.dist.asynchronous,
                          run.comm.metrics() if run.comm else {}, weights_fingerprint(run.model))
    for action in (actions.DoneLine(say, calls, ledger), actions.RaisePeak(run, rates.peak, say),
                   actions.WeightsLine(tell, run.dist.task), actions.LogSummary(log, calls),
                   actions.Samples(run, say, ledger, samples)):
        action(summary)
    return summary


def _start(run: Run, say, step: int) -> tuple[Throughput, MetricsLog, perf.Progress, StepProfiler]:
    """The header, and what the loop reports to: the metrics log (its entries past `step` dropped), the
    progress bar and the profiler."""
    cfg, t, d = run.cfg, run.cfg.train, run.cfg.data
    peak, peak_how = run.dist.peak_flops(
        lambda: say("starting  measuring the MFU peak (once per machine: a float32 matmul, a few seconds) ..."))
    for line in describe_run(run, step, peak, peak_how):
        say(line)
    if step >= t.steps:
        say(f"nothing to do: the run is already at step {step} of train.steps={t.steps}")
    log = MetricsLog(cfg.run_dir, enabled=run.dist.is_chief, resume_step=step,
                     device=run.dist.io_device, lock=run.lock,  # drops entries past `step`
                     extra=("tasks",) if t.eval_tasks else ())
    if log.dropped:
        say(f"metrics   dropped {log.dropped} entries logged after step {step} (metrics.jsonl and TensorBoard): "
            "the steps after the checkpoint are done again")
    progress = perf.Progress(t.steps, initial=step, label="step ", quiet=not run.dist.is_chief)
    profiler = StepProfiler(t.profile_steps, cfg.run_dir, t.steps, trace=run.dist.is_chief)  # cuts calls on every worker
    if profiler.missed(step):
        say(f"profile   train.profile_steps={t.profile_steps} was done before step {step}: no trace this time")
    rates = Throughput(t.batch_size * d.seq_len, phases.flops_per_token(cfg, run.model.vocab_size), peak)
    return rates, log, progress, profiler


class HostCall:
    """One host call of training steps from `step` to the next interval's end (an evaluation, a save, the
    profile range, or steps_per_loop x loops_per_call steps), timed; TensorFlow's errors as one line."""

    def __init__(self, run: Run, guard: fault.Guard, profiler: StepProfiler, say, rates: Throughput):
        self.run, self.guard, self.profiler, self.say, self.rates = run, guard, profiler, say, rates
        self.first = True  # no call ran steps yet: the next one traces and compiles the loop

    def end(self, step: int) -> int:
        t = self.run.cfg.train
        tasks = _next_boundary(step, t.eval_tasks_every, t.steps) if t.eval_tasks else t.steps
        return min(step + t.steps_per_loop * self.run.dist.loops_per_call(), _next_boundary(step, t.eval_every, t.steps),
                   _next_boundary(step, self.run.cfg.checkpoint.every_steps, t.steps), self.profiler.boundary(step),
                   tasks)

    def __call__(self, step: int) -> CallRecord:
        run, t = self.run, self.run.cfg.train
        end = self.end(step)
        self.profiler.before_call(step)
        if self.first:
            self.say(phases.compile_line(run.cfg.execution, run.dist.jit_compile, end - step))
        start = time.perf_counter()
        with actions.user_errors(run, step, "training"):  # waits for the steps; a signal may end the call early
            out = self.guard.call(lambda: run.trainer.run(run.train_iterator, end - step, t.steps_per_loop))
        seconds = time.perf_counter() - start
        lr = float(run.optimizer.learning_rate) if out["steps"] else float("nan")
        record = CallRecord.of(out, step, end, t.steps, seconds, self.first, lr, self.rates, run.dist.asynchronous)
        self.first = self.first and not out["steps"]
        return record


def _next_boundary(step: int, every: int, total: int) -> int:
    return min(total, (step // every + 1) * every) if every > 0 else total


def weights_fingerprint(model: GPT) -> str:
    digest = hashlib.sha256()
    for array in model.get_weights():
        digest.update(array.tobytes())
    return digest.hexdigest()[:16]


def _quiet(*_) -> None:
    pass
