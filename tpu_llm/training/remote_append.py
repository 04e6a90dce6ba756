"""Lines appended to a file on a remote filesystem (gs://) in batches, not one upload per line.

TensorFlow's GCS filesystem has no append: a file opened with mode "a" is uploaded again whole when it
is closed (its gcs_file_system.cc: "By default the entire file is reuploaded"; GCS_APPEND_MODE=compose
is off by default, for the temporary objects it can strand). A line per host call into metrics.jsonl and
goodput.jsonl would upload both files again at every host call: bytes that grow with the square of the
run's length, and an upload's latency per call. Here the lines wait in memory and go out together when
the oldest has waited `every` seconds, and whenever the owner flushes (each saved checkpoint, the end of
the run). A killed process loses at most that long of lines, all after its last checkpoint: lines a
resumed run drops (metrics) or counts as unrecorded time (goodput) anyway. Local files are appended
line by line as before (an append there is cheap).
"""

from __future__ import annotations

import time
from typing import Callable


class RemoteAppender:
    def __init__(self, path: str, check: Callable[[], None] | None = None, every: float = 60.0,
                 clock: Callable[[], float] = time.monotonic):
        self.path, self.check, self.every, self.clock = path, check, every, clock
        self.pending: list[str] = []
        self.since: float | None = None  # when the oldest pending line came
        self.uploads = 0

    def append(self, line: str) -> None:
        self.pending.append(line)
        if self.since is None:
            self.since = self.clock()
        if self.clock() - self.since >= self.every:
            self.flush()

    def flush(self) -> None:
        """Append the pending lines (one upload), unless the run lost its lock meanwhile: then they are
        dropped, since another process owns the file now (its error was reported where it was found)."""
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
