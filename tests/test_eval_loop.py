"""lm-evaluation-harness tasks inside the training loop (train.eval_tasks, tpu_llm/eval/in_loop.py; issue 49).

A tiny byte-tokenizer run evaluates the local task tiny_choice (tests/data/eval_tasks) on its live weights
twice; its "tasks" records must equal what `tpu_llm.load(run_dir).evaluate` gives on the checkpoint saved at
the end (the live weights and the checkpoint are the same model), a misspelt task must stop the run before
its first step, and `tpu-llm report` shows the numbers.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local JSON files only; before `datasets` is imported
pytest.importorskip("lm_eval", reason="the evaluation tests need lm-eval: pip install -e '.[eval]'")
from helpers import TINY_FLAGS, metrics, tiny_config, write_corpus  # noqa: E402

import tpu_llm  # noqa: E402
from tpu_llm import cli  # noqa: E402
from tpu_llm.errors import UserError  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TASKS_DIR = "tests/data/eval_tasks"  # the YAML's data_files are relative to the repository
LIMIT = 8


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(REPO)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run of 4 steps that evaluates tiny_choice at step 2 and at the end (step 4); its lines."""
    tmp = tmp_path_factory.mktemp("evalloop")
    os.chdir(REPO)
    lines = []
    cfg = tiny_config(tmp, **{"train.eval_tasks": "tiny_choice,tiny_ppl", "train.eval_include_path": TASKS_DIR,
                              "train.eval_tasks_every": 2, "train.eval_tasks_limit": LIMIT})
    tpu_llm.train(cfg, say=lines.append, samples=False)
    return Path(cfg.run_dir), lines


def test_tasks_are_logged_and_equal_an_evaluation_of_the_checkpoint(run):
    run_dir, lines = run
    records = metrics(run_dir, "tasks")
    assert [r["step"] for r in records] == [2, 4]
    perplexities = {f"tiny_ppl/{m}" for m in ("word_perplexity", "byte_perplexity", "bits_per_byte")}
    assert set(records[-1]) == {"split", "step", "tiny_choice/acc", "tiny_choice/acc_norm"} | perplexities
    results = tpu_llm.load(str(run_dir)).evaluate(["tiny_choice", "tiny_ppl"], include_path=TASKS_DIR, limit=LIMIT)
    for key in sorted(set(records[-1]) - {"split", "step"}):  # the perplexities: any other weights would show
        task, metric = key.split("/")
        assert records[-1][key] == pytest.approx(results["results"][task][f"{metric},none"], rel=1e-6), key
    assert records[0]["tiny_ppl/bits_per_byte"] != records[-1]["tiny_ppl/bits_per_byte"]  # two steps of training
    # (the progress lines go to the progress stream, not to `say`; the record is the same numbers)
    from tpu_llm.eval.in_loop import line

    assert line(4, {"tiny_choice/acc": 0.375}) == "tasks     step 4: tiny_choice acc 0.375"
    goodput = [json.loads(x) for x in open(run_dir / "goodput.jsonl")]
    evaluations = [g["step"] for g in goodput if g["kind"] == "evaluation"]
    assert evaluations == [2, 4, 4]  # the tasks at 2, the validation loss and the tasks at 4
    assert (run_dir / "logs" / "tasks").is_dir()  # TensorBoard's folder of the split


def test_report_shows_the_tasks_latest_values(run, capsys):
    run_dir, _ = run
    assert cli.main(["report", "--run_dir", str(run_dir), "--plot", str(run_dir.parent / "report.png")]) == 0
    out = capsys.readouterr().out
    acc = metrics(run_dir, "tasks")[-1]["tiny_choice/acc"]
    assert f"tasks     tiny_choice/acc: {acc:.4f} at step 4" in out, out


def test_an_unknown_task_stops_the_run_before_its_first_step(tmp_path, capsys, monkeypatch):
    from lm_eval.tasks import TaskManager

    from tpu_llm.eval import run as eval_run

    # the local tasks only: an unknown name makes task_manager index lm-eval's own ~15,000 too (~15 s)
    monkeypatch.setattr(eval_run, "task_manager", lambda path, names: TaskManager(include_path=path,
                                                                                  include_defaults=False))
    write_corpus(tmp_path / "corpus")
    flags = [f"--run_dir={tmp_path / 'run'}", f"--data.train={tmp_path / 'corpus' / '*.txt'}", *TINY_FLAGS,
             "--train.eval_tasks=tiny_choise", f"--train.eval_include_path={TASKS_DIR}"]
    assert cli.main(["train", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: train.eval_tasks: lm-eval has no task 'tiny_choise'; did you mean tiny_choice"), err
    assert "give your own task YAML's folder with train.eval_include_path=DIR" in err and err.count("\n") == 1, err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_missing_include_path_is_one_line_at_the_start(tmp_path):
    with pytest.raises(UserError, match=r"^train.eval_include_path='nowhere' is not a directory"):
        tpu_llm.train(tiny_config(tmp_path, **{"train.eval_tasks": "tiny_choice",
                                               "train.eval_include_path": "nowhere"}))
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_an_include_path_without_tasks_is_refused_with_the_config():
    with pytest.raises(UserError, match=r"^config: train.eval_include_path='tests/data/eval_tasks' is set but "
                                        r"train.eval_tasks is empty"):
        tiny_config(Path("unused"), **{"data.train": "", "train.eval_include_path": TASKS_DIR})


@pytest.mark.parametrize("strategy", ["multi_worker", "parameter_server"])
def test_a_cluster_strategy_is_refused_with_the_config(strategy):
    """The chief evaluates alone: a multi-worker cluster's other processes would wait in their collectives."""
    with pytest.raises(UserError, match=rf"^config: train.eval_tasks runs lm-eval on one process, which "
                                        rf"strategy={strategy} does not support yet: set train.eval_tasks=''"):
        tiny_config(Path("unused"), **{"data.train": "", "strategy": strategy, "train.eval_tasks": "tiny_choice"})
