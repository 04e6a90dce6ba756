"""Throughput accounting: peak FLOP/s for MFU, and the progress line.

MFU = achieved model FLOP/s / peak FLOP/s. On TPU the peak comes from the published per-chip bf16
figures below; on CPU and GPU it is measured once at start-up with a large float32 matmul, so the
MFU printed on a laptop is against what that laptop can actually do.
"""

from __future__ import annotations

import io
import sys
import time

import tensorflow as tf

# bf16 peak TFLOP/s per chip (Cloud TPU documentation); keys match device_kind prefixes
TPU_PEAK_TFLOPS = {"v4": 275.0, "v5 lite": 197.0, "v5e": 197.0, "v5p": 459.0, "v6 lite": 918.0,
                   "v6e": 918.0}


def tpu_peak_flops(device_kind: str) -> float | None:
    kind = device_kind.lower().replace("tpu", "").strip()
    for prefix, tflops in sorted(TPU_PEAK_TFLOPS.items(), key=lambda kv: -len(kv[0])):
        if kind.startswith(prefix):
            return tflops * 1e12
    return None


def measured_matmul_flops(device: str = "/CPU:0", n: int = 2048, repeats: int = 4) -> float:
    """Best-of-`repeats` float32 n x n matmul throughput on `device`, in FLOP/s."""
    with tf.device(device):
        a = tf.random.normal([n, n])
        b = tf.random.normal([n, n])
        matmul = tf.function(lambda: tf.reduce_sum(tf.matmul(a, b)))
        matmul().numpy()  # warm up: trace, allocate
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            matmul().numpy()
            best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def format_count(x: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.0f}"


def format_seconds(s: float) -> str:
    s = int(max(s, 0))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class Progress:
    """A one-line progress bar on a terminal; plain log lines (one per update) otherwise."""

    def __init__(self, total: int, initial: int = 0, label: str = "", stream=None, width: int = 20,
                 quiet: bool = False):
        self.total, self.initial, self.label, self.width = total, initial, label, width
        self.stream = stream or (io.StringIO() if quiet else sys.stderr)
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.start = time.perf_counter()

    def update(self, done: int, text: str, eta: float | None | str = "rate") -> None:
        """`eta`: seconds left as the caller measured them, None for not known yet (shown `--`), or by
        default from the mean rate since the start."""
        frac = done / max(self.total, 1)
        if eta == "rate":
            elapsed = time.perf_counter() - self.start
            rate = (done - self.initial) / elapsed if elapsed > 0 else 0
            eta = (self.total - done) / rate if rate > 0 else 0
        bar = "#" * int(frac * self.width) + "-" * (self.width - int(frac * self.width))
        left = "--" if eta is None else format_seconds(eta)
        line = f"{self.label}{done:>{len(str(self.total))}}/{self.total} [{bar}] {text} | eta {left}"
        if self.tty:
            self.stream.write("\r\033[K" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def message(self, text: str) -> None:
        """A line that stays above the bar."""
        self.stream.write(("\r\033[K" if self.tty else "") + text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
