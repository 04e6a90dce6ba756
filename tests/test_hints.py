"""Hints must work (issue 50, item 8): every `tpu-llm ...` or `make ...` command line that tpu_llm/ can
print in backticks (an error's suggested fix, a help text, a printed next step) is one the test suite
checks: read from the source's string literals and f-strings (docstrings left out), its placeholders
filled in, parsed by our own command-line parser (no command runs) or checked against the Makefile.
The refusal of train.init_from naming a LoRA run is run end to end: its command as printed, then the
init_from it suggests."""

from __future__ import annotations

import ast
import contextlib
import io
import re
import shlex
from pathlib import Path

import numpy as np
import pytest
from helpers import TINY, make_problem, quiet, tiny_config, write_corpus

from tpu_llm import cli
from tpu_llm.cli.commands import BENCH_SUITES, EXPORT_FORMATS, train_flags
from tpu_llm.cli.parser import COMMANDS, parse
from tpu_llm.config import TOKENIZERS
from tpu_llm.errors import UserError

ROOT = Path(__file__).resolve().parent.parent
HOLE = "\u00abHOLE\u00bb"  # an f-string's {expression}: a value only known when the message is made
COMMAND_LINE = re.compile(r"`((?:[A-Z_]+=\S+\s+)*(?:tpu-llm|make)\s[^`]*)`")
# outside backticks: a printed next step (`next      tpu-llm generate --run_dir ...`, up to two spaces or
# the line's end) and a make command in parentheses (`(make data-upload OVERWRITE=1)`)
PRINTED = re.compile(r"(?<![\w-])(tpu-llm (?:[a-z]+ )?[a-z]+ --.*?)(?=\s{2}|$)"
                     r"|\((make [a-z][\w-]*(?:\s+[A-Z_]+=[^\s)]+)*)\)", re.M)
# values the parser takes as text but a command refuses when it runs: a hint must name a valid one
CHOICES = {("export", "format"): EXPORT_FORMATS, ("data prepare", "tokenizer"): TOKENIZERS,
           ("bench", "suite"): BENCH_SUITES, ("launch", "network"): ("auto", "open")}
# flags a command refuses to run without, though the parser lets them default (the command says why)
NEEDED = {"data prepare": ("output",), "plan": ("accelerator",)}


def _text(node: ast.AST) -> str:
    """The string, each {expression} a HOLE; but {train_flags(DIR, KIND)} (the flags that read data
    prepare's shards, in the next steps `tpu-llm import` prints) as the flags it makes."""
    if isinstance(node, ast.Constant):
        return node.value
    return "".join(v.value if isinstance(v, ast.Constant) else _made(v.value) for v in node.values)


def _made(expression: ast.AST) -> str:
    if isinstance(expression, ast.Call) and getattr(expression.func, "id", "") == "train_flags":
        kind = expression.args[1]
        return train_flags(HOLE, kind.value if isinstance(kind, ast.Constant) else "byte")
    return HOLE


def hint_lines() -> list[tuple[str, str]]:
    """(file:line, the command line) of every backticked `tpu-llm ...` / `make ...` in a string of
    tpu_llm/ that is not a docstring (adjacent literals are one string to Python's parser), and of every
    printed one (PRINTED), whitespace collapsed; plus every command's example, which `--help` and some
    errors print."""
    found = []
    for path in sorted((ROOT / "tpu_llm").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}  # docstrings
        for node in ast.walk(tree):
            if isinstance(node, (ast.JoinedStr, ast.FormattedValue)):  # their parts are not strings of their own
                skip |= {id(part) for part in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if id(node) in skip or not (isinstance(node, ast.JoinedStr) or isinstance(node, ast.Constant)
                                        and isinstance(node.value, str)):
                continue
            text = _text(node)
            lines = COMMAND_LINE.findall(text)
            lines += ["".join(m) for m in PRINTED.findall(COMMAND_LINE.sub("", text))]
            for line in lines:
                found.append((f"{path.relative_to(ROOT)}:{node.lineno}", " ".join(line.split())))
    found += [(f"tpu-llm {name} (its example)", cmd.example) for name, cmd in COMMANDS.items()]
    return found


HINTS = hint_lines()


def test_the_hints_are_found():
    """The reader finds the hints it is there for (a broken reader would pass every test below)."""
    lines = [line for _, line in HINTS]
    assert len(HINTS) > 80
    assert "tpu-llm export --run_dir «HOLE» --format run --output BASE" in lines  # check_base_run's
    assert "tpu-llm launch --workers 2 -- train --config configs/tiny.yaml" in lines
    assert "make tpu-up REPLACE=1" in lines
    assert not any("(`tpu-llm" in line for line in lines)


def _placeholder(word: str) -> bool:
    """N, DIR, BASE, PATH, ...: a value the reader fills in."""
    return word == "..." or HOLE in word and not word.replace(HOLE, "") or bool(re.fullmatch(r"[A-Z][A-Z0-9_]*", word))


def _fill(word: str, kind: type) -> str:
    if _placeholder(word):
        return {int: "1", float: "1", bool: "true"}.get(kind, "x")
    return word.replace(HOLE, "x")


def filled(words: list[str]) -> tuple[list[str], list[str]]:
    """(argv for `parse`, the problems seen) of a `tpu-llm` command line without the program name: each
    placeholder filled with a value of its flag's type, `...` (more flags) left out."""
    name = " ".join(words[:2]) if " ".join(words[:2]) in COMMANDS else words[0]
    cmd, argv, problems = COMMANDS.get(name), name.split(), []
    rest, i = words[len(name.split()):], 0
    while cmd is not None and i < len(rest):
        word, i = rest[i], i + 1
        if word == "--":  # launch: what follows is the tasks' command
            inner, more = filled(rest[i:])
            return argv + ["--"] + inner, problems + more
        if word == "...":  # more flags
            continue
        if not word.startswith("--"):  # the positional argument
            argv.append(_fill(word, cmd.flags[cmd.positional].kind if cmd.positional else str))
            choices = CHOICES.get((name, cmd.positional))
            if choices and not _placeholder(word) and argv[-1] not in choices:
                problems.append(f"{cmd.positional} {argv[-1]!r} is none of {', '.join(choices)}")
            continue
        key, given, value = word[2:].partition("=")
        flag = cmd.flags.get(key)
        kind = flag.kind if flag else str
        if not given:
            if kind is bool or i >= len(rest) or rest[i].startswith("--"):
                argv.append(word)
                continue
            value, i = rest[i], i + 1
        choices = CHOICES.get((name, key))
        if choices and not _placeholder(value) and value not in choices:
            problems.append(f"--{key}={value!r} is none of {', '.join(choices)}")
        argv.append(f"--{key}={choices[0] if choices and _placeholder(value) else _fill(value, kind)}")
    return argv, problems


TPU_LLM = [pytest.param(line, id=f"{where}: {line[:70]}") for where, line in HINTS if line.startswith("tpu-llm")]
MAKE = [pytest.param(line, id=f"{where}: {line[:70]}") for where, line in HINTS if not line.startswith("tpu-llm")]


@pytest.mark.parametrize("line", TPU_LLM)
def test_every_tpu_llm_hint_parses(line):
    """The command line parses as printed (placeholders filled), naming valid choices; a bare command
    name (`tpu-llm tokenizer train`, named rather than given as a command line) names a command."""
    words = shlex.split(line)[1:]
    argv, problems = filled(words)
    assert not problems, f"`{line}`: {'; '.join(problems)}"
    if " ".join(words) in COMMANDS:  # a command named, not a command line
        return
    name = " ".join(words[:2]) if " ".join(words[:2]) in COMMANDS else words[0]
    own = argv[:argv.index("--")] if "--" in argv else argv
    missing = [f"--{flag}" for flag in NEEDED.get(name, ()) if not any(a.startswith(f"--{flag}=") for a in own)]
    assert not missing, f"`{line}` lacks {', '.join(missing)}, without which `tpu-llm {name}` refuses to run"
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            parse(argv)
        except UserError as e:
            pytest.fail(f"`{line}` (parsed as {shlex.join(argv)}):\n    error: {e}")


@pytest.mark.parametrize("line", MAKE)
def test_every_make_hint_names_a_target_and_known_settings(line):
    words = [w for w in shlex.split(line) if w != "..." and HOLE not in w]  # `make «HOLE»`: the caller's target
    problem = make_problem(words)
    assert not problem, f"`{line}`: {problem}"


# ---- the refusal of a LoRA run as train.init_from, run as printed -----------------------------------------------


def test_the_lora_init_from_refusal_prints_a_command_that_makes_a_base(tmp_path, capsys):
    """A LoRA run is no base: train.init_from naming it is refused with a command. That command, run
    as printed (BASE a new directory), makes a run whose weights are the LoRA run's, adapters merged,
    and train.init_from=BASE then starts a LoRA run from exactly those weights (the refusal's earlier
    hint, `tpu-llm export --format hf SRC DIR` then `tpu-llm import`, did not parse, and an HF export
    of a byte-tokenizer run holds no tokenizer to import)."""
    from tpu_llm.model.adapters import merged
    from tpu_llm.training.checkpoint import load_for_generation
    from tpu_llm.training.controller import build_run, train

    small = {**TINY, "model.n_layer": 1, "model.n_embd": 16, "model.max_len": 16, "data.seq_len": 8,
             "train.batch_size": 2, "train.steps": 2, "train.eval_steps": 1, "train.lora_rank": 2,
             "train.lora_alpha": 4.0, "data.train": str(tmp_path / "corpus" / "*.txt"), "execution": "graph"}
    write_corpus(tmp_path / "corpus")
    # adapters trained on a random base (a LoRA run needs no init_from)
    train(tiny_config(tmp_path, **{**small, "run_dir": str(tmp_path / "lora run"), "train.lr": 1e-2}), say=quiet)
    flags = [f"--{key}={value}" for key, value in {**small, "run_dir": str(tmp_path / "next")}.items()]
    capsys.readouterr()
    assert cli.main(["train", "--dry_run", *flags, f"--train.init_from={tmp_path / 'lora run'}"]) == 2
    refusal = capsys.readouterr().err
    assert "is a LoRA run (train.lora_rank=2)" in refusal and "then train.init_from=BASE" in refusal, refusal
    hint, = COMMAND_LINE.findall(refusal)
    base = tmp_path / "merged base"
    argv = shlex.split(hint.replace("BASE", shlex.quote(str(base))))
    assert argv[0] == "tpu-llm" and cli.main(argv[1:]) == 0, capsys.readouterr()
    assert cli.main(argv[1:]) == 2 and "already holds a tpu-llm run" in capsys.readouterr().err  # never replaced
    assert cli.main(["train", "--dry_run", *flags, f"--train.init_from={base}"]) == 0, capsys.readouterr()

    cfg = tiny_config(tmp_path, **{**small, "run_dir": str(tmp_path / "next"), "train.init_from": str(base)})
    started = build_run(cfg).model.by_path()  # what train.init_from=BASE starts from
    trained = load_for_generation(str(tmp_path / "lora run"))[0]  # its frozen base, its adapters
    frozen, folded = trained.by_path(), merged(trained).by_path()
    adapted = [path.removesuffix("lora_a") + "kernel" for path in frozen if path.endswith("lora_a")]
    assert adapted and started.keys() == frozen.keys()
    for path in adapted:  # the adapters' work is in the new base, and the new run starts from it
        np.testing.assert_array_equal(started[path].numpy(), folded[path].numpy(), err_msg=path)
        assert not np.array_equal(folded[path].numpy(), frozen[path].numpy()), path
    for path in set(frozen) - set(adapted):  # the other weights as they were; fresh adapters
        expected = np.zeros_like(frozen[path]) if path.endswith("lora_b") else frozen[path].numpy()
        if not path.endswith("lora_a"):
            np.testing.assert_array_equal(started[path].numpy(), expected, err_msg=path)

