"""Shared test helpers: a tiny run config and a small UTF-8 corpus (CPU only, fast).

Use from any test file:

    from conftest import tiny_config, write_corpus

    def test_something(tmp_path, corpus_dir):
        cfg = tiny_config(tmp_path, **{"train.steps": 2})      # dotted keys ...
        cfg = tiny_config(tmp_path, model__n_layer=1)            # ... or `__` for the dot

The test process splits its CPU into `CPU_DEVICES` logical devices before TensorFlow starts, so
multi-device code (MirroredStrategy, `cpu_devices`) runs in-process; single-device code uses the
first of them, exactly as it would without the split.
"""

from __future__ import annotations

import hashlib
import os
import random
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before anything imports TensorFlow

import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

CPU_DEVICES = 4
tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0],
                                           [tf.config.LogicalDeviceConfiguration()] * CPU_DEVICES)

from tpu_llm import perf  # noqa: E402
from tpu_llm.config import Config, load_config  # noqa: E402

_measure_matmul_flops, _measured = perf.measured_matmul_flops, {}


def _measured_once(device: str = "/CPU:0", n: int = 2048, repeats: int = 4) -> float:
    """The MFU peak that every `train` and CPU `plan` measures (five 2048^3 matmuls, about a CPU-second),
    measured once per test process and device: the tests' runs share the cores, so each would measure
    the same number (a subprocess still measures its own)."""
    if (device, n, repeats) not in _measured:
        _measured[device, n, repeats] = _measure_matmul_flops(device, n, repeats)
    return _measured[device, n, repeats]


perf.measured_matmul_flops = _measured_once

# Lines mixing ASCII, accented Latin, CJK, Greek/Cyrillic, symbols, tabs and runs of spaces.
CORPUS_LINES = [
    "The quick brown fox jumps over the lazy dog.",
    "Héllo wörld: café, naïve, façade, jalapeño, smørrebrød.",
    "日本語のテキストも少し含めます。東京と京都。",
    "Ελληνικά και русский текст; symbols ✓ ★ ∑ x² ≤ ∞.",
    "def add(a, b):\n\treturn a + b  # two  spaces",
    "Numbers 0123456789 and brackets {}[]()<>=+-*/%&|^~!?",
]
CORPUS_FILES = 3  # files written by `write_corpus`
CORPUS_LINES_PER_FILE = 60  # about 3.7 KB per file


def write_corpus(directory, files: int = CORPUS_FILES, lines: int = CORPUS_LINES_PER_FILE) -> list[str]:
    """Write `files` UTF-8 text files `doc<i>.txt` (deterministic content) into `directory`.

    Returns their paths, sorted. Each file is a few KB of numbered lines drawn from `CORPUS_LINES`
    (non-ASCII, tabs, double spaces, newlines). Glob them with `f"{directory}/*.txt"`.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    paths = []
    for i in range(files):
        text = "\n".join(f"{j} {rng.choice(CORPUS_LINES)}" for j in range(lines)) + "\n"
        path = directory / f"doc{i}.txt"
        path.write_text(text, encoding="utf-8")
        paths.append(str(path))
    return sorted(paths)


@pytest.fixture
def corpus_dir(tmp_path) -> Path:
    """`tmp_path/corpus`, holding the small corpus of `write_corpus` (glob: `corpus_dir / "*.txt"`)."""
    write_corpus(tmp_path / "corpus")
    return tmp_path / "corpus"


TINY = {
    "model.n_layer": 2,
    "model.n_head": 2,
    "model.n_embd": 32,
    "model.max_len": 32,
    "data.seq_len": 16,
    "data.shuffle_buffer": 64,
    "train.batch_size": 4,
    "train.steps": 4,
    "train.steps_per_loop": 2,
    "train.warmup_steps": 1,
    "train.eval_every": 0,
    "train.eval_steps": 2,
    "checkpoint.every_steps": 0,
    "sample.num_samples": 0,
    "sample.max_new_tokens": 8,
}


def tiny_config(tmp_path, **overrides) -> Config:
    """A validated `Config` for a very small, fast CPU run inside `tmp_path`.

    Defaults: run_dir=`tmp_path/run`; a 2-layer, 2-head, width-32 model with max_len 32; seq_len 16,
    batch 4, 4 steps of 2 per loop, warmup 1, evaluation and checkpoints only at the end
    (eval_steps 2), no samples printed; byte tokenizer. Unless `data.train` is overridden, the data is
    the small corpus of `write_corpus`, written to `tmp_path/corpus` (3 files; validation is the tail
    of each file). Pass `data.train=""` for the embedded stdlib corpus.

    `overrides` are config keys in dotted form, given as `**{"train.steps": 8}` or with `__` standing
    for the dot (`train__steps=8`); they are applied like command-line overrides (and validated).
    """
    values = dict(TINY, run_dir=str(Path(tmp_path) / "run"))
    values.update({key.replace("__", "."): value for key, value in overrides.items()})
    if "data.train" not in values:
        write_corpus(Path(tmp_path) / "corpus")
        values["data.train"] = str(Path(tmp_path) / "corpus" / "*.txt")
    return load_config(None, values)


@pytest.fixture
def poison(monkeypatch):
    """poison(*steps): the loss and gradients become NaN at those optimizer steps (0-based), once each
    (a rolled-back run passes the same step number again). Under MirroredStrategy the replicas share
    the flag: at least the first replica's batch is poisoned."""
    armed = tf.Variable(tf.zeros([64], tf.int32), trainable=False)
    from tpu_llm.training.trainer import Trainer

    original = Trainer._loss_and_grads_fn

    def loss_and_grads(self, inputs, targets):
        loss, grads = original(self, inputs, targets)
        step = tf.cast(self.optimizer.iterations, tf.int32)
        bad = tf.gather(armed, step) > 0
        armed.scatter_nd_update([[step]], [0])  # after the read (TF orders ops on a variable as written)
        nan = tf.constant(float("nan"))
        return tf.where(bad, nan, loss), [tf.where(bad, nan, g) for g in grads]

    monkeypatch.setattr(Trainer, "_loss_and_grads_fn", loss_and_grads)
    return lambda *steps: [armed[s].assign(1) for s in steps]


def snapshot(root) -> dict[str, str] | None:
    """Every file under `root` by content hash, and every directory; None if `root` does not exist.
    Tests compare two snapshots to prove a run directory was left exactly as it was."""
    if not os.path.exists(root):
        return None
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        out.update({os.path.relpath(os.path.join(dirpath, d), root) + "/": "dir" for d in dirnames})
        for name in filenames:
            with open(os.path.join(dirpath, name), "rb") as f:
                out[os.path.relpath(os.path.join(dirpath, name), root)] = hashlib.sha256(f.read()).hexdigest()
    return out


BPE_CORPUS = ["The quick brown fox jumps over the lazy dog.", "Héllo wörld: café, naïve, façade.",
              "def add(a, b):\n\treturn a + b", "日本語のテキスト。", "Numbers 0123456789 {}[]()<>"] * 4


def write_bpe_tokenizer(folder, vocab: int = 300) -> None:
    """A small byte-level BPE in the GPT-2 style, as tokenizer.json + tokenizer_config.json (the HF
    import tests' checkpoints carry it)."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(BPE_CORPUS, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                            show_progress=False))
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>"}, f)
