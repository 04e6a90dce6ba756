"""Fault tolerance: stopping cleanly on a signal, skipping non-finite steps, lost cluster tasks.

What a run does when something goes wrong, and the exit status it ends with:

  0    train.steps reached
  2    a user mistake (errors.UserError): one line, nothing in the run directory changed
  3    diverged: more than train.max_bad_steps steps had a non-finite loss or gradient
  4    a task of the cluster was lost (a multi-worker peer, a parameter-server ps task)
  130  stopped by SIGINT (Ctrl-C) after saving a checkpoint at the step it had reached
  143  stopped by SIGTERM (spot preemption, `gcloud ... stop`, `kill`) after saving likewise

130 and 143 are what a shell reports for a process ended by those signals (128 + the signal number),
and 143 is also the code TensorFlow's own preemption handler exits with on Google Cloud; scripts that
restart preempted jobs already look for them. Running the same command again resumes.

Signals: a signal only sets a flag. On one machine the compiled training loop reads that flag (a
variable) before every step, so a host call of `steps_per_loop` steps ends at the next step
boundary instead of finishing all of them (on a TPU a host call may last minutes, longer than a
spot VM's 30 s notice). Python runs signal handlers only between bytecodes of the main thread, which
is blocked inside the training loop; so a thread woken through `signal.set_wakeup_fd` sets the
variable the moment the signal arrives. MultiWorkerMirroredStrategy workers must all stop at the
same step (each save is collective), which is what TensorFlow's `PreemptionCheckpointHandler`
agrees on through the cluster's coordination service: it is used there, at host-call boundaries.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import tempfile
import threading
import time
import uuid

import tensorflow as tf

from tpu_llm.errors import RunStopped
from tpu_llm.platform import tf_compat
from tpu_llm.platform.run_layout import checkpoint_name, checkpoint_step

EXIT_DIVERGED = 3
EXIT_CLUSTER = 4
EXIT_SIGNAL = {signal.SIGINT: 130, signal.SIGTERM: 143}
SIGNAL_NAMES = {signal.SIGINT: "SIGINT", signal.SIGTERM: "SIGTERM"}


Stopped = RunStopped  # raised for every early stop; the CLI prints it and exits with its code


# ---- signals --------------------------------------------------------------------------------------


class StopSignals:
    """While entered: SIGTERM and SIGINT ask the run to stop at the next step boundary.

    `received` is the signal number once one arrived; `flag` (a tf.Variable, optional) is set to 1
    at that moment, for the training loop to read. A second signal of the same kind ends the process
    at once, as it would have without this handler.
    """

    def __init__(self, flag: tf.Variable | None = None, signals=(signal.SIGTERM, signal.SIGINT)):
        self.flag, self.signals = flag, tuple(signals)
        self.received: int | None = None
        self._previous: dict = {}
        self._pipe: tuple[int, int] | None = None
        self._old_wakeup = -1
        self._handled = False

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is not threading.main_thread():
            return self  # only the main thread may set handlers (e.g. a test calling train() from a thread)
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        if self.flag is not None:
            read, write = os.pipe()
            os.set_blocking(write, False)
            self._pipe = (read, write)
            self._old_wakeup = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
            threading.Thread(target=self._watch, args=(read,), name="stop-signals", daemon=True).start()
        return self

    def __exit__(self, *_) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}
        if self._pipe:
            signal.set_wakeup_fd(self._old_wakeup)
            os.close(self._pipe[1])  # the watcher's read returns b"" and it ends; it closes its end
            self._pipe = None

    def _watch(self, read: int) -> None:
        try:
            while True:
                got = os.read(read, 64)
                if not got:
                    return
                mine = [b for b in got if b in self.signals]
                if mine:
                    self.received = self.received or mine[0]
                    self.flag.assign(1)
        finally:
            os.close(read)

    def _handle(self, signum, _frame) -> None:
        if self.received == signum and self._handled:
            signal.signal(signum, signal.SIG_DFL)  # asked twice: stop now, without the checkpoint
            os.kill(os.getpid(), signum)
            return
        self._handled = True
        self.received = self.received or signum
        if self.flag is not None:
            # the handler runs on the main thread between bytecodes, possibly while it traces a
            # tf.function: without init_scope the assign would become an op of that graph
            with tf.init_scope():
                self.flag.assign(1)

    @property
    def name(self) -> str:
        return SIGNAL_NAMES.get(self.received, str(self.received))

    def stopped(self, step: int, checkpoint: str) -> Stopped:
        return Stopped(f"{self.name} at step {step}: saved {checkpoint}; run the same command to resume",
                       EXIT_SIGNAL.get(self.received, 143), label="stopped")


class MultiWorkerPreemption:
    """TensorFlow's PreemptionCheckpointHandler for MultiWorkerMirroredStrategy: a SIGTERM on any
    worker makes every worker save at the same host call (agreed through the coordination service)
    and stop. `save()` saves through the run's Checkpointer (atomic, the run's numbering); the handler
    is given a throwaway CheckpointManager only because it insists on restoring one at start-up,
    which the run has already done itself (falling back past corrupt checkpoints).
    """

    def __init__(self, strategy, save, stop):
        nowhere = os.path.join(tempfile.gettempdir(), f"tpu-llm-unused-{uuid.uuid4().hex}")  # never written
        manager = tf.train.CheckpointManager(tf.train.Checkpoint(), nowhere, max_to_keep=1)
        config = tf.distribute.experimental.TerminationConfig(exit_fn=stop, save_fn=save)
        self.handler = tf.distribute.experimental.PreemptionCheckpointHandler(
            strategy.cluster_resolver, manager, termination_config=config)
        # On Google Cloud CPU/TPU VMs TensorFlow disables the handler (it installs no SIGTERM handler)
        self.active = tf_compat.preemption_handler_active(self.handler)

    def check(self) -> None:
        """After every host call, on every worker: saves and stops (through `stop`) if any was preempted."""
        self.handler.save_checkpoint_if_preempted()  # its save_fn and exit_fn read the guard's step


def forward_sigint_as_sigterm():
    """Under MultiWorkerMirroredStrategy Ctrl-C must take the handler's path too (it watches SIGTERM)."""
    return signal.signal(signal.SIGINT, lambda *_: os.kill(os.getpid(), signal.SIGTERM))


# ---- non-finite steps -----------------------------------------------------------------------------


def apply_if(ok, apply, skip, grads) -> None:
    """In a replica context: `apply(grads)` (the optimizer update) if `ok`, else `skip()`. Used only where
    the optimizer cannot skip by itself (mixed_float16: Keras' LossScaleOptimizer, which takes its own
    cond the same way); optimizer.ReducedGradientsAdamW skips without control flow.

    Every replica must take the same branch; `ok` is computed from all-reduced values so it does. A
    `tf.cond` whose branch calls `merge_call` is not allowed in a replica context, and Keras'
    optimizer makes that call under MirroredStrategy on CPUs: there, as Keras' own
    LossScaleOptimizer does, the condition is taken in the cross-replica context, and each replica
    then applies its own copy of the gradients.
    """
    if tf_compat.supports_no_merge_call():
        tf.cond(ok, lambda: _nothing(apply(grads)), lambda: _nothing(skip()))
        return

    def cross_replica(strategy, ok, grads):
        first = strategy.experimental_local_results(ok)[0]
        tf.cond(first, lambda: _nothing(strategy.extended.call_for_each_replica(apply, args=(grads,))),
                lambda: _nothing(skip()))

    tf.distribute.get_replica_context().merge_call(cross_replica, args=(ok, grads))


def _nothing(_=None):
    return tf.constant(0)  # both branches of a cond must return the same structure


class BadSteps:
    """The divergence guard's host side: counts steps whose update was skipped (non-finite loss or
    gradient) and decides what happens next: go on, roll back to the newest checkpoint, or stop."""

    def __init__(self, max_bad_steps: int, on_bad_step: str):
        self.max, self.mode = max_bad_steps, on_bad_step
        self.total = 0

    def after_call(self, bad: int, first_bad_step: int, checkpoint: str | None, checkpoint_step: int | None):
        """Returns "ok", "skip" or "rollback"; raises Stopped (exit 3) once more than max_bad_steps."""
        if not bad:
            return "ok"
        self.total += bad
        if self.total > self.max:
            last = (f"the last good checkpoint is {checkpoint} (step {checkpoint_step})" if checkpoint
                    else "no checkpoint was saved yet")
            raise Stopped(f"step {first_bad_step}: non-finite loss or gradient on {self.total} step(s), more than "
                          f"train.max_bad_steps={self.max} (none of them was applied); {last}; lower train.lr or "
                          "raise train.warmup_steps, and check the data, then run again to resume from it",
                          EXIT_DIVERGED)
        return "rollback" if self.mode == "rollback" and checkpoint else "skip"


# ---- lost cluster tasks ---------------------------------------------------------------------------

CLUSTER_ERRORS = (tf.errors.UnavailableError, tf.errors.DeadlineExceededError, tf.errors.AbortedError,
                  tf.errors.CancelledError)


def cluster_failure(error: tf.errors.OpError, me: str, checkpoint: str | None) -> Stopped:
    """The one-line message for a training call that failed because a task of the cluster is gone."""
    text = str(error.message)
    lost = sorted({f"{job} {task}" for job, task in re.findall(r"/job:(\w+)(?:/replica:\d+)?/task:(\d+)", text)}
                  - {" ".join(me.split()[:2])})
    why = ("no worker is left to run steps" if "no worker is left" in text else
           "it stopped sending heartbeats" if "heartbeat" in text else
           "a collective waited longer than cluster.timeout_seconds" if isinstance(error, tf.errors.DeadlineExceededError)
           else "it cannot be reached" if isinstance(error, tf.errors.UnavailableError) else "its work was aborted")
    resume = f"resume from {checkpoint}" if checkpoint else "start again (no checkpoint was saved yet)"
    return Stopped(f"{me}: the cluster lost {', '.join(lost) or 'a task'} ({type(error).__name__}: {why}); "
                   f"every task stops; restart the whole job with the same command to {resume}", EXIT_CLUSTER)


def make_any_worker(strategy):
    """A function `[flags] -> [bools]`: each True if any worker of a multi-worker cluster passed True.
    Decisions taken from each worker's own clock or signals must be the same on all of them, since
    every save is collective."""
    @tf.function
    def any_worker(flags):
        votes = strategy.run(lambda: tf.cast(flags, tf.int32))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, votes, axis=None) > 0

    return lambda flags: [bool(v) for v in any_worker(tf.constant([bool(f) for f in flags]))]


# ---- the controller's side ------------------------------------------------------------------------


class Guard:
    """Everything between host calls that keeps a run safe; used by `controller.train`:

        with Guard(run, say, log) as guard:
            while step < steps:
                out = guard.call(lambda: trainer.run(...))  # a lost cluster task -> Stopped (exit 4)
                record = guard.after_call(record)           # non-finite steps: skip / roll back / stop
                guard.checkpoint(record.step, due)          # due, time-based, or on a signal (then stop)
    """

    def __init__(self, run, say, log):
        self.run, self.say, self.log = run, say, log
        c, t = run.cfg.checkpoint, run.cfg.train
        self.every_seconds = 60.0 * c.every_minutes
        self.bad = BadSteps(t.max_bad_steps, t.on_bad_step)
        self.last_save, self.saved_step = time.monotonic(), None
        self.step = int(run.optimizer.iterations.numpy())
        # The checkpoint resumed from is this step's, already saved: a stop before the first step runs
        # (a signal during compilation) must not save it again, since the input position variable holds
        # zeros until a step writes it (the position is read from the checkpoint, not restored into it).
        resumed = getattr(run, "resumed_from", None)
        if resumed and checkpoint_step(resumed) == self.step:
            self.saved_step, self.saved_path = self.step, resumed
        self.multi_worker = run.dist.name == "multi_worker"
        self.any_worker = make_any_worker(run.dist.strategy) if self.multi_worker else None
        self.preemption: MultiWorkerPreemption | None = None
        self.signals: StopSignals | None = None
        self._old_sigint = None

    def __enter__(self) -> "Guard":
        dist = self.run.dist
        if self.multi_worker:
            self.preemption = MultiWorkerPreemption(dist.strategy, self._save_for_preemption, self._stop_for_preemption)
            if self.preemption.active:
                self._old_sigint = forward_sigint_as_sigterm()
                return self
            self.preemption = None  # a platform where TF turns it off: own handler, agreed by all-reduce
        # the flag is read by the compiled loop between steps; parameter-server steps run on the
        # workers, which cannot read a variable of the chief, so the chief stops between rounds
        flag = self.run.trainer.stop_flag  # None for asynchronous and multi-worker runs
        if flag is not None:
            flag.assign(0)
        self.signals = StopSignals(flag).__enter__()
        return self

    def __exit__(self, *_) -> None:
        if self.signals:
            self.signals.__exit__()
        if self._old_sigint is not None:
            signal.signal(signal.SIGINT, self._old_sigint)

    def call(self, fn):
        """fn() (a host call of training steps, a collective save or vote); a task of the cluster lost
        during it -> Stopped."""
        try:
            return fn()
        except CLUSTER_ERRORS as e:
            if not (self.run.dist.task or self.run.dist.asynchronous):
                raise
            raise cluster_failure(e, self.run.dist.task or "the chief", self.run.checkpointer.latest) from None

    def after_call(self, record):
        """Handle the non-finite steps of a call (its record.CallRecord); returns the record, its step the
        one to continue from (the checkpoint's after a rollback)."""
        latest = self.run.checkpointer.latest
        latest_step = checkpoint_step(latest)
        action = self.bad.after_call(record.bad_steps, record.first_bad_step, latest, latest_step)
        if action == "ok":
            return record
        step = record.step
        what = (f"{record.bad_steps} step(s) up to step {step} had a non-finite loss or gradient (first: step "
                f"{record.first_bad_step}) and were not applied; {self.bad.total} of train.max_bad_steps="
                f"{self.bad.max} so far")
        if action == "rollback":  # weights and optimizer of the checkpoint; the data stream goes on
            self.run.checkpointer.restore(latest)
            if getattr(self.run, "comm", None):  # per-replica residuals / local SGD copies (comm.py)
                self.run.comm.restore(latest)
            step = int(self.run.optimizer.iterations.numpy())
            self.log.truncate(step)  # the steps after the checkpoint are done again: logged once (MetricsLog)
            what += f"; rolled back to {latest}, continuing with the batches after the bad ones"
        self.say(f"warning   {what}")
        self.log.write("bad_steps", step, {"bad_steps": record.bad_steps, "first_bad_step": record.first_bad_step,
                                           "total": self.bad.total, "action": action})
        return dataclasses.replace(record, step=step)

    def checkpoint(self, step: int, due: bool) -> None:
        """Save at `step` if `due` (every_steps, the end), if checkpoint.every_minutes passed, or if a
        signal asked to stop (then raise Stopped); the same decision on every worker."""
        self.step = step
        timed = self.every_seconds > 0 and time.monotonic() - self.last_save >= self.every_seconds
        stop = bool(self.signals and (self.signals.received or self._flag_set()))
        if self.any_worker is not None and (self.every_seconds > 0 or self.signals):  # one small all-reduce
            timed, stop = self.call(lambda: self.any_worker([timed, stop]))
        path = self.call(lambda: self.save(step)) if (due or timed or stop) else None
        if stop:
            if self.signals.received:
                raise self.signals.stopped(step, path)
            raise Stopped(f"another worker was stopped by a signal at step {step}: saved {path}; run the same "
                          "command to resume", EXIT_SIGNAL[signal.SIGTERM], label="stopped")
        if self.preemption is not None:
            self.call(self.preemption.check)  # TF's handler: saves and stops if any worker got SIGTERM

    def save(self, step: int) -> str:
        if self.saved_step != step:
            self.run.checkpointer.save(step)
            self.saved_step, self.last_save = step, time.monotonic()
            # the run's checkpoint (a multi-worker non-chief saves into a scratch directory, then deletes it)
            self.saved_path = os.path.join(self.run.checkpointer.directory, checkpoint_name(step))
        return self.saved_path

    def _flag_set(self) -> bool:
        flag = self.run.trainer.stop_flag
        return flag is not None and int(flag.numpy()) > 0

    def _save_for_preemption(self, step: int | None = None) -> None:
        self.save(self.step if step is None else step)

    def _stop_for_preemption(self) -> None:
        raise Stopped(f"SIGTERM on a worker of the cluster at step {self.step}: every worker saved "
                      f"{self.saved_path}; run the same command on every worker to resume",
                      EXIT_SIGNAL[signal.SIGTERM], label="stopped")
