"""A newcomer's first hour (issue 15), through the real entry point: `python -m tpu_llm ...` in subprocesses.

Every command is started once per module (at most `PARALLEL` at a time); the tests then check each
result: the exit status, that no traceback was printed, the message, and the run directory's content
hashes before and after. The environment has no TF_CPP_MIN_LOG_LEVEL, as a user's shell has none.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import snapshot, write_corpus

from tpu_llm import cli

REPO = Path(__file__).resolve().parent.parent
ENV = {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "TPU_LLM_VERBOSE")}
TIMEOUT = 300
PARALLEL = 4  # TensorFlow processes at a time (each holds ~0.5 GB)
TINY = ["--model.n_layer=1", "--model.n_head=2", "--model.n_embd=16", "--model.max_len=16", "--data.seq_len=8",
        "--train.batch_size=2", "--train.steps=4", "--train.steps_per_loop=2", "--train.warmup_steps=1",
        "--train.eval_steps=1", "--sample.num_samples=0", "--checkpoint.every_steps=2", "--data.tokenizer=char"]
PROMPT = "Hello Жук €!"  # Ж and € are not in the corpus of conftest.write_corpus
COMMANDS = list(cli.COMMANDS)  # every registered command, so a new one cannot go without --help


class Run:
    """`python [-X importtime] -m tpu_llm *args`; `watch` is the directory hashed before and after."""

    def __init__(self, args: list[str], watch: Path | None = None, python_flags: tuple = ()):
        self.args, self.watch, self.python_flags = [str(a) for a in args], watch, python_flags
        self.proc = None

    def start(self) -> "Run":
        self.before = snapshot(self.watch) if self.watch else None
        self.proc = subprocess.Popen([sys.executable, *self.python_flags, "-m", "tpu_llm", *self.args], cwd=REPO,
                                     env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     stdin=subprocess.DEVNULL)
        return self

    def finish(self) -> "Run":
        try:
            self.stdout, self.stderr = self.proc.communicate(timeout=0 if self.proc.poll() is None else TIMEOUT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.stdout, self.stderr = self.proc.communicate()
        self.code = self.proc.returncode
        self.after = snapshot(self.watch) if self.watch else None
        return self

    def __str__(self) -> str:
        return (f"tpu_llm {' '.join(self.args)} -> exit {self.code}\n--- stdout\n{self.stdout[-3000:]}\n"
                f"--- stderr\n{self.stderr[-3000:]}")


def run_all(runs: list[Run]) -> None:
    """Run them, `PARALLEL` at a time; one that hangs is killed after TIMEOUT seconds (and fails its test)."""
    waiting, running = list(runs), []
    while waiting or running:
        while waiting and len(running) < PARALLEL:
            running.append(waiting.pop(0).start())
            running[-1].started = time.time()
        for r in list(running):
            if r.proc.poll() is not None or time.time() - r.started > TIMEOUT:
                running.remove(r.finish())  # finish() kills a hung one
        time.sleep(0.05)


@pytest.fixture(scope="module")
def hour(tmp_path_factory):
    """The commands that need their own process, run in parallel: help, wrong arguments (all refused
    before TensorFlow loads, so they are fast), `info` and one training run (their stderr: item 9)."""
    tmp = tmp_path_factory.mktemp("newcomer")
    write_corpus(tmp / "corpus")
    (tmp / "latin1.yaml").write_bytes("sample:\n  prompt: caf\xe9\n".encode("latin-1"))
    base = tmp / "run"
    runs: dict[str, Run] = {f"help {name}": Run([*name.split(), "--help"]) for name in COMMANDS}
    runs["help -h train"] = Run(["train", "-h"])
    runs["help"] = Run(["--help"])
    runs["trian"] = Run(["trian", "--run_dir", base])
    runs["data prepar"] = Run(["data", "prepar", "--input", tmp / "corpus"])
    runs["config dir"] = Run(["train", "--config", REPO / "configs", f"--run_dir={tmp / 'never'}"])
    runs["config latin1"] = Run(["train", "--config", tmp / "latin1.yaml", f"--run_dir={tmp / 'never'}"])
    runs["base"] = Run(["train", f"--run_dir={base}", f"--data.train={tmp / 'corpus' / '*.txt'}", *TINY])
    runs["info"] = Run(["info"])
    run_all(list(runs.values()))
    assert runs["base"].code == 0, runs["base"]
    runs["generate typo"] = Run(["generate", "--run_dir", base, "--temprature", "0.5", "--max_new_tokens", "5"],
                                watch=base, python_flags=("-X", "importtime"))
    run_all([runs["generate typo"]])
    yield runs, tmp


class InProcess:
    """`tpu-llm ARGS` through `cli.main` in this process (TensorFlow is loaded once for all of them):
    exit status, stdout, stderr, and the snapshots of `watch` before and after."""

    def __init__(self, capsys, args: list, watch: Path | None = None):
        from tpu_llm import cli

        self.args, self.watch = [str(a) for a in args], watch
        self.before = snapshot(watch) if watch else None
        capsys.readouterr()
        self.code = cli.main(self.args)
        self.stdout, self.stderr = capsys.readouterr()
        self.after = snapshot(watch) if watch else None

    __str__ = Run.__str__


@pytest.fixture
def run_copy(hour, tmp_path):
    """A copy of the module's trained run (char vocabulary, checkpoints at steps 2 and 4), and the flags
    that trained it."""
    copy = tmp_path / "run"
    shutil.copytree(hour[1] / "run", copy)
    return copy, [f"--data.train={hour[1] / 'corpus' / '*.txt'}", *TINY]


def ours(stderr: str) -> list[str]:
    """stderr's lines, `-X importtime`'s report left out."""
    return [line for line in stderr.splitlines() if not line.startswith("import time:")]


def assert_refused(r: Run, message: str) -> None:
    """Exit 2, one `error:` line holding `message` and nothing else on stderr, the watched directory unchanged."""
    assert r.code == 2, r
    assert ours(r.stderr) == [line for line in ours(r.stderr) if line.startswith("error: ")] and len(ours(r.stderr)) == 1, r
    assert message in r.stderr, r
    assert "Traceback" not in r.stderr + r.stdout, r
    if r.watch:
        assert r.before == r.after, f"{r.watch} changed:\n{r}"


# 1. --help and -h for every command ------------------------------------------------------------------


@pytest.mark.parametrize("name", COMMANDS)
def test_every_command_has_help(hour, name):
    r = hour[0][f"help {name}"]
    assert r.code == 0 and r.stderr == "", r
    assert r.stdout.startswith(f"usage: tpu-llm {name} "), r
    assert "flags:" in r.stdout and "--help" in r.stdout and f"example:\n  tpu-llm {name} " in r.stdout, r
    if name in ("train", "plan"):  # the config keys, and where their reference is
        assert "tpu-llm config --reference" in r.stdout and "docs/configuration.md" in r.stdout, r
        assert "model       n_layer n_head n_embd" in r.stdout and "train       steps batch_size" in r.stdout, r


def test_top_level_help_lists_every_command_and_short_h_works(hour):
    runs = hour[0]
    r = runs["help"]
    assert r.code == 0 and r.stderr == "", r
    for name in COMMANDS:
        assert f"\n  {name} " in r.stdout, (name, r)
    assert runs["help -h train"].code == 0 and runs["help -h train"].stdout == runs["help train"].stdout


# 2. arguments are checked before any work --------------------------------------------------------------


def test_a_misspelt_flag_is_refused_before_tensorflow_loads(hour):
    r = hour[0]["generate typo"]
    assert_refused(r, "error: tpu-llm generate: unknown flag --temprature; did you mean --temperature?")
    assert "--- sample" not in r.stdout, r  # nothing was generated first
    imported = {line.split("|")[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    assert "tpu_llm.cli" in imported and "tensorflow" not in imported, sorted(imported)


def test_an_unknown_command_names_the_nearest(hour):
    runs = hour[0]
    assert_refused(runs["trian"], "error: 'trian' is not a command; did you mean 'train'? commands: train, generate,")
    assert_refused(runs["data prepar"], "error: 'data prepar' is not a command; did you mean 'data prepare'?")


# 3. config files ------------------------------------------------------------------------------------------


def test_a_config_that_is_a_directory_or_not_utf8_is_one_line(hour):
    runs, tmp = hour
    assert_refused(runs["config dir"], "is a directory; give a YAML file, e.g. --config ")
    assert_refused(runs["config latin1"], f"error: {tmp / 'latin1.yaml'}: not UTF-8 text (byte 0xe9 at offset 21)")
    assert not (tmp / "never").exists()


# 4. every check before the first step and before the run directory is written --------------------------
# (in this process, through cli.main: each case fails before training, so a process of its own would cost
# TensorFlow's start-up for nothing)


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


# 5. a directory that is not a run ---------------------------------------------------------------------


def test_another_tools_directory_is_not_taken_over(run_copy, tmp_path, capsys):
    _, flags = run_copy
    docsite = tmp_path / "docsite"  # another tool's folder, with its own config.yaml
    docsite.mkdir()
    (docsite / "config.yaml").write_text("site_name: My docs\nnav: []\n")
    (docsite / "index.md").write_text("# Welcome\n")
    r = InProcess(capsys, ["train", f"--run_dir={docsite}", *flags], watch=docsite)
    assert_refused(r, "is not empty and is not a tpu-llm run (no .tpu-llm-run; it holds config.yaml, index.md); "
                      "choose a new or empty --run_dir")


def test_a_run_directory_of_an_earlier_version_resumes_and_gets_its_marker(hour, run_copy, capsys):
    run, flags = run_copy
    assert (hour[1] / "run" / ".tpu-llm-run").exists()
    (run / ".tpu-llm-run").unlink()  # as a version without the marker left it
    r = InProcess(capsys, ["train", f"--run_dir={run}", *flags])
    assert r.code == 0 and "nothing to do: the run is already at step 4" in r.stdout, r
    assert r.stderr == "", r
    assert (run / ".tpu-llm-run").exists()


# 6. prompt characters the vocabulary lacks: an error ---------------------------------------------------

MISSING = "has 2 character(s) that the run's char vocabulary does not hold: 'Ж', '€'; remove or replace"


def test_unknown_prompt_characters_are_an_error_in_generate(run_copy, capsys):
    run, _ = run_copy
    r = InProcess(capsys, ["generate", "--run_dir", run, "--prompt", PROMPT, "--max_new_tokens", "5"], watch=run)
    assert_refused(r, "error: --prompt " + MISSING)
    assert r.stdout == "", r


def test_unknown_prompt_characters_of_the_end_samples_are_refused_before_training(run_copy, tmp_path, capsys):
    _, flags = run_copy
    r = InProcess(capsys, ["train", f"--run_dir={tmp_path / 'new'}", *flags, "--sample.num_samples=1",
                           f"--sample.prompt={PROMPT}"], watch=tmp_path / "new")
    assert_refused(r, "error: sample.prompt " + MISSING)
    assert r.after is None


# 7. the checkpoint fallback is said ----------------------------------------------------------------------


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


# 8. a directory given as data ------------------------------------------------------------------------------


def test_a_data_directory_gets_the_glob_to_use(run_copy, tmp_path, capsys):
    run, flags = run_copy
    corpus = Path(flags[0].split("=", 1)[1]).parent
    r = InProcess(capsys, ["train", f"--run_dir={tmp_path / 'new'}", *flags, f"--data.train={corpus}"],
                  watch=tmp_path / "new")
    assert_refused(r, f"error: data.train: '{corpus}' is a directory; give a glob of its files, e.g. "
                      f"--data.train='{corpus}/*.txt' (3 .txt files in it)")
    assert r.after is None


# 9. noise -------------------------------------------------------------------------------------------------


def test_info_prints_nothing_but_its_own_lines(hour):
    r = hour[0]["info"]
    assert r.code == 0 and r.stdout.startswith("tensorflow "), r
    assert r.stderr == "", r  # no cuInit line, no absl or oneDNN notice


def test_training_stderr_holds_only_our_lines(hour):
    r = hour[0]["base"]
    assert all(line.startswith(("step ", "eval ")) for line in r.stderr.splitlines()), r
