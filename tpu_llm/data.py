"""Host-side input pipeline: sources -> tokenize -> append EOS -> pack -> shuffle -> batch.

Everything here runs in tf.data on the host CPU. The step only ever sees int32 batches of a fixed
shape `(per_replica_batch, seq_len)`, so it compiles once (TPU rule: static shapes, drop_remainder).

Sources are text files (each file is one document) or pre-tokenized TFRecord shards written by
`tpu-llm data prepare` (`write_shards`). With no `data.train`, the embedded corpus is used: the
running interpreter's own standard-library `.py` sources, split into train/validation by a stable
hash of each file's path, so `make train` needs no download.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import sysconfig
import time
from typing import Callable

import tensorflow as tf

from tpu_llm.config import DataConfig
from tpu_llm.errors import UserError

FILES_PER_PIPELINE = 4  # fewer files per input pipeline: split by window, not by file
AUTOTUNE = tf.data.AUTOTUNE
SNIFF_BYTES = 4096  # bytes read from each file to tell text from binary
SNIFF_MAX_FILES = 256  # files sniffed up front (each costs a request on gs://)
TFRECORD_FEATURE = "tokens"
RECORD_MAX_TOKENS = 1 << 16  # long documents are split across records of at most this many tokens


@dataclasses.dataclass
class Source:
    """Resolved files for one split, and how to read them."""

    files: list[str]
    format: str  # "text" | "tfrecord"
    byte_range: tuple[float, float] = (0.0, 1.0)  # fraction of each text file this split reads
    description: str = ""


# --------------------------------------------------------------------------------------------------
# Resolving config to files


def embedded_corpus_files() -> list[str]:
    """The interpreter's stdlib .py files, sorted (tests and site-packages left out)."""
    root = sysconfig.get_paths()["stdlib"]
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test"}
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip and not d.startswith("."))
        files.extend(os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py"))
    return sorted(files)


def stable_fraction(path: str, root: str = "") -> float:
    """A number in [0, 1) fixed by the path (relative to `root`), the same on every machine."""
    rel = os.path.relpath(path, root) if root else path
    return int(hashlib.sha256(rel.encode()).hexdigest()[:8], 16) / 2**32


def resolve_sources(cfg: DataConfig) -> tuple[Source, Source]:
    """(train, validation) sources for the data config; raises UserError for missing/bad files."""
    frac = cfg.validation_fraction
    if not cfg.train:
        files = embedded_corpus_files()
        if not files:
            raise UserError("the embedded corpus is empty: this Python has no stdlib .py sources; "
                            "point data.train at your own text files")
        root = sysconfig.get_paths()["stdlib"]
        val = [f for f in files if stable_fraction(f, root) < frac]
        train = [f for f in files if stable_fraction(f, root) >= frac]
        version = f"Python {sys.version_info.major}.{sys.version_info.minor}"
        return (Source(train, "text", description=f"embedded corpus ({version} stdlib): {len(train)} files"),
                Source(val, "text", description=f"embedded corpus ({version} stdlib): {len(val)} files"))

    train_files = expand_globs(cfg.train, "data.train")
    fmt = detect_format(train_files, cfg.format, "data.train")
    if cfg.validation:
        val_files = expand_globs(cfg.validation, "data.validation")
        vfmt = detect_format(val_files, cfg.format, "data.validation")
        return (Source(train_files, fmt, description=f"{cfg.train}: {len(train_files)} files"),
                Source(val_files, vfmt, description=f"{cfg.validation}: {len(val_files)} files"))
    if len(train_files) >= 10:  # enough files: hold out whole files (hashed relative to their root)
        root = os.path.commonpath(train_files) if len(set(train_files)) > 1 else ""
        val = [f for f in train_files if stable_fraction(f, root) < frac]
        train = [f for f in train_files if stable_fraction(f, root) >= frac]
        if val and train:
            return (Source(train, fmt, description=f"{cfg.train}: {len(train)} files"),
                    Source(val, fmt, description=f"{cfg.train}: {len(val)} held-out files"))
    if fmt == "tfrecord":
        raise UserError(f"data.train={cfg.train!r} has too few shards to hold some out for "
                        "validation; set data.validation to separate shards")
    cut = 1.0 - frac  # few files: the tail of each file is validation (as nanoGPT does)
    return (Source(train_files, fmt, (0.0, cut), f"{cfg.train}: first {cut:.0%} of {len(train_files)} files"),
            Source(train_files, fmt, (cut, 1.0), f"{cfg.train}: last {frac:.0%} of {len(train_files)} files"))


def expand_globs(spec: str, key: str) -> list[str]:
    files: list[str] = []
    for pattern in (p.strip() for p in spec.split(",")):
        if not pattern:
            continue
        try:
            matched = tf.io.gfile.glob(pattern)
        except tf.errors.OpError as e:
            raise UserError(f"{key}: cannot list {pattern!r} ({e.message.splitlines()[0]}); "
                            "check the path and your credentials") from None
        matched = [m for m in matched if not tf.io.gfile.isdir(m)]
        if not matched:
            raise UserError(f"{key}: no files match {pattern!r}; check the path or glob")
        files.extend(sorted(matched))
    if not files:
        raise UserError(f"{key} is empty; give files or globs, comma-separated")
    if all(tf.io.gfile.stat(f).length == 0 for f in files[:SNIFF_MAX_FILES]):
        raise UserError(f"{key}: every file matching {spec!r} is empty; point it at your data")
    return files


def detect_format(files: list[str], fmt: str, key: str) -> str:
    if fmt == "auto":
        fmt = "tfrecord" if all(".tfrecord" in os.path.basename(f) for f in files) else "text"
    if fmt == "text":
        for path in files[:SNIFF_MAX_FILES]:
            check_text_file(path, key)
    return fmt


def check_text_file(path: str, key: str) -> None:
    """Raise UserError unless the start of `path` is UTF-8 text."""
    with tf.io.gfile.GFile(path, "rb") as f:
        head = f.read(SNIFF_BYTES)
    if b"\0" in head:
        raise UserError(f"{key}: {path} looks binary (NUL bytes); give UTF-8 text, or TFRecord "
                        "shards from `tpu-llm data prepare` with data.format=tfrecord")
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        if len(head) < SNIFF_BYTES or e.start < len(head) - 3:  # not a character cut by the sniff
            raise UserError(f"{key}: {path} is not UTF-8 text (byte 0x{head[e.start]:02x} at "
                            f"offset {e.start}); convert it to UTF-8 first") from None


# --------------------------------------------------------------------------------------------------
# Building the pipeline


def read_documents(source: Source) -> Callable[[tf.Tensor], tf.data.Dataset]:
    """file path -> dataset of documents (strings for text, int32 token vectors for tfrecord)."""
    if source.format == "tfrecord":
        spec = {TFRECORD_FEATURE: tf.io.RaggedFeature(tf.int64)}

        def read(path):
            records = tf.data.TFRecordDataset(path)
            return records.map(lambda r: tf.cast(tf.io.parse_single_example(r, spec)[TFRECORD_FEATURE],
                                                 tf.int32))
        return read

    start, end = source.byte_range

    def read(path):
        text = tf.io.read_file(path)
        if (start, end) != (0.0, 1.0):
            n = tf.cast(tf.strings.length(text), tf.float64)
            lo, hi = tf.cast(n * start, tf.int32), tf.cast(n * end, tf.int32)
            text = tf.strings.substr(text, lo, hi - lo)
        return tf.data.Dataset.from_tensors(text)
    return read


def pack(tokens: tf.data.Dataset, window: int) -> tf.data.Dataset:
    """Concatenate token vectors and cut them into windows of exactly `window` tokens.

    A `scan` carries the leftover tail of one document into the next, so no token is lost or
    duplicated and no per-token tf.data elements are created (fast on long documents).
    """
    def step(carry, doc):
        stream = tf.concat([carry, doc], axis=0)
        n = tf.shape(stream)[0] // window
        full = tf.reshape(stream[: n * window], [n, window])
        return stream[n * window:], full

    return tokens.scan(tf.zeros([0], tf.int32), step).unbatch()


def _random_start(index, doc, window, seed):
    """Drop a random prefix (< one window, < 1/8 of the document) from pass `index` over a document.

    Without it every epoch cuts a document into the same windows, and a small corpus trained for
    several epochs is memorised window by window. The offset is a pure function of (seed, index),
    so the stream stays deterministic and resumable.
    """
    limit = tf.minimum(window - 1, tf.shape(doc)[0] // 8) + 1  # start in [0, limit)
    start = tf.random.stateless_uniform([], seed=tf.stack([tf.cast(seed, tf.int64), index]), minval=0,
                                        maxval=limit, dtype=tf.int32)
    return doc[start:]


def make_dataset_fn(source: Source, tokenizer, seq_len: int, global_batch: int, *, training: bool,
                    seed: int | None, shuffle_buffer: int, skip_steps: int = 0) -> Callable:
    """A function of `tf.distribute.InputContext` returning this host's batched dataset.

    Each element is `(inputs, targets)`, both int32 `(per_replica_batch, seq_len)`; targets are the
    inputs shifted by one token. Training data repeats forever, is shuffled, and starts each pass
    over a document at a random offset (`_random_start`); validation is read in order, so every
    evaluation sees the same batches. `skip_steps` drops the batches of that many global steps (this
    host's share), to resume where an earlier run stopped.

    Several input pipelines (one per worker) split the data by file when every pipeline gets at
    least `FILES_PER_PIPELINE` files; otherwise each reads and shuffles the whole stream the same
    way and keeps every n-th window, so that together they feed exactly the global batches a single
    process would (same windows, same steps). `seed=None` draws the order from each pipeline's
    clock instead: parameter-server workers build the same dataset graph, and a fixed seed would
    give them all the same batches.
    """
    window = seq_len + 1
    eos = tf.constant([tokenizer.eos_id], tf.int32)

    def dataset_fn(ctx: tf.distribute.InputContext | None = None) -> tf.data.Dataset:
        ctx = ctx or tf.distribute.InputContext()
        pipelines, index = ctx.num_input_pipelines, ctx.input_pipeline_id
        per_replica = ctx.get_per_replica_batch_size(global_batch)
        order = seed if seed is not None else tf.cast(tf.timestamp() * 1e6, tf.int64) % (2 ** 31)
        files = tf.data.Dataset.from_tensor_slices(source.files)
        shard_files = pipelines > 1 and len(source.files) >= FILES_PER_PIPELINE * pipelines
        if shard_files:
            files = files.shard(pipelines, index)
        if training:
            files = files.shuffle(len(source.files), seed=order, reshuffle_each_iteration=True).repeat()
        # a long document spans several records of one shard: tfrecord shards are read one at a
        # time so its records stay contiguous; text files are whole documents and can interleave
        docs = files.interleave(read_documents(source), cycle_length=1 if source.format == "tfrecord" else 4,
                                num_parallel_calls=AUTOTUNE, deterministic=True)
        if source.format == "text":
            docs = docs.batch(16).map(lambda t: tokenizer.encode_tf(t), num_parallel_calls=AUTOTUNE)
            docs = docs.unbatch()
            docs = docs.map(lambda d: tf.concat([tf.cast(d, tf.int32), eos], axis=0))  # shards hold theirs
        if training:
            docs = docs.enumerate().map(lambda i, d: _random_start(i, d, window, order))
        windows = pack(docs, window)
        if training:
            windows = windows.shuffle(shuffle_buffer, seed=order)
        if pipelines > 1 and not shard_files:  # after the shuffle: every pipeline shuffled alike
            windows = windows.shard(pipelines, index)
        batches = windows.batch(per_replica, drop_remainder=True)
        if skip_steps:  # each global step takes one batch per replica fed by this pipeline
            batches = batches.skip(skip_steps * ctx.num_replicas_in_sync // pipelines)
        batches = batches.map(lambda w: (w[:, :-1], w[:, 1:]), num_parallel_calls=AUTOTUNE)
        if not training:
            batches = batches.repeat()  # an eval pass may ask for more batches than one epoch holds
        return batches.prefetch(AUTOTUNE)

    return dataset_fn


# --------------------------------------------------------------------------------------------------
# Pre-tokenized shards


def write_shards(source: Source, tokenizer, output: str, num_shards: int, overwrite: bool = False,
                 progress: Callable[[int, int, int], None] | None = None) -> dict:
    """Tokenize `source` once and write `num_shards` TFRecord files plus `meta.json` to `output`.

    Shard i holds the i-th contiguous run of documents, so reading the shards in order gives the
    input order; a long document is split across consecutive records of one shard. Each shard is
    written under a temporary name and renamed when complete, so an interrupted run never leaves a
    truncated shard behind.
    """
    from tpu_llm.tokenizer import save_tokenizer

    tf.io.gfile.makedirs(output)
    existing = tf.io.gfile.glob(os.path.join(output, "*.tfrecord"))
    if existing and not overwrite:
        raise UserError(f"{output} already holds {len(existing)} shards; pass --overwrite to "
                        "replace them or choose another --output")
    names = [os.path.join(output, f"data-{i:05d}-of-{num_shards:05d}.tfrecord") for i in range(num_shards)]
    writers = [tf.io.TFRecordWriter(n + ".tmp") for n in names]
    docs = tf.data.Dataset.from_tensor_slices(source.files).map(tf.io.read_file)
    docs = docs.batch(8).map(tokenizer.encode_tf, num_parallel_calls=AUTOTUNE).unbatch()
    docs = docs.prefetch(AUTOTUNE)
    tokens = records = 0
    start = time.time()
    for i, doc in enumerate(docs):
        shard = i * num_shards // len(source.files)  # contiguous runs of documents, in input order
        ids = doc.numpy().tolist() + [tokenizer.eos_id]
        for lo in range(0, len(ids), RECORD_MAX_TOKENS):
            feature = tf.train.Feature(int64_list=tf.train.Int64List(value=ids[lo:lo + RECORD_MAX_TOKENS]))
            example = tf.train.Example(features=tf.train.Features(feature={TFRECORD_FEATURE: feature}))
            writers[shard].write(example.SerializeToString())
            records += 1
        tokens += len(ids)
        if progress:
            progress(i + 1, len(source.files), tokens)
    for w in writers:
        w.close()
    for n in names:
        tf.io.gfile.rename(n + ".tmp", n, overwrite=True)
    for path in set(existing) - set(names):  # overwritten: no stale shard (other --shards) may remain
        tf.io.gfile.remove(path)
    save_tokenizer(tokenizer, output)
    meta = {"files": len(source.files), "tokens": tokens, "records": records, "shards": num_shards,
            "tokenizer": tokenizer.spec(), "seconds": round(time.time() - start, 1)}
    with tf.io.gfile.GFile(os.path.join(output, "meta.json"), "w") as f:
        f.write(json.dumps(meta, indent=1))
    return meta
