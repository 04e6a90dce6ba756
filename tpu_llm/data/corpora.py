"""Text corpora shipped inside the package, named `builtin:NAME` wherever files are given.

`data.train: builtin:tinyshakespeare` reads the copy in `tpu_llm/data/shipped/` (its origin and licence:
tpu_llm/shipped/README.md), so the benchmark config works from a clean clone, from any working
directory and offline. The file's SHA-256 is checked the first time a process resolves the name: a
run never trains on a copy that was altered or cut short, and says which file to restore.

    resolve("builtin:tinyshakespeare,more/*.txt", "data.train")  # -> "<package>/shipped/tinyshakespeare.txt,more/*.txt"
"""

from __future__ import annotations

import functools
import hashlib
import os

from tpu_llm.errors import UserError

PREFIX = "builtin:"
DIRECTORY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shipped")

# name -> (file in DIRECTORY, SHA-256 of its bytes)
CORPORA = {
    # char-rnn's data/tinyshakespeare/input.txt: 1,115,394 characters of Shakespeare (public domain)
    "tinyshakespeare": ("tinyshakespeare.txt", "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"),
}


def path(name: str, key: str = "data.train") -> str:
    """The checked file of the shipped corpus `name`; UserError if the name is unknown, or the file is
    missing or not the shipped bytes."""
    if name not in CORPORA:
        raise UserError(f"{key}: there is no shipped corpus {PREFIX}{name}; shipped: "
                        f"{', '.join(PREFIX + n for n in CORPORA)}")
    return _checked(name, key)


@functools.lru_cache(maxsize=None)
def _checked(name: str, key: str) -> str:
    filename, expected = CORPORA[name]
    file = os.path.join(DIRECTORY, filename)
    try:
        with open(file, "rb") as f:
            actual = hashlib.sha256(f.read()).hexdigest()
    except OSError as e:
        raise UserError(f"{key}: the shipped corpus {PREFIX}{name} cannot be read ({file}: {e.strerror}); "
                        "reinstall tpu-llm (pip install -e . in its checkout)") from None
    if actual != expected:
        raise UserError(f"{key}: {file} is not the shipped {PREFIX}{name} (SHA-256 {actual[:16]}..., expected "
                        f"{expected[:16]}...); restore it (git checkout -- tpu_llm/data/shipped/{filename}) or reinstall tpu-llm")
    return file


def resolve(spec: str, key: str) -> str:
    """`spec` (comma-separated files or globs) with every `builtin:NAME` replaced by its checked file."""
    if PREFIX not in spec:
        return spec
    parts = [p.strip() for p in spec.split(",")]
    return ",".join(path(p[len(PREFIX):], key) if p.startswith(PREFIX) else p for p in parts)
