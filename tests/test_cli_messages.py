"""What the command line says, through the real entry point (`python -m tpu_llm ...` in subprocesses): --help
of every command, arguments and config files refused in one line before any work (a misspelt flag
before TensorFlow loads), and nothing on stderr but our own lines.

Every command is started once per module (at most `PARALLEL` at a time); the tests then check each
result: the exit status, that no traceback was printed, the message, and the run directory's content
hashes before and after. The environment has no TF_CPP_MIN_LOG_LEVEL, as a user's shell has none.
Mistakes caught before the first step that need TensorFlow (data, vocabulary, checkpoints, run
directories) run in one process: test_user_errors.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import TINY_FLAGS, assert_refused, snapshot, write_corpus

import tpu_llm
from tpu_llm import cli

pytestmark = pytest.mark.slow  # the CLI in subprocesses

REPO = Path(__file__).resolve().parent.parent
ENV = {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "TPU_LLM_VERBOSE")}
TIMEOUT = 300
PARALLEL = 4  # TensorFlow processes at a time (each holds ~0.5 GB)
FLAGS = [*TINY_FLAGS, "--checkpoint.every_steps=2", "--data.tokenizer=char"]
COMMANDS = list(cli.COMMANDS)  # every registered command, so a new one cannot go without --help


class Run:
    """`python [-X importtime] -m tpu_llm *args`; `watch` is the directory hashed before and after."""

    def __init__(self, args: list, watch: Path | None = None, python_flags: tuple = ()):
        # bytes stay bytes: an argument that is not UTF-8, as a Latin-1 terminal passes it
        self.args = [a if isinstance(a, bytes) else str(a) for a in args]
        self.watch, self.python_flags = watch, python_flags
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
        return (f"tpu_llm {' '.join(map(os.fsdecode, self.args))} -> exit {self.code}\n--- stdout\n{self.stdout[-3000:]}\n"
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
def commands(tmp_path_factory):
    """The commands, run in parallel: help, wrong arguments (all refused before TensorFlow loads, so
    they are fast), `info` and one training run (their stderr: the last tests); ({name: Run}, tmp)."""
    tmp = tmp_path_factory.mktemp("cli_messages")
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
    runs["base"] = Run(["train", f"--run_dir={base}", f"--data.train={tmp / 'corpus' / '*.txt'}", *FLAGS])
    runs["info"] = Run(["info"])
    run_all(list(runs.values()))
    assert runs["base"].code == 0, runs["base"]
    runs["generate typo"] = Run(["generate", "--run_dir", base, "--temprature", "0.5", "--max_new_tokens", "5"],
                                watch=base, python_flags=("-X", "importtime"))
    (tmp / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    for case, flags, _ in GENERATE_REFUSED:
        flags = [str(f).format(tmp=tmp) if isinstance(f, str) else f for f in flags]
        runs[f"generate {case}"] = Run(["generate", "--run_dir", base, *flags], watch=base,
                                       python_flags=("-X", "importtime"))
    run_all([runs["generate typo"]] + [runs[f"generate {case}"] for case, _, _ in GENERATE_REFUSED])
    yield runs, tmp


# generate's arguments that are refused before the model loads: (case, flags, the message)
GENERATE_REFUSED = [
    ("a billion tokens", ["--max_new_tokens", "1000000000"],
     "error: --max_new_tokens=1000000000 must be between 1 and 1,000,000"),
    ("no tokens", ["--max_new_tokens", "0"], "error: --max_new_tokens=0 must be between 1 and 1,000,000"),
    ("infinite temperature", ["--temperature", "inf"], "error: --temperature=inf must be a finite number >= 0"),
    ("nan temperature", ["--temperature=nan"], "error: --temperature=nan must be a finite number >= 0"),
    ("negative temperature", ["--temperature", "-0.5"], "error: --temperature=-0.5 must be a finite number >= 0"),
    ("top_p 0", ["--top_p", "0"], "error: --top_p=0.0 must be in (0, 1]"),
    ("top_p above 1", ["--top_p", "1.5"], "error: --top_p=1.5 must be in (0, 1]"),
    ("negative top_k", ["--top_k", "-1"], "error: --top_k=-1 must be >= 0"),
    ("no samples", ["--num_samples", "0"], "error: --num_samples=0 must be between 1 and 1,000"),
    ("a seed beyond 64 bits", ["--seed", str(2**63)], "error: --seed=9223372036854775808 must fit in 64 bits"),
    ("a prompt not UTF-8", ["--prompt", b"caf\xe9"],  # Python gets a lone surrogate for the byte
     "error: --prompt: 'caf\\xe9' is not UTF-8 text (byte 0xe9 at character 3); tpu-llm reads its arguments as "
     "UTF-8: convert the text, or run from a terminal or script in a UTF-8 locale (e.g. LANG=C.UTF-8), or put the "
     "text in a UTF-8 file and pass --prompt_file FILE"),
    ("a prompt file not UTF-8", ["--prompt_file", "{tmp}/latin1.txt"],
     "is not UTF-8 text (byte 0xe9 at offset 3); convert it to UTF-8 first"),
    ("a missing prompt file", ["--prompt_file", "{tmp}/none.txt"],
     "none.txt cannot be read (No such file or directory)"),
    ("a prompt twice", ["--prompt", "a", "--prompt_file", "{tmp}/latin1.txt"],
     "error: give --prompt or --prompt_file, not both"),
    ("no beams", ["--num_beams", "0"], "error: --num_beams=0 must be between 1 (off: sample) and 64"),
    ("too many beams", ["--num_beams", "65", "--temperature", "0"], "error: --num_beams=65 must be between 1"),
    ("beams while sampling", ["--num_beams", "4"],
     "error: --num_beams=4 searches greedily: add --temperature 0 (not 0.8; beam sampling is not supported)"),
    ("more sequences than beams", ["--num_beams", "4", "--temperature", "0", "--num_return_sequences", "5"],
     "error: --num_return_sequences=5 must be between 1 and --num_beams=4"),
    ("samples of a beam search", ["--num_beams", "4", "--temperature", "0", "--num_samples", "2"],
     "error: --num_samples=2 with --num_beams=4: beam search is deterministic"),
    ("early stopping misspelt", ["--num_beams", "4", "--temperature", "0", "--early_stopping", "nevr"],
     "error: --early_stopping='nevr'; valid choices: false, true, never"),
    ("infinite length penalty", ["--length_penalty", "inf"], "error: --length_penalty=inf must be between -4 and 4"),
    ("length penalty 1e39", ["--length_penalty", "1e39"], "error: --length_penalty=1e+39 must be between -4 and 4"),
    ("length penalty -1e39", ["--length_penalty=-1e39"], "error: --length_penalty=-1e+39 must be between -4 and 4"),
]


# 1. --help and -h for every command ------------------------------------------------------------------


@pytest.mark.parametrize("name", COMMANDS)
def test_every_command_has_help(commands, name):
    r = commands[0][f"help {name}"]
    assert r.code == 0 and r.stderr == "", r
    assert r.stdout.startswith(f"usage: tpu-llm {name} "), r
    assert "flags:" in r.stdout and "--help" in r.stdout and f"example:\n  tpu-llm {name} " in r.stdout, r
    if name in ("train", "plan"):  # the config keys, and where their reference is
        assert "tpu-llm config --reference" in r.stdout and "docs/configuration.md" in r.stdout, r
        assert "model       n_layer n_head n_embd" in r.stdout and "train       steps batch_size" in r.stdout, r


def test_top_level_help_lists_every_command_and_short_h_works(commands):
    runs = commands[0]
    r = runs["help"]
    assert r.code == 0 and r.stderr == "", r
    for name in COMMANDS:
        assert f"\n  {name} " in r.stdout, (name, r)
    assert runs["help -h train"].code == 0 and runs["help -h train"].stdout == runs["help train"].stdout


# 2. arguments are checked before any work --------------------------------------------------------------


def test_a_misspelt_flag_is_refused_before_tensorflow_loads(commands):
    r = commands[0]["generate typo"]
    assert_refused(r, "error: tpu-llm generate: unknown flag --temprature; did you mean --temperature?")
    assert "--- sample" not in r.stdout, r  # nothing was generated first
    imported = {line.split("|")[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    assert "tpu_llm.cli" in imported and "tensorflow" not in imported, sorted(imported)


@pytest.mark.parametrize("case, flags, message", GENERATE_REFUSED, ids=[c[0] for c in GENERATE_REFUSED])
def test_generate_checks_its_arguments_before_tensorflow_loads(commands, case, flags, message):
    r = commands[0][f"generate {case}"]
    assert_refused(r, message)
    imported = {line.split("|")[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    assert "tpu_llm.cli" in imported and "tensorflow" not in imported, sorted(imported)


def test_an_unknown_command_names_the_nearest(commands):
    runs = commands[0]
    assert_refused(runs["trian"], "error: 'trian' is not a command; did you mean 'train'? commands: train, generate,")
    assert_refused(runs["data prepar"], "error: 'data prepar' is not a command; did you mean 'data prepare'?")


# 3. config files ------------------------------------------------------------------------------------------


def test_a_config_that_is_a_directory_or_not_utf8_is_one_line(commands):
    runs, tmp = commands
    assert_refused(runs["config dir"], "is a directory; give a YAML file, e.g. --config ")
    assert_refused(runs["config latin1"], f"error: {tmp / 'latin1.yaml'}: not UTF-8 text (byte 0xe9 at offset 21)")
    assert not (tmp / "never").exists()


# 4. noise -------------------------------------------------------------------------------------------------


def test_info_prints_nothing_but_its_own_lines(commands):
    r = commands[0]["info"]
    assert r.code == 0 and r.stdout.startswith(f"tpu-llm {tpu_llm.__version__}, tensorflow "), r
    assert r.stderr == "", r  # no cuInit line, no absl or oneDNN notice


def test_training_stderr_holds_only_our_lines(commands):
    r = commands[0]["base"]
    assert all(line.startswith(("step ", "eval ")) for line in r.stderr.splitlines()), r


def test_help_into_a_pipe_closed_early_is_no_error():
    """`tpu-llm --help | head -0`: the reader has left before help is written; no BrokenPipeError traceback."""
    p = subprocess.Popen([sys.executable, "-m", "tpu_llm", "train", "--help"], cwd=REPO, env=ENV,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    p.stdout.close()  # before the interpreter has even started: the first write meets a closed pipe
    err = p.stderr.read()
    assert p.wait(timeout=TIMEOUT) == 0 and "Traceback" not in err and "BrokenPipe" not in err, err
