"""`tpu-llm data prepare`: text tokenized into TFRecord shards balanced by tokens, and their `meta.json`.

Training reads the shards back with the input pipeline's reader, tpu_llm/data/reading.py (`read_documents`; the
sizes, records and tokens that meta.json records are what `check_shard_sizes` and `training_units` use).
"""

from __future__ import annotations

import json
import os
import re
import time
from typing import Callable

import numpy as np
import tensorflow as tf

from tpu_llm.data.reading import AUTOTUNE, file_bounds, read_documents
from tpu_llm.data.sources import TFRECORD_FEATURE, Source
from tpu_llm.errors import UserError
from tpu_llm.platform.files import write_atomically
from tpu_llm.platform.run_layout import CHECKPOINT_DIR, CONFIG_FILE, HF_FILE, MARKER_FILE, SP_MODEL_FILE, SPEC_FILE
from tpu_llm.tokenizers import save_tokenizer

RECORD_MAX_TOKENS = 1 << 16  # long documents are split across records of at most this many tokens
META_FILE = "meta.json"
OWN_FILES = (META_FILE, SPEC_FILE, SP_MODEL_FILE, HF_FILE)  # with its shards: all data prepare writes
SHARD_NAME = re.compile(r"data-\d{5,}-of-\d{5,}\.tfrecord(\.tmp)?")


def write_shards(source: Source, tokenizer, output: str, num_shards: int, overwrite: bool = False,
                 progress: Callable[[int, int, int], None] | None = None) -> dict:
    """Tokenize `source` and write `num_shards` TFRecord files plus `meta.json` to `output`.

    Shards are balanced by tokens: shard i holds tokens [i * T // n, (i + 1) * T // n) of the stream
    (each document's tokens, then end-of-text), so a large document or a single large file is split
    across shards, none is empty, and reading them in order gives the input order. Text streams in
    pieces of lines (`text_pieces`: memory holds a piece, never a file), read twice: once to count
    the tokens, once to write them. A record holds at most RECORD_MAX_TOKENS tokens of one document.
    Each shard is written under a temporary name and renamed when complete, so an interrupted run
    never leaves a truncated shard behind. Too few tokens for `num_shards`: a UserError naming the
    count that fits, before anything is written.
    """
    try:  # before the input is read twice: a bucket out of reach is said at once, in one line
        existing = check_output(output, overwrite)
    except (tf.errors.OpError, OSError) as e:
        raise unreachable(output, e, "nothing was written") from None
    start = time.time()
    total, top = 0, -1
    for _, ids in _documents(source, tokenizer):  # the first pass: how many tokens, and the largest id
        total += len(ids)
        top = max(top, int(np.max(ids)) if len(ids) else -1)
    if top >= tokenizer.vocab_size:  # a tokenizer that contradicts itself: training would gather out of range
        raise UserError(f"the {tokenizer.kind} tokenizer gave token id {top:,}, outside its own "
                        f"{tokenizer.vocab_size:,} ids; check --tokenizer_model; nothing was written")
    if total < num_shards:
        raise UserError(f"the input holds {total:,} tokens, too few for --shards={num_shards} (each shard must "
                        f"hold at least one); pass --shards={max(1, total)} or fewer, or add data")
    try:
        return _write(source, tokenizer, output, num_shards, existing, total, start, progress, top)
    except (tf.errors.OpError, OSError) as e:  # the network or the bucket lost half-way
        raise unreachable(output, e, "a shard is renamed from its .tmp name only once complete; run the same "
                                     "command again with --overwrite") from None


def check_output(output: str, overwrite: bool) -> list[str]:
    """Refuse (UserError) an --output that `data prepare` does not own; return the shards it would replace.

    It writes only into a new or empty directory, or with --overwrite, and then only its own files
    (OWN_FILES and its shards): never into a run directory (whose char vocabulary a prepare's
    tokenizer.json replaced, so that the run could no longer resume), never through a link at one of its
    names (a linked meta.json was written into the file it named), never into another file's place."""
    is_dir = tf.io.gfile.isdir(output)
    names = [n.rstrip("/") for n in tf.io.gfile.listdir(output)] if is_dir else []
    if not is_dir and tf.io.gfile.exists(output):
        raise UserError(f"--output {output!r} is a file, not a directory; choose a new or empty directory")
    run_files = [n for n in names if n in (MARKER_FILE, CONFIG_FILE, CHECKPOINT_DIR)]
    if run_files and (MARKER_FILE in names or {CONFIG_FILE, SPEC_FILE, CHECKPOINT_DIR} <= set(names)):
        raise UserError(f"--output {output!r} is a tpu-llm run directory (it holds {', '.join(run_files)}); shards "
                        "never go into a run's directory (its tokenizer.json would be replaced): choose a new --output")
    if run_files:  # another tool's folder (a config.yaml, a checkpoints/ of its own): say what it is, and is not
        raise UserError(f"--output {output!r} is not empty and not a tpu-llm data directory (it holds "
                        f"{', '.join(run_files)}, no {META_FILE}); shards never go beside such files, even with "
                        "--overwrite: choose a new or empty --output")
    ours = [n for n in names if n in OWN_FILES or SHARD_NAME.fullmatch(n)]
    if "://" not in output:  # gs:// has no links
        for name in ours:
            if os.path.islink(os.path.join(output, name)):
                raise UserError(f"--output {output!r} holds a symbolic link, {name}; data prepare never writes "
                                "through a link: remove it, or choose a new --output")
    shards = [os.path.join(output, n) for n in ours if n.endswith(".tfrecord")]
    if names and not overwrite:
        others = sorted(set(names) - set(ours))
        what = (f"{len(shards)} shards" if shards else
                f"files of an earlier data prepare ({', '.join(sorted(ours))})" if ours else
                f"{len(others)} other files ({', '.join(others[:3])}{', ...' if len(others) > 3 else ''})")
        raise UserError(f"{output} already holds {what}; pass --overwrite to replace data prepare's own files there "
                        "(nothing else is touched) or choose another --output")
    return shards


def unreachable(output: str, error: Exception, after: str) -> UserError:
    """The one line for an --output that cannot be reached or written (TensorFlow's own error is 20
    lines of HTTP retries): the bucket, the fix, and `after`, what became of the shards."""
    said = (getattr(error, "message", "") or getattr(error, "strerror", "") or str(error)).strip()
    said = (said.splitlines() or [""])[0][:160]
    if "://" in output:
        bucket = "/".join(output.split("/")[:3])
        fix = (f"check the network, your credentials (gcloud auth application-default login) and that the bucket "
               f"{bucket} exists (`python -m tpu_llm.cloud check {output}` tests it)")
    else:
        fix = "check the path and its permissions"
    return UserError(f"--output {output!r} cannot be reached or written ({type(error).__name__}: {said}); {fix}; "
                     f"{after}")


def _write(source: Source, tokenizer, output: str, num_shards: int, existing: list[str], total: int, start: float,
           progress, top: int) -> dict:
    tf.io.gfile.makedirs(output)
    names = [os.path.join(output, f"data-{i:05d}-of-{num_shards:05d}.tfrecord") for i in range(num_shards)]
    bounds = [(i + 1) * total // num_shards for i in range(num_shards)]  # shard i ends before token bounds[i]
    shard, written, records = 0, 0, [0] * num_shards
    writer = tf.io.TFRecordWriter(names[0] + ".tmp")

    def write(ids: list[int]) -> None:
        feature = tf.train.Feature(int64_list=tf.train.Int64List(value=ids))
        writer.write(tf.train.Example(features=tf.train.Features(feature={TFRECORD_FEATURE: feature}))
                     .SerializeToString())
        records[shard] += 1

    files_done = 0
    for file_end, ids in _documents(source, tokenizer):
        at = 0
        while at < len(ids):
            piece = ids[at:at + min(RECORD_MAX_TOKENS, bounds[shard] - written)]
            write(piece)
            at, written = at + len(piece), written + len(piece)
            if written == bounds[shard] and shard + 1 < num_shards:
                writer.close()
                shard += 1
                writer = tf.io.TFRecordWriter(names[shard] + ".tmp")
        if file_end:
            files_done += 1
            if progress:
                progress(files_done, len(source.files), written)
    writer.close()
    for n in names:
        tf.io.gfile.rename(n + ".tmp", n, overwrite=True)
    for path in set(existing) - set(names):  # overwritten: no stale shard (other --shards) may remain
        tf.io.gfile.remove(path)
    save_tokenizer(tokenizer, output)
    shard_tokens = [b - a for a, b in zip([0] + bounds[:-1], bounds)]
    meta = {"files": len(source.files), "tokens": total, "records": sum(records), "shards": num_shards,
            "tokenizer": tokenizer.spec(), "seconds": round(time.time() - start, 1),
            "max_id": top,  # the largest token id: what training checks against the model's vocabulary
            # what check_shard_sizes compares each shard with before training, and what
            # training_units cuts shards into parts with
            "shard_bytes": {os.path.basename(n): tf.io.gfile.stat(n).length for n in names},
            "shard_records": {os.path.basename(n): r for n, r in zip(names, records)},
            "shard_tokens": {os.path.basename(n): t for n, t in zip(names, shard_tokens)}}
    write_atomically(os.path.join(output, META_FILE), json.dumps(meta, indent=1))
    return meta


def _documents(source: Source, tokenizer):
    """(file ends, token ids) for each piece of each text file of `source`, in order: a file's pieces,
    then [end-of-text] with `file ends` True. Streams: memory holds one piece (data.tokenizer=hf: one
    file, tokenized whole)."""
    bounds = file_bounds(Source(source.files, "text", source.byte_range))
    if getattr(tokenizer, "kind", "") == "hf":
        # whole documents: an HF tokenizer's normalizer and template act on a text's start (Llama's BOS
        # and its "▁" prefix) and its merges may cross a line break, so pieces would not give the ids
        # of the document; memory holds one file (docs/tokenizers.md)
        for path, (lo, hi) in zip(source.files, bounds):
            with tf.io.gfile.GFile(path, "rb") as f:
                f.seek(lo)
                yield False, tokenizer.encode(f.read(hi - lo))
            yield True, [tokenizer.eos_id]
        return
    read = read_documents(Source(source.files, "text", source.byte_range))
    files = tf.data.Dataset.from_tensor_slices((source.files, tf.constant([b[0] for b in bounds], tf.int64),
                                                tf.constant([b[1] for b in bounds], tf.int64)))
    parts = files.flat_map(lambda f, lo, hi: read(f, lo, hi, True))
    parts = parts.map(lambda p, last: (last, tf.cast(tokenizer.encode_tf(p[None])[0], tf.int32)),
                      num_parallel_calls=AUTOTUNE, deterministic=True).prefetch(AUTOTUNE)
    for last, ids in parts.as_numpy_iterator():
        yield (True, [tokenizer.eos_id]) if last else (False, ids.tolist())
