"""scripts/docs_check.py, the executable docs (`make docs-check`): how it reads the pages' command
blocks and markers, what it compares, and (fast, in every `make test`) that every `tpu-llm` command
in README.md and docs/*.md is accepted by the command-line parser."""

import contextlib
import importlib.util
import io
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


# The pages whose command blocks are marked and run in full (docs/development.md#docs-that-run). README's
# `make train` block trains the tiny config for 500 steps (~2 minutes), the rest takes seconds.
MARKED = ["README.md", "docs/quickstart.md", "docs/planning.md", "docs/tokenizers.md", "docs/memory.md",
          "docs/pipeline-tensor.md"]  # (docs/python-api.md's example: tests/test_api.py)


@pytest.mark.slow
def test_the_marked_pages_run_as_written():
    """Every command of the marked pages runs (or is parsed, as marked) and prints what the page shows."""
    import subprocess

    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "docs_check.py"), *MARKED], cwd=ROOT,
                       capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0 and r.stdout.rstrip().endswith("; 0 failure(s)"), r.stdout[-6000:] + r.stderr[-2000:]
