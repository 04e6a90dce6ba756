"""XLA_FLAGS for `tpu-llm doctor`'s hlo lines, without TensorFlow: XLA reads the variable once per process,
on first use, so the CLI sets it before a command imports TensorFlow (tools/doctor/hlo.py reads the dump)."""

from __future__ import annotations

import os
import shlex
from collections.abc import MutableMapping

PREFIX = "tpu-llm-doctor-hlo-"  # of the temporary directory the doctor's dump goes to


def ask_dump(directory: str, environ: MutableMapping[str, str] | None = None) -> str:
    """Ask XLA to dump every module it compiles as text into `directory` (appended to XLA_FLAGS); a
    --xla_dump_to already there wins. Returns the directory the modules go to. Takes effect only if
    XLA has not read XLA_FLAGS yet in this process (the doctor's hlo line says so when nothing arrives)."""
    environ = os.environ if environ is None else environ
    flags = shlex.split(environ.get("XLA_FLAGS", ""))
    given = [f.split("=", 1)[1] for f in flags if f.startswith("--xla_dump_to=")]
    if given:
        directory = given[-1]
    else:
        flags.append(f"--xla_dump_to={directory}")
    if "--xla_dump_hlo_as_text" not in flags:
        flags.append("--xla_dump_hlo_as_text")
    environ["XLA_FLAGS"] = " ".join(flags)
    return directory
