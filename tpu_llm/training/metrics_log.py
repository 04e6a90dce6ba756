"""metrics.jsonl and TensorBoard's event files in the run directory: the run's history of metrics.

The controller's train actions write each host call's record (record.CallRecord.values), the
validation losses, the goodput figures at each save and the end-of-run summary; fault.Guard writes its
bad-step events and cuts the history back on a rollback.
"""

from __future__ import annotations

import json
import os

import tensorflow as tf

from tpu_llm.platform import files
from tpu_llm.platform.run_layout import LOGS_DIR, METRICS_FILE, check_run_tree, link_error
from tpu_llm.training import run_lock
from tpu_llm.training.line_log import LineLog, logged_step, read_lines


class MetricsLog:
    """TensorBoard summaries plus metrics.jsonl in the run directory (chief only).

    Both hold one history, that of the steps the run's weights went through: a run resumed from (or
    rolled back to) step S first drops every entry past S (`truncate`), since those steps are done
    again, with other values after a rollback or a changed config. So no step is logged twice, and
    readers need no rule for duplicates. metrics.jsonl is rewritten atomically (a new file renamed
    over it); TensorBoard's event files are rewritten likewise, keeping the events up to S.
    """

    def __init__(self, run_dir: str, enabled: bool = True, resume_step: int | None = None, device: str = "",
                 lock: run_lock.Handle | None = None, extra: tuple[str, ...] = ()):
        self.run_dir = run_dir  # extra: TensorBoard folders of more splits, e.g. "tasks" (train.eval_tasks)
        self.path = os.path.join(run_dir, METRICS_FILE)
        self.logs = os.path.join(run_dir, LOGS_DIR)
        self.enabled, self.writers, self.lock = enabled, {}, lock
        self.out = LineLog(run_dir, METRICS_FILE, lock.check if lock else None)  # on gs://: in batches
        # a remote TPU: the writers (and their ops) on this process, not on the TPU host (tpu.CLIENT_IO)
        self.device = device
        if enabled:  # TF's summary writers follow links: none under logs/ (nor at metrics.jsonl) ...
            check_run_tree(run_dir)
            self.out.check_file()  # ... and metrics.jsonl a regular file of this directory only
        self.dropped = self.truncate(resume_step) if enabled and resume_step is not None else 0
        with tf.device(device or None):
            self.writers = {split: tf.summary.create_file_writer(os.path.join(run_dir, "logs", split))
                            for split in ("train", "validation", "goodput", *extra)} if enabled else {}

    def truncate(self, step: int) -> int:
        """Drop the entries logged after `step` from metrics.jsonl and the event files; returns how
        many metrics.jsonl lines went."""
        if not self.enabled:
            return 0
        self.flush()
        check_run_tree(self.run_dir)  # it rewrites metrics.jsonl and the event files
        dropped = 0
        lines = read_lines(self.path)
        kept = [line for line in lines if (logged := logged_step(line)) is not None and logged <= step]
        if len(kept) < len(lines):  # (a line torn by a kill mid-write goes too, and one from elsewhere)
            dropped = len(lines) - len(kept)
            files.write_atomically(self.path, "".join(kept))
        for path in tf.io.gfile.glob(os.path.join(self.logs, "*", "events.out.tfevents.*")):
            _truncate_events(path, step)
        return dropped

    def write(self, split: str, step: int, values: dict) -> None:
        if not self.enabled:
            return
        if self.lock is not None:  # a run that lost its lock writes no more
            self.lock.check()
        if "://" not in self.run_dir:  # the writers' files are open already: their directories, three lstat calls
            for rel in (LOGS_DIR, *(os.path.join(LOGS_DIR, s) for s in self.writers)):
                if os.path.islink(os.path.join(self.run_dir, rel)):
                    raise link_error(self.run_dir, rel)
        if split in self.writers:  # the end-of-run summary goes to metrics.jsonl only
            with tf.device(self.device or None), self.writers[split].as_default(step=step):
                for key, value in values.items():
                    tf.summary.scalar(key, value)
        self.out.append(json.dumps({"split": split, "step": step, **values}) + "\n")
        if split == "summary":  # the run's last line (on gs://, at once)
            self.out.flush()

    def flush(self) -> None:
        self.out.flush()
        with tf.device(self.device or None):
            for w in self.writers.values():
                w.flush()


def _truncate_events(path: str, step: int) -> None:
    """Rewrite a TensorBoard event file without its events after `step` (if it has any)."""
    kept, changed = [], False
    try:
        for event in tf.compat.v1.train.summary_iterator(path):
            if event.step > step:
                changed = True
            else:
                kept.append(event.SerializeToString())
    except tf.errors.DataLossError:  # a record torn by a kill mid-write
        changed = True
    if changed:
        tmp = f"{path}.tmp"
        with tf.io.TFRecordWriter(tmp) as writer:
            for record in kept:
                writer.write(record)
        tf.io.gfile.rename(tmp, path, overwrite=True)
