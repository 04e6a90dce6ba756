"""How tpu-llm writes a small file whole (`write_atomically`: a run directory's marker and config.yaml, an
imported run's files, the MFU peak's cache) and opens a file it did not write itself (`open_regular`,
`read_regular`: prompt files, configs, HF directories, shards' meta.json and a run directory's own files,
which may have been copied from anywhere): regular files only, no links, bounded reads.

A leaf (tests/test_layout.py, layer 0), standard library only at import: TensorFlow is imported only
for a path of another filesystem (gs://), which only tf.io.gfile reaches.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import uuid

from tpu_llm.errors import UserError


def write_atomically(path: str, data: str | bytes) -> None:
    """Write `path` anew (`data`; text as UTF-8) through a temporary file beside it, renamed over it: a
    reader, or a kill, sees the old file or the new one, never a part of one.

    The temporary name is new each time (`<path>.tmp-<8 hex digits>`), so two writers never write into
    one temporary file. Locally it is created exclusively and with O_NOFOLLOW (a link planted at its
    name is refused, never written through), with the mode `open` gives (0666 less the umask), and
    removed again if the write fails; the rename replaces a link at `path` itself, never writing through
    it. A gs:// path goes through tf.io.gfile (its rename of one object is a copy then a delete)."""
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    data = data.encode("utf-8") if isinstance(data, str) else data
    if "://" in path:
        import tensorflow as tf

        with tf.io.gfile.GFile(tmp, "wb") as f:
            f.write(data)
        tf.io.gfile.rename(tmp, path, overwrite=True)
        return
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


# ---- reading a file from outside (or from a run directory, which may have been copied from anywhere) ----

_KINDS = ((stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "named pipe (FIFO)"), (stat.S_ISCHR, "character device"),
          (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket"))


def open_regular(path: str, what: str, flags: int = os.O_RDONLY, *, single_link: bool = False,
                 mode: int = 0o644, fix: str = "", follow_links: bool = False) -> int:
    """The descriptor of the local regular file `path` (what: how a message names it, e.g. "--prompt_file").

    Opened with O_NOFOLLOW (a link at `path` is refused, never followed) and O_NONBLOCK (a FIFO at the name
    neither blocks the open nor a read), then checked with fstat: anything but a regular file (a FIFO, a
    device such as /dev/zero, a socket, a directory) is refused in one line. With `single_link` (files a
    run appends to or rewrites in place: its lock, metrics.jsonl, goodput.jsonl) a file with another hard
    link is refused too: writing through it would change a file outside the run directory.
    `follow_links`: a file the user named outside a run directory (a --config, a --prompt_file, a file of
    a Hugging Face cache, whose snapshots link into its blobs) may be reached through a link, still a
    regular file only. `fix` replaces the messages' own advice. FileNotFoundError passes through (callers decide what a
    missing file means)."""
    try:
        nofollow = 0 if follow_links else os.O_NOFOLLOW
        fd = os.open(path, flags | os.O_NONBLOCK | nofollow | os.O_CLOEXEC, mode)
    except FileNotFoundError:
        raise
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UserError(f"{what} {path} is a symbolic link; tpu-llm never reads or writes it through a link (it "
                            "could lead anywhere): " + (fix or "replace the link with the file itself")) from None
        if e.errno == errno.ENXIO:  # a FIFO opened for writing with no reader
            raise UserError(_special(what, path, "named pipe (FIFO)", fix)) from None
        raise UserError(f"{what} {path} cannot be opened ({e.strerror or e})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UserError(_special(what, path, kind_of(info.st_mode), fix))
        if single_link and info.st_nlink > 1:
            raise UserError(f"{what} {path} has {info.st_nlink} hard links: writing to it would change the same file "
                            "elsewhere; " + (fix or "replace it with a copy of its own (cp F F.copy && mv F.copy F)"))
    except BaseException:
        os.close(fd)
        raise
    return fd


def kind_of(mode: int) -> str:
    """How a message names what `mode` (st_mode) is: "directory", "named pipe (FIFO)", ..., "regular file"."""
    if stat.S_ISREG(mode):
        return "regular file"
    return next((name for test, name in _KINDS if test(mode)), "special file")


def _special(what: str, path: str, kind: str, fix: str = "") -> str:
    why = "" if kind == "directory" else ": reading it could block or never end"
    return f"{what} {path} is a {kind}, not a regular file{why}; {fix or 'give a regular file'}"


def read_regular(path: str, max_bytes: int, what: str, fix: str = "", follow_links: bool = False) -> bytes:
    """The bytes of the regular file `path`, at most `max_bytes` of them: a larger file is refused in one
    line (`fix` says what to give instead). The bound holds whatever size the file reports: at most
    max_bytes + 1 bytes are read, so a file whose size reads as 0 (/proc, a device) cannot run on.
    Locally opened by `open_regular` (no special files; no links unless `follow_links`); a gs:// path
    through tf.io.gfile.
    FileNotFoundError passes through."""
    if "://" in path:
        import tensorflow as tf

        if not tf.io.gfile.exists(path):
            raise FileNotFoundError(path)
        with tf.io.gfile.GFile(path, "rb") as f:
            data = f.read(max_bytes + 1)
    else:
        fd = open_regular(path, what, follow_links=follow_links)
        chunks, left = [], max_bytes + 1
        try:
            while left > 0:
                chunk = os.read(fd, min(left, 1 << 24))
                if not chunk:
                    break
                chunks.append(chunk)
                left -= len(chunk)
        except OSError as e:
            raise UserError(f"{what} {path} cannot be read ({e.strerror or e})") from None
        finally:
            os.close(fd)
        data = b"".join(chunks)
    if len(data) > max_bytes:
        raise UserError(f"{what} {path} holds more than {max_bytes:,} bytes, the most it may have"
                        + (f"; {fix}" if fix else ""))
    return data
