"""TensorFlow profiler traces of chosen training steps (train.profile_steps=START:END).

The training loop runs many steps per host call inside one `tf.function` (trainer.py), so a trace
can only start or stop between host calls. The controller therefore cuts its calls at step START-1
and at step END (`boundary`): the trace then holds exactly the calls that run steps START..END (each
still up to train.steps_per_loop steps inside), and nothing else. Steps count from 1, as the logs
count them ("step 10" = ten optimizer steps done). The first call of a process also traces and
compiles the step, so a START of 1 profiles compilation; START >= 2 (after the first call) shows the
steady state.

The trace goes to <run_dir>/logs/train/plugins/profile/<time>/<host>.xplane.pb: where TensorBoard's
profile plugin looks (`tensorboard --logdir <run_dir>/logs`, then the PROFILE tab; docs/profiling.md).
"""

from __future__ import annotations

import glob
import os
import time

import tensorflow as tf

from tpu_llm.config import profile_range
from tpu_llm.platform.run_layout import LOGS_DIR

NEVER = float("inf")


def profile_dir(run_dir: str) -> str:
    """The log directory given to the profiler (its trace lands in plugins/profile/<time>/ below it)."""
    return os.path.join(run_dir, LOGS_DIR, "train")


def start_trace(logdir: str) -> None:
    """Start TensorFlow's profiler (host and device activity, Python tracing off: it is slow and large)."""
    options = tf.profiler.experimental.ProfilerOptions(host_tracer_level=2, python_tracer_level=0, device_tracer_level=1)
    tf.profiler.experimental.start(logdir, options=options)


def stop_trace(logdir: str, before: set[str]) -> str:
    """Stop the profiler and write its trace; returns the new trace file (or the profile directory)."""
    tf.profiler.experimental.stop()
    new = sorted(set(trace_files(logdir)) - before)
    return new[-1] if new else os.path.join(logdir, "plugins", "profile")


def trace_files(logdir: str) -> list[str]:
    """The profiler's trace files under `logdir` (one per host and capture)."""
    return tf.io.gfile.glob(os.path.join(logdir, "plugins", "profile", "*", "*.xplane.pb")) \
        if "://" in logdir else glob.glob(os.path.join(logdir, "plugins", "profile", "*", "*.xplane.pb"))


class StepProfiler:
    """Traces the host calls that run steps START..END of train.profile_steps:

        end = min(..., profiler.boundary(step))   # calls cut at START-1 and END (on every worker alike)
        profiler.before_call(step)                # starts the trace before the call running step START
        ... the host call ...
        if profiler.stops_at(step):               # step END done
            path = profiler.stop()                # writes the trace
        profiler.close()                          # at the end, whatever happened (a signal, an error)

    Only a process with `trace` (the chief) traces; the others cut their calls the same way, since the
    workers of a synchronous cluster must run the same number of steps per call.
    """

    def __init__(self, spec: str, run_dir: str, total_steps: int, trace: bool = True):
        self.range = profile_range(spec, total_steps)
        self.logdir = profile_dir(run_dir)
        self.trace = trace
        self.active = False
        self.path = ""  # the trace file written, once the trace stopped
        self._before: set[str] = set()

    def boundary(self, step: int) -> float:
        """The step where the host call starting at `step` must end (NEVER when no cut is needed)."""
        if self.range is None:
            return NEVER
        start, end = self.range
        if step < start - 1:
            return start - 1
        return end if step < end else NEVER

    def missed(self, step: int) -> bool:
        """Whether the range was done before this process started at `step` (a resume): nothing to trace."""
        return self.trace and self.range is not None and step >= self.range[1]

    def before_call(self, step: int) -> None:
        if (self.trace and self.range is not None and not self.active and not self.path
                and self.range[0] - 1 <= step < self.range[1]):
            self._before = set(trace_files(self.logdir))
            start_trace(self.logdir)
            self.active = True

    def stops_at(self, step: int) -> bool:
        return self.active and step >= self.range[1]

    def stop(self) -> str:
        """Stop the profiler and write the trace; returns the trace file."""
        self.active = False
        self.path = stop_trace(self.logdir, self._before)
        return self.path

    def close(self) -> None:
        """Stop a trace still running (the run ended early): what it caught is written."""
        if self.active:
            self.stop()


def read_trace(path: str) -> dict:
    """What a trace file holds, read with the XSpace protobuf that TensorBoard's profile plugin reads:
    {"planes": names, "events": count, "host_calls": executions of the training loop (`_train_loop`)}.
    Raises ValueError when the file is not an XSpace."""
    from google.protobuf.message import DecodeError
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    with tf.io.gfile.GFile(path, "rb") as f:
        try:
            space.ParseFromString(f.read())
        except DecodeError as e:
            raise ValueError(f"{path} is not a profiler trace (XSpace): {e}") from None
    events, calls = 0, 0
    for plane in space.planes:
        names = {key: meta.name for key, meta in plane.event_metadata.items()}
        for line in plane.lines:
            events += len(line.events)
            calls += sum(1 for e in line.events if names.get(e.metadata_id, "").startswith("EagerLocalExecute: ")
                         and "_train_loop" in names[e.metadata_id])
    return {"planes": [p.name for p in space.planes], "events": events, "host_calls": calls}


def capture(run, steps: int) -> tuple[str, float, dict]:
    """Trace one host call of `steps` training steps of a built run (tpu-llm doctor's first-contact trace);
    returns the trace file, the seconds the call and the writing took, and `read_trace` of it."""
    logdir = profile_dir(run.cfg.run_dir)
    before = set(trace_files(logdir))
    began = time.perf_counter()
    start_trace(logdir)
    try:
        run.trainer.run(run.train_iterator, steps, steps)
    finally:
        path = stop_trace(logdir, before)
    return path, time.perf_counter() - began, read_trace(path)
