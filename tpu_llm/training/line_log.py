"""Lines appended to a run directory's log files (metrics.jsonl, goodput.jsonl), locally or on gs://.

Locally each line is appended at once, the file opened by files.open_regular: a link planted at its name,
a FIFO (which would block the run) or a file hard-linked to another outside the run directory is refused
in one line, never appended through (docs/run-directory.md). `check_file` runs the same checks before
the run writes anything.

On gs:// lines go out in batches. TensorFlow's GCS filesystem has no append: a file opened with mode "a"
is uploaded again whole when it is closed (its gcs_file_system.cc: "By default the entire file is
reuploaded"; GCS_APPEND_MODE=compose is off by default, for the temporary objects it can strand). A line
per host call would upload both files again at every host call: bytes that grow with the square of the
run's length, and an upload's latency per call. So the lines wait in memory and go out together when
the oldest has waited `every` seconds, and whenever the owner flushes (each saved checkpoint, the end of
the run). A killed process loses at most that long of lines, all after its last checkpoint: lines a
resumed run drops (metrics) or counts as unrecorded time (goodput) anyway.
"""

from __future__ import annotations

import json
import os
import time
from typing import Callable

from tpu_llm.platform import files
from tpu_llm.platform.run_layout import GOODPUT_FILE, MAX_LINE_LOG_BYTES, METRICS_FILE, link_error


class LineLog:
    def __init__(self, run_dir: str, name: str, check: Callable[[], None] | None = None, every: float = 60.0,
                 clock: Callable[[], float] = time.monotonic):
        self.run_dir, self.name, self.path = run_dir, name, os.path.join(run_dir, name)
        self.remote = "://" in self.path
        self.check, self.every, self.clock = check, every, clock
        self.pending: list[str] = []
        self.since: float | None = None  # when the oldest pending line came
        self.uploads = 0

    def append(self, line: str) -> None:
        if not self.remote:
            self._append_local(line)
            return
        self.pending.append(line)
        if self.since is None:
            self.since = self.clock()
        if self.clock() - self.since >= self.every:
            self.flush()

    def flush(self) -> None:
        """Append the pending lines on gs:// (one upload), unless the run lost its lock meanwhile: then
        they are dropped, since another process owns the file now (its error was reported where found)."""
        if not self.pending:
            return
        lines, self.pending, self.since = "".join(self.pending), [], None
        if self.check is not None:
            try:
                self.check()
            except Exception:  # noqa: BLE001  (a lost lock: nothing more is written)
                return
        import tensorflow as tf

        with tf.io.gfile.GFile(self.path, "a") as f:
            f.write(lines)
        self.uploads += 1

    def check_file(self) -> None:
        """Refuse (UserError) a local file at the log's name that could not be appended to safely."""
        if not self.remote:
            try:
                os.close(self._open(os.O_RDONLY))
            except FileNotFoundError:
                pass

    def _open(self, flags: int) -> int:
        if os.path.islink(self.path):  # named as every other link in a run directory is
            raise link_error(self.run_dir, self.name)
        return files.open_regular(self.path, f"the run's {self.name}", flags, single_link=True)

    def _append_local(self, line: str) -> None:
        fd = self._open(os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        with os.fdopen(fd, "a", encoding="utf-8") as f:
            f.write(line)


def check_logs(run_dir: str) -> None:
    """Refuse (UserError), before a run writes anything, a metrics.jsonl or goodput.jsonl it could not
    append to safely: a FIFO or other special file, a link, a file hard-linked elsewhere."""
    for name in (METRICS_FILE, GOODPUT_FILE):
        LineLog(run_dir, name).check_file()


def read_lines(path: str) -> list[str]:
    """The lines of metrics.jsonl or goodput.jsonl (local or gs://), ends kept; [] if there is none. Read
    as a file from elsewhere (the run directory may have been copied from anywhere): a regular file of
    at most MAX_LINE_LOG_BYTES (files.read_regular), bytes that are not UTF-8 replaced; each reader
    skips the lines it cannot use (torn by a kill mid-write, or written by something else)."""
    try:
        raw = files.read_regular(path, MAX_LINE_LOG_BYTES, "the run's log",
                                 "move it away (a record only: training and generation do not need it)")
    except FileNotFoundError:
        return []
    return raw.decode("utf-8", errors="replace").splitlines(keepends=True)


def parse_line(line: str) -> dict | None:
    """A line's JSON object, or None: not JSON (torn), nested too deeply for the parser, or not an object."""
    try:
        entry = json.loads(line)
    except (ValueError, RecursionError):
        return None
    return entry if isinstance(entry, dict) else None


def whole(value) -> int | None:
    """`value` as a step when it is a finite whole JSON number (2 or 2.0; not true, NaN, Infinity, "2")."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, float) and not (value == value and abs(value) != float("inf") and value == int(value)):
        return None
    return int(value)


def logged_step(line: str) -> int | None:
    """The step of a metrics.jsonl line with a text split; None for any other line."""
    entry = parse_line(line)
    if entry is None or not isinstance(entry.get("split"), str):
        return None
    return whole(entry.get("step"))
