#!/usr/bin/env python3
"""`make faults`: inject faults into tiny real runs and print what happened (docs/faults.md).

Each row of ROWS starts real `python -m tpu_llm` processes (a 2-layer model, 24 steps of 4 x 16
tokens, a checkpoint every 8 steps), injects one fault (a signal at a chosen moment, a killed task
of a cluster, a truncated or corrupted file, NaN gradients, a full disk) and checks the outcome:

  expected   what the run must do (exit status and the line it prints)
  observed   what it did
  lost       whether anything was lost: the final weights' fingerprint (metrics.jsonl's summary)
             and every step's loss against an uninterrupted run of the same config, or, for a run
             that must refuse to start, the run directory's file hashes before and after

Every process has a timeout: a hang is a failure. The table ends with a count of rows as expected;
the exit status is 1 if any row is not.

    python scripts/faults.py                 # every row, two at a time (FAULTS_JOBS=N to change)
    python scripts/faults.py -k nan -k sigterm   # rows whose name contains one of the words
    python scripts/faults.py --list
    python scripts/faults.py -k symlink -k two-trainers   # the run-directory rows of issue 28

Needs Linux; the full-disk row mounts a small tmpfs and is skipped (with the reason) when this user
may not mount one. It is not part of `make test`: it runs ~60 TensorFlow processes.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # this process reads checkpoints with TensorFlow too
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the harness writes Hugging Face checkpoints with this tree's tpu_llm, as its processes run it
STEPS, EVERY, LOOP = 24, 8, 4
TIMEOUT = 240  # seconds for one process; a process still running then is a hang
TINY = ["--model.n_layer=2", "--model.n_head=2", "--model.n_embd=32", "--model.max_len=32", "--model.dropout=0.1",
        "--data.seq_len=16", "--data.shuffle_buffer=64", "--train.batch_size=4", "--train.warmup_steps=1",
        f"--train.decay_steps={STEPS}", f"--train.steps_per_loop={LOOP}", f"--checkpoint.every_steps={EVERY}",
        "--train.eval_every=0", "--train.eval_steps=2", "--sample.num_samples=0"]
CLUSTER = ["--train.batch_size=8", "--train.steps_per_loop=2", "--cluster.timeout_seconds=10"]

# Runs tpu_llm's CLI with a hook in TF's checkpoint bookkeeping: when checkpoint FAULT_SAVE is being
# recorded (its files are written; the state file is written last), send FAULT_SIGNAL to itself.
IN_SAVE = """
import os, signal, sys
from tensorflow.python.checkpoint import checkpoint_management as cm
record, sent = cm.update_checkpoint_state_internal, []
def hooked(save_dir, model_checkpoint_path, *args, **kwargs):
    if model_checkpoint_path.endswith("ckpt-" + os.environ["FAULT_SAVE"]) and not sent:  # once: a second
        sent.append(1)  # SIGTERM means "stop now" (tpu_llm.fault.StopSignals), and TF records a save twice
        os.kill(os.getpid(), getattr(signal, os.environ["FAULT_SIGNAL"]))
    return record(save_dir, model_checkpoint_path, *args, **kwargs)
cm.update_checkpoint_state_internal = hooked
from tpu_llm.cli import main
sys.exit(main(sys.argv[1:]))
"""

# Runs tpu_llm's CLI with NaN loss and gradients on every replica at optimizer step FAULT_NAN_STEP
# (0-based), once: what a bad batch or an overflow does to a step.
NAN = """
import os, sys
import tensorflow as tf
from tpu_llm.training.trainer import Trainer
original = Trainer._micro_fn  # each micro-batch (NaN in one: the step's sum is NaN)
at = int(os.environ["FAULT_NAN_STEP"])
def poisoned(self, inputs, targets):
    loss, grads = original(self, inputs, targets)
    bad = tf.equal(tf.cast(self.optimizer.iterations, tf.int32), at)
    nan = tf.constant(float("nan"))
    return tf.where(bad, nan, loss), [tf.where(bad, nan, g) for g in grads]
Trainer._micro_fn = poisoned
from tpu_llm.cli import main
sys.exit(main(sys.argv[1:]))
"""


# Runs tpu_llm's CLI held before its second host call until the file PAUSE_UNTIL exists: a trainer
# surely still running (and holding its run directory) while another process is started on it.
PAUSED = """
import os, sys, time
from tpu_llm.training.trainer import Trainer
real, calls = Trainer.run, []
def paused(self, *args, **kwargs):
    calls.append(1)
    if len(calls) == 2:
        print("paused", flush=True)
        while not os.path.exists(os.environ["PAUSE_UNTIL"]):
            time.sleep(0.05)
    return real(self, *args, **kwargs)
Trainer.run = paused
from tpu_llm.cli import main
sys.exit(main(sys.argv[1:]))
"""


# ---- processes ------------------------------------------------------------------------------------


class Hang(Exception):
    pass


class Proc:
    """A `python -m tpu_llm ...` (or `python -c CODE ...`) process, its output in a file."""

    def __init__(self, log: Path, args: list[str], code: str | None = None, env: dict | None = None):
        self.log = log
        prefix = ["-c", code] if code else ["-m", "tpu_llm"]
        environment = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1", **(env or {})}
        environment["PYTHONPATH"] = os.pathsep.join([str(ROOT), environment.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        with open(log, "w") as out:
            self.proc = subprocess.Popen([sys.executable, *prefix, *args], cwd=ROOT, env=environment, stdout=out,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)

    @property
    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, predicate: Callable[[str], bool], what: str) -> str:
        deadline = time.time() + TIMEOUT
        while time.time() < deadline:
            text = self.text
            if predicate(text):
                return text
            if self.proc.poll() is not None:
                raise RuntimeError(f"exited ({self.proc.returncode}) before {what}: {last_lines(text)}")
            time.sleep(0.05)
        self.kill()
        raise Hang(f"no {what} within {TIMEOUT} s")

    def wait(self) -> int:
        try:
            return self.proc.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            self.kill()
            raise Hang(f"still running after {TIMEOUT} s: {last_lines(self.text)}") from None

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: a launcher's tasks too
            except ProcessLookupError:
                pass
            self.proc.wait()


def last_lines(text: str, n: int = 2) -> str:
    lines = [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith(("W0", "E0", "I0"))]
    return " | ".join(lines[-n:])[-400:]


def progress(text: str) -> int:
    """The newest step of a progress line ('step  12/24 ...', or '[chief 0] step ...')."""
    steps = [line.split("step", 1)[1].split("/")[0].strip() for line in text.splitlines()
             if line.startswith(("step ", "[chief 0] step ", "[worker 0] step "))]
    return int(steps[-1]) if steps and steps[-1].isdigit() else -1


def error_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.startswith(("error:", "stopped:", "[chief 0] error:",
                                                                    "[worker 0] error:"))]
    return lines[-1] if lines else ""


def has_traceback(text: str) -> bool:
    return "Traceback (most recent call last)" in text


# ---- the run directory ----------------------------------------------------------------------------


def tree_hash(directory: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(directory)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def logged(run_dir: Path) -> tuple[dict[int, float], str | None]:
    """(step -> training loss, the final fingerprint) from metrics.jsonl."""
    losses, fingerprint = {}, None
    path = run_dir / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        entry = json.loads(line)
        if entry["split"] == "train":
            losses[entry["step"]] = entry["loss"]
        elif entry["split"] == "summary":
            fingerprint = entry.get("fingerprint")
    return losses, fingerprint


def checkpoint_finite(run_dir: Path) -> tuple[str | None, int]:
    """(the newest readable checkpoint, how many of its float tensors hold NaN or inf)."""
    import numpy as np
    import tensorflow as tf

    latest = tf.train.latest_checkpoint(str(run_dir / "checkpoints"))
    if not latest:
        return None, 0
    reader = tf.train.load_checkpoint(latest)
    bad = 0
    for name, dtype in reader.get_variable_to_dtype_map().items():
        if dtype.is_floating:
            bad += int(not np.all(np.isfinite(reader.get_tensor(name))))
    return latest, bad


@dataclasses.dataclass
class Outcome:
    observed: str
    ok: bool  # as expected
    lost: str  # "no" | "YES: ..." | "-" (not applicable)


class Bench:
    """The shared pieces of every row: the corpus, the command lines, the uninterrupted reference."""

    def __init__(self, work: Path):
        self.work = work
        corpus = work / "corpus"
        corpus.mkdir(parents=True, exist_ok=True)
        rng = random.Random(0)
        words = ("the quick brown fox jumps over the lazy dog; héllo wörld, naïve café. 日本語 Ελληνικά "
                 "русский ✓ ∑ x² def add(a, b): return a + b").split()
        for i in range(3):
            (corpus / f"doc{i}.txt").write_text("\n".join(" ".join(rng.choice(words) for _ in range(12))
                                                          for _ in range(80)) + "\n", encoding="utf-8")
        self.corpus = str(corpus / "*.txt")
        self.reference: tuple[dict[int, float], str | None] | None = None

    def train_args(self, run_dir: Path, steps: int = STEPS, *extra: str) -> list[str]:
        return ["train", f"--run_dir={run_dir}", f"--data.train={self.corpus}", *TINY, f"--train.steps={steps}",
                *extra]

    def dir(self, name: str) -> Path:
        path = self.work / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def compare(self, run_dir: Path) -> str:
        """'no' if run_dir's losses and final weights equal the uninterrupted run's, else what differs."""
        losses, fingerprint = logged(run_dir)
        ref_losses, ref_fingerprint = self.reference
        if fingerprint != ref_fingerprint:
            first = next((s for s in sorted(ref_losses) if losses.get(s) != ref_losses[s]), None)
            return f"YES: final weights differ from the uninterrupted run (losses from step {first})"
        if losses != ref_losses:
            return "YES: the logged losses differ from the uninterrupted run's"
        return "no"


# ---- rows -----------------------------------------------------------------------------------------


def resume_and_compare(bench: Bench, run_dir: Path, first: int | None, expect_first: tuple[int, ...], name: str,
                       extra_check: Callable[[str], str] = lambda text: "") -> Outcome:
    """After the fault (`first`: the exit status it caused, None for a damaged file), run the same
    command again: it must finish, and the run must equal the uninterrupted one."""
    again = Proc(bench.work / f"{name}-again.log", bench.train_args(run_dir))
    code = again.wait()
    text = again.text
    observed = (f"exit {first}; " if first is not None else "") + f"again: exit {code}" + \
        (f" ({error_line(text) or last_lines(text, 1)})" if code else "")
    note = extra_check(text)
    if note:
        observed += f"; {note}"
    lost = bench.compare(run_dir) if code == 0 else "YES: the same command did not finish"
    ok = code == 0 and lost == "no" and not note and (first is None or first in expect_first)
    return Outcome(observed[:300], ok, lost)


def signal_row(moment: str, predicate: Callable[[str], bool], sig=signal.SIGTERM, prepare_steps: int = 0):
    def run(bench: Bench, name: str) -> Outcome:
        run_dir = bench.dir(name) / "run"
        if prepare_steps:  # a run to resume: it stops at a checkpoint first
            code = Proc(bench.work / f"{name}-prepare.log", bench.train_args(run_dir, prepare_steps)).wait()
            if code:
                return Outcome(f"preparing the run failed (exit {code})", False, "-")
        p = Proc(bench.work / f"{name}.log", bench.train_args(run_dir))
        p.wait_for(predicate, moment)
        p.signal(sig)
        code = p.wait()
        return resume_and_compare(bench, run_dir, code, (128 + sig, -sig), name)
    return run


def in_save_row(sig: str, expect: tuple[int, ...]):
    def run(bench: Bench, name: str) -> Outcome:
        run_dir = bench.dir(name) / "run"
        p = Proc(bench.work / f"{name}.log", bench.train_args(run_dir), code=IN_SAVE,
                 env={"FAULT_SAVE": str(2 * EVERY), "FAULT_SIGNAL": sig})
        code = p.wait()
        return resume_and_compare(bench, run_dir, code, expect, name)
    return run


def damaged_checkpoint_row(damage: Callable[[Path], None], expect_line: str):
    def run(bench: Bench, name: str) -> Outcome:
        run_dir = bench.dir(name) / "run"
        code = Proc(bench.work / f"{name}-prepare.log", bench.train_args(run_dir, 2 * EVERY)).wait()
        if code:
            return Outcome(f"preparing the run failed (exit {code})", False, "-")
        damage(run_dir / "checkpoints")

        def says(text: str) -> str:
            return "" if expect_line in text else f"no line with {expect_line!r}"
        return resume_and_compare(bench, run_dir, None, (), name, says)
    return run


def truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep)])


def refused_row(prepare: Callable[[Bench, Path], list[str]], expect_text: str):
    """A fault the run must refuse in one line (exit 2), leaving the run directory as it was, and what a
    prepare put outside it (`outside`, beside it) too."""
    def run(bench: Bench, name: str) -> Outcome:
        run_dir = bench.dir(name) / "run"
        args = prepare(bench, run_dir)
        before = tree_hash(run_dir) if run_dir.exists() else "", outside_hash(run_dir.parent / "outside")
        p = Proc(bench.work / f"{name}.log", args)
        code = p.wait()
        text, line = p.text, error_line(p.text)
        after = tree_hash(run_dir) if run_dir.exists() else "", outside_hash(run_dir.parent / "outside")
        lost = ("no" if before == after else "YES: the run directory changed" if before[0] != after[0]
                else "YES: a file outside the run directory changed")
        ok = code == 2 and expect_text in line and not has_traceback(text) and lost == "no"
        observed = f"exit {code}: {line or last_lines(text)}" + (" (with a traceback)" if has_traceback(text) else "")
        return Outcome(observed[:300], ok, lost)
    return run


def outside_hash(path: Path) -> str:
    """What a row put outside the run directory (a file or a directory), by content; "" if nothing."""
    if path.is_dir():
        return tree_hash(path)
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16] if path.is_file() else ""


def state_naming_outside(bench: Bench, run_dir: Path) -> list[str]:
    """A run stopped at ckpt-16 whose checkpoint state file lists `outside/victim` (its .index and .data-*
    files exist) as its oldest checkpoint: TF's CheckpointManager deleted them at the next save."""
    Proc(bench.work / "state-outside-prepare.log", bench.train_args(run_dir, 2 * EVERY)).wait()
    outside = run_dir.parent / "outside"
    outside.mkdir()
    for suffix in (".index", ".data-00000-of-00001"):
        (outside / f"victim{suffix}").write_text("precious")
    now = time.time()
    paths = [str(outside / "victim"), f"ckpt-{EVERY}", f"ckpt-{2 * EVERY}"]
    (run_dir / "checkpoints" / "checkpoint").write_text("\n".join(
        [f'model_checkpoint_path: "ckpt-{2 * EVERY}"', *(f'all_model_checkpoint_paths: "{p}"' for p in paths),
         *(f"all_model_checkpoint_timestamps: {now - 10 + i}" for i in range(len(paths))),
         f"last_preserved_timestamp: {now - 100}"]) + "\n")
    return bench.train_args(run_dir, STEPS, "--checkpoint.keep=1")


def checkpoints_a_file(bench: Bench, run_dir: Path) -> list[str]:
    """A run stopped at ckpt-8 whose checkpoints/ is then a regular file: a resume found no checkpoint,
    dropped metrics.jsonl's lines, then failed at its first save."""
    Proc(bench.work / "checkpoints-file-prepare.log", bench.train_args(run_dir, EVERY)).wait()
    shutil.rmtree(run_dir / "checkpoints")
    (run_dir / "checkpoints").write_text("not a directory")
    return bench.train_args(run_dir)


def lora_alpha_edited(bench: Bench, run_dir: Path) -> list[str]:
    """A LoRA run stopped at ckpt-8 whose config.yaml then says train.lora_alpha 16 (it trained with 8): a
    resume read its adapters at twice their scale, without a word."""
    Proc(bench.work / "config-drift-prepare.log", bench.train_args(run_dir, EVERY, "--train.lora_rank=2")).wait()
    config = run_dir / "config.yaml"
    config.write_text(config.read_text().replace("lora_alpha: 8.0", "lora_alpha: 16.0"))
    return ["train", "--config", str(config), f"--run_dir={run_dir}", f"--train.steps={STEPS}"]


def freeze_edited(bench: Bench, run_dir: Path) -> list[str]:
    """A run stopped at ckpt-8 that trained every layer, resumed with train.freeze=embeddings: AdamW's moments,
    saved by position among the trainable variables, would be restored into other layers."""
    Proc(bench.work / "freeze-drift-prepare.log", bench.train_args(run_dir, EVERY)).wait()
    return bench.train_args(run_dir) + ["--train.freeze=embeddings"]


def text_outside_the_vocabulary(bench: Bench, run_dir: Path) -> list[str]:
    """A char-vocabulary run asked for the perplexity of a text holding a character its data never had: it
    would be scored as the unknown id, a perplexity of text nobody wrote."""
    Proc(bench.work / "eval-vocabulary-prepare.log", bench.train_args(run_dir, EVERY, "--data.tokenizer=char")).wait()
    notes = run_dir.parent / "notes.txt"
    notes.write_text("def parrot():\n    return '\U0001F99C'\n", encoding="utf-8")
    return ["eval", "--run_dir", str(run_dir), "--text", str(notes)]


def corrupted_tokenizer(bench: Bench, run_dir: Path) -> list[str]:
    Proc(bench.work / "tokenizer-prepare.log", bench.train_args(run_dir, EVERY)).wait()
    (run_dir / "tokenizer.json").write_text('{"kind": "byte", "vocab')  # torn mid-write
    return bench.train_args(run_dir)


def special_file(name: str, kind: str):
    """A run stopped at ckpt-8 whose `name` is then a FIFO (kind "fifo": a reader would wait forever) or
    hard-linked to a file outside the run directory (kind "hardlink": an append would write into it)."""
    def prepare(bench: Bench, run_dir: Path) -> list[str]:
        Proc(bench.work / f"{kind}-{name.replace('/', '-')}-prepare.log", bench.train_args(run_dir, EVERY)).wait()
        if kind == "fifo":
            (run_dir / name).unlink()
            os.mkfifo(run_dir / name)
        else:
            os.link(run_dir / name, run_dir.parent / "outside")
        return bench.train_args(run_dir)
    return prepare


def prepare_into_run(bench: Bench, run_dir: Path) -> list[str]:
    Proc(bench.work / "prepare-into-run-prepare.log", bench.train_args(run_dir, EVERY)).wait()
    return ["data", "prepare", "--input", bench.corpus, "--output", str(run_dir), "--shards", "2", "--overwrite"]


def truncated_shard(bench: Bench, run_dir: Path) -> list[str]:
    shards = run_dir.parent / "shards"
    Proc(bench.work / "shards-prepare.log", ["data", "prepare", "--input", bench.corpus, "--output", str(shards),
                                             "--shards", "2"]).wait()
    train, validation = sorted(shards.glob("*.tfrecord"))
    truncate(train, 0.6)
    return ["train", f"--run_dir={run_dir}", f"--data.train={train}", f"--data.validation={validation}", *TINY,
            f"--train.steps={STEPS}"]


def hf_checkpoint(bench: Bench, folder: Path) -> Path:
    """A tiny GPT-2 checkpoint in the Hugging Face layout: config.json, model.safetensors (random
    weights of the shapes config.json implies) and a byte-level BPE tokenizer trained on the corpus."""
    import glob

    import numpy as np
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from tpu_llm.config import ModelConfig
    from tpu_llm.interop import hf, hf_config, safetensors_io

    folder.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 320, "n_positions": 32,
              "n_embd": 32, "n_layer": 2, "n_head": 2, "resid_pdrop": 0.0}
    (folder / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(0)
    tensors = {name: rng.normal(0, 0.02, shape).astype(np.float32)
               for name, shape in hf.tensor_shapes(ModelConfig(**hf_config.model_config(config))).items()}
    safetensors_io.write(str(folder / "model.safetensors"), [(k, v.shape, v.dtype) for k, v in tensors.items()],
                         tensors.__getitem__)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = [Path(f).read_text(encoding="utf-8") for f in sorted(glob.glob(bench.corpus))]
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return folder


def hf_import(damage: Callable[[Path], None]):
    """`tpu-llm import` of a tiny checkpoint damaged by `damage` (the checkpoint directory)."""
    def prepare(bench: Bench, run_dir: Path) -> list[str]:
        source = hf_checkpoint(bench, run_dir.parent / "hf")
        damage(source)
        return ["import", "--from", str(source), "--run_dir", str(run_dir)]
    return prepare


def tied_head_unlike_its_table(source: Path) -> None:
    """model.safetensors with an lm_head.weight beside the tied embedding table, one row different:
    transformers unties them and uses the head; tpu-llm ignored it for the table."""
    from tpu_llm.interop import safetensors_io

    reader = safetensors_io.Reader(str(source))
    tensors = {name: reader.get(name).copy() for name in reader.names()}
    tensors["lm_head.weight"] = tensors["transformer.wte.weight"].copy()
    tensors["lm_head.weight"][7] += 1.0
    safetensors_io.write(str(source / "model.safetensors"), [(k, v.shape, v.dtype) for k, v in tensors.items()],
                         tensors.__getitem__)


def adapter_with_nan(bench: Bench, run_dir: Path) -> list[str]:
    """`tpu-llm import --adapter` of a PEFT adapter (rank 2 on c_attn) whose first tensor holds a NaN."""
    import numpy as np

    from tpu_llm.config.reading import set_dotted
    from tpu_llm.interop import hf_config, peft, safetensors_io

    source, adapter = hf_checkpoint(bench, run_dir.parent / "hf"), run_dir.parent / "adapter"
    cfg = hf_config.run_config(hf_config.read_config(str(source)), str(source), "unused")
    for key, value in {"train.lora_rank": 2, "train.lora_alpha": 4.0, "train.lora_targets": "c_attn"}.items():
        set_dotted(cfg, key, value, source="faults")
    tensors = {name: np.full(shape, 0.01, np.float32) for name, shape in peft.adapter_shapes(cfg).items()}
    tensors[sorted(tensors)[0]][0, 0] = np.nan
    adapter.mkdir()
    safetensors_io.write(str(adapter / "adapter_model.safetensors"),
                         [(k, v.shape, v.dtype) for k, v in tensors.items()], tensors.__getitem__)
    (adapter / "adapter_config.json").write_text(json.dumps(peft.adapter_config(cfg)))
    return ["import", "--from", str(source), "--adapter", str(adapter), "--run_dir", str(run_dir)]


def offsets_out_of_range(source: Path) -> None:
    """model.safetensors with its first tensor's offsets moved 1,000 bytes before the data."""
    path = source / "model.safetensors"
    raw = path.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + size])
    entry = header["transformer.wte.weight"]
    entry["data_offsets"] = [offset - 1000 for offset in entry["data_offsets"]]
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + size:])


def config_json_of_a_billion_layers(source: Path) -> None:
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "n_layer": 10**9}))


def sparse_tokenizer_json(source: Path) -> None:
    with open(source / "tokenizer.json", "r+b") as f:  # 500 MB that take no disk
        f.truncate(500 << 20)


def nan_row(comm: list[str]):
    def run(bench: Bench, name: str) -> Outcome:
        run_dir = bench.dir(name) / "run"
        p = Proc(bench.work / f"{name}.log", bench.train_args(run_dir, 16, "--cpu_devices=2", "--strategy=mirrored",
                                                              "--execution=graph", *comm),
                 code=NAN, env={"FAULT_NAN_STEP": "3"})
        code = p.wait()
        text = p.text
        skipped = "1 step(s) up to step" in text and "were not applied" in text
        latest, bad = checkpoint_finite(run_dir) if code in (0, 3) else (None, 0)
        losses, _ = logged(run_dir)
        finite = all(v == v and abs(v) != float("inf") for v in losses.values())
        observed = (f"exit {code}" + ("; the bad step was skipped" if skipped else "; no skip reported")
                    + (f"; {bad} non-finite tensors in {Path(latest).name}" if latest else "")
                    + ("" if finite else "; non-finite losses logged")
                    + (f" ({error_line(text) or last_lines(text, 1)})" if code else ""))
        lost = "no" if latest and not bad and finite else "YES: NaN state or no checkpoint"
        return Outcome(observed[:300], code == 0 and skipped and lost == "no", lost)
    return run


def summed_losses(losses: dict[int, float]) -> dict[int, float]:
    """step -> the sum of every step's loss up to it, from metrics.jsonl's host-call means (step -> mean
    of the steps since the previous entry)."""
    sums, total, previous = {}, 0.0, 0
    for step in sorted(losses):
        total += losses[step] * (step - previous)
        sums[step], previous = total, step
    return sums


def other_layout_row():
    """A 2-replica run with AdamW's moments divided over its replicas (parallel.shard_optimizer=state),
    SIGTERM after step 12, resumed on one replica with whole moments: every step's loss within 1e-5 of the
    same 2-replica run left alone (a replica count changes only the order of float32 sums; without dropout,
    whose masks are drawn per replica, so that another replica count draws others)."""
    def run(bench: Bench, name: str) -> Outcome:
        two = ["--cpu_devices=2", "--strategy=mirrored", "--parallel.shard_optimizer=state", "--model.dropout=0"]
        straight = bench.dir(name) / "straight"
        code = Proc(bench.work / f"{name}-straight.log", bench.train_args(straight, STEPS, *two)).wait()
        if code:
            return Outcome(f"the uninterrupted 2-replica run failed (exit {code})", False, "-")
        run_dir = bench.dir(name) / "run"
        p = Proc(bench.work / f"{name}.log", bench.train_args(run_dir, STEPS, *two))
        p.wait_for(lambda t: progress(t) >= 12, "step 12")
        p.signal(signal.SIGTERM)
        stopped = p.wait()
        resumed = Proc(bench.work / f"{name}-resumed.log",
                       bench.train_args(run_dir, STEPS, "--parallel.shard_optimizer=none", "--model.dropout=0"))
        code = resumed.wait()
        # each logged loss is its host call's mean: the stop split a call, so compare the sums of the
        # steps' losses up to every step both logged
        run_sums, reference = summed_losses(logged(run_dir)[0]), summed_losses(logged(straight)[0])
        apart = [step for step, total in reference.items()
                 if step not in run_sums or abs(run_sums[step] - total) > 1e-5 * abs(total)]
        said = "resumed   from" in resumed.text
        observed = f"exit {stopped}, then {code} on one replica" + ("" if said else "; no `resumed` line")
        lost = "no" if not apart and code == 0 else f"YES: steps {apart[:5]} apart"
        return Outcome(observed, stopped in (143, -15) and code == 0 and said and lost == "no", lost)
    return run


def cluster_row(workers: int, ps: int, victim: str, expect_code: int, expect_text: str, steps: int = 40):
    def run(bench: Bench, name: str) -> Outcome:
        run_dir = bench.dir(name) / "run"
        args = ["launch", "--workers", str(workers), "--ps", str(ps), "--",
                *bench.train_args(run_dir, steps), *CLUSTER, "--checkpoint.every_steps=10"]
        p = Proc(bench.work / f"{name}.log", args)
        text = p.wait_for(lambda t: progress(t) >= 12, "step 12")  # after the first checkpoint (ckpt-10)
        line = next(line for line in text.splitlines() if line.startswith("launch    pids "))
        pids = dict(item.split("=") for item in line[len("launch    pids "):].split(", "))
        os.kill(int(pids[victim]), signal.SIGKILL)
        code = p.wait()
        text = p.text
        line = error_line(text) or next((l for l in text.splitlines() if "done      step" in l), "")
        latest, bad = checkpoint_finite(run_dir)
        lost = "no" if latest and not bad else "YES: no readable checkpoint"
        ok = code == expect_code and expect_text in text and lost == "no"
        return Outcome(f"exit {code}: {line or last_lines(text)}"[:300], ok, lost)
    return run


def tasks_of(cluster: str) -> list[int]:
    """The live processes whose TF_CONFIG holds this cluster (its ports): a launcher's tasks, wherever they went."""
    found = []
    for entry in Path("/proc").iterdir():
        try:  # a zombie's environ reads empty: gone
            if entry.name.isdigit() and cluster.encode() in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def launcher_kill_row(ps: int):
    """SIGKILL of `tpu-llm launch` itself mid-run: every task must be gone within 30 s (they get SIGTERM
    from the kernel, tpu_llm/platform/tether.py), the cluster having saved a checkpoint on its way out."""
    def run(bench: Bench, name: str) -> Outcome:
        run_dir = bench.dir(name) / "run"
        args = ["launch", "--workers", "2", "--ps", str(ps), "--", *bench.train_args(run_dir, 4000), *CLUSTER,
                "--checkpoint.every_steps=1000"]  # no checkpoint but the one the launcher's death asks for
        p = Proc(bench.work / f"{name}.log", args)
        text = p.wait_for(lambda t: progress(t) >= 12, "step 12")
        cluster = json.dumps(json.loads(text.splitlines()[0].split(" on 127.0.0.1 (", 1)[1].rsplit("): ", 1)[0]))
        up = len(tasks_of(cluster))
        os.kill(p.proc.pid, signal.SIGKILL)  # the launcher alone: its tasks are left to the tether
        p.proc.wait()
        killed = time.time()
        while tasks_of(cluster) and time.time() - killed < 30:
            time.sleep(0.2)
        left, seconds = tasks_of(cluster), time.time() - killed
        for pid in left:  # this row's tasks only (their TF_CONFIG names its ports)
            os.kill(pid, signal.SIGKILL)
        latest, bad = checkpoint_finite(run_dir)
        lost = "no" if latest and not bad else "YES: no checkpoint saved on the way out"
        observed = (f"{up} tasks up; launcher killed: " + (f"{len(left)} task(s) still running after 30 s" if left
                    else f"every task gone after {seconds:.1f} s") + f"; newest checkpoint "
                    f"{Path(latest).name if latest else 'none'}")
        return Outcome(observed, up == 2 + 2 * bool(ps) and not left and lost == "no", lost)
    return run


def corrupt_record_row(bench: Bench, name: str) -> Outcome:
    """One flipped byte mid-shard (its size unchanged): a run that reaches it stops with one line naming
    the shard, the checkpoints it saved before intact; the same command stops there again, changing nothing."""
    run_dir = bench.dir(name) / "run"
    shards = run_dir.parent / "shards"
    Proc(bench.work / f"{name}-prepare.log", ["data", "prepare", "--input", bench.corpus, "--output", str(shards),
                                              "--shards", "2"]).wait()
    train, validation = sorted(shards.glob("*.tfrecord"))
    data = bytearray(train.read_bytes())
    data[len(data) * 3 // 4] ^= 0x01
    train.write_bytes(bytes(data))
    args = ["train", f"--run_dir={run_dir}", f"--data.train={train}", f"--data.validation={validation}", *TINY,
            "--train.steps=4000"]
    p = Proc(bench.work / f"{name}.log", args)
    code, text = p.wait(), p.text
    line = error_line(text)
    latest, bad = checkpoint_finite(run_dir)
    before = tree_hash(run_dir / "checkpoints") if latest else ""
    again = Proc(bench.work / f"{name}-again.log", args)
    code_again, line_again = again.wait(), error_line(again.text)
    same = latest is not None and tree_hash(run_dir / "checkpoints") == before and line_again == line
    lost = "no" if latest and not bad and same else "YES: no readable checkpoint, or the second run changed them"
    ok = (code == code_again == 2 and f"shard {train} has a corrupt record at byte" in line
          and not has_traceback(text + again.text) and lost == "no")
    observed = (f"exit {code}: {line or last_lines(text)}"[:300] + f"; again: exit {code_again}"
                + (" (with a traceback)" if has_traceback(text + again.text) else ""))
    return Outcome(observed, ok, lost)


def shard_ids_row(bench: Bench, name: str) -> Outcome:
    """Byte-level shards whose tokenizer.json was replaced by a 12-id char vocabulary and whose meta.json says
    their largest id is 10 (a lie that passes the check before training): the input pipeline's own check
    stops the first host call with one line naming the id; no checkpoint written (XLA gathered the ids past
    the embedding silently, a finite loss of nonsense)."""
    run_dir = bench.dir(name) / "run"
    shards = run_dir.parent / "shards"
    Proc(bench.work / f"{name}-prepare.log", ["data", "prepare", "--input", bench.corpus, "--output", str(shards),
                                              "--shards", "2", "--tokenizer", "byte"]).wait()
    meta = json.loads((shards / "meta.json").read_text())
    (shards / "meta.json").write_text(json.dumps({**meta, "max_id": 10}))
    (shards / "tokenizer.json").write_text(json.dumps({"kind": "char", "chars": "abcdefghij"}))
    train, validation = sorted(shards.glob("*.tfrecord"))
    p = Proc(bench.work / f"{name}.log", ["train", f"--run_dir={run_dir}", f"--data.train={train}",
                                          f"--data.validation={validation}", "--data.tokenizer=char", *TINY,
                                          f"--train.steps={STEPS}"])
    code, text = p.wait(), p.text
    line = error_line(text)
    latest, _ = checkpoint_finite(run_dir)
    lost = "no" if latest is None else f"YES: {latest} was saved"
    ok = code == 2 and "outside the model's 12 ids" in line and not has_traceback(text) and lost == "no"
    observed = f"exit {code}: {line or last_lines(text)}"[:300] + (" (with a traceback)" if has_traceback(text) else "")
    return Outcome(observed, ok, lost)


def full_disk(bench: Bench, name: str) -> Outcome:
    mount = bench.dir(f"{name}/disk")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=640k", "tmpfs", str(mount)], capture_output=True,
                             text=True) if os.geteuid() == 0 else None
    if not mounted or mounted.returncode:
        why = mounted.stderr.strip()[:120] if mounted else "not root"
        return Outcome(f"skipped: cannot mount a small tmpfs here ({why})", True, "-")
    try:
        run_dir = mount / "run"
        p = Proc(bench.work / f"{name}.log", bench.train_args(run_dir))
        code = p.wait()
        text, line = p.text, error_line(p.text)
        latest, bad = checkpoint_finite(run_dir)
        lost = "no" if latest and not bad else "YES: no readable checkpoint left"
        ok = code == 2 and "space" in line and not has_traceback(text) and lost == "no"
        observed = (f"exit {code}: {line or last_lines(text)}"[:240] + f"; newest checkpoint "
                    f"{Path(latest).name if latest else 'none'}")
        return Outcome(observed, ok, lost)
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def symlink_row(name: str):
    """`name` in a run stopped at ckpt-16 replaced by a symbolic link to a file or directory outside it
    (for ckpt-16.index a file that is no index: the run would fall back to ckpt-8 and save ckpt-16
    through the link). The next run must refuse in one line naming the link, and neither the run
    directory nor the link's target may change."""
    def run(bench: Bench, name_: str) -> Outcome:
        run_dir = bench.dir(name_) / "run"
        code = Proc(bench.work / f"{name_}-prepare.log", bench.train_args(run_dir, 2 * EVERY)).wait()
        if code:
            return Outcome(f"preparing the run failed (exit {code})", False, "-")
        inside, outside = run_dir / name, bench.dir(name_) / "outside"
        if name.endswith(".index"):
            outside.write_text("precious: any file the link names")
            inside.unlink()
        else:  # the link leads to what was there
            shutil.move(str(inside), str(outside))
        inside.symlink_to(outside)

        def state() -> tuple[str, str]:
            return tree_hash(run_dir), tree_hash(outside) if outside.is_dir() else hashlib.sha256(
                outside.read_bytes()).hexdigest()
        before = state()
        p = Proc(bench.work / f"{name_}.log", bench.train_args(run_dir))
        code = p.wait()
        text, line = p.text, error_line(p.text)
        lost = "no" if state() == before and inside.is_symlink() else "YES: written through the link"
        ok = code == 2 and f"symbolic link, {name} -> " in line and not has_traceback(text) and lost == "no"
        return Outcome(f"exit {code}: {line or last_lines(text)}"[:300], ok, lost)
    return run


def two_trainers(bench: Bench, name: str) -> Outcome:
    """A second `tpu-llm train` (another learning rate) on the run directory of one still training: it
    must be refused (exit 2, one line naming the first's pid), the first finish equal to the reference."""
    run_dir, go = bench.dir(name) / "run", bench.dir(name) / "go"
    first = Proc(bench.work / f"{name}-first.log", bench.train_args(run_dir), code=PAUSED,
                 env={"PAUSE_UNTIL": str(go)})
    try:
        first.wait_for(lambda t: "paused" in t, "the first trainer's second host call")
        second = Proc(bench.work / f"{name}-second.log", bench.train_args(run_dir, STEPS, "--train.lr=1e-3"))
        code = second.wait()
        line = error_line(second.text)
    finally:
        go.write_text("")
    first_code = first.wait()
    lost = bench.compare(run_dir) if first_code == 0 else "YES: the first trainer did not finish"
    ok = (code == 2 and "is in use by another tpu-llm process" in line and f"pid {first.proc.pid}," in line
          and not has_traceback(second.text) and first_code == 0 and lost == "no")
    return Outcome(f"second: exit {code}: {line or last_lines(second.text)}; first: exit {first_code}"[:300], ok, lost)


def export_symlink(bench: Bench, name: str) -> Outcome:
    """`export --overwrite --output LINK`, LINK a symbolic link to a directory holding an export: refused
    in one line; the export it names intact (it was deleted, then the rename failed: issue 28)."""
    run_dir, real, link = bench.dir(name) / "run", bench.dir(name) / "real", bench.dir(name) / "link"
    code = Proc(bench.work / f"{name}-prepare.log", bench.train_args(run_dir, EVERY)).wait()
    code = code or Proc(bench.work / f"{name}-export.log", ["export", "--run_dir", str(run_dir), "--output",
                                                            str(real)]).wait()
    if code:
        return Outcome(f"preparing the run and its export failed (exit {code})", False, "-")
    link.symlink_to(real)
    before = tree_hash(real)
    p = Proc(bench.work / f"{name}.log", ["export", "--run_dir", str(run_dir), "--output", str(link), "--overwrite"])
    code = p.wait()
    text, line = p.text, error_line(p.text)
    lost = "no" if tree_hash(real) == before and link.is_symlink() else "YES: the export behind the link changed"
    ok = code == 2 and "symbolic link" in line and not has_traceback(text) and lost == "no"
    return Outcome(f"exit {code}: {line or last_lines(text)}"[:300], ok, lost)


OWNER = "import runpy; runpy.run_module('tpu_llm.cloud', run_name='__main__')"  # python -m tpu_llm.cloud ARGS


def owned_teardown(bench: Bench, name: str) -> Outcome:
    """A run owned as on TPU worker 0 (`python -m tpu_llm.cloud own`, DOWN_AFTER=1's teardown file, a fake
    gcloud): SIGTERM to the trainer after step 12, as `make tpu-stop` or TTL_HOURS send it. The trainer saves
    and stops (143); the owner records 143, then asks for the TPU's deletion exactly once; the same command
    then finishes equal to the uninterrupted run."""
    work = bench.dir(name)
    run_dir, home, bin_dir, calls, log = work / "run", work / "home", work / "bin", work / "gcloud.log", work / "train.log"
    home.mkdir(exist_ok=True)
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "gcloud").write_text(f'#!/bin/sh\necho "$*" >> {calls}\n')
    (bin_dir / "gcloud").chmod(0o755)
    (home / "tpu-llm-run.teardown").write_text("gcloud compute tpus tpu-vm delete tpu-x --zone=z --project=p --async\n")
    log.write_text("")
    train = [sys.executable, "-m", "tpu_llm", *bench.train_args(run_dir)]
    owner = Proc(bench.work / f"{name}-owner.log", ["own", f"--log={log}", f"--home={home}", "--copy-seconds=1",
                                                     "--log-url=gs://b/train.log", "--", *train], code=OWNER,
                 env={"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "TF_CPP_MIN_LOG_LEVEL": "2"})
    deadline = time.time() + TIMEOUT
    while progress(log.read_text(errors="replace")) < 12:
        if owner.proc.poll() is not None or time.time() > deadline:
            owner.kill()
            return Outcome(f"the owned run never reached step 12: {last_lines(log.read_text(errors='replace'))}",
                           False, "-")
        time.sleep(0.05)
    os.kill(int((home / "tpu-llm-train.pid").read_text()), signal.SIGTERM)
    code = owner.wait()
    deletes = [c for c in calls.read_text().splitlines() if c.startswith("compute tpus tpu-vm delete")]
    status = (home / "tpu-llm-run.status").read_text().strip() if (home / "tpu-llm-run.status").exists() else "none"
    ended = log.read_text().find("the run ended with exit status 143") < log.read_text().find("deleting this TPU")
    outcome = resume_and_compare(bench, run_dir, code, (143,), name)
    observed = f"status {status}, {len(deletes)} delete(s) after the run ended; {outcome.observed}"
    return Outcome(observed[:300], outcome.ok and status == "143" and len(deletes) == 1 and ended, outcome.lost)


@dataclasses.dataclass
class Row:
    name: str
    fault: str
    expected: str
    run: Callable[[Bench, str], Outcome]
    reference: bool = True  # compares with the uninterrupted run (trained first, only when a row needs it)


SAME = "the same command then finishes equal to the uninterrupted run"
ROWS = [
    Row("sigterm-startup", "SIGTERM at start-up (first line printed)", f"stops (143 or killed); {SAME}",
        signal_row("start-up", lambda t: "run_dir" in t)),
    Row("sigterm-resumed", "SIGTERM right after resuming (the `resumed` line)", f"143, keeps the data position; {SAME}",
        signal_row("the resumed line", lambda t: "resumed   from" in t, prepare_steps=EVERY)),
    Row("sigterm-compile", "SIGTERM during the first host call (XLA compilation)", f"143 at a step boundary; {SAME}",
        signal_row("compilation", lambda t: "batch " in t and time.sleep(0.5) is None)),
    Row("sigterm-step", "SIGTERM mid-run (after step 12)", f"143 at the next step boundary; {SAME}",
        signal_row("step 12", lambda t: progress(t) >= 12)),
    Row("sigint-step", "SIGINT mid-run (after step 12)", f"130 at the next step boundary; {SAME}",
        signal_row("step 12", lambda t: progress(t) >= 12, sig=signal.SIGINT)),
    Row("sigkill-save", "SIGKILL while saving ckpt-16", f"killed, ckpt-16 not recorded; {SAME}",
        in_save_row("SIGKILL", (-9,))),
    Row("sigterm-save", "SIGTERM while saving ckpt-16", f"the save completes, then 143; {SAME}",
        in_save_row("SIGTERM", (143,))),
    Row("truncated-index", "truncated ckpt-16.index", f"a warning, resumes from ckpt-8; {SAME}",
        damaged_checkpoint_row(lambda d: truncate(d / f"ckpt-{2 * EVERY}.index"), "cannot be read")),
    Row("truncated-data", "truncated ckpt-16 data file", f"a warning, resumes from ckpt-8; {SAME}",
        damaged_checkpoint_row(lambda d: truncate(next(d.glob(f"ckpt-{2 * EVERY}.data-*"))), "cannot be read")),
    Row("truncated-state", "truncated checkpoint state file", f"a warning, resumes from the files; {SAME}",
        damaged_checkpoint_row(lambda d: truncate(d / "checkpoint", 0.4), "state file")),
    Row("empty-state", "empty checkpoint state file (power loss)", f"a warning, resumes from the files; {SAME}",
        damaged_checkpoint_row(lambda d: (d / "checkpoint").write_text(""), "state file")),
    Row("corrupt-tokenizer", "torn tokenizer.json in the run directory", "exit 2, one line naming tokenizer.json; "
        "the run directory unchanged", refused_row(corrupted_tokenizer, "tokenizer.json")),
    Row("truncated-shard", "truncated TFRecord training shard (TF reads it as if it ended there)",
        "exit 2, one line naming the shard (its size differs from the one meta.json records); nothing written",
        refused_row(truncated_shard, "data-00000-of-00002.tfrecord")),
    Row("hf-offsets", "`import` of a safetensors file whose first tensor starts 1,000 bytes before the data",
        "exit 2, one line naming the file, the tensor and its offsets; nothing written",
        refused_row(hf_import(offsets_out_of_range), "data_offsets [-1000, 39960], outside the file's")),
    Row("hf-layers", "`import` of a config.json of 10^9 layers", "exit 2 at once, one line naming n_layer and its cap; "
        "nothing written", refused_row(hf_import(config_json_of_a_billion_layers), "n_layer=1000000000 is more than")),
    Row("hf-tokenizer-size", "`import` with a 500 MB tokenizer.json", "exit 2, one line naming the file and the "
        "100 MB cap, before reading it; nothing written",
        refused_row(hf_import(sparse_tokenizer_json), "a tokenizer file may have")),
    Row("hf-tied-head", "`import` of a checkpoint whose config.json ties the head, with an lm_head.weight unlike the "
        "table", "exit 2, one line naming both tensors; nothing written",
        refused_row(hf_import(tied_head_unlike_its_table), "lm_head.weight differs from the embedding table"),
        reference=False),
    Row("adapter-nan", "`import --adapter` of a PEFT adapter holding a NaN", "exit 2, one line naming the tensor; "
        "nothing written", refused_row(adapter_with_nan, "holds 1 non-finite values"), reference=False),
    Row("shard-ids", "shards holding byte ids (up to 255) with a 12-id tokenizer.json and a meta.json that says "
        "their largest id is 10", "exit 2, one line naming the id and the model's 12 ids; no checkpoint written",
        shard_ids_row, reference=False),
    Row("corrupt-record", "one flipped byte mid-way through a TFRecord training shard (its size unchanged)",
        "exit 2, one line naming the shard and the byte; the checkpoints saved before it readable, unchanged by "
        "running the same command again", corrupt_record_row, reference=False),
    Row("full-disk", "full disk (640 KB tmpfs run directory)", "exit 2, one line (free space); the newest "
        "checkpoint readable", full_disk),
    Row("symlink-index", "ckpt-16.index a symbolic link to a file outside the run directory",
        "exit 2, one line naming the link; nothing written through it", symlink_row("checkpoints/ckpt-16.index")),
    Row("symlink-metrics", "metrics.jsonl a symbolic link to a file outside the run directory",
        "exit 2, one line naming the link; nothing written through it", symlink_row("metrics.jsonl")),
    Row("symlink-logs", "logs/train a symbolic link to a directory outside the run directory",
        "exit 2, one line naming the link; nothing written through it", symlink_row("logs/train")),
    Row("fifo-lock", "the run directory's .tpu-llm-lock a FIFO", "exit 2 at once, one line naming the FIFO; the run "
        "directory unchanged", refused_row(special_file(".tpu-llm-lock", "fifo"), "a named pipe (FIFO)")),
    Row("fifo-metrics", "the run directory's metrics.jsonl a FIFO", "exit 2 at once, one line naming the FIFO; the "
        "run directory unchanged", refused_row(special_file("metrics.jsonl", "fifo"), "a named pipe (FIFO)")),
    Row("fifo-state", "the checkpoint state file a FIFO (TensorFlow opens it itself)", "exit 2 at once, one line "
        "naming the FIFO; the run directory unchanged",
        refused_row(special_file("checkpoints/checkpoint", "fifo"), "a named pipe (FIFO), checkpoints/checkpoint"),
        reference=False),
    Row("fifo-index", "ckpt-8.index a FIFO (TensorFlow opens it itself)", "exit 2 at once, one line naming the FIFO; "
        "the run directory unchanged",
        refused_row(special_file(f"checkpoints/ckpt-{EVERY}.index", "fifo"), "a named pipe (FIFO), checkpoints/"),
        reference=False),
    Row("state-outside", "the checkpoint state file lists a checkpoint outside the run directory (its files exist)",
        "exit 2, one line naming the path; nothing deleted, inside or outside the run directory",
        refused_row(state_naming_outside, "not a checkpoint ckpt-N of"), reference=False),
    Row("checkpoints-file", "checkpoints/ replaced by a regular file", "exit 2, one line naming it; the run "
        "directory (metrics.jsonl included) unchanged",
        refused_row(checkpoints_a_file, "holds checkpoints as a regular file"), reference=False),
    Row("config-drift", "train.lora_alpha edited in a LoRA run's config.yaml (8 -> 16), then the resume",
        "exit 2, one line naming train.lora_alpha and both values; the run directory unchanged",
        refused_row(lora_alpha_edited, "was trained with train.lora_alpha=8.0, this config has 16.0"), reference=False),
    Row("freeze-drift", "a run that trained every layer, resumed with --train.freeze=embeddings",
        "exit 2, one line naming train.freeze and both values; the run directory unchanged",
        refused_row(freeze_edited, "was trained with train.freeze='', this config has 'embeddings'"), reference=False),
    Row("eval-vocabulary", "`eval --text` of a file holding a character a char-vocabulary run never saw",
        "exit 2, one line naming the character; the run directory unchanged",
        refused_row(text_outside_the_vocabulary, "character(s) that the run's char vocabulary does not hold"),
        reference=False),
    Row("hardlink-goodput", "goodput.jsonl hard-linked to a file outside the run directory", "exit 2, one line "
        "naming the hard link; nothing appended through it", refused_row(special_file("goodput.jsonl", "hardlink"),
                                                                         "goodput.jsonl has 2 hard links")),
    Row("prepare-into-run", "`data prepare --overwrite --output` a run directory", "exit 2, one line (a run "
        "directory); the run's tokenizer.json unchanged", refused_row(prepare_into_run, "is a tpu-llm run directory")),
    Row("owned-teardown", "SIGTERM to a run owned as on TPU worker 0 with DOWN_AFTER=1 (fake gcloud), after step 12",
        f"143; the owner records it, then deletes the TPU once; {SAME}", owned_teardown),
    Row("two-trainers", "a second trainer (another learning rate) on the run directory of one still training",
        "the second: exit 2, one line naming the first's pid; the first finishes equal to the uninterrupted run",
        two_trainers),
    Row("export-symlink", "export --overwrite to a symbolic link to a directory holding an export",
        "exit 2, one line (a symbolic link); the export behind it intact", export_symlink),
    *[Row(f"nan-{mode}", f"NaN gradients at step 4, 2 replicas, {mode}", "the step skipped, exit 0; every "
          "checkpoint tensor finite", nan_row(flags)) for mode, flags in {
        "allreduce": [], "bf16": ["--comm.compression=bf16"], "powersgd": ["--comm.compression=powersgd",
                                                                          "--comm.rank=2"],
        "topk": ["--comm.compression=topk", "--comm.topk_ratio=0.05"], "localsgd": ["--comm.sync_every=4"],
        "zero2": ["--parallel.shard_optimizer=grads", "--train.grad_accum=2"]}.items()],
    Row("zero-layout", "SIGTERM after step 12 of a 2-replica run with divided moments (shard_optimizer=state), "
        "resumed on 1 replica with whole ones (no dropout)", "143, then exit 0; every step's loss within 1e-5 of the 2-replica "
        "run left alone", other_layout_row(), reference=False),
    Row("ps-worker", "SIGKILL of one of 2 parameter-server workers", "exit 0: the chief goes on with the other",
        cluster_row(2, 1, "worker 1", 0, "[chief 0] done      step 40")),
    Row("ps-task", "SIGKILL of the ps task", "exit 4, one line: the cluster lost ps 0",
        cluster_row(2, 1, "ps 0", 4, "the cluster lost ps 0", steps=4000)),
    Row("ps-last-worker", "SIGKILL of the last parameter-server worker", "exit 4, one line: no worker is left",
        cluster_row(1, 1, "worker 0", 4, "no worker is left to run steps", steps=4000)),
    Row("mw-worker", "SIGKILL of a multi-worker peer", "exit 4: every task stops",
        cluster_row(2, 0, "worker 1", 4, "exited with status -9: stopping every task", steps=4000)),
    Row("launcher-kill-mw", "SIGKILL of `tpu-llm launch` (2 multi-worker tasks) after step 12",
        "no task left after 30 s; a checkpoint saved on the way out", launcher_kill_row(0), reference=False),
    Row("launcher-kill-ps", "SIGKILL of `tpu-llm launch` (chief, 2 workers, 1 ps) after step 12",
        "no task left after 30 s; the chief saved a checkpoint on the way out", launcher_kill_row(1),
        reference=False),
]


def run_row(bench: Bench, row: Row) -> tuple[Row, Outcome, float]:
    start = time.time()
    try:
        outcome = row.run(bench, row.name)
    except Hang as e:
        outcome = Outcome(f"HANG: {e}"[:300], False, "?")
    except Exception as e:  # noqa: BLE001 (a row that cannot even run is reported, not fatal)
        outcome = Outcome(f"harness error: {type(e).__name__}: {e}"[:300], False, "?")
    return row, outcome, time.time() - start


def table(results) -> str:
    lines = ["| fault | expected | observed | lost | as expected | seconds |", "|---|---|---|---|---|---|"]
    for row, outcome, seconds in results:
        observed = outcome.observed.replace("|", "/").replace("\n", " ")
        lines.append(f"| {row.fault} | {row.expected} | {observed} | {outcome.lost} | "
                     f"{'yes' if outcome.ok else '**NO**'} | {seconds:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", action="append", default=[], help="only rows whose name contains this")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs, run directories)")
    options = parser.parse_args(argv)
    rows = [r for r in ROWS if not options.k or any(k in r.name for k in options.k)]
    if options.list:
        for r in rows:
            print(f"{r.name:18} {r.fault}: {r.expected}")
        return 0
    work = Path(tempfile.mkdtemp(prefix="tpu-llm-faults-"))
    bench, start = Bench(work), time.time()
    print(f"faults    {len(rows)} rows; logs and run directories in {work}", flush=True)
    if any(r.reference for r in rows):
        reference = Proc(work / "reference.log", bench.train_args(work / "reference"))
        if reference.wait():
            print(f"error: the uninterrupted reference run failed: {last_lines(reference.text)}", file=sys.stderr)
            return 1
        bench.reference = logged(work / "reference")
        print(f"faults    reference: {STEPS} steps, fingerprint {bench.reference[1]} ({time.time() - start:.0f} s)",
              flush=True)
    results = []
    with concurrent.futures.ThreadPoolExecutor(int(os.environ.get("FAULTS_JOBS", "2"))) as pool:
        for row, outcome, seconds in pool.map(lambda r: run_row(bench, r), rows):
            print(f"faults    {row.name:18} {'ok ' if outcome.ok else 'NOT'} ({seconds:.0f} s) {outcome.observed}",
                  flush=True)
            results.append((row, outcome, seconds))
    print()
    print(table(results))
    good = sum(o.ok for _, o, _ in results)
    print(f"\n{good} of {len(results)} rows as expected; {time.time() - start:.0f} s in all")
    if not options.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if good == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
