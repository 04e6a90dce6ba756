"""Goodput: where a run's wall time went, across all the processes that trained it.

Each training process appends what it did to <run_dir>/goodput.jsonl as it goes (`Ledger`): one
`start` record (when the process started, when its first host call was ready, the step it resumed
at), one record per host call of training steps, per evaluation, checkpoint, profiler write and
sampling (with its seconds), and an `end` record unless it was killed. The file is only appended to,
never cut back on a resume (unlike metrics.jsonl), so a later process still sees the steps an
earlier one did past the checkpoint it resumed from: those were done twice.

`account(records)` turns the records into seconds per category (docs/goodput.md):

    productive  host calls of training steps that stayed in the run's history, less `compile`
    compile     the first host call of each process, less what its steps take in the steady state
    evaluation  validation passes (their own first-call compilation included)
    checkpoint  checkpoint saves
    profiling   writing profiler traces (train.profile_steps)
    sampling    the samples printed at the end
    startup     the first process: from its start (interpreter, imports, TensorFlow, building the run)
                to its first host call
    restart     every later process: its start-up, the steps redone because it resumed from an older
                checkpoint (or rolled back), and the time between the previous process's last record and
                this one's start (the unrecorded end of a killed process, and any time no process ran)
    other       the rest of each process's recorded time: logging, host work between calls

They add up to the wall time from the first process's start to the last record. Input waiting is not
a category: the input pipeline runs inside the compiled loop (many steps per host call), where the
host cannot tell waiting for data from computing; a profile (train.profile_steps) shows it.

This module imports no TensorFlow at load (tpu-llm report reads local records without it).
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import os
import socket
import statistics
import time

from tpu_llm.errors import UserError
from tpu_llm.platform.run_layout import GOODPUT_FILE
from tpu_llm.training.line_log import LineLog, parse_line, read_lines

CATEGORIES = ("productive", "compile", "evaluation", "checkpoint", "profiling", "sampling", "startup", "restart",
              "other")
TIMED = ("evaluation", "checkpoint", "profiling", "sampling")  # recorded as (kind, seconds) by `Ledger.timed`
MIN_SECONDS = 1e-3
_IMPORTED = time.time()


def process_started(pid: int | str = "self") -> float:
    """Unix time this process (or process `pid`) started (Linux: from /proc, so the interpreter's and imports'
    time counts; elsewhere: when this module was imported)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime, in clock ticks since boot
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return _IMPORTED


_COMMANDS: list[float] = []  # when each `tpu-llm` command of this process began (cli.main)


def command_began() -> None:
    """cli.main, at its start: a process may run several commands (a test, the docs checker, a notebook)."""
    _COMMANDS.append(time.time())


def command_started() -> float:
    """When the current command began, for its wall time: the process's start for the first command of a
    process (the interpreter's and imports' time count), the command's own start for a later one."""
    return process_started() if len(_COMMANDS) <= 1 else _COMMANDS[-1]


# ---- recording ------------------------------------------------------------------------------------


class Ledger:
    """A training process's records in <run_dir>/goodput.jsonl (the chief's; others record nothing)."""

    def __init__(self, run_dir: str, started: float, enabled: bool = True, lock=None):
        self.path = os.path.join(run_dir, GOODPUT_FILE)
        self.run_dir, self.started, self.enabled, self.lock = run_dir, started, enabled, lock
        self.out = LineLog(run_dir, GOODPUT_FILE, lock.check if lock else None)  # on gs://: in batches
        if enabled:  # a regular file of this run directory only (not a FIFO, not hard-linked elsewhere)
            self.out.check_file()
        self.records = read_records(self.path) if enabled else []
        self.open = False

    def start(self, step: int) -> None:
        """Training starts now, at `step`: the time since `started` was the process's start-up."""
        self._write({"kind": "start", "started": self.started, "t": time.time(), "step": step, "pid": os.getpid(),
                     "host": socket.gethostname()})
        self.open = True

    def steps(self, first: int, n: int, seconds: float) -> None:
        """A host call that ran steps first+1 .. first+n in `seconds`."""
        if n:
            self._write({"kind": "steps", "t": time.time(), "seconds": seconds, "from": first, "to": first + n})

    def add(self, kind: str, seconds: float, step: int) -> None:
        """`seconds` spent on `kind` (TIMED) up to `step`; under a millisecond (a checkpoint not due) is
        left to `other`, which keeps the file at about one line per host call."""
        if seconds >= MIN_SECONDS:
            self._write({"kind": kind, "t": time.time(), "seconds": seconds, "step": step})

    @contextlib.contextmanager
    def timed(self, kind: str, step: int):
        """Record the time of the block as `kind` (also when it raises: a save before a signal's stop)."""
        began = time.perf_counter()
        try:
            yield
        finally:
            self.add(kind, time.perf_counter() - began, step)

    def close(self) -> None:
        """The `end` record, on the way out of `train` whatever ended it. It never replaces the error
        that did: a run that lost its lock, or whose goodput.jsonl became a link, writes no end (and
        is accounted as if killed)."""
        if not self.open:  # it stopped before training started: nothing to end (its time is the next one's)
            return
        self.open = False
        try:
            self._write({"kind": "end", "t": time.time()})
        except (UserError, OSError):
            pass

    def figures(self) -> dict:
        return account(self.records)

    def _write(self, record: dict) -> None:
        self.records.append(record)
        if not self.enabled:
            return
        if self.lock is not None:  # a run that lost its lock writes no more
            self.lock.check()
        self.out.append(json.dumps(record) + "\n")
        if record["kind"] in ("start", "end"):  # (on gs://, at once)
            self.out.flush()

    def flush(self) -> None:
        """Write the records held back on gs:// (at each saved checkpoint and the end of training)."""
        self.out.flush()


def read_records(path: str) -> list[dict]:
    """The records of a goodput.jsonl; a line torn by a kill mid-write (or otherwise unreadable) is skipped."""
    return read_records_counted(path)[0]


def read_records_counted(path: str) -> tuple[list[dict], list[int], int]:
    """(read_records' records, the numbers of the lines skipped, the number of lines): tpu-llm report says
    how many were skipped."""
    records, skipped, lines = [], [], read_lines(path)  # a regular file of a bounded size (line_log.read_lines)
    for number, line in enumerate(lines, 1):
        record = parse_line(line)
        if record is not None and isinstance(record.get("kind"), str) and _number(record.get("t")):
            records.append(record)
        else:
            skipped.append(number)
    return records, skipped, len(lines)


def _number(value) -> bool:
    """A finite JSON number of a sane size (a record from elsewhere may hold anything)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value) and abs(value) < 1e15
    except OverflowError:  # an integer past float's range
        return False


# ---- accounting -----------------------------------------------------------------------------------


def account(records: list[dict]) -> dict:
    """Seconds per category (CATEGORIES), their `total`, the `goodput` fraction and details: `processes`,
    `redone_steps`, and restart's parts `restart_startup`, `restart_redone`, `restart_unrecorded`."""
    seconds = collections.Counter({c: 0.0 for c in CATEGORIES})
    detail = collections.Counter(restart_startup=0.0, restart_redone=0.0, restart_unrecorded=0.0, redone_steps=0)
    processes = _processes(records)
    kept: list[list[float]] = []  # [from, to, productive seconds] of the steps in the run's history, in order
    previous_end = None
    rates: list[float] = []  # steady seconds per step of the processes so far (for one-call processes)

    def redo(at: float) -> None:
        """Steps past `at` are done again: their time moves from productive to restart."""
        for interval in kept:
            first, last, secs = interval
            if last > at:
                cut = secs * (last - max(first, at)) / (last - first)
                detail["restart_redone"] += cut
                detail["redone_steps"] += last - max(first, at)
                interval[1], interval[2] = max(first, at), secs - cut
        kept[:] = [i for i in kept if i[1] > i[0]]

    for n, (start, body) in enumerate(processes):
        began = min(start["started"], start["t"])
        ready = start["t"] - began
        if n == 0:
            seconds["startup"] += ready
        else:
            detail["restart_startup"] += ready
            detail["restart_unrecorded"] += max(0.0, began - previous_end)
            redo(start.get("step", 0))
        calls = [r for r in body if r["kind"] == "steps" and r["to"] > r["from"] and r["seconds"] >= 0]
        steady = [r["seconds"] / (r["to"] - r["from"]) for r in calls[1:]]
        rate = statistics.median(steady) if steady else (statistics.median(rates) if rates else None)
        if steady:
            rates.append(statistics.median(steady))
        used = ready
        for i, r in enumerate(calls):
            secs = r["seconds"]
            if i == 0 and rate is not None:  # the first call traces and compiles the loop
                compiled = max(0.0, secs - rate * (r["to"] - r["from"]))
                seconds["compile"] += compiled
                secs -= compiled
            if kept and r["from"] < kept[-1][1]:  # a rollback: the steps after `from` are done again
                redo(r["from"])
            kept.append([r["from"], r["to"], secs])
            used += r["seconds"]
        for r in body:
            if r["kind"] in TIMED and _number(r.get("seconds")):
                seconds[r["kind"]] += r["seconds"]
                used += r["seconds"]
        end = max([start["t"], *(r["t"] for r in body)])
        seconds["other"] += (end - began) - used
        previous_end = end
    seconds["productive"] = sum(i[2] for i in kept)
    seconds["restart"] = detail["restart_startup"] + detail["restart_redone"] + detail["restart_unrecorded"]
    total = (previous_end - min(processes[0][0]["started"], processes[0][0]["t"])) if processes else 0.0
    out = {c: seconds[c] for c in CATEGORIES}
    out.update(total=total, goodput=seconds["productive"] / total if total > 0 else 0.0, processes=len(processes),
               **dict(detail))
    return out


def _processes(records: list[dict]) -> list[tuple[dict, list[dict]]]:
    """[(start record, the records after it)], one per process, in order; records before any start skipped."""
    out = []
    for r in records:
        if r["kind"] == "start" and _number(r.get("started")) and _number(r.setdefault("step", 0)):
            out.append((r, []))
        elif out and (r["kind"] != "steps" or all(_number(r.get(k)) for k in ("seconds", "from", "to"))):
            out[-1][1].append(r)
    return out


def metrics(figures: dict) -> dict:
    """The figures as metrics.jsonl / TensorBoard scalars (split "goodput")."""
    out = {"goodput": figures["goodput"], "wall_seconds": figures["total"]}
    out.update({f"{c}_seconds": figures[c] for c in CATEGORIES})
    out.update(redone_steps=figures["redone_steps"], processes=figures["processes"])
    return out


def summary(figures: dict) -> str:
    """For the `done` line: e.g. 'goodput 71% of 12.3 s (compile 15%, startup 9%, checkpoint 3%)'."""
    total = figures["total"]
    if total <= 0:
        return "goodput: nothing recorded"
    lost = sorted(((figures[c], c) for c in CATEGORIES[1:] if figures[c] / total >= 0.005), reverse=True)
    parts = ", ".join(f"{c} {100 * s / total:.0f}%" for s, c in lost)
    return f"goodput {100 * figures['goodput']:.0f}% of {total:.1f} s" + (f" ({parts})" if parts else "")


def table(figures: dict) -> list[str]:
    """The lines of `tpu-llm report`'s table."""
    total = figures["total"] or 1.0
    lines = [f"{'category':<12}{'seconds':>10}{'share':>8}"]
    for c in CATEGORIES:
        lines.append(f"{c:<12}{figures[c]:>10.1f}{100 * figures[c] / total:>7.1f}%")
        if c == "restart" and figures["restart"] > 0:
            lines += [f"  {'start-up':<10}{figures['restart_startup']:>10.1f}",
                      f"  {'redone':<10}{figures['restart_redone']:>10.1f}   ({figures['redone_steps']:.0f} steps)",
                      f"  {'unrecorded':<10}{figures['restart_unrecorded']:>10.1f}"]
    lines.append(f"{'total':<12}{figures['total']:>10.1f}{100.0:>7.1f}%   ({figures['processes']} process(es))")
    return lines
