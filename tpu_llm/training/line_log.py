"""Lines appended to a run directory's log files (metrics.jsonl, goodput.jsonl), locally or on gs://.

Locally each line is appended at once, the file opened with O_NOFOLLOW: a link planted at its name is
refused in one line, never appended through (docs/run-directory.md).

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

import errno
import os
import time
from typing import Callable

from tpu_llm.run_layout import link_error


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

    def _append_local(self, line: str) -> None:
        try:  # O_NOFOLLOW: a link at the file's name is refused, whenever it appeared
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise link_error(self.run_dir, self.name) from None
            raise
        with os.fdopen(fd, "a", encoding="utf-8") as f:
            f.write(line)
