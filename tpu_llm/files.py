"""How tpu-llm writes a small file whole: `write_atomically`, used for a run directory's marker and
config.yaml, an imported run's files and the MFU peak's cache.

A leaf (tests/test_layout.py, layer 0), standard library only at import: TensorFlow is imported only
for a path of another filesystem (gs://), which only tf.io.gfile reaches.
"""

from __future__ import annotations

import contextlib
import os
import uuid


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
