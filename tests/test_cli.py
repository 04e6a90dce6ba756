"""The command line, run as users run it: `python -m tpu_llm ...` in subprocesses.

Each subprocess pays TensorFlow's start-up, so the commands are started once per module and run
concurrently where they do not depend on each other; the tests then check their results.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import TINY_FLAGS, snapshot, write_corpus

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
TIMEOUT = 300  # seconds per command; a hang fails the tests instead of blocking them
SP_VOCAB = 400


@dataclasses.dataclass
class Result:
    args: list[str]
    returncode: int
    stdout: str
    stderr: str
    changes: tuple = ()  # (snapshot before, snapshot after) of the run directory, for user-error cases

    @property
    def errors(self) -> list[str]:
        """Our error lines (TensorFlow's own log lines on stderr are ignored)."""
        return [line for line in self.stderr.splitlines() if line.startswith("error:")]

    def __str__(self) -> str:
        return (f"tpu_llm {' '.join(self.args)} -> exit {self.returncode}\n--- stdout\n{self.stdout[-3000:]}"
                f"\n--- stderr\n{self.stderr[-3000:]}")


class Command:
    """`python -m tpu_llm *args` started in the background, output captured to files."""

    def __init__(self, logs: Path, name: str, *args: str):
        self.args = list(args)
        self.out, self.err = logs / f"{name}.stdout", logs / f"{name}.stderr"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "tpu_llm", *self.args], cwd=REPO, env=ENV,
                                         stdout=out, stderr=err, stdin=subprocess.DEVNULL)

    def result(self) -> Result:
        try:
            code = self.proc.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            code = -9
        return Result(self.args, code, self.out.read_text(errors="replace"), self.err.read_text(errors="replace"))


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli")
    logs = tmp / "logs"
    logs.mkdir()
    write_corpus(tmp / "corpus")
    paths = {"tmp": tmp, "corpus": str(tmp / "corpus" / "*.txt"), "run": tmp / "run",
             "sp": tmp / "sp" / "sp.model", "shards": tmp / "shards", "missing": str(tmp / "nothing" / "*.txt")}
    started: list[Command] = []

    def start(name, *args):
        started.append(Command(logs, name, *args))
        return started[-1]

    try:
        # 1. train, and (concurrently) tokenizer train -> data prepare with that tokenizer
        train = start("train", "train", f"--run_dir={paths['run']}", f"--data.train={paths['corpus']}", *TINY_FLAGS)
        results = {"tokenizer": start("tokenizer", "tokenizer", "train", "--input", paths["corpus"], "--vocab_size",
                                      str(SP_VOCAB), "--output", str(paths["sp"])).result()}
        results["prepare"] = start("prepare", "data", "prepare", "--input", paths["corpus"], "--output",
                                   str(paths["shards"]), "--shards", "2", "--tokenizer", "sentencepiece",
                                   "--tokenizer_model", str(paths["sp"])).result()
        results["train"] = train.result()

        # 2. generate from the run; user mistakes against copies of the (existing) run directory
        bad = {}
        for name in ("unknown_key", "missing_glob"):
            bad[name] = tmp / f"run_{name}"
            if paths["run"].is_dir():
                shutil.copytree(paths["run"], bad[name])
            else:  # training failed (its test says why); still check nothing gets written
                bad[name].mkdir()
                (bad[name] / "keep.txt").write_text("x")
        before = {name: snapshot(d) for name, d in bad.items()}
        generate = start("generate", "generate", "--run_dir", str(paths["run"]), "--max_new_tokens", "5",
                         "--prompt", "ab")
        unknown = start("unknown_key", "train", f"--run_dir={bad['unknown_key']}", f"--data.train={paths['corpus']}",
                        "--model.n_layr=1")
        missing = start("missing_glob", "train", f"--run_dir={bad['missing_glob']}",
                        f"--data.train={paths['missing']}", *TINY_FLAGS)
        results.update(generate=generate.result(), unknown_key=unknown.result(), missing_glob=missing.result())
        for name, d in bad.items():
            results[name].changes = (before[name], snapshot(d))
        yield results, paths
    finally:
        for command in started:  # only our own processes, if a failure left any running
            if command.proc.poll() is None:
                command.proc.kill()
                command.proc.wait()


@pytest.mark.slow
def test_tokenizer_train(cli):
    results, paths = cli
    r = results["tokenizer"]
    assert r.returncode == 0 and not r.errors, r
    assert f"wrote {paths['sp']}: {SP_VOCAB} pieces from 3 files" in r.stdout, r
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(paths["sp"]))
    assert sp.get_piece_size() == SP_VOCAB
    text = "héllo wörld ✓ 日本語\n\tx  y"
    assert sp.decode(sp.encode(text)) == text


@pytest.mark.slow
def test_data_prepare(cli):
    results, paths = cli
    r = results["prepare"]
    assert r.returncode == 0 and not r.errors, r
    shards = paths["shards"]
    assert sorted(p.name for p in shards.glob("*.tfrecord")) == ["data-00000-of-00002.tfrecord",
                                                                 "data-00001-of-00002.tfrecord"]
    assert json.loads((shards / "tokenizer.json").read_text())["kind"] == "sentencepiece"
    assert (shards / "tokenizer.model").read_bytes() == paths["sp"].read_bytes()
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(paths["sp"]))
    files = sorted((paths["tmp"] / "corpus").glob("*.txt"))
    meta = json.loads((shards / "meta.json").read_text())
    assert meta["files"] == 3 and meta["shards"] == 2
    assert meta["tokens"] == sum(len(sp.encode(f.read_text(encoding="utf-8"))) + 1 for f in files)
    assert f"--data.train='{shards}/*.tfrecord' --data.tokenizer=sentencepiece" in r.stdout


@pytest.mark.slow
def test_train(cli):
    results, paths = cli
    r = results["train"]
    assert r.returncode == 0 and not r.errors, r
    assert "done      step 4: train loss" in r.stdout, r
    run = paths["run"]
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["model"]["n_layer"] == 1 and saved["data"]["train"] == paths["corpus"]
    assert saved["model"]["vocab_size"] == 257  # filled in from the byte tokenizer
    assert json.loads((run / "tokenizer.json").read_text()) == {"kind": "byte"}
    assert (run / "checkpoints" / "ckpt-4.index").exists()
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if m["split"] == "train"] == [2, 4]
    assert [m["step"] for m in metrics if m["split"] == "validation"] == [4]
    assert all(0 < m["loss"] < 20 for m in metrics if m["split"] in ("train", "validation"))
    assert [m["step"] for m in metrics if m["split"] == "goodput"] == [4]  # with the checkpoint (docs/goodput.md)
    assert [m["step"] for m in metrics if m["split"] == "summary"] == [4]


@pytest.mark.slow
def test_generate(cli):
    results, _ = cli
    r = results["generate"]
    assert r.returncode == 0 and not r.errors, r
    header = "--- sample 1 (temperature 0.8, top_k 0, top_p 1.0, seed 0)\n"
    assert header in r.stdout, r
    sample = r.stdout.split(header, 1)[1]
    assert sample.startswith("ab") and "--- sample 2" not in sample


@pytest.mark.slow
@pytest.mark.parametrize("case, expected", [
    ("unknown_key", "error: tpu-llm train: unknown flag --model.n_layr; did you mean --model.n_layer?"),
    ("missing_glob", "error: data.train: no files match '{missing}'"),
])
def test_user_error_exits_2_with_one_line_and_leaves_run_dir(cli, case, expected):
    results, paths = cli
    r = results[case]
    assert r.returncode == 2, r
    assert len(r.errors) == 1, r
    assert r.errors[0].startswith(expected.format(**paths)), r
    assert "Traceback" not in r.stderr, r
    before, after = r.changes
    assert before == after
    assert len(before) > 1  # a real run directory was there to be left alone


# --- in-process (no TensorFlow): how command-line overrides reach the config -------------------------


def test_repeated_set_flags_all_apply(monkeypatch, capsys):
    from tpu_llm import cli, config
    from tpu_llm.errors import UserError

    seen = []

    def fake_load_config(path, overrides):  # stands in for the real one: record, then stop before training
        seen.append((path, overrides))
        raise UserError("stop here")

    monkeypatch.setattr(config, "load_config", fake_load_config)
    code = cli.main(["train", "--config", "c.yaml", "--set", "model.n_layer=2", "--set", "train.lr=3e-4",
                     "--set=sample.prompt=def main(): 'x'", "--data.seq_len=8"])
    assert code == 2 and capsys.readouterr().err == "error: stop here\n"
    assert seen == [("c.yaml", {"model.n_layer": 2, "train.lr": "3e-4", "sample.prompt": "def main(): 'x'",
                                "data.seq_len": 8})]


@pytest.mark.slow
def test_stderr_holds_only_tpu_llms_lines(cli):
    """docs/cli.md: without --verbose no native log line reaches stderr (issue 30: SentencePiece's
    `normalizer.cc(51) LOG(INFO)` line showed in data prepare); train starts by saying what it loads."""
    results, _ = cli
    ours = ("step ", "eval ", "files ")  # the progress bars' lines and the eval lines beside them
    for name in ("train", "tokenizer", "prepare"):
        r = results[name]
        assert r.returncode == 0, r
        assert [line for line in r.stderr.splitlines() if not line.startswith(ours)] == [], r
    assert results["train"].stdout.splitlines()[0] == "starting  loading TensorFlow ...", results["train"]
