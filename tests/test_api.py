"""The Python API (tpu_llm/api.py, docs/python-api.md): the page's example runs as written; greedy
`generate` equals arg-max decoding by full `logits`; `generate` and `tpu-llm generate` give the same
text; overrides are checked as on the command line; `import tpu_llm` loads no TensorFlow."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import tiny_config

import tpu_llm
from tpu_llm import cli
from tpu_llm.errors import UserError

pytestmark = pytest.mark.slow  # trains twice (the page's example, a Config object)

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "python-api.md"


@pytest.fixture(scope="module")
def page_run(tmp_path_factory):
    """docs/python-api.md's example, run as written in an empty directory; its namespace afterwards."""
    block = re.search(r"```python\n(.*?)```", PAGE.read_text(), re.S).group(1)
    where = tmp_path_factory.mktemp("page")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(where)
        namespace: dict = {}
        exec(compile(block, str(PAGE), "exec"), namespace)
    namespace["where"] = where
    return namespace


def test_the_pages_example_runs_as_written(page_run):
    summary, run = page_run["summary"], page_run["run"]
    assert summary["step"] == 20 and np.isfinite(summary["train_loss"])
    assert run.checkpoint.endswith("ckpt-20") and run.config.model.n_layer == 4  # the tiny preset
    assert page_run["text"].startswith("def ") and len(run.tokenizer.encode(page_run["text"])) == 4 + 40
    assert page_run["logits"].shape == (1, len(page_run["ids"]), run.tokenizer.vocab_size)
    assert len(page_run["beams"]) == 2 and all(beam.startswith("def ") for beam in page_run["beams"])


def test_greedy_generate_is_the_arg_max_of_the_full_logits_again_and_again(page_run):
    run = page_run["run"]
    ids = run.tokenizer.encode("def ")
    for _ in range(12):  # no cache here: the whole sequence again for each token
        ids.append(int(np.argmax(run.logits(ids)[0, -1])))
    assert run.generate("def ", max_new_tokens=12, temperature=0.0) == run.tokenizer.decode(ids)


def test_generate_is_what_the_command_line_prints(page_run, capsys):
    run = page_run["run"]
    texts = run.samples("def ", num_samples=2, max_new_tokens=16, temperature=0.9, top_k=20, seed=7)
    assert texts[0] == run.generate("def ", max_new_tokens=16, temperature=0.9, top_k=20, seed=7)
    assert cli.main(["generate", "--run_dir", str(page_run["where"] / "runs/api"), "--prompt", "def ",
                     "--num_samples", "2", "--max_new_tokens", "16", "--temperature", "0.9", "--top_k", "20",
                     "--seed", "7"]) == 0
    printed = capsys.readouterr().out
    for i, text in enumerate(texts):
        assert f"--- sample {i + 1} (temperature 0.9, top_k 20, top_p 1.0, seed {7 + i})\n{text}\n" in printed


def test_logits_refuse_ids_outside_the_vocabulary_or_the_context(page_run):
    run = page_run["run"]
    with pytest.raises(ValueError, match="ids must be in"):
        run.logits([0, run.tokenizer.vocab_size])
    with pytest.raises(ValueError, match="more than model.max_len"):
        run.logits([1] * (run.config.model.max_len + 1))


def test_overrides_are_checked_as_on_the_command_line(tmp_path):
    with pytest.raises(UserError, match="unknown config key 'train.stepz'.*train.steps"):
        tpu_llm.train("tiny", train__stepz=3)
    cfg = tiny_config(tmp_path)
    with pytest.raises(UserError, match="unknown config key"):
        tpu_llm.train(cfg, model__n_layerz=3)


def test_a_config_object_and_its_overrides_train(tmp_path):
    lines = []
    summary = tpu_llm.train(tiny_config(tmp_path), say=lines.append, samples=False, **{"train.steps": 2})
    assert summary["step"] == 2 and any(line.startswith("done") for line in lines)
    assert tpu_llm.load(summary["run_dir"]).checkpoint.endswith("ckpt-2")


def test_load_of_a_directory_without_a_run_is_one_user_error(tmp_path):
    with pytest.raises(UserError, match="is not a run directory"):
        tpu_llm.load(str(tmp_path))


def test_import_tpu_llm_loads_no_tensorflow():
    code = ("import sys, tpu_llm; assert 'tensorflow' not in sys.modules, 'tensorflow loaded'; "
            "assert callable(tpu_llm.load) and 'tensorflow' in sys.modules; tpu_llm.nothing")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert "AttributeError: module 'tpu_llm' has no attribute 'nothing'" in r.stderr, r.stderr[-2000:]


def test_beam_search_from_python_is_the_searchers_beams_and_what_the_command_line_prints(page_run, capsys):
    from tpu_llm.model.beam_search import BeamSearcher

    run, tokenizer = page_run["run"], page_run["run"].tokenizer
    settings = {"max_new_tokens": 12, "num_beams": 3, "length_penalty": 0.5, "early_stopping": "never"}
    texts = run.samples("def ", temperature=0.0, num_return_sequences=2, **settings)
    prompt = tokenizer.encode("def ")
    beams = BeamSearcher(run.model, tokenizer.eos_id, tokenizer.vocab_size).generate(
        prompt, 12, 3, 0.5, "never", num_return_sequences=2)
    assert texts == [tokenizer.decode(prompt + [i for i in beam.ids if i != tokenizer.eos_id]) for beam in beams]
    assert run.generate("def ", temperature=0.0, **settings) == texts[0]
    assert cli.main(["generate", "--run_dir", str(page_run["where"] / "runs/api"), "--prompt", "def ", "--temperature",
                     "0", "--max_new_tokens", "12", "--num_beams", "3", "--length_penalty", "0.5", "--early_stopping",
                     "never", "--num_return_sequences", "2"]) == 0
    printed = capsys.readouterr().out
    for i, (text, beam) in enumerate(zip(texts, beams)):
        assert (f"--- beam {i + 1} of 3 (score {beam.score:.4f}, length_penalty 0.5, early_stopping never)\n{text}\n"
                in printed)
    with pytest.raises(UserError, match="sample.num_beams=3 searches greedily: set sample.temperature=0"):
        run.generate("def ", **settings)  # the default temperature samples
