"""Files from outside (issue 28, trust boundaries): a safetensors checkpoint and its shard index, a
Hugging Face config.json, a tokenizer.json or our own tokenizer spec, a YAML config. Whatever they
hold, reading them ends in success or in one UserError (one line, naming the file and the fix) within
a bound of time and memory: never another exception, a read outside the file, a crash or a hang.

First the defects found, one test each (every one failed before its fix); then property-based
tests (hypothesis, derandomized: the same examples on every run) for each parser, over random and
damaged inputs. A hang shows as a failure (`time_limit`, SIGALRM), memory as the growth of the
process's peak resident size.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from helpers import GPT2_CONFIG, peak_rss_mb, sample, snapshot, time_limit, write_gpt2

from tpu_llm import cli
from tpu_llm.config import CAPS, MAX_PARAMS, load_config
from tpu_llm.errors import UserError
from tpu_llm.interop import hf, safetensors_io

pytest.importorskip("tokenizers", reason="the checkpoints here carry an hf tokenizer: pip install -e '.[hf]'")
WTE = "transformer.wte.weight"  # the first tensor of write_gpt2's file: (300, 32) float32
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory) -> Path:
    """A valid tiny GPT-2 checkpoint (config.json, model.safetensors, tokenizer); copy it before damaging it."""
    folder = tmp_path_factory.mktemp("gpt2") / "gpt2"
    write_gpt2(folder)
    return folder


def copy_of(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def read_file(path) -> tuple[object, bytes]:
    """(the JSON header, the data bytes) of a safetensors file."""
    raw = Path(path).read_bytes()
    size = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + size]), raw[8 + size:]


def write_file(path, header, data: bytes) -> None:
    text = json.dumps(header).encode()
    Path(path).write_bytes(struct.pack("<Q", len(text)) + text + data)


def damaged(folder: Path, edit) -> Path:
    """`folder`'s model.safetensors with its header replaced by `edit(header)` (the data kept)."""
    path = folder / safetensors_io.SINGLE_FILE
    header, data = read_file(path)
    write_file(path, edit(header), data)
    return folder


def with_entry(name: str, **changes):
    def edit(header):
        header[name] = {**header[name], **changes}
        return header
    return edit


def import_(source, run_dir, capsys) -> tuple[int, str]:
    """`tpu-llm import` in this process: (exit status, stderr); stdout must be empty on a refusal."""
    with contextlib.redirect_stdout(io.StringIO()) as out:
        status = cli.main(["import", "--from", str(source), "--run_dir", str(run_dir)])
    err = capsys.readouterr().err
    if status:
        assert out.getvalue() == "", out.getvalue()
    return status, err


def assert_one_line(err: str, *words: str) -> None:
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for word in words:
        assert word in err, (word, err)


# ---- the YAML config and its flags -------------------------------------------------------------------------


def test_a_width_of_4e9_is_refused_at_once_naming_the_cap():
    """Before: the message of a check that passed listed the divisors of n_embd, a loop of 4e9 steps."""
    start = time.perf_counter()
    with time_limit(5), pytest.raises(UserError) as refused:
        load_config(str(ROOT / "configs" / "tiny.yaml"), {"model.n_embd": 4_000_000_000})
    assert time.perf_counter() - start < 0.5
    assert str(refused.value) == ("config: model.n_embd=4000000000 is more than its cap of 1,048,576 (widths: 2^20; "
                                  "the widest published models are under 2^15)")


def test_a_failed_divisibility_check_lists_a_few_divisors_quickly():
    with time_limit(5), pytest.raises(UserError, match=r"valid grad_accum values: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, .*, 28, "
                                                       r"30 \(and 216 more\)$"):
        load_config(None, {"train.batch_size": 720720, "train.grad_accum": 17})
    with time_limit(5), pytest.raises(UserError, match=r"valid n_head values: 1, 2, 3, .*, 30 \(and 14 more\)$"):
        load_config(None, {"model.n_embd": 720720, "model.n_head": 17})


@pytest.mark.parametrize("key", sorted(CAPS))
def test_every_capped_key_is_refused_one_past_its_cap(key):
    cap, why = CAPS[key]
    with time_limit(5), pytest.raises(UserError, match=rf"^config: {key}={cap + 1} is more than its cap of {cap:,} "):
        load_config(None, {key: cap + 1})


@pytest.mark.slow
def test_the_config_command_answers_a_huge_width_in_under_a_few_seconds():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "tpu_llm", "config", "--config", "configs/tiny.yaml",
                           "--model.n_embd=4000000000"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    seconds = time.perf_counter() - start
    assert done.returncode == 2 and done.stdout == "", done
    assert_one_line(done.stderr, "model.n_embd=4000000000 is more than its cap of 1,048,576")
    assert seconds < 5, seconds  # 0.1 s on a quiet machine: the CLI imports no TensorFlow for `config`


@pytest.mark.parametrize("text, words", [
    ("model:\n  n_layer: " + "9" * 5000 + "\n", ["a value YAML cannot hold"]),
    ("model: " + "[" * 50_000 + "\n", ["YAML"]),
    ("a: &a [x, x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
     "c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c]\n"
     "e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d]\nf: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e, *e]\n"
     "g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f, *f]\ndata:\n  train: *g\n", ["unknown config key 'a'"]),
    ("data:\n  train: &g [[[[[[x]]]]]]\nmodel:\n  n_layer: 1e999\n", ["'data.train' must be str"]),
    ("train:\n  lr: .inf\n", ["'train.lr' must be a finite number"]),
    ("train:\n  lr: " + "1" * 400 + "\n", ["'train.lr' must be float, got 1111"]),
    ("model:\n  \"n_\\nlayer\": 2\n", ["unknown config key 'model.n_\\nlayer'; did you mean 'model.n_layer'?"]),
])
def test_a_yaml_config_from_elsewhere_is_one_line(tmp_path, text, words):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    with time_limit(10), pytest.raises(UserError) as refused:
        load_config(str(path))
    message = str(refused.value)
    assert "\n" not in message and len(message) < 2000, message
    for word in words:
        assert word in message, message


def test_a_yaml_config_over_1_mb_is_refused_before_it_is_parsed(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text("# " + "x" * (1 << 20) + "\n")
    with time_limit(5), pytest.raises(UserError, match=r"big.yaml: 1,048,579 bytes, more than the 1,048,576"):
        load_config(str(path))
