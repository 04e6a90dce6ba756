"""Executable docs: run the shell command blocks of README.md and docs/*.md, in document order, in a
scratch copy of the repository, and fail on a non-zero exit or on output that no longer matches what
the page shows. `make docs-check`; docs/development.md ("Docs that run") describes the markers.

A block (``` fence without a language, or bash/sh/console) is a command block when its lines start
with `$ ` (each command followed by its expected output) or its first line starts with a known
command (tpu-llm, make, python, ...): one command per line, `# comments` and `\\` continuations
allowed. An HTML comment on the line(s) before a fence changes how it is checked:

  <!-- docs-check: skip REASON -->    not run here (Cloud, TPU, downloads, long runs); `tpu-llm`
                                       commands are still parsed (the CLI must refuse nothing)
  <!-- docs-check: dry-run -->        `tpu-llm train` commands run with --dry_run (no model, no compile)
  <!-- docs-check: output -->         this block is the expected output of the previous block's last command
  <!-- docs-check: machine-dependent lines=step,done -->   numbers not compared; only lines starting
                                       with these words compared (an output block; `_` stands for a
                                       space: lines=[worker_0] compares worker 0's lines only)
  <!-- docs-check: tolerance 5% -->   numbers compared within 5% (default 2%)
  <!-- docs-check: skip ...; `make train` runs `tpu-llm train --config configs/tiny.yaml` -->
                                       that command instead of `make train` (the rest of the block skipped)
  <!-- docs-check: exit 2 -->         the commands are expected to exit with this status (a refusal)
  <!-- docs-check: quick --train.steps=20 -->   flags added to each `tpu-llm train` (also after
                                       `launch ... --`): a long training cut short, its later commands run
  <!-- docs-check: file my_run.yaml --> the block (any language) is written to that file, as the page
                                       tells the reader to
  <!-- docs-check: skip ...; `huggingface-cli download gpt2 --local-dir gpt2` runs `python scripts/tiny_hf.py gpt2 gpt2` -->
                                       a stand-in for a command that cannot run here (any program)
Markers combine: `<!-- docs-check: dry-run exit 2 -->`.

The scratch copy has a `corpus/` folder of text (CORPUS: Python standard-library modules as .txt files),
standing in for the reader's own text that the pages call `corpus/*.txt`.

Expected lines are matched in order against the command's stdout+stderr lines that start with the
same first word; lines of `...` and lines whose first word the command never printed at all are
failures too (a section that disappeared). `tpu-llm` commands run in this process (cli.main), so
TensorFlow starts once for the whole check; other commands run in bash.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMAND_WORDS = ("tpu-llm", "make", "python", "python3", ".venv/bin/tpu-llm", "pip", "cd", "ls", "cat",
                 "huggingface-cli", "hf", "gcloud", "terraform", "tensorboard", "time", "export", "DRY_RUN=1", "rm", "mkdir")
MARKER = re.compile(r"<!--\s*docs-check:\s*(.*?)\s*-->")
# numbers that measure this machine, never compared: throughput, MFU, time left, step time, peak FLOP/s
MACHINE = re.compile(r"[\d.]+[kMG]? tok/s|MFU [\d.]+%|eta \S+|[\d.]+ ms/step|[\d.]+[kMGT]?FLOP/s|[\d.]+ s\b"
                     r"|goodput \d+% of [^;]*|fingerprint [0-9a-f]{16}")  # goodput: its shares of wall time vary by machine too
PLACEHOLDER = re.compile(r"<[a-z][a-z ]*>")  # in an expected line: any one word (a time, a host name)
NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?")  # (a sentence's full stop is not a decimal point)


@dataclasses.dataclass
class Step:
    page: str
    line: int
    command: str
    expected: list[str]
    marks: str  # the block's marker text ('' for none)
    output_marks: str = ""
    contents: str | None = None  # a `file` block's text


@dataclasses.dataclass
class Failure:
    step: Step
    what: str

    def __str__(self):
        return f"{self.step.page}:{self.step.line}: $ {self.step.command}\n    {self.what}"


def blocks(text: str):
    """(first line number, language, marker text, lines) of each fenced block."""
    lines = text.splitlines()
    i, marks = 0, ""
    while i < len(lines):
        found = MARKER.search(lines[i])
        if found:
            marks = found.group(1)
        elif lines[i].startswith("```"):
            lang, start, body = lines[i][3:].strip(), i + 1, []
            i += 1
            while i < len(lines) and not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            yield start + 1, lang, marks, body
            marks = ""
        elif lines[i].strip():
            marks = ""  # a marker applies to the fence right after it (blank lines allowed)
        i += 1


def steps(page: str, text: str) -> list[Step]:
    out: list[Step] = []
    for line, lang, marks, body in blocks(text):
        written = re.match(r"file (\S+)", marks)
        if written:  # the page shows a file's contents: write them (a step of its own, in page order)
            out.append(Step(page, line, f"(write {written.group(1)})", [], marks, contents="\n".join(body) + "\n"))
            continue
        if lang not in ("", "bash", "sh", "console", "shell"):
            continue
        if (marks.startswith("output") or marks.startswith("machine-dependent")) and \
                not any(b.startswith("$ ") for b in body):
            # the output of the previous block's last command that runs (or runs a stand-in)
            target = next((s for s in reversed(out) if not s.marks.startswith("skip")
                           or f"`{s.command}` runs `" in s.marks), None)
            if target:
                target.expected += [b for b in body if b.strip()]
                target.output_marks = marks
            continue
        if any(b.startswith("$ ") for b in body):
            for j, b in enumerate(body):
                if b.startswith("$ "):
                    out.append(Step(page, line + j, strip_comment(b[2:]).strip(), [], marks))
                elif out and out[-1].line >= line and b.strip():
                    out[-1].expected.append(b)
            continue
        first = next((b.split()[0] for b in body if b.strip()), "")
        if first not in COMMAND_WORDS and not re.match(r"[A-Z_]+=", first):
            continue
        joined = ""
        for j, b in enumerate(body):
            part = b.strip() if joined else b.rstrip()
            joined += part[:-1].rstrip() + " " if part.endswith("\\") else part
            if not b.rstrip().endswith("\\"):
                command = strip_comment(joined).strip()
                if command:
                    out.append(Step(page, line + j, command, [], marks))
                joined = ""
    return out


def empty_tables(page: str, text: str) -> list[Failure]:
    """A Markdown table with its header and no row (its rows lost in an edit) is a failure."""
    lines, found = text.splitlines(), []
    for i in range(1, len(lines)):
        if re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", lines[i].strip()) and lines[i - 1].lstrip().startswith("|") and \
                not (i + 1 < len(lines) and lines[i + 1].lstrip().startswith("|")):
            found.append(Failure(Step(page, i, lines[i - 1].strip()[:80], [], ""), "a table with no rows"))
    return found


def strip_comment(command: str) -> str:
    """`command` without a trailing `# comment` (a # inside quotes or a word is kept)."""
    quote = ""
    for i, c in enumerate(command):
        if quote:
            quote = "" if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or command[i - 1].isspace()):
            return command[:i].rstrip()
    return command


def numbers_match(expected: str, actual: str, tolerance: float | None) -> bool:
    """Same text with numbers masked, and each number within `tolerance` (None: not compared)."""
    expected, actual = MACHINE.sub("~", expected), MACHINE.sub("~", actual)
    shape, got = NUMBER.sub("N", " ".join(expected.split())), NUMBER.sub("N", " ".join(actual.split()))
    if PLACEHOLDER.search(shape):  # <time>, <host>: a word the page cannot know; the rest by shape
        parts = PLACEHOLDER.split(shape)
        return re.fullmatch(r"\S+?".join(re.escape(part) for part in parts), got) is not None
    if "..." in shape:  # the page shortened the line: its parts, in order
        if not re.fullmatch(".*".join(re.escape(part) for part in shape.split("...")), got):
            return False
        return True  # numbers of a shortened line are compared by its shape only
    if shape != got:
        return False
    if tolerance is None:
        return True
    for e, a in zip(NUMBER.findall(expected), NUMBER.findall(actual)):
        e_value, a_value = float(e.replace(",", "")), float(a.replace(",", ""))
        if abs(e_value - a_value) > tolerance * max(abs(e_value), abs(a_value)) + 1e-12:
            return False
    return True


def compare(step: Step, output: str) -> list[str]:
    marks = step.output_marks or step.marks
    tolerance = None if "machine-dependent" in marks else 0.02
    found = re.search(r"tolerance (\d+(?:\.\d+)?)%", marks)
    if found:
        tolerance = float(found.group(1)) / 100
    words = re.search(r"lines=(\S+)", marks)
    only = [w.replace("_", " ") for w in words.group(1).split(",")] if words else None  # `_`: a space
    actual = [line for line in output.splitlines() if line.strip()]
    problems, at = [], 0
    for want in step.expected:
        if want.strip() in ("...", "…"):
            continue
        word = want.split()[0]
        if only is not None and not any(want.startswith(p + " ") or want == p for p in only):
            continue
        candidates = [(i, a) for i, a in enumerate(actual) if a.split() and a.split()[0] == word]
        if not candidates:
            problems.append(f"expected a line starting with {word!r}: {want}\n    got no such line")
            continue
        hit = next((i for i, a in candidates if i >= at and numbers_match(want, a, tolerance)), None)
        if hit is None:
            # the nearest: a line of the same shape (numbers aside), else the next one with that first word
            near = next((a for i, a in candidates if numbers_match(want, a, None)),
                        next((a for i, a in candidates if i >= at), candidates[-1][1]))
            problems.append(f"expected: {want}\n    got:      {near}")
        else:
            at = hit + 1
    return problems


# TensorFlow's and its libraries' own log lines, which docs/cli.md promises stay off stderr without --verbose
NOISE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: [IWEF] |[IWE]\d{4} \d\d:\d\d:\d\d|WARNING: All log messages"
                   r"|.*(normalizer\.cc|Compiled cluster using XLA|SessionOptions:|oneDNN custom operations))")


def run_tpu_llm(argv: list[str], parse_only: bool) -> tuple[int, str]:
    """Run `tpu-llm ARGV` in this process: its output, Python's and the native libraries' (file
    descriptors 1 and 2) in one stream, in the order it was written, as a terminal shows it."""
    from tpu_llm import cli
    from tpu_llm.errors import UserError

    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 1)
        os.dup2(captured.fileno(), 2)
        stream = open(captured.fileno(), "w", buffering=1, encoding="utf-8", closefd=False)
        try:
            with contextlib.redirect_stdout(stream), contextlib.redirect_stderr(stream):
                if parse_only:
                    try:
                        cli.parse(argv)
                        code = 0
                    except UserError as e:
                        print(f"error: {e}", file=sys.stderr)
                        code = 2
                else:
                    code = cli.main(argv)
        finally:
            stream.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
        captured.seek(0)
        return code, captured.read().decode("utf-8", "replace")


def run_step(step: Step, env: dict) -> tuple[int, str, str]:
    """(exit code, output, how it ran)."""
    if step.contents is not None:
        path = Path(re.match(r"file (\S+)", step.marks).group(1))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(step.contents)
        return 0, "", "written"
    command, skip = step.command, step.marks.startswith("skip")
    stand_in = re.search(r"`" + re.escape(step.command) + r"` runs `([^`]+)`", step.marks)
    if stand_in:  # e.g. `make train` runs `tpu-llm train --config configs/tiny.yaml` here, minus the install
        command, skip = stand_in.group(1), False
    words = shlex.split(command)
    if words and words[0] in ("tpu-llm", ".venv/bin/tpu-llm") and not any(c in command for c in "|;&>"):
        argv = words[1:]
        quick = re.search(r"quick ((?:--[^\s;]+\s*)+)", step.marks)
        # `train`, or `launch ... -- train`
        trains = argv[:1] == ["train"] or ("--" in argv and argv[argv.index("--") + 1:][:1] == ["train"])
        if quick and trains and not skip:
            argv += quick.group(1).split()
        if "dry-run" in step.marks and trains and "--dry_run" not in argv:
            argv.append("--dry_run")
        if not skip and any(a.startswith("--cpu_devices") for a in argv):
            # TensorFlow's devices are fixed once it has started: logical CPUs need a fresh process
            r = subprocess.run([sys.executable, "-m", "tpu_llm", *argv], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env=env, timeout=600)
            return r.returncode, r.stdout, "process"
        code, output = run_tpu_llm(argv, parse_only=skip)
        return code, output, "parsed" if skip else "ran"
    if words[:2] == ["python", "-m"] and words[2:3] == ["tpu_llm"] and not skip:
        return (*run_tpu_llm(words[3:], parse_only=False), "ran")
    if skip:
        return 0, "", "skipped"
    if words and words[0] == "make" and "run" not in step.marks.split():
        # make installs environments and runs suites or Cloud TPUs: never by accident
        return 1, "a `make` command: mark its block `<!-- docs-check: skip REASON -->` or `run`", "refused"
    r = subprocess.run(["bash", "-c", command], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       env=env, timeout=600)
    return r.returncode, r.stdout, "stand-in" if stand_in else "ran"


# the reader's own text (`corpus/*.txt` on the pages): modules of Python's standard library, 20-270 KB each
CORPUS = ["argparse", "ast", "calendar", "csv", "dataclasses", "difflib", "fractions", "functools", "heapq",
          "inspect", "shlex", "textwrap"]


def scratch_copy() -> Path:
    where = Path(tempfile.mkdtemp(prefix="docs-check-"))
    shutil.copytree(ROOT, where / "repo", ignore=shutil.ignore_patterns(".git", ".venv", "runs", "__pycache__",
                                                                        "*.egg-info", "site", "corpus"))
    (where / "repo" / "corpus").mkdir()
    stdlib = Path(os.__file__).parent
    for name in CORPUS:
        shutil.copy(stdlib / f"{name}.py", where / "repo" / "corpus" / f"{name}.txt")
    return where / "repo"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pages", nargs="*", help="pages to check (default: README.md and docs/*.md)")
    parser.add_argument("--list", action="store_true", help="list the commands and how each would be checked")
    parser.add_argument("--show", action="store_true", help="print each command's output (to update a page from a run)")
    args = parser.parse_args(argv)
    pages = args.pages or ["README.md"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))
    plan = [s for page in pages for s in steps(page, (ROOT / page).read_text())]
    if args.list:
        for s in plan:
            print(f"{s.page}:{s.line}: [{s.marks or 'run'}] {s.command}")
        return 0
    sys.path.insert(0, str(ROOT))  # the checkout under test (the scratch copies are only where commands run)
    os.environ.pop("TF_CPP_MIN_LOG_LEVEL", None)  # (make sets it:) what tpu-llm silences itself is checked
    os.environ["HF_HUB_OFFLINE"] = "1"  # transformers on a page reads local folders, never the network
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}", PYTHONPATH=str(ROOT))
    failures = [f for page in pages for f in empty_tables(page, (ROOT / page).read_text())]
    counts, start, home = {}, time.time(), os.getcwd()
    trained = Path(tempfile.mkdtemp(prefix="docs-check-tiny-"))  # runs/tiny once a page made it
    try:
        for page in pages:
            # each page starts from a clean checkout, as its reader would, plus `make train`'s runs/tiny:
            # README's once it ran, else a short one (make_runs_tiny)
            repo = scratch_copy()
            if (trained / "tiny").is_dir():
                shutil.copytree(trained / "tiny", repo / "runs" / "tiny")
            os.chdir(repo)
            try:
                if page != "README.md" and not (trained / "tiny").is_dir():
                    make_runs_tiny()
                for step in (s for s in plan if s.page == page):
                    failures += check_step(step, env, counts, args.show)
                if (repo / "runs" / "tiny").is_dir() and not (trained / "tiny").is_dir():
                    shutil.copytree(repo / "runs" / "tiny", trained / "tiny", symlinks=True)
            finally:
                os.chdir(home)
                shutil.rmtree(repo.parent, ignore_errors=True)
    finally:
        shutil.rmtree(trained, ignore_errors=True)
    print(f"\n{len(plan)} commands ({', '.join(f'{n} {k}' for k, n in sorted(counts.items()))}) in "
          f"{time.time() - start:.0f} s; {len(failures)} failure(s)")
    for f in failures:
        print(f"\n{f}")
    return 1 if failures else 0


def make_runs_tiny() -> None:
    """A short `runs/tiny` for pages checked without README.md (whose `make train` makes the real one):
    a reader of any page may have run `make train`, and an example that forgets its own `--run_dir`
    must collide with it here as it would there (the trap of issue 30)."""
    t0 = time.time()
    code, output = run_tpu_llm(["train", "--config", "configs/tiny.yaml", "--train.steps=25",
                                "--sample.num_samples=0"], parse_only=False)
    if code != 0:
        raise SystemExit(f"docs_check: could not make runs/tiny ({code}):\n{output[-2000:]}")
    print(f"(runs/tiny: 25 steps of configs/tiny.yaml, as `make train` leaves it for the pages; {time.time() - t0:.0f} s)",
          flush=True)


def check_step(step: Step, env: dict, counts: dict, show: bool = False) -> list[Failure]:
    """Run one step, compare, print its line; its failures."""
    t0, failures = time.time(), []
    try:
        code, output, how = run_step(step, env)
    except Exception as e:  # the checker's own trouble with one command: report it, go on
        code, output, how = -1, f"{type(e).__name__}: {e}", "ran"
    counts[how] = counts.get(how, 0) + 1
    wanted = re.search(r"exit (\d+)", step.marks)
    wanted = int(wanted.group(1)) if wanted and step.command.startswith(("tpu-llm", ".venv/bin/tpu-llm")) else 0
    if code != wanted:
        last = [line for line in output.splitlines() if line.strip()][-3:]
        failures.append(Failure(step, f"exit {code} (the page expects {wanted}): " + " | ".join(last)))
    elif how not in ("parsed", "skipped"):  # (a skipped block's expected lines are the page's word alone)
        failures += [Failure(step, problem) for problem in compare(step, output)]
    if "tpu-llm" in step.command and "--verbose" not in step.command:
        failures += [Failure(step, f"a native log line on the terminal (docs/cli.md: only tpu-llm's without "
                                   f"--verbose): {line.strip()[:160]}") for line in output.splitlines() if NOISE.match(line)]
    status = "FAIL" if failures else "ok"
    print(f"{status:4} {how:8} {time.time() - t0:5.1f}s {step.page}:{step.line}: {step.command[:90]}", flush=True)
    if show:
        print("\n".join(f"   | {line}" for line in output.rstrip().splitlines()), flush=True)
    if failures:  # at once too: a long check can be read (or stopped) while it runs
        print("\n".join(f"     {f.what}" for f in failures), flush=True)
    return failures


if __name__ == "__main__":
    sys.exit(main())
