"""`tpu-llm report --run_dir R`: where a run's wall time went (training/goodput.py), and its losses.

Prints the goodput table of all the processes that trained the run (from <run_dir>/goodput.jsonl)
and the newest losses (from metrics.jsonl). Where matplotlib is importable it also draws the loss
curves and the time per category into one PNG (<run_dir>/report.png unless --plot says otherwise);
matplotlib is not a dependency of tpu-llm, and without it the report says so and prints the table only.
A local run directory is read without TensorFlow; a gs:// one through tf.io.gfile.
"""

from __future__ import annotations

import io
import os

from tpu_llm.errors import UserError
from tpu_llm.platform.run_layout import GOODPUT_FILE, METRICS_FILE, REPORT_FILE, check_run_tree
from tpu_llm.training import goodput, line_log


def losses(run_dir: str) -> dict[str, list[tuple[int, float]]]:
    """{"train": [(step, loss)], "validation": [...]} from metrics.jsonl (torn or foreign lines skipped:
    not JSON, a split that is not "train" or "validation", a step that is not a whole number, a loss
    that is not a number)."""
    out: dict[str, list[tuple[int, float]]] = {"train": [], "validation": []}
    for line in line_log.read_lines(os.path.join(run_dir, METRICS_FILE)):
        entry = line_log.parse_line(line) or {}
        split, step, loss = entry.get("split"), line_log.whole(entry.get("step")), entry.get("loss")
        if split in ("train", "validation") and step is not None and isinstance(loss, (int, float)) \
                and not isinstance(loss, bool) and not abs(loss) >= 1e300:  # (NaN passes: a diverged run's)
            out[split].append((step, float(loss)))
    return out


def plot(figures: dict, curves: dict, path: str) -> str | None:
    """Draw the loss curves and the seconds per category into the PNG `path`; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for split, points in curves.items():
        if points:
            left.plot(*zip(*points), label=split, marker="." if len(points) < 30 else None)
    left.set(xlabel="step", ylabel="loss", title="loss")
    left.legend()
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


def report(run_dir: str, plot_path: str = "", say=print) -> dict:
    """Print the goodput table and the newest losses of `run_dir`; draw the PNG where matplotlib is
    importable. Returns the goodput figures."""
    check_run_tree(run_dir)  # report.png is written with open(): a link there would write the plot into its target
    records = goodput.read_records(os.path.join(run_dir, GOODPUT_FILE))
    curves = losses(run_dir)
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
    written = plot(figures, curves, plot_path or os.path.join(run_dir, REPORT_FILE))
    say(f"plot      {written}" if written else "plot      skipped: matplotlib is not installed (pip install matplotlib)")
    return figures
