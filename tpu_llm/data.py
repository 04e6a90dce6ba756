"""Host-side input pipeline: sources -> tokenize -> append EOS -> pack -> shuffle -> batch.

Everything here runs in tf.data on the host CPU. The step only ever sees int32 batches of a fixed
shape `(per_replica_batch, seq_len)`, so it compiles once (TPU rule: static shapes, drop_remainder).

Sources are text files (each file is one document) or pre-tokenized TFRecord shards written by
`tpu-llm data prepare` (`write_shards`). With no `data.train`, the embedded corpus is used: the
running interpreter's own standard-library `.py` sources, split into train/validation by a stable
hash of each file's path, so `make train` needs no download. `builtin:NAME` names a corpus shipped in
the package (tpu_llm/corpora.py: the benchmark's tinyshakespeare).
"""

from __future__ import annotations

import codecs
import dataclasses
import hashlib
import json
import os
import sys
import sysconfig
import time
from typing import Callable

import tensorflow as tf

from tpu_llm import corpora
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
    spec = corpora.resolve(spec, key)  # builtin:NAME -> the file shipped in the package, checksum checked
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
        if not matched and tf.io.gfile.isdir(pattern):
            raise UserError(_directory_message(pattern, key))
        if not matched:
            raise UserError(f"{key}: no files match {pattern!r}; check the path or glob")
        files.extend(sorted(matched))
    if not files:
        raise UserError(f"{key} is empty; give files or globs, comma-separated")
    if all(tf.io.gfile.stat(f).length == 0 for f in files[:SNIFF_MAX_FILES]):
        raise UserError(f"{key}: every file matching {spec!r} is empty; point it at your data")
    return files


def _directory_message(path: str, key: str) -> str:
    """`key` names a directory: the glob to use instead, from what the directory holds."""
    names = [n for n in tf.io.gfile.listdir(path) if not n.endswith("/")]
    names = [n for n in names if not tf.io.gfile.isdir(os.path.join(path, n))]
    extensions = [os.path.splitext(n)[1] for n in names if os.path.splitext(n)[1] not in (".json", ".model")]
    flag = f"--{key}=" if key.startswith("data.") else f"{key} "
    if not extensions:
        return (f"{key}: {path!r} is a directory{' with no data files' if not names else ''}; give files or a "
                f"glob, e.g. {flag}'{path.rstrip('/')}/*.txt'")
    ext = ".tfrecord" if ".tfrecord" in extensions else max(set(extensions), key=extensions.count)
    count = extensions.count(ext)
    return (f"{key}: {path!r} is a directory; give a glob of its files, e.g. {flag}'{path.rstrip('/')}/*{ext}' "
            f"({count} {ext or 'extensionless'} file{'s' if count != 1 else ''} in it)")


def detect_format(files: list[str], fmt: str, key: str) -> str:
    if fmt == "auto":
        fmt = "tfrecord" if all(".tfrecord" in os.path.basename(f) for f in files) else "text"
    if fmt == "text":
        for path in files[:SNIFF_MAX_FILES]:
            check_text_file(path, key)
    else:
        check_shard_sizes(files, key)
    return fmt


def check_shard_sizes(files: list[str], key: str) -> None:
    """Raise UserError for a shard whose size differs from the one `data prepare` recorded in its
    folder's meta.json ("shard_bytes"): TensorFlow reads a TFRecord file cut short (an interrupted copy
    or upload) as if it ended there, so a torn shard would train silently on part of its data. One
    stat per file; shards without that record (written by an earlier version) are not checked."""
    recorded: dict[str, dict] = {}
    for path in files:
        folder = os.path.dirname(path)
        if folder not in recorded:
            meta_path = os.path.join(folder, "meta.json")
            try:
                with tf.io.gfile.GFile(meta_path) as f:
                    recorded[folder] = json.loads(f.read()).get("shard_bytes", {})
            except (tf.errors.NotFoundError, ValueError, AttributeError):
                recorded[folder] = {}
        expected = recorded[folder].get(os.path.basename(path))
        if expected is not None and tf.io.gfile.stat(path).length != expected:
            raise UserError(f"{key}: shard {path} is {tf.io.gfile.stat(path).length:,} bytes, but its meta.json "
                            f"records {expected:,}: it was cut short or changed (an interrupted copy?); copy it "
                            "again, or re-run `tpu-llm data prepare`")


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


READ_CHUNK = 1 << 20  # bytes read at a time by the checks below
CHARACTERS_READ_LIMIT = 64 << 20  # bytes of text a char vocabulary is checked against (all of a small corpus)


def count_tokens(source: Source, tokenizer, stop_at: int) -> int:
    """Tokens in one pass over `source` (end-of-text included), counted until `stop_at` is reached: a
    check that costs little on a large corpus. Byte tokens are counted from file sizes; char and
    SentencePiece tokens by encoding the text 1 MB at a time (a character or piece cut at a chunk's
    edge counts as more, never fewer, tokens); TFRecord shards by reading their records."""
    total = 0
    if source.format == "tfrecord":
        spec = {TFRECORD_FEATURE: tf.io.RaggedFeature(tf.int64)}
        for record in tf.data.TFRecordDataset(source.files):
            total += int(tf.shape(tf.io.parse_single_example(record, spec)[TFRECORD_FEATURE])[0])
            if total >= stop_at:
                break
        return total
    start, end = source.byte_range
    for path in source.files:
        size = tf.io.gfile.stat(path).length
        lo, hi = int(size * start), int(size * end)  # as read_documents cuts the file
        total += 1  # end-of-text
        if tokenizer.kind == "byte":
            total += hi - lo
        else:
            with tf.io.gfile.GFile(path, "rb") as f:
                f.seek(lo)
                while lo < hi and total < stop_at:
                    chunk = f.read(min(READ_CHUNK, hi - lo))
                    if not chunk:
                        break
                    lo += len(chunk)
                    total += len(tokenizer.encode(chunk))
        if total >= stop_at:
            break
    return total


def check_holds_a_batch(source: Source, tokenizer, batch_size: int, seq_len: int, split: str) -> None:
    """UserError unless one pass over `source` holds at least one batch of `batch_size` windows of
    `seq_len + 1` tokens. Validation reads one pass (less than a batch: no evaluation at all); training
    repeats the data, but a corpus smaller than one batch would be the same few windows over and over.
    Run before training, so that the run directory is left alone (controller.build_run)."""
    window = seq_len + 1
    if count_tokens(source, tokenizer, stop_at=batch_size * window) < batch_size * window:
        raise UserError(f"{split} data ({source.description}) holds less than one batch of {batch_size} x "
                        f"{window} tokens; add data or lower train.batch_size / data.seq_len")


def text_characters(files: list[str], limit: int = CHARACTERS_READ_LIMIT) -> set[str]:
    """The characters of `files` (decoded as CharTokenizer.from_files does), reading at most `limit` bytes."""
    chars: set[str] = set()
    for path in files:
        with tf.io.gfile.GFile(path, "rb") as f:
            text = f.read(limit)
        cut = len(text) == limit  # a character cut at the limit is not one of the data's
        chars.update(codecs.getincrementaldecoder("utf-8")(errors="replace").decode(text, final=not cut))
        limit -= len(text)
        if limit <= 0:
            break
    return chars


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


def _seed(order, *values) -> tf.Tensor:
    """A stateless-RNG seed (shape [2]) that is a pure function of the run's seed and `values`; the
    first value names what it is for, so the file order, start offsets and chunk orders never share one."""
    seed = tf.stack([tf.cast(order, tf.int64), tf.constant(0, tf.int64)])
    for value in values:
        seed = tf.random.experimental.stateless_fold_in(seed, tf.cast(value, tf.int64))
    return seed


FILE_ORDER, START_OFFSET, CHUNK_ORDER = 1, 2, 3  # first value of `_seed` for each use


def _random_start(doc, window, seed):
    """Drop a random prefix (< one window, < 1/8 of the document) from one pass over a document.

    Without it every epoch cuts a document into the same windows, and a small corpus trained for
    several epochs is memorised window by window. `seed` is a function of (run seed, epoch, file,
    document), so the stream stays deterministic and resumable.
    """
    limit = tf.minimum(window - 1, tf.shape(doc)[0] // 8) + 1  # start in [0, limit)
    start = tf.random.stateless_uniform([], seed=seed, minval=0, maxval=limit, dtype=tf.int32)
    return doc[start:]


def pack_located(docs: tf.data.Dataset, window: int) -> tf.data.Dataset:
    """`pack`, for documents tagged with where they start (a vector whose last value is the token
    offset, e.g. (file slot, document, token)): each window comes with the location of its first
    token, from which the stream can be rebuilt exactly."""
    def step(state, element):
        carry, carry_at = state
        doc, at = element
        stream = tf.concat([carry, doc], axis=0)
        n, c = tf.shape(stream)[0] // window, tf.shape(carry)[0]
        offsets = tf.cast(tf.range(n) * window - c, tf.int64)  # into `doc`; negative: in the carry
        in_doc = tf.concat([tf.tile(at[None, :-1], [n, 1]), (at[-1] + offsets)[:, None]], axis=1)
        starts = tf.where((offsets < 0)[:, None], carry_at[None, :], in_doc)
        used = n * window
        rest_at = tf.where(used < c, carry_at, tf.concat([at[:-1], [at[-1] + tf.cast(used - c, tf.int64)]], 0))
        return (stream[used:], rest_at), (tf.reshape(stream[:used], [n, window]), starts)

    return docs.scan((tf.zeros([0], tf.int32), tf.zeros([3], tf.int64)), step).unbatch()


LANES = 4  # files read side by side (at most one lane per file), their windows interleaved in each chunk
# A training pipeline's position, one int64 row per pipeline: `taken` windows of chunk number `chunk`
# were consumed; the chunk starts, in lane l, at token `token_l` of document `document_l` of the
# `slot_l`-th file read (epoch slot // files, in that epoch's order). The rest say how the stream was
# cut: over how many pipelines the files were split (1: all read everything), lanes, chunk size, and
# which files it indexes (`files_fingerprint`).
POSITION_FIELDS = ("chunk", "taken", "file_shards", "lanes", "chunk_size", "files_fingerprint") + tuple(
    f"{name}_{lane}" for lane in range(LANES) for name in ("slot", "document", "token"))
FIXED = 6  # the fields before the lanes'


def files_fingerprint(files: list[str]) -> int:
    """A number fixed by the list of training files, in order (paths relative to their common folder,
    so that moving the whole folder keeps it): a saved position indexes this list."""
    root = os.path.commonpath(files) if len(set(files)) > 1 else os.path.dirname(files[0]) if files else ""
    text = "\n".join(os.path.relpath(f, root) if root else f for f in files)
    return int(hashlib.sha256(text.encode()).hexdigest()[:15], 16)  # 60 bits: a positive int64


def make_dataset_fn(source: Source, tokenizer, seq_len: int, global_batch: int, *, training: bool,
                    seed: int | None, shuffle_buffer: int, skip_steps: int = 0, start=None,
                    with_position: bool = False) -> Callable:
    """A function of `tf.distribute.InputContext` returning this host's batched dataset.

    Each element is `(inputs, targets)`, both int32 `(per_replica_batch, seq_len)`; targets are the
    inputs shifted by one token. Validation is read in order, so every evaluation sees the same
    batches. Training data repeats forever and is a pure function of the seed and a position
    (`POSITION_FIELDS`), so a resumed run continues it exactly without replaying it:

      files        epoch e reads the files in a permutation drawn from (seed, e) (`index_shuffle`,
                   computed per file, so starting at epoch e, file i costs nothing)
      lanes        LANES streams of files side by side (lane l reads the file slots l, l + LANES,
                   ...), their windows interleaved, so that one long file never fills a chunk
      documents    each pass over a document starts at a random offset (`_random_start`)
      windows      packed across documents and epochs within a lane (no token lost), each tagged
                   with where its first token is (`pack_located`)
      chunks       `shuffle_buffer` consecutive windows, permuted by (seed, chunk number): a shuffle
                   whose state is one number, unlike a shuffle buffer's

    `with_position` adds a third element, the position after the batch, as an int64
    `(pipelines, len(POSITION_FIELDS))` update: this pipeline's row in the first of its replicas'
    batches of a step, zeros elsewhere, so that summing over replicas (a SUM-on-read variable, see
    `controller.build_run`) gives every pipeline's position. `start` is such a table from a
    checkpoint: the stream resumes from it, reading at most one file and one chunk again. Without a
    usable `start`, `skip_steps` replays that many global steps (checkpoints that hold no position).
    A position made over another list of training files (files added, removed or renamed: it would
    land elsewhere) is not used, nor is the stream replayed: it starts over on the new list ("files").
    After it was called, `dataset_fn.resumed` says which happened ("position", "files", "replay" or
    "") and `dataset_fn.pipelines` is the number of input pipelines (the position table's rows).

    Several input pipelines (one per worker) split the data by file when every pipeline gets at
    least `FILES_PER_PIPELINE` files; otherwise each reads the whole stream the same way and takes
    its slice of every global batch, so that together they feed exactly the global batches a single
    process would. `seed=None` draws the order from each pipeline's clock instead: parameter-server
    workers build the same dataset graph, and a fixed seed would give them all the same batches.
    """
    window = seq_len + 1
    eos = tf.constant([tokenizer.eos_id], tf.int32)
    fingerprint = files_fingerprint(source.files) if training else 0

    def tokenized(docs):
        if source.format != "text":  # shards hold token ids, end-of-text included
            return docs
        docs = docs.batch(16).map(tokenizer.encode_tf, num_parallel_calls=AUTOTUNE).unbatch()
        return docs.map(lambda d: tf.concat([tf.cast(d, tf.int32), eos], axis=0))

    # a long document spans several records of one shard: tfrecord shards are read one at a time so
    # its records stay contiguous; text files are whole documents and can interleave
    cycle = 1 if source.format == "tfrecord" else 4

    def validation(ctx):
        pipelines, index = ctx.num_input_pipelines, ctx.input_pipeline_id
        files = tf.data.Dataset.from_tensor_slices(source.files)
        shard_files = pipelines > 1 and len(source.files) >= FILES_PER_PIPELINE * pipelines
        if shard_files:
            files = files.shard(pipelines, index)
        docs = tokenized(files.interleave(read_documents(source), cycle_length=cycle,
                                          num_parallel_calls=AUTOTUNE, deterministic=True))
        windows = pack(docs, window)
        if pipelines > 1 and not shard_files:
            windows = windows.shard(pipelines, index)
        batches = windows.batch(ctx.get_per_replica_batch_size(global_batch), drop_remainder=True)
        # an eval pass may ask for more batches than one epoch holds
        return batches.map(lambda w: (w[:, :-1], w[:, 1:]), num_parallel_calls=AUTOTUNE).repeat()

    def dataset_fn(ctx: tf.distribute.InputContext | None = None) -> tf.data.Dataset:
        ctx = ctx or tf.distribute.InputContext()
        if not training:
            return validation(ctx).prefetch(AUTOTUNE)
        pipelines, index = ctx.num_input_pipelines, ctx.input_pipeline_id
        per_replica = ctx.get_per_replica_batch_size(global_batch)
        replicas = ctx.num_replicas_in_sync // pipelines  # fed by this pipeline
        order = seed if seed is not None else tf.cast(tf.timestamp() * 1e6, tf.int64) % (2 ** 31)
        shard_files = pipelines > 1 and len(source.files) >= FILES_PER_PIPELINE * pipelines
        files = source.files[index::pipelines] if shard_files else source.files
        # more lanes than files would read the same files side by side from their beginnings: a
        # one-file corpus in 4 lanes trains 4 times on its first quarter before seeing the rest
        lanes = min(LANES, shuffle_buffer, len(files))
        size = -(-shuffle_buffer // lanes) * lanes  # windows per chunk: whole rounds of the lanes
        shape = (pipelines if shard_files else 1, lanes, size, fingerprint)
        row = _start_row(start, shape, index)
        files_changed = row is None and _other_files(start, fingerprint)
        dataset_fn.resumed = "position" if row is not None else "files" if files_changed else \
            "replay" if skip_steps else ""
        dataset_fn.pipelines = pipelines
        chunk, taken, at = (row[0], row[1], row[FIXED:]) if row is not None else (0, 0, [0] * (3 * LANES))
        windows = _lanes(source, files, tokenizer, eos, window, order, lanes, at)

        def permute(c, chunk_):
            w, starts = chunk_  # the chunk's first `lanes` windows are lanes 0.. in order: their starts
            k = tf.range(size, dtype=tf.int64)
            head = tf.stack([c, 0, shape[0], lanes, size, fingerprint])
            lane_starts = tf.pad(tf.reshape(starts[:lanes], [-1]), [[0, 3 * (LANES - lanes)]])
            where = tf.tile(tf.concat([head, lane_starts], 0)[None], [size, 1])
            where = tf.concat([where[:, :1], (k + 1)[:, None], where[:, 2:]], 1)  # taken: k + 1
            return tf.gather(w, tf.random.experimental.index_shuffle(k, _seed(order, CHUNK_ORDER, c), size - 1)), where

        stream = windows.batch(size, drop_remainder=True).enumerate(start=chunk).map(permute)
        stream = stream.prefetch(1).unbatch().skip(taken)  # the next chunk is packed while one is consumed
        take = per_replica * replicas  # this pipeline's windows per step
        lo = 0 if shard_files else index * take  # its slice of the global batch
        steps = stream.batch(take if shard_files else global_batch, drop_remainder=True)
        steps = steps.map(lambda w, where: (w[lo:lo + take], where[-1]))
        if skip_steps and row is None and not files_changed:
            steps = steps.skip(skip_steps)

        def per_replica_batches(w, where):
            mine = tf.one_hot(index, pipelines, dtype=tf.int64)[:, None] * where[None, :]
            updates = tf.concat([mine[None], tf.zeros([replicas - 1, pipelines, len(POSITION_FIELDS)], tf.int64)], 0)
            return tf.reshape(w, [replicas, per_replica, window]), updates

        batches = steps.map(per_replica_batches, num_parallel_calls=AUTOTUNE).unbatch()
        if with_position:
            batches = batches.map(lambda w, u: (w[:, :-1], w[:, 1:], u), num_parallel_calls=AUTOTUNE)
        else:
            batches = batches.map(lambda w, u: (w[:, :-1], w[:, 1:]), num_parallel_calls=AUTOTUNE)
        return batches.prefetch(AUTOTUNE)

    dataset_fn.resumed, dataset_fn.pipelines = "", 1
    return dataset_fn


def _lanes(source: Source, files: list[str], tokenizer, eos, window: int, order, lanes: int, at) -> tf.data.Dataset:
    """The windows of `lanes` lanes, interleaved one by one. Lane l reads the file slots l, l + lanes, ...
    (slot s is file s % len(files) of epoch s // len(files), in that epoch's permutation) and packs
    them into windows tagged with their start (slot, document, token); it starts at `at[l]` (all 0s:
    the beginning). One lane function serves all lanes (built once: tf.data traces it once)."""
    fresh = not any(at)
    first = tf.constant([[l, 0, 0] if fresh else at[3 * l: 3 * l + 3] for l in range(lanes)], tf.int64)
    n, paths = len(files), tf.constant(files)
    read = read_documents(source)

    def lane_windows(lane):
        first_slot, first_doc, first_token = first[lane][0], first[lane][1], first[lane][2]

        def documents(s):
            path = tf.gather(paths, tf.random.experimental.index_shuffle(s % n, _seed(order, FILE_ORDER, s // n), n - 1))
            skip = tf.where(tf.equal(s, first_slot), first_doc, 0)
            return read(path).enumerate().skip(skip).map(lambda d, doc: (s, d, doc))

        def located(s, d, doc):
            if source.format == "text":  # shards hold token ids, end-of-text included
                doc = tf.concat([tf.cast(tokenizer.encode_tf(doc[None])[0], tf.int32), eos], axis=0)
            doc = _random_start(doc, window, _seed(order, START_OFFSET, s, d))
            here = tf.logical_and(tf.equal(s, first_slot), tf.equal(d, first_doc))
            cut = tf.where(here, first_token, 0)  # the resumed document: from its token
            return doc[cut:], tf.stack([s, d, cut])

        docs = tf.data.Dataset.range(first_slot, tf.int64.max, lanes).interleave(
            documents, cycle_length=1, num_parallel_calls=AUTOTUNE, deterministic=True)  # one file at a time
        return pack_located(docs.map(located, num_parallel_calls=AUTOTUNE, deterministic=True), window)

    return tf.data.Dataset.range(lanes).interleave(lane_windows, cycle_length=lanes, block_length=1,
                                                   num_parallel_calls=lanes, deterministic=True)


def _start_row(start, shape: tuple, index: int):
    """This pipeline's row of a saved position table, or None when the table does not fit this run
    (files split over another number of pipelines, other lanes or chunk size: the stream was cut
    differently)."""
    if start is None or len(start) == 0:
        return None
    rows = [tuple(int(v) for v in r) for r in start]
    if not any(any(r) for r in rows):  # saved before any step ran (still the variable's zeros): the start
        return (0, 0, *shape) + (0,) * (3 * LANES)
    if any(len(r) != len(POSITION_FIELDS) or r[2:FIXED] != shape for r in rows):
        return None
    if shape[0] > 1:
        return rows[index] if len(rows) == shape[0] else None
    return rows[0]


def _other_files(start, fingerprint: int) -> bool:
    """Whether a saved position table was made over another list of training files."""
    if start is None or len(start) == 0 or len(start[0]) != len(POSITION_FIELDS):
        return False
    return any(any(int(v) for v in r) and int(r[FIXED - 1]) != fingerprint for r in start)


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
            "tokenizer": tokenizer.spec(), "seconds": round(time.time() - start, 1),
            # what check_shard_sizes compares each shard with before training
            "shard_bytes": {os.path.basename(n): tf.io.gfile.stat(n).length for n in names}}
    with tf.io.gfile.GFile(os.path.join(output, "meta.json"), "w") as f:
        f.write(json.dumps(meta, indent=1))
    return meta
