"""A user's mistakes, caught before the first step and before the run directory is written: data smaller
than a batch, a saved vocabulary that lacks the data's or the prompt's characters, no readable checkpoint
to resume from, another tool's directory as run_dir, a data directory instead of a glob; and what is
said rather than refused: a run directory of an earlier version resumes, an unreadable newest
checkpoint is named when generate and export fall back to the previous one.

Each case runs `tpu-llm ...` through `cli.main` in this process: each fails before training, so a
process of its own would cost TensorFlow's start-up for nothing. The module trains one tiny run (char
vocabulary, checkpoints at steps 2 and 4) and each test works on a copy of it. The command line's own
refusals (flags, commands, config files), in subprocesses: test_cli_messages.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers import TINY_FLAGS, assert_refused, snapshot, write_corpus

from tpu_llm import cli

# the step as a TF graph: the subject here is what is checked before it (XLA's compile costs seconds)
FLAGS = [*TINY_FLAGS, "--checkpoint.every_steps=2", "--data.tokenizer=char", "--execution=graph"]
PROMPT = "Hello Жук €!"  # Ж and € are not in the corpus of helpers.write_corpus


class InProcess:
    """`tpu-llm ARGS` through `cli.main` in this process (TensorFlow is loaded once for all of them):
    exit status, stdout, stderr, and the snapshots of `watch` before and after."""

    def __init__(self, capsys, args: list, watch: Path | None = None):
        self.args, self.watch = [str(a) for a in args], watch
        self.before = snapshot(watch) if watch else None
        capsys.readouterr()
        self.code = cli.main(self.args)
        self.stdout, self.stderr = capsys.readouterr()
        self.after = snapshot(watch) if watch else None

    def __str__(self) -> str:
        return (f"tpu-llm {' '.join(self.args)} -> exit {self.code}\n--- stdout\n{self.stdout[-3000:]}\n"
                f"--- stderr\n{self.stderr[-3000:]}")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The module's run, trained once through `cli.main` (4 steps, checkpoints at steps 2 and 4), and
    the flags that trained it: (run directory, flags)."""
    tmp = tmp_path_factory.mktemp("trained")
    write_corpus(tmp / "corpus")
    flags = [f"--data.train={tmp / 'corpus' / '*.txt'}", *FLAGS]
    assert cli.main(["train", f"--run_dir={tmp / 'run'}", *flags]) == 0
    assert {p.name for p in (tmp / "run" / "checkpoints").glob("ckpt-*.index")} == {"ckpt-2.index", "ckpt-4.index"}
    return tmp / "run", flags


@pytest.fixture
def run_copy(trained, tmp_path):
    """A copy of the module's trained run, and the flags that trained it."""
    run, flags = trained
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    return copy, flags


# 1. every check before the first step and before the run directory is written --------------------------


def test_resuming_on_data_smaller_than_a_batch_changes_nothing(run_copy, tmp_path, capsys):
    run, flags = run_copy
    (tmp_path / "nine.txt").write_text("abc 0123\n")  # 9 bytes, every character in the run's vocabulary
    r = InProcess(capsys, ["train", f"--run_dir={run}", *flags, f"--data.train={tmp_path / 'nine.txt'}",
                           "--train.steps=6"], watch=run)
    assert_refused(r, "error: training data (")
    assert "holds less than one batch of 2 x 9 tokens; add data or lower train.batch_size" in r.stderr


def test_a_new_run_on_data_smaller_than_a_batch_writes_nothing(run_copy, tmp_path, capsys):
    _, flags = run_copy
    (tmp_path / "nine.txt").write_text("abc 0123\n")
    r = InProcess(capsys, ["train", f"--run_dir={tmp_path / 'new'}", *flags, f"--data.train={tmp_path / 'nine.txt'}"],
                  watch=tmp_path / "new")
    assert_refused(r, "holds less than one batch of 2 x 9 tokens; add data or lower train.batch_size")
    assert r.after is None  # not even the directory (no tokenizer.json built from 9 characters)


def test_validation_data_smaller_than_a_batch_is_refused_before_training(run_copy, tmp_path, capsys):
    _, flags = run_copy
    (tmp_path / "val.txt").write_text("abc\n")
    r = InProcess(capsys, ["train", f"--run_dir={tmp_path / 'new'}", *flags, f"--data.validation={tmp_path / 'val.txt'}"],
                  watch=tmp_path / "new")
    assert_refused(r, f"error: validation data ({tmp_path / 'val.txt'}: 1 files) holds less than one batch of 2 x 9")
    assert r.after is None


def test_a_saved_char_vocabulary_that_lacks_the_datas_characters_is_refused(run_copy, tmp_path, capsys):
    run, flags = run_copy
    (tmp_path / "other.txt").write_text("Жук € ß and more\n" * 50)
    r = InProcess(capsys, ["train", f"--run_dir={run}", *flags, f"--data.train={tmp_path / 'other.txt'}"], watch=run)
    assert_refused(r, "(115 characters) lacks 3 character(s) of this data: 'ß', 'Ж', '€'; train on the data it was built")


def test_a_resume_with_no_readable_checkpoint_leaves_config_yaml_alone(run_copy, capsys):
    run, flags = run_copy
    for data_file in (run / "checkpoints").glob("ckpt-*.data-*"):
        data_file.write_bytes(b"corrupt")
    r = InProcess(capsys, ["train", f"--run_dir={run}", *flags, "--train.steps=6"], watch=run)
    assert_refused(r, "error: no checkpoint in ")


# 2. a directory that is not a run ---------------------------------------------------------------------


def test_another_tools_directory_is_not_taken_over(run_copy, tmp_path, capsys):
    _, flags = run_copy
    docsite = tmp_path / "docsite"  # another tool's folder, with its own config.yaml
    docsite.mkdir()
    (docsite / "config.yaml").write_text("site_name: My docs\nnav: []\n")
    (docsite / "index.md").write_text("# Welcome\n")
    r = InProcess(capsys, ["train", f"--run_dir={docsite}", *flags], watch=docsite)
    assert_refused(r, "is not empty and is not a tpu-llm run (no .tpu-llm-run; it holds config.yaml, index.md); "
                      "choose a new or empty --run_dir")


def test_a_run_directory_of_an_earlier_version_resumes_and_gets_its_marker(trained, run_copy, capsys):
    run, flags = run_copy
    assert (trained[0] / ".tpu-llm-run").exists()
    (run / ".tpu-llm-run").unlink()  # as a version without the marker left it
    r = InProcess(capsys, ["train", f"--run_dir={run}", *flags])
    assert r.code == 0 and "nothing to do: the run is already at step 4" in r.stdout, r
    assert r.stderr == "", r
    assert (run / ".tpu-llm-run").exists()


# 3. prompt characters the vocabulary lacks: an error ---------------------------------------------------

MISSING = "has 2 character(s) that the run's char vocabulary does not hold: 'Ж', '€'; remove or replace"


def test_unknown_prompt_characters_are_an_error_in_generate(run_copy, capsys):
    run, _ = run_copy
    r = InProcess(capsys, ["generate", "--run_dir", run, "--prompt", PROMPT, "--max_new_tokens", "5"], watch=run)
    assert_refused(r, "error: --prompt " + MISSING)
    assert r.stdout == "", r


def test_a_prompt_file_is_the_prompt_verbatim_and_checked_like_one(run_copy, tmp_path, capsys):
    run, _ = run_copy
    (tmp_path / "prompt.txt").write_bytes("\ufeffThe quick\n".encode("utf-8"))  # a BOM (dropped), a final newline
    r = InProcess(capsys, ["generate", "--run_dir", run, "--prompt_file", tmp_path / "prompt.txt",
                           "--max_new_tokens", "5", "--temperature", "0"], watch=run)
    assert r.code == 0 and r.stdout.startswith("--- sample 1 "), r
    assert r.stdout.split("\n", 1)[1].startswith("The quick\n"), r  # the sample: the prompt, then what follows
    (tmp_path / "prompt.txt").write_text(PROMPT, encoding="utf-8")
    r = InProcess(capsys, ["generate", "--run_dir", run, "--prompt_file", tmp_path / "prompt.txt"], watch=run)
    assert_refused(r, "error: --prompt_file " + MISSING)


def test_unknown_prompt_characters_of_the_end_samples_are_refused_before_training(run_copy, tmp_path, capsys):
    _, flags = run_copy
    r = InProcess(capsys, ["train", f"--run_dir={tmp_path / 'new'}", *flags, "--sample.num_samples=1",
                           f"--sample.prompt={PROMPT}"], watch=tmp_path / "new")
    assert_refused(r, "error: sample.prompt " + MISSING)
    assert r.after is None


# 4. the checkpoint fallback is said ----------------------------------------------------------------------


@pytest.mark.parametrize("command", ["generate", "export"])
def test_generate_and_export_say_when_the_newest_checkpoint_is_unreadable(run_copy, tmp_path, capsys, command):
    run, _ = run_copy
    (run / "checkpoints" / "ckpt-4.data-00000-of-00001").write_bytes(b"corrupt")
    args = ["--max_new_tokens", "3"] if command == "generate" else ["--output", tmp_path / "export"]
    r = InProcess(capsys, [command, "--run_dir", run, *args], watch=run)
    assert r.code == 0, r
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning   checkpoint ") and "ckpt-4 cannot be read" in lines[0], r
    assert lines[0].endswith("ckpt-2 instead"), r
    assert r.before == r.after
    assert ("at step 2 to" if command == "export" else "--- sample 1") in r.stdout, r


# 5. a directory given as data ------------------------------------------------------------------------------


def test_a_data_directory_gets_the_glob_to_use(run_copy, tmp_path, capsys):
    run, flags = run_copy
    corpus = Path(flags[0].split("=", 1)[1]).parent
    r = InProcess(capsys, ["train", f"--run_dir={tmp_path / 'new'}", *flags, f"--data.train={corpus}"],
                  watch=tmp_path / "new")
    assert_refused(r, f"error: data.train: '{corpus}' is a directory; give a glob of its files, e.g. "
                      f"--data.train='{corpus}/*.txt' (3 .txt files in it)")
    assert r.after is None
