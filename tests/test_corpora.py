"""Shipped corpora (`builtin:NAME`, tpu_llm/data/corpora.py): the benchmark's tinyshakespeare is in the package,
checked by its SHA-256, and the benchmark config reads it from any working directory. No training here."""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
from pathlib import Path

import pytest

from tpu_llm.config import load_config
from tpu_llm.data import corpora, sources
from tpu_llm.errors import UserError
from tpu_llm.tools import bench

ROOT = Path(__file__).resolve().parent.parent
# char-rnn's data/tinyshakespeare/input.txt (what nanoGPT's shakespeare_char downloads)
TINYSHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"


@pytest.fixture
def fresh_checks():
    """Forget which files this process already checked, before and after the test."""
    corpora._checked.cache_clear()
    yield
    corpora._checked.cache_clear()


def test_shipped_tinyshakespeare_is_the_char_rnn_text(fresh_checks):
    path = corpora.path("tinyshakespeare")
    raw = Path(path).read_bytes()
    assert hashlib.sha256(raw).hexdigest() == TINYSHAKESPEARE_SHA256 == corpora.CORPORA["tinyshakespeare"][1]
    text = raw.decode("utf-8")
    assert len(text) == 1_115_394 and text.startswith("First Citizen:\n")
    assert (Path(path).parent / "README.md").read_text().count(TINYSHAKESPEARE_SHA256) == 1  # origin, licence


def test_the_package_data_ships_it():
    """A non-editable install (a wheel, a TPU worker's pip install) carries the file and its notes."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    package = ROOT / "tpu_llm" / "data"
    shipped = {os.path.relpath(f, package) for pattern in package_data["tpu_llm.data"]
               for f in glob.glob(str(package / pattern))}
    assert {"shipped/tinyshakespeare.txt", "shipped/README.md"} <= shipped


def test_benchmark_config_reads_the_shipped_copy_from_any_directory(tmp_path, monkeypatch, fresh_checks):
    monkeypatch.chdir(tmp_path)  # a user's own directory: no configs/, no ../shared
    cfg = load_config(bench.config_path("configs/shakespeare_char.yaml"), {})
    assert cfg.data.train == "builtin:tinyshakespeare"
    train, validation = sources.resolve_sources(cfg.data)
    shipped = os.path.join(os.path.dirname(corpora.__file__), "shipped", "tinyshakespeare.txt")
    assert train.files == validation.files == [shipped]
    assert (train.byte_range, validation.byte_range) == ((0.0, 0.9), (0.9, 1.0))  # nanoGPT's split: the last 10%


def test_bench_runs_from_any_directory(tmp_path, monkeypatch, fresh_checks):
    """`tpu-llm bench` from elsewhere finds its config and data and starts training (stubbed here)."""
    import tpu_llm.training.controller

    seen = {}

    def fake_train(cfg):
        seen["cfg"] = cfg
        return {"tokens_per_sec": 1.0, "ms_per_step": 1.0, "mfu": 0.0, "train_loss": 2.0, "val_loss": 2.0}

    monkeypatch.setattr(tpu_llm.training.controller, "train", fake_train)
    monkeypatch.chdir(tmp_path)
    bench.shakespeare_char(steps=3)
    cfg = seen["cfg"]
    assert cfg.data.train == "builtin:tinyshakespeare" and cfg.data.tokenizer == "char" and cfg.train.steps == 3


def test_an_altered_missing_or_unknown_corpus_is_one_error_line(tmp_path, monkeypatch, fresh_checks):
    monkeypatch.setattr(corpora, "DIRECTORY", str(tmp_path))
    with pytest.raises(UserError, match=r"^data.train: the shipped corpus builtin:tinyshakespeare cannot be read "
                                        r"\(.*tinyshakespeare.txt: No such file or directory\); reinstall tpu-llm"):
        sources.expand_globs("builtin:tinyshakespeare", "data.train")

    altered = tmp_path / "tinyshakespeare.txt"
    shutil.copy(os.path.join(os.path.dirname(corpora.__file__), "shipped", "tinyshakespeare.txt"), altered)
    with open(altered, "r+b") as f:
        f.seek(1000)
        f.write(b"#")
    with pytest.raises(UserError) as e:
        sources.expand_globs("corpus/*.txt, builtin:tinyshakespeare", "data.train")  # checked before any glob
    message = str(e.value)
    assert message.startswith(f"data.train: {altered} is not the shipped builtin:tinyshakespeare (SHA-256 ")
    assert message.endswith("restore it (git checkout -- tpu_llm/data/shipped/tinyshakespeare.txt) or reinstall tpu-llm")
    assert "\n" not in message

    with pytest.raises(UserError, match=r"^data.validation: there is no shipped corpus builtin:shakespeare; "
                                        r"shipped: builtin:tinyshakespeare$"):
        sources.expand_globs("builtin:shakespeare", "data.validation")
