"""The package's layout (docs/development.md, "Module map"): sub-packages by concern, each importing only
the ones below it, no import cycle, function-level imports only where they keep TensorFlow out of
start-up, modules and functions of a readable length, and tests that import the package as users do
(no sys.path edits)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tpu_llm"

# Sub-packages and top-level modules by layer: a module may import its own sub-package and lower layers.
LAYERS = [
    # leaves anyone may import; the model's TensorFlow-free declarations (its spec and families) among them:
    # config.py validates a model section with them
    {"__init__", "errors", "config", "platform", "model.spec", "model.families"},
    {"cloud", "tokenizers", "model"},
    {"data"},
    {"parallel"},
    {"training"},
    {"harness"},  # the offline compile harness: the run's step traced and compiled (training/assemble.py's)
    {"interop", "tools", "eval"},  # eval: lm-evaluation-harness on a loaded run (issue 49)
    {"api"},  # tpu_llm.load and tpu_llm.train, what the CLI calls too
    {"cli", "__main__"},
]
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}


def modules() -> dict[str, Path]:
    return {".".join(p.relative_to(ROOT).with_suffix("").parts): p for p in sorted(PACKAGE.rglob("*.py"))}


LOW = {"model.spec", "model.families"}  # parts of a sub-package that sit lower than the rest of it


def unit(module: str) -> str:
    """The sub-package (or top-level module) a dotted module name belongs to."""
    parts = module.split(".")
    if ".".join(parts[1:3]) in LOW:
        return ".".join(parts[1:3])
    return parts[1] if len(parts) > 1 else "__init__"


def imports(path: Path):
    """(line, imported module, inside a function) for every `tpu_llm` import of the file."""
    tree = ast.parse(path.read_text())
    inner = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
             for n in ast.walk(f)}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "tpu_llm":
            known = modules()  # `from tpu_llm.pkg import module` names a module; `import name` its package's
            targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known
                       or f"{node.module}.{a.name}.__init__" in known else node.module for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names if a.name.split(".")[0] == "tpu_llm"]
        else:
            continue
        for target in targets:
            yield node.lineno, target, id(node) in inner


def test_every_sub_package_imports_only_lower_layers():
    wrong = []
    for module, path in modules().items():
        for line, target, _ in imports(path):
            mine, theirs = unit(module), unit(target)
            if theirs == "__version__" or mine == theirs:
                continue
            assert mine in RANK and theirs in RANK, f"{module} or {target}: not in the layer table of {__file__}"
            siblings_may = RANK[mine] in (0, len(LAYERS) - 1)  # leaves among themselves; __main__ runs the CLI
            if RANK[theirs] > RANK[mine] or RANK[theirs] == RANK[mine] and not siblings_may:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {target} (layer {RANK[theirs]} >= {RANK[mine]})")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle_between_modules():
    """Imports inside functions count too: one there only defers the cycle to the first call (and hid
    `checkpoint -> goodput -> line_log -> checkpoint` from this test, issue 37)."""
    known = modules()
    graph: dict[str, dict[str, str]] = {m: {} for m in known}  # module -> {imported module: how, for the message}
    for module, path in known.items():
        for line, target, inner in imports(path):
            for name in (target, f"{target}.__init__"):
                if name in known and name != module:
                    how = f"{path.relative_to(ROOT)}:{line}" + (" inside a function" if inner else "")
                    graph[module].setdefault(name, how)
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(m, path):
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycle = path[path.index(n):] + [n]
                raise AssertionError("import cycle: " + " -> ".join(cycle) + " ("
                                     + "; ".join(graph[a][b] for a, b in zip(cycle, cycle[1:])) + ")")
            if n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_function_level_imports_only_keep_tensorflow_out_of_start_up():
    """A module that imports TensorFlow anyway has no reason to import tpu_llm inside a function (that was
    how cycles were dodged); modules without it at the top (the CLI, plan, bench) keep theirs lazy."""
    wrong = []
    for module, path in modules().items():
        top = ast.parse(path.read_text()).body
        heavy = any(isinstance(n, (ast.Import, ast.ImportFrom)) and "tensorflow" in ast.dump(n) for n in top)
        wrong += [f"{path.relative_to(ROOT)}:{line} imports {target} inside a function"
                  for line, target, inner in imports(path) if inner and heavy]
    assert not wrong, "\n".join(wrong)


@pytest.mark.slow
def test_every_module_imports_in_a_fresh_interpreter():
    names = [m.removesuffix(".__init__") for m in modules() if not m.endswith("__main__")]
    code = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\nprint('ok')"
    done = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_tests_import_the_package_without_sys_path_edits():
    edits = [f"{p.name}:{i}" for p in sorted(Path(__file__).parent.glob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if "sys.path." + "insert" in line
             or "sys.path." + "append" in line]
    assert not edits, edits


def test_no_test_module_imports_another():
    """Shared builders live in helper modules (tests/helpers.py and the like, docs/development.md), never in a
    test file that another imports: that one would then run, or skip, with the other's module-level code."""
    imports = []
    for path in sorted(Path(__file__).parent.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            imports += [f"{path.name}:{node.lineno} imports {n}" for n in names if n.split(".")[0].startswith("test_")]
    assert not imports, imports


MAX_MODULE_LINES, MAX_FUNCTION_LINES = 500, 60
REASON = "Long because"  # how a longer function's docstring starts the line that says why (nested ones too)


def test_no_module_over_500_lines_and_no_function_over_60_without_its_reason():
    long, unsaid = [], []
    for path in modules().values():
        name, text = path.relative_to(ROOT).as_posix(), path.read_text()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            long.append(f"{name} ({len(text.splitlines())} lines)")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                    node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES:
                doc = ast.get_docstring(node) or ""
                if not any(line.strip().startswith(REASON) for line in doc.splitlines()):
                    unsaid.append(f"{name}::{node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert not long, f"over {MAX_MODULE_LINES} lines: split by concern: {long}"
    assert not unsaid, (f"over {MAX_FUNCTION_LINES} lines without a docstring line starting {REASON!r}: split it, "
                        f"or say why: {unsaid}")
