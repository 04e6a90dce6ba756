"""`tpu-llm report --run_dir R`: where a run's wall time went (training/goodput.py), and its losses.

Prints the goodput table of all the processes that trained the run (from <run_dir>/goodput.jsonl)
and the newest losses and lm-eval task metrics (train.eval_tasks; from metrics.jsonl). Where matplotlib
is importable it also draws the loss curves, the task metrics and the time per category into one PNG
(<run_dir>/report.png unless --plot says otherwise); matplotlib is not a dependency of tpu-llm, and
without it the report says so and prints the table only.
A local run directory is read without TensorFlow; a gs:// one through tf.io.gfile.
"""

from __future__ import annotations

import io
import os
import sys

from tpu_llm.errors import UserError
from tpu_llm.platform.run_layout import GOODPUT_FILE, METRICS_FILE, REPORT_FILE, check_run_tree
from tpu_llm.training import goodput, line_log


def losses(run_dir: str) -> dict[str, list[tuple[int, float]]]:
    """{"train": [(step, loss)], "validation": [...]} from metrics.jsonl (`read_metrics`' curves)."""
    return read_metrics(run_dir)[0]


def read_metrics(run_dir: str) -> tuple[dict[str, list[tuple[int, float]]], list[int], int,
                                        dict[str, list[tuple[int, float]]]]:
    """(the curves of `losses`, the numbers of the lines skipped, the number of lines, the task metrics). A
    line is skipped when it is torn or foreign: not a JSON object with a text split and a whole step, or a
    train or validation line whose loss is not a number. The report says how many (`say_skipped`). The task
    metrics: {"tiny_choice/acc": [(step, value)], ...} from the "tasks" lines (train.eval_tasks, lm-eval's
    metrics on the live weights), each metric's numbers in the order logged; what is no number is left out."""
    out: dict[str, list[tuple[int, float]]] = {"train": [], "validation": []}
    tasks: dict[str, list[tuple[int, float]]] = {}
    lines, skipped = line_log.read_lines(os.path.join(run_dir, METRICS_FILE)), []
    for number, line in enumerate(lines, 1):
        entry = line_log.parse_line(line) or {}
        split, step, loss = entry.get("split"), line_log.whole(entry.get("step")), entry.get("loss")
        if not isinstance(split, str) or step is None:
            skipped.append(number)
        elif split in ("train", "validation"):
            if isinstance(loss, (int, float)) and not isinstance(loss, bool) and not abs(loss) >= 1e300:
                out[split].append((step, float(loss)))  # (NaN passes: a diverged run's)
            else:
                skipped.append(number)
        elif split == "tasks":
            for key, value in entry.items():
                if key not in ("split", "step") and isinstance(value, (int, float)) and not isinstance(value, bool):
                    tasks.setdefault(key, []).append((step, float(value)))
    return out, skipped, len(lines), tasks


def say_skipped(path: str, skipped: list[int], total: int, what: str, warn) -> None:
    """Never partial data shown as whole: how many lines of `path` the report left out, and why."""
    if skipped:
        first = f"line {skipped[0]}" + (", ..." if len(skipped) > 1 else "")
        warn(f"warning   {path}: {len(skipped):,} of {total:,} lines skipped ({first}): not {what}; the report "
             "leaves them out")


def plot(figures: dict, curves: dict, path: str, tasks: dict | None = None) -> str | None:
    """Draw the loss curves, the task metrics' curves (if any) and the seconds per category into the PNG
    `path`; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 3 if tasks else 2, figsize=(16 if tasks else 11, 4))
    left, right = axes[0], axes[-1]
    for split, points in curves.items():
        if points:
            left.plot(*zip(*points), label=split, marker="." if len(points) < 30 else None)
    left.set(xlabel="step", ylabel="loss", title="loss")
    left.legend()
    for name, points in (tasks or {}).items():  # as the validation curve: a point per evaluation
        axes[1].plot(*zip(*points), label=name, marker="." if len(points) < 30 else None)
    if tasks:
        axes[1].set(xlabel="step", title="tasks (lm-eval)")
        axes[1].legend(fontsize="small")
    shown = [c for c in goodput.CATEGORIES if figures[c] > 0]
    right.barh(shown[::-1], [figures[c] for c in shown][::-1], color=["tab:green" if c == "productive" else "tab:gray"
                                                                     for c in shown][::-1])
    right.set(xlabel="seconds", title=f"goodput {100 * figures['goodput']:.0f}% of {figures['total']:.0f} s")
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    if "://" in path:
        import tensorflow as tf

        with tf.io.gfile.GFile(path, "wb") as f:
            f.write(buffer.getvalue())
    else:
        with open(path, "wb") as f:
            f.write(buffer.getvalue())
    return path


def report(run_dir: str, plot_path: str = "", say=print, warn=None) -> dict:
    """Print the goodput table and the newest losses of `run_dir`; draw the PNG where matplotlib is
    importable. Returns the goodput figures. `warn` (default: stderr) hears how many lines of each file
    were skipped, and why."""
    warn = warn or (lambda line: print(line, file=sys.stderr, flush=True))
    check_run_tree(run_dir)  # report.png is written with open(): a link there would write the plot into its target
    goodput_path = os.path.join(run_dir, GOODPUT_FILE)
    records, skipped, total = goodput.read_records_counted(goodput_path)
    say_skipped(goodput_path, skipped, total, "a JSON object with a text kind and a time", warn)
    curves, skipped, total, tasks = read_metrics(run_dir)
    say_skipped(os.path.join(run_dir, METRICS_FILE), skipped, total, "a JSON object with a text split, a whole step "
                "and (train, validation) a numeric loss", warn)
    if not records and not any(curves.values()):
        there = "" if "://" in run_dir or os.path.isdir(run_dir) else " (no such directory)"
        raise UserError(f"{run_dir!r} holds no {GOODPUT_FILE} and no {METRICS_FILE}{there}; pass the --run_dir "
                        "of a `tpu-llm train` run")
    figures = goodput.account(records)
    say(f"report    {run_dir}")
    if records:
        for line in goodput.table(figures):
            say(f"          {line}")
        say(f"goodput   {100 * figures['goodput']:.1f}% (productive step time / wall time; docs/goodput.md)")
    else:
        say(f"goodput   no {GOODPUT_FILE}: the run was trained by a tpu-llm without goodput records")
    for split, points in curves.items():
        if points:
            step, loss = points[-1]
            say(f"loss      {split}: {loss:.4f} at step {step}")
    for name, points in tasks.items():
        step, value = points[-1]
        say(f"tasks     {name}: {value:.4f} at step {step}")
    written = plot(figures, curves, plot_path or os.path.join(run_dir, REPORT_FILE), tasks)
    say(f"plot      {written}" if written else "plot      skipped: matplotlib is not installed (pip install matplotlib)")
    return figures
