"""`tpu-llm train --dry_run` (checks and plan, no model), the refusal of another model's run directory
when the command left --run_dir/--config to defaults (both cures as commands that work), and the
"next step" hints of `data prepare` and `import` run as printed (docs/cli.md)."""

import shlex

import pytest
from helpers import TINY_FLAGS, write_corpus, write_gpt2

from tpu_llm import cli


def run(capsys, argv):
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def corpus(tmp_path):
    write_corpus(tmp_path / "corpus")
    return str(tmp_path / "corpus" / "*.txt")


def test_dry_run_new_run_writes_nothing(tmp_path, capsys, corpus):
    run_dir = tmp_path / "run"
    code, out, err = run(capsys, ["train", *TINY_FLAGS, f"--data.train={corpus}", f"--run_dir={run_dir}", "--dry_run"])
    assert code == 0, err
    assert f"run_dir   {run_dir}" in out
    assert "tokenizer byte, 257 ids" in out
    assert out.splitlines()[-1] == "dry run   all checks passed; would: starts a new run, trains 4 steps"
    assert not run_dir.exists()  # nothing written, no model built


def test_dry_run_resume_and_trap(tmp_path, capsys, corpus, monkeypatch):
    monkeypatch.chdir(tmp_path)
    base = ["train", *TINY_FLAGS, f"--data.train={corpus}"]
    code, _, err = run(capsys, base + ["--run_dir=runs/a"])
    assert code == 0, err
    code, out, err = run(capsys, base + ["--run_dir=runs/a", "--train.steps=6", "--dry_run"])
    assert code == 0, err
    assert out.splitlines()[-1] == "dry run   all checks passed; would: resumes from ckpt-4 at step 4, trains to step 6"
    # the same checks as training: another model in the run directory is refused, before anything loads
    code, out, err = run(capsys, base + ["--run_dir=runs/a", "--model.n_layer=2", "--dry_run"])
    assert code == 2 and err.count("\n") == 1 and "holds a run made with model.n_layer=1 (this config has 2) and this command gave no --config;" in err  # --run_dir was given: only the missing --config is named

    # the trap: a config file whose run_dir holds another model, without --run_dir
    (tmp_path / "six.yaml").write_text("run_dir: runs/a\nmodel:\n  n_layer: 2\n")
    argv = base[:1] + ["--config", "six.yaml"] + base[1:] + ["--model.n_layer=2"]
    code, out, err = run(capsys, argv + ["--dry_run"])
    assert code == 2 and err.count("\n") == 1, err
    assert "(this config has 2) and this command gave no --run_dir; for a new run add" in err
    cures = [c.strip("`") for c in err.split("`")[1::2]]
    assert cures == ["--run_dir runs/a-2", "--config runs/a/config.yaml"]
    # both cures work as printed: a new run, or the earlier run resumed with its own config
    code, out, err = run(capsys, argv + shlex.split(cures[0]) + ["--dry_run"])
    assert code == 0 and "would: starts a new run" in out, err
    code, out, err = run(capsys, ["train"] + shlex.split(cures[1]) + ["--dry_run"])
    assert code == 0 and "would: nothing to do: ckpt-4 is at step 4 of train.steps=4" in out, err


def test_dry_run_in_help(capsys):
    assert run(capsys, ["train", "--help"])[1].count("--dry_run") >= 1


def hint(out: str) -> list[str]:
    """The train flags of data prepare's last line ('...; train with FLAGS')."""
    return shlex.split(out.strip().splitlines()[-1].split("train with ", 1)[1])


@pytest.mark.parametrize("kind", ["byte", "sentencepiece"])
def test_prepare_hint_trains_as_printed(tmp_path, capsys, kind, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_corpus(tmp_path / "corpus")
    extra = []
    if kind == "sentencepiece":
        pytest.importorskip("tensorflow_text")
        code, _, err = run(capsys, ["tokenizer", "train", "--input", "corpus/*.txt", "--vocab_size", "400",
                                    "--output", "sp.model"])
        assert code == 0, err
        extra = ["--tokenizer_model", "sp.model"]
    code, out, err = run(capsys, ["data", "prepare", "--input", "corpus/*.txt", "--output", "shards",
                                  "--tokenizer", kind, "--shards", "2", *extra])
    assert code == 0, err
    flags = hint(out)
    code, out, err = run(capsys, ["train", *TINY_FLAGS, *flags, "--run_dir=runs/x", "--dry_run"])
    assert code == 0 and "would: starts a new run" in out, err


def test_import_hints_run_as_printed(tmp_path, capsys, monkeypatch):
    pytest.importorskip("safetensors")
    monkeypatch.chdir(tmp_path)
    write_gpt2(tmp_path / "hf")
    code, out, err = run(capsys, ["import", "--from", "hf", "--run_dir", "runs/gpt2"])
    assert code == 0, err
    hints = [line.split("  (")[0].replace("next", "", 1).strip() for line in out.splitlines()[1:]]
    assert [h.split()[:2] for h in hints] == [["tpu-llm", "generate"], ["tpu-llm", "data"], ["tpu-llm", "train"]]
    write_corpus(tmp_path / "corpus")
    code, _, err = run(capsys, shlex.split(hints[1])[1:])  # data prepare, as printed
    assert code == 0, err
    code, out, err = run(capsys, shlex.split(hints[2])[1:] + ["--train.batch_size=2", "--data.seq_len=8",
                                                             "--dry_run"])
    assert code == 0 and "would: resumes from ckpt-0 at step 0, trains to step 200" in out, err
