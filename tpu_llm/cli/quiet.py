"""Keeping TensorFlow's own output off the terminal unless `--verbose` (or TPU_LLM_VERBOSE=1): its C++
log lines, absl and Python warnings. Only tpu-llm's own lines and errors reach the user."""

from __future__ import annotations

import io
import os
import re
import sys
import threading

from tpu_llm.platform.native_log import VERBOSE_ENV, quiet_absl  # noqa: F401  (quiet_absl: for main, after parsing)


def quiet_tensorflow(verbose: bool) -> None:
    """Keep TensorFlow's start-up output off the terminal (before it is imported): C++ log lines below
    FATAL (level 2 still lets CUDA's `failed call to cuInit` ERROR line through on a machine without a
    GPU), its Python and absl loggers below ERROR, and Python warnings raised inside TF and Keras."""
    if verbose:
        os.environ[VERBOSE_ENV] = "1"  # the tasks of `tpu-llm launch` inherit it
        return
    import logging
    import warnings

    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    for name in ("tensorflow", "absl", "keras"):
        logging.getLogger(name).setLevel(logging.ERROR)
    for module in ("tensorflow", "keras", "tf_keras", "absl", "google.protobuf", "h5py", "tensorflow_text"):
        warnings.filterwarnings("ignore", module=module)


# A C++ log line of TensorFlow/XLA below FATAL: absl's format (`I0000 00:00:1796.5  123 file.cc:196] ...`,
# which TF_CPP_MIN_LOG_LEVEL does not govern, e.g. XLA's "Compiled cluster using XLA!"), TSL's format
# (`2026-12-03 09:38:53.252688: E external/.../cuda_platform.cc:51] ...`) and absl's notice before them.
_NATIVE_LOG = re.compile(rb"[IWE]\d{4} \d\d:\d\d:\d+\.\d+ +\d+ [\w./-]+:\d+\] |"
                         rb"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: [IWE] [\w./-]+:\d+\] |"
                         rb"WARNING: All log messages before absl::InitializeLog\(\) is called")


class NativeLogFilter:
    """Drops TensorFlow's C++ log lines (`_NATIVE_LOG`) from file descriptor 2, where C++ writes them,
    and passes everything else on. Python's own `sys.stderr` is pointed straight at the terminal
    (the progress bar still sees a tty); only what reaches fd 2 from native code goes through a pipe
    read by a thread. Installed only when sys.stderr is the process's own (not under pytest's capture
    or in a notebook)."""

    def __init__(self):
        self.active = sys.stderr is sys.__stderr__ and _fileno(sys.stderr) == 2
        if not self.active:
            return
        sys.stderr.flush()
        self.terminal = os.dup(2)
        self.python_stderr = sys.stderr
        sys.stderr = io.TextIOWrapper(io.FileIO(os.dup(self.terminal), "w"), encoding=sys.stderr.encoding,
                                      errors="backslashreplace", line_buffering=True, write_through=True)
        read, write = os.pipe()
        os.dup2(write, 2)
        os.close(write)
        self.thread = threading.Thread(target=self._pump, args=(read,), daemon=True)
        self.thread.start()

    def _pump(self, read: int) -> None:
        pending = b""
        while chunk := os.read(read, 1 << 16):
            *lines, pending = (pending + chunk).split(b"\n")
            kept = b"".join(line + b"\n" for line in lines if not _NATIVE_LOG.match(line))
            if pending and not _NATIVE_LOG.match(pending + b" " * 80):  # not the start of a log line
                kept, pending = kept + pending, b""
            self._write(kept)
        os.close(read)
        self._write(pending)

    def _write(self, data: bytes) -> None:
        try:
            while data:
                data = data[os.write(self.terminal, data):]
        except OSError:
            pass  # the terminal is gone: go on draining the pipe, so that no writer ever blocks on it

    def close(self) -> None:
        if not self.active:
            return
        sys.stderr.flush()
        os.dup2(self.terminal, 2)  # closes this process's end of the pipe: the thread sees its end
        self.thread.join(timeout=2)  # (a child process still holding the pipe must not hold us up)
        sys.stderr = self.python_stderr


def _fileno(stream) -> int:
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):
        return -1
