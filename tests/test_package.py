"""tpu-llm as users get it: presets by name, one version, and the wheel built, checked and installed.

The wheel test builds the sdist and wheel from a copy of the working tree's files (what git tracks),
checks both with twine, installs the wheel (not editable) into a new virtual environment and runs the
command line from an empty directory, as `pip install tpu-llm[cpu]` on a TPU VM or in Colab would.
The new environment borrows this one's installed libraries (TensorFlow, Keras ...) through a .pth line
rather than downloading them again; tpu_llm itself must come from the wheel, which the test asserts.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest
from helpers import TINY_FLAGS

import tpu_llm
from tpu_llm import cli
from tpu_llm.config import load_config
from tpu_llm.config.reading import PRESETS_DIR, presets
from tpu_llm.errors import UserError

REPO = Path(__file__).resolve().parent.parent
PRESETS = ["gpt2_125m", "llama_1b", "llama_tiny", "qwen2_5_0_5b", "qwen2_5_1_5b", "qwen2_tiny", "shakespeare_char",
           "shakespeare_char_llama", "tiny"]


# ---- presets ----------------------------------------------------------------------------------------

def test_every_preset_is_in_the_package_and_configs_links_to_it():
    assert list(presets()) == PRESETS
    for name, path in presets().items():
        checkout = REPO / "configs" / f"{name}.yaml"  # one source: the checkout's file is a link to the package's
        assert checkout.is_symlink() and checkout.resolve() == Path(path).resolve(), checkout
    assert sorted(p.name for p in (REPO / "configs").iterdir()) == [f"{n}.yaml" for n in PRESETS]


@pytest.mark.parametrize("name", PRESETS)
def test_a_preset_by_name_from_any_directory_is_the_file(name, tmp_path, monkeypatch):
    from_checkout = load_config(str(REPO / "configs" / f"{name}.yaml"), {"train.warmup_steps": 7})
    monkeypatch.chdir(tmp_path)  # no configs/ here
    assert load_config(name, {"train.warmup_steps": 7}) == from_checkout
    assert load_config(f"{name}.yaml") == load_config(os.path.join(PRESETS_DIR, f"{name}.yaml"))


def test_a_file_of_a_presets_name_in_the_working_directory_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.yaml").write_text("model:\n  n_layer: 3\n")
    assert load_config("tiny.yaml").model.n_layer == 3 and load_config("tiny").model.n_layer == 4


def test_an_unknown_preset_is_one_line_naming_the_nearest(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=r"'tinyy' not found; give --config tiny \(a preset\) or a YAML file's path; "
                                        r"presets: gpt2_125m, .*tiny \(`tpu-llm config --list`\)"):
        load_config("tinyy")


def test_config_list_names_each_preset_with_what_it_is_for(capsys):
    assert cli.main(["config", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == PRESETS
    assert "GPT-2 small shape for a Cloud TPU run" in lines[0] and "The CPU default" in lines[-1]


# ---- one version ------------------------------------------------------------------------------------

def test_the_version_is_defined_once_and_shown_by_the_cli(capsys):
    pyproject = (REPO / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject and 'version = {attr = "tpu_llm.__version__"}' in pyproject
    assert "\nversion = " not in pyproject.split("[project]")[1].split("\n[")[0]  # no second copy in [project]
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"tpu-llm {tpu_llm.__version__}\n"


# ---- the wheel, installed as users get it ---------------------------------------------------------------

def tracked_copy(dest: Path) -> Path:
    """The files git tracks (as they are in the working tree), copied to `dest`: what a clean clone holds."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for name in filter(None, files.decode().split("\0")):
        src, out = REPO / name, dest / name
        if not src.exists() and not src.is_symlink():  # deleted in the working tree, not yet committed
            continue
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, out, follow_symlinks=False)
    return dest


def run(args: list, cwd: Path, env: dict, timeout: int = 300) -> subprocess.CompletedProcess:
    r = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0 and "Traceback" not in r.stderr, (args, r.stdout[-2000:], r.stderr[-3000:])
    return r


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """dist/ with the sdist and wheel built from a copy of the tracked files, both checked by twine."""
    root = tmp_path_factory.mktemp("package")
    src, dist = tracked_copy(root / "src"), root / "dist"
    # --no-isolation: the build uses this environment's setuptools (dev extra) instead of downloading one
    run([sys.executable, "-m", "build", "--no-isolation", "--outdir", dist, src], root, dict(os.environ))
    run([sys.executable, "-m", "twine", "check", "--strict", *sorted(dist.iterdir())], root, dict(os.environ))
    return dist


@pytest.mark.slow
def test_the_wheel_holds_the_package_data_and_the_entry_point(built):
    wheel = next(built.glob("*.whl"))
    assert wheel.name == f"tpu_llm-{tpu_llm.__version__}-py3-none-any.whl"
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"tpu_llm/presets/{n}.yaml" for n in PRESETS} <= names
    assert {"tpu_llm/data/shipped/README.md", "tpu_llm/data/shipped/tinyshakespeare.txt"} <= names
    info = f"tpu_llm-{tpu_llm.__version__}.dist-info"
    entry = zipfile.ZipFile(wheel).read(f"{info}/entry_points.txt").decode()
    assert "tpu-llm = tpu_llm.cli:main" in entry
    sdist = next(built.glob("*.tar.gz"))
    assert sdist.name == f"tpu_llm-{tpu_llm.__version__}.tar.gz"


@pytest.mark.slow
def test_the_installed_wheel_runs_from_an_empty_directory(built, tmp_path):
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    # this environment's pip installs into the new one (--python); no dependency is resolved or downloaded
    run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "--quiet",
         next(built.glob("*.whl"))], tmp_path, dict(os.environ))
    # TensorFlow & co. from this environment, after the new one's own packages (a .pth line is appended to sys.path)
    (site / "borrowed.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    empty = tmp_path / "empty"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PATH=f"{env_dir / 'bin'}{os.pathsep}{env['PATH']}", TF_CPP_MIN_LOG_LEVEL="2")
    where = run([python, "-c", "import tpu_llm, importlib.metadata as m; print(tpu_llm.__file__); "
                 "print(m.version('tpu-llm'))"], empty, env).stdout.split()
    assert Path(where[0]).is_relative_to(site) and where[1] == tpu_llm.__version__, where  # the wheel's, not the checkout's
    tool = env_dir / "bin" / "tpu-llm"
    assert "usage: tpu-llm COMMAND" in run([tool, "--help"], empty, env).stdout
    assert run([tool, "--version"], empty, env).stdout == f"tpu-llm {tpu_llm.__version__}\n"
    assert "gpt2_125m" in run([tool, "config", "--list"], empty, env).stdout
    trained = run([tool, "train", "--config", "tiny", *TINY_FLAGS, "--train.steps=2", "--run_dir", "run"], empty, env)
    assert "done" in trained.stdout and (empty / "run" / "checkpoints").is_dir(), trained.stdout[-2000:]
    planned = run([tool, "plan", "--config", "gpt2_125m", "--accelerator", "v5p-16"], empty, env)
    assert "MFU" in planned.stdout and "v5p" in planned.stdout, planned.stdout
    assert sorted(p.name for p in empty.iterdir()) == ["run"]  # nothing else written where it ran


def test_the_installed_metadata_is_this_version():
    assert importlib.metadata.version("tpu-llm") == tpu_llm.__version__


def test_the_python_api_keeps_tensorflows_native_log_lines_off_stderr(tmp_path):
    """Issue 50 #7: `tpu_llm.load(...)` printed TensorFlow's C++ start-up lines (cuda stubs, cpu_feature_guard),
    which the command line hides; TPU_LLM_VERBOSE=1 still shows them, as --verbose does."""
    from tpu_llm.cli.quiet import _NATIVE_LOG

    code = (f"import tpu_llm\ntry:\n    tpu_llm.load({str(tmp_path)!r})\n"
            "except Exception as e:\n    print(type(e).__name__)")
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "TPU_LLM_VERBOSE")}
    runs = {verbose: subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=300,
                                    env={**env, **({"TPU_LLM_VERBOSE": "1"} if verbose else {})})
            for verbose in (False, True)}
    assert runs[False].stdout.decode().strip() == "UserError", runs[False]
    native = {verbose: [line for line in r.stderr.splitlines() if _NATIVE_LOG.match(line)]
              for verbose, r in runs.items()}
    assert native[False] == [], runs[False].stderr.decode()[-2000:]
    assert native[True], "TensorFlow printed no start-up line at all: this test proves nothing here"
