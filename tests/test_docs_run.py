"""scripts/docs_check.py, the executable docs (`make docs-check`): how it reads the pages' command
blocks and markers, what it compares, and (fast, in every `make test`) that every `tpu-llm` command
in README.md and docs/*.md is accepted by the command-line parser."""

import contextlib
import importlib.util
import io
import os
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("docs_check", ROOT / "scripts" / "docs_check.py")
docs_check = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = docs_check  # (dataclasses look their module up there)
_spec.loader.exec_module(docs_check)

PAGE = """Intro.

<!-- docs-check: dry-run exit 2 -->
```
$ tpu-llm train --model.n_layers=6
error: unknown config key 'model.n_layers'
```

```
tpu-llm plan --config configs/tiny.yaml \\
    --accelerator v4-8   # a comment
make test
```

<!-- docs-check: output tolerance 5% lines=done -->
```
step 1 ignored
done      step 500: train loss 2.0132; 8.0k tok/s, MFU 51.8%
```

```python
tpu-llm not a shell block
```

| a | b |
|---|---|

text
"""


def test_reads_commands_expected_lines_and_markers():
    steps = docs_check.steps("page.md", PAGE)
    assert [(s.line, s.command, s.marks) for s in steps] == [
        (5, "tpu-llm train --model.n_layers=6", "dry-run exit 2"),
        (11, "tpu-llm plan --config configs/tiny.yaml --accelerator v4-8", ""),
        (12, "make test", "")]
    assert steps[0].expected == ["error: unknown config key 'model.n_layers'"]
    assert steps[2].output_marks == "output tolerance 5% lines=done"


def test_compares_lines_that_matter_with_tolerance():
    step = docs_check.steps("page.md", PAGE)[2]
    ok = "step 1 other\ndone      step 500: train loss 2.05; 3.1k tok/s, MFU 12.0%\n"
    assert docs_check.compare(step, ok) == []  # 2% off the loss, throughput and MFU never compared
    far = docs_check.compare(step, "done      step 500: train loss 2.2; 8.0k tok/s, MFU 51.8%")
    assert far == ["expected: done      step 500: train loss 2.0132; 8.0k tok/s, MFU 51.8%\n"
                   "    got:      done      step 500: train loss 2.2; 8.0k tok/s, MFU 51.8%"]
    assert "got no such line" in docs_check.compare(step, "nothing")[0]
    error = docs_check.steps("page.md", PAGE)[0]
    assert docs_check.compare(error, "error: unknown config key 'model.n_layers'; did you mean") != []


def test_empty_table_and_unmarked_make_fail():
    assert [(f.step.line, f.what) for f in docs_check.empty_tables("page.md", PAGE)] == [(25, "a table with no rows")]
    code, output, how = docs_check.run_step(docs_check.steps("page.md", PAGE)[2], {})
    assert (code, how) == (1, "refused") and "mark its block" in output


QUICK_PAGE = """<!-- docs-check: file cfg/my.yaml -->
```yaml
run_dir: runs/x
```

<!-- docs-check: quick --train.steps=20 --sample.num_samples=0; `huggingface-cli download x` runs `echo fetched` -->
```
huggingface-cli download x
tpu-llm train --config cfg/my.yaml
tpu-llm launch --workers 2 -- train --config cfg/my.yaml
tpu-llm tokenizer train --input x --output y
```

<!-- docs-check: skip: a bucket -->
```
$ tpu-llm report --run_dir RUN
report    RUN
```
"""


def test_file_quick_and_stand_in_markers(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write, fetch, train, launch, tokenizer, report = docs_check.steps("page.md", QUICK_PAGE)
    assert docs_check.run_step(write, {})[::2] == (0, "written") and (tmp_path / "cfg/my.yaml").read_text() == \
        "run_dir: runs/x\n"
    assert docs_check.run_step(fetch, dict(os.environ)) == (0, "fetched\n", "stand-in")
    ran = []
    monkeypatch.setattr(docs_check, "run_tpu_llm", lambda argv, parse_only: ran.append(argv) or (0, ""))
    for step in (train, launch, tokenizer):
        docs_check.run_step(step, {})
    quick = ["--train.steps=20", "--sample.num_samples=0"]
    assert ran == [["train", "--config", "cfg/my.yaml", *quick],
                   ["launch", "--workers", "2", "--", "train", "--config", "cfg/my.yaml", *quick],
                   ["tokenizer", "train", "--input", "x", "--output", "y"]]  # (not a training run)
    assert docs_check.check_step(report, {}, {}) == []  # a skipped block's output is not compared


def test_placeholders_prefixes_and_native_log_lines(monkeypatch):
    assert docs_check.numbers_match("profile   traced: a/<time>/<host>.xplane.pb (b)",
                                    "profile   traced: a/2026_12_04/t1v-n-0.xplane.pb (b)", 0.02)
    assert not docs_check.numbers_match("profile   traced: a/<time>/<host>.xplane.pb (b)",
                                        "profile   traced: b/2026_12_04/t1v-n-0.xplane.pb (b)", 0.02)
    step = docs_check.Step("p.md", 1, "tpu-llm launch", ["[worker 0] step 5 loss 2.0", "[worker 1] late 7"],
                           "tolerance 1% lines=[worker_0]")
    assert docs_check.compare(step, "[worker 1] late 9\n[worker 0] step 5 loss 2.0\n") == []  # worker 1's not compared
    assert docs_check.compare(step, "[worker 0] step 5 loss 2.5\n") != []
    noise = ["2026-12-04 21:43:33.528476: I external/local_xla/xla/tsl/cuda/cudart_stub.cc:31] Could not find cuda",
             "I0000 00:00:1733349813.000000   12 device_compiler.h:188] Compiled cluster using XLA!",
             "normalizer.cc(51) LOG(INFO) precompiled_charsmap is empty. use identity normalization."]
    assert all(docs_check.NOISE.match(line) for line in noise)
    assert not any(docs_check.NOISE.match(line) for line in ["step 25/500 [#---] loss 4.1", "error: the disk is full"])
    monkeypatch.setattr(docs_check, "run_step", lambda step, env: (0, noise[1] + "\n", "ran"))
    found = docs_check.check_step(docs_check.Step("p.md", 1, "tpu-llm train", [], ""), {}, {})
    assert len(found) == 1 and "native log line" in found[0].what


def doc_commands():
    pages = ["README.md"] + sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))
    for page in pages:
        for step in docs_check.steps(page, (ROOT / page).read_text()):
            words = shlex.split(step.command)
            if words[0] in ("tpu-llm", ".venv/bin/tpu-llm") and "[" not in step.command:
                yield pytest.param(step, id=f"{page}:{step.line}")


@pytest.mark.parametrize("step", list(doc_commands()))
def test_every_documented_command_parses(step):
    """Argument validity of every `tpu-llm` command of the docs (those run for real: make docs-check)."""
    from tpu_llm.cli import parse
    from tpu_llm.errors import UserError

    argv = shlex.split(step.command)[1:]
    if "exit 2" in step.marks:
        pytest.skip("a documented refusal")
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            parse(argv)
        except UserError as e:
            pytest.fail(f"{step.page}:{step.line}: $ {step.command}\n    error: {e}")


# Every page runs (docs/development.md#docs-that-run), in two groups that take about as long, so that
# pytest-xdist's two workers run them side by side. The first holds README.md, whose `make train` (the
# tiny config's 500 steps, ~80 s) makes the runs/tiny that the other pages of its group start from.
PAGES = ["README.md"] + sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))
FIRST = ["README.md", "docs/quickstart.md", "docs/export.md", "docs/goodput.md", "docs/profiling.md",
         "docs/migrate-from-model-fit.md"]  # with runs/tiny; the rest below make what they need


def test_every_page_is_in_a_group():
    assert set(FIRST) <= set(PAGES) and len(PAGES) == len(set(PAGES))


@pytest.mark.slow
@pytest.mark.parametrize("group", ["with-runs-tiny", "the-rest"])
def test_the_pages_run_as_written(group):
    """Every command of every page runs (or is parsed, as marked) and prints what the page shows."""
    import subprocess

    pages = FIRST if group == "with-runs-tiny" else [p for p in PAGES if p not in FIRST]
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "docs_check.py"), *pages], cwd=ROOT,
                       capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0 and r.stdout.rstrip().endswith("; 0 failure(s)"), r.stdout[-6000:] + r.stderr[-2000:]


def make_commands():
    """Every `make ...` the pages show, in command blocks or inline code (`make tpu-up TPU_WAIT_MINUTES=120`)."""
    import re

    for page in PAGES:
        text = (ROOT / page).read_text()
        found = {s.command for s in docs_check.steps(page, text)}
        found |= set(re.findall(r"`((?:[A-Z_]+=\S+ )*make [^`]+)`", text))
        for command in sorted(found):
            for part in command.split("&&"):  # (prose: `make tpu-up && make train`)
                words = [w for w in shlex.split(part) if w != "/"]  # (`make tpu-up / train / tpu-down`)
                if "make" in words:
                    yield pytest.param(words, id=f"{page}:{part.strip()[:60]}")


@pytest.mark.parametrize("words", list(make_commands()))
def test_every_documented_make_command_names_a_target_and_known_settings(words):
    """Argument validity of the `make` commands the checker cannot run (Cloud TPU, long suites): each
    names a target of the Makefile, and each NAME=VALUE a setting the Makefile or what it runs reads."""
    from helpers import make_problem

    problem = make_problem(words)
    assert not problem, problem
