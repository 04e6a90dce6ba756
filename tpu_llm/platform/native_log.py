"""Native (C++) log lines of TensorFlow and its libraries, silenced where they are made unless verbose.

Two sources write to file descriptor 2 behind Python's back:
- absl logging inside TensorFlow's framework library: XLA's "Compiled cluster using XLA!" and a
  parameter-server task's `SessionOptions:` ConfigProto dump (~20 lines per task, eager_service_impl.cc).
  TF_CPP_MIN_LOG_LEVEL governs only TSL's own logging, not absl's, so `quiet_absl` calls absl's
  `SetMinLogLevel` in that library (an exported C++ function, found by its mangled name).
- tensorflow-text's copy of SentencePiece, whose `normalizer.cc(51) LOG(INFO)` line is printed when its
  op is built; its log level is a private variable, so `dropping_native_lines` captures fd 2 around
  that call and writes back every line but the dropped ones.
With TPU_LLM_VERBOSE set (`--verbose`) both leave everything as it is.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
import re
import struct
import sys
import tempfile

VERBOSE_ENV = "TPU_LLM_VERBOSE"  # inherited by the tasks of `tpu-llm launch`
ABSL_ERROR = 2  # absl::LogSeverityAtLeast::kError: INFO and WARNING are dropped, ERROR and FATAL kept
_SET_MIN_LOG_LEVEL = re.compile(rb"_ZN4absl(?:\d+lts_\d+)?14SetMinLogLevelENS\w*?18LogSeverityAtLeastE")
# SentencePiece's own log format: `normalizer.cc(51) LOG(INFO) ...` (INFO only: warnings and errors stay)
SENTENCEPIECE_INFO = re.compile(rb"\w+\.cc\(\d+\) LOG\(INFO\) ")


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


def quiet_library() -> None:
    """The Python API's share of the command line's quiet (cli/quiet.py), before TensorFlow loads: its C++
    log lines below FATAL off (TF_CPP_MIN_LOG_LEVEL=3, unless the user set it), and absl's below ERROR.
    `tpu_llm.load` printed TensorFlow's start-up lines (cuda stubs, cpu_feature_guard), which `tpu-llm
    generate` hides. TPU_LLM_VERBOSE=1 keeps everything, as --verbose does. No file descriptor is taken
    over (the command line's NativeLogFilter): a library leaves the process's stderr alone."""
    if verbose():
        return
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # read once, when TensorFlow's library loads
    quiet_absl()


def quiet_absl(level: int = ABSL_ERROR) -> bool:
    """Set absl's minimum log level in TensorFlow's framework library (before or after TensorFlow is
    imported: it is one global of that library). Returns whether it could; False leaves logging as is."""
    spec = importlib.util.find_spec("tensorflow")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(folder, "libtensorflow_framework.so.2")
        symbol = _dynamic_symbol(path, _SET_MIN_LOG_LEVEL)
        if symbol:
            try:
                getattr(ctypes.CDLL(path), symbol)(ctypes.c_int(level))
                return True
            except (OSError, AttributeError):
                return False
    return False


def _dynamic_symbol(path: str, pattern: re.Pattern) -> str | None:
    """The first name in a 64-bit little-endian ELF library's dynamic string table that `pattern`
    matches (reads only that table, ~13 MB for TensorFlow's, not the 250 MB library)."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
            if head[:6] != b"\x7fELF\x02\x01":
                return None
            (shoff,) = struct.unpack_from("<Q", head, 0x28)
            shentsize, shnum = struct.unpack_from("<HH", head, 0x3A)
            f.seek(shoff)
            table = f.read(shentsize * shnum)
            for i in range(shnum):
                kind, link = struct.unpack_from("<I", table, i * shentsize + 4)[0], \
                    struct.unpack_from("<I", table, i * shentsize + 40)[0]
                if kind == 11:  # SHT_DYNSYM: sh_link is its string table
                    offset, size = struct.unpack_from("<QQ", table, link * shentsize + 24)
                    f.seek(offset)
                    found = pattern.search(f.read(size))
                    return found.group(0).decode() if found else None
    except (OSError, struct.error):
        return None
    return None


@contextlib.contextmanager
def dropping_native_lines(pattern: re.Pattern):
    """Run the body with fd 2 captured in a temporary file, then write back every line that `pattern`
    does not match (errors and anything else stay, in order). Nothing is dropped when verbose."""
    if verbose():
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            with contextlib.suppress(Exception):
                sys.stderr.flush()  # Python's writes to fd 2 meanwhile are written back too
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            kept = b"".join(line for line in capture.read().splitlines(keepends=True) if not pattern.match(line))
            while kept:
                kept = kept[os.write(2, kept):]
