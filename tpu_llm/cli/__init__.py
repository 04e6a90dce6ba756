"""Command line: `tpu-llm <command>` or `python -m tpu_llm <command>`; `tpu-llm --help` lists the commands.

Three parts: the commands (commands.py, one function each; generate's flag checks in generate_flags.py),
the parser and help (parser.py) and the filter that keeps TensorFlow's own log lines off the terminal
(quiet.py).

Arguments are parsed and checked here, in full, before a command runs and before TensorFlow is
imported: an unknown flag or command is one `error:` line naming the nearest valid one (exit 2).
Commands registered with `config=True` also take `--config FILE.yaml`, any config key as
`--section.key=value` (or `--section.key value`) and `--set section.key=value` (repeatable); their
names are checked against the config schema (tpu_llm/config/schema.py) here, their values by `load_config`.

TensorFlow's own start-up output (C++ log lines such as CUDA's `failed call to cuInit`, absl and
Python warnings) is kept off the terminal unless `--verbose` (or TPU_LLM_VERBOSE=1) is given.
A user mistake prints one line starting with "error:" and exits with status 2.

On a TPU VM `main` points TensorFlow at libtpu (the PJRT variables, pjrt.py) before a command imports it.
"""

from __future__ import annotations

import os
import sys

from tpu_llm.cli import commands  # noqa: F401  (registers every command)
from tpu_llm.cli import pjrt
from tpu_llm.cli.parser import COMMANDS, Command, Flag, help_text, overview, parse
from tpu_llm.cli.quiet import NativeLogFilter, quiet_absl, quiet_tensorflow
from tpu_llm.errors import EXIT_USER_ERROR, RunStopped, UserError
from tpu_llm.platform import native_log, tether
from tpu_llm.training import goodput

__all__ = ["COMMANDS", "Command", "Flag", "help_text", "main", "overview", "parse"]


def tensorflow_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("tensorflow") is not None


def asked_tpu(kwargs: dict) -> str:
    """The tpu= a command was given on its command line ('' if none; a config file's is read later)."""
    return str(kwargs.get("tpu") or (kwargs.get("overrides") or {}).get("tpu") or "")


def main(argv: list[str] | None = None) -> int:
    tethered = tether.as_child()  # a task of `tpu-llm launch`, a bench run; before any thread starts
    goodput.command_began()
    argv = list(sys.argv[1:] if argv is None else argv)
    own = argv[:argv.index("--")] if "--" in argv else argv
    verbose = "--verbose" in own or native_log.verbose()
    quiet_tensorflow(verbose)
    native = None if verbose else NativeLogFilter()
    if tethered:  # its output goes to the parent: stop and save unheard when the parent is gone
        tether.outlive_reader()
    try:
        cmd, kwargs = parse(argv)
        if cmd is None:  # --help was printed
            return 0
        if not tensorflow_installed():  # TensorFlow comes with an extra: one wheel per environment
            raise UserError("TensorFlow is not installed: pip install 'tpu-llm[cpu]' (CPU), 'tpu-llm[gpu]' (NVIDIA "
                            "GPUs) or 'tpu-llm[tpu]' (a Cloud TPU VM), one of them per environment")
        pjrt.set_variables(asked_tpu(kwargs))  # before any command imports TensorFlow
        if not verbose:  # absl's INFO lines (XLA's compile notice, a ps task's ConfigProto dump); ~0.1 s,
            quiet_absl()  # so only once the arguments are valid
        result = cmd.run(**kwargs)
        return result if isinstance(result, int) else 0
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except RunStopped as e:  # a signal, divergence or a lost cluster task (tpu_llm/training/fault.py)
        print(f"{e.label}: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `tpu-llm --help | head`: the reader left, which is no error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python flushes stdout at exit
        return 0
    finally:
        if native:
            native.close()
