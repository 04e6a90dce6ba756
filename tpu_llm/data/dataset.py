"""Host-side input pipeline: sources -> tokenize -> append EOS -> pack -> shuffle -> batch.

Everything here runs in tf.data on the host CPU. The step only ever sees int32 batches of a fixed
shape `(per_replica_batch, seq_len)`, so it compiles once (TPU rule: static shapes, drop_remainder).

Sources (tpu_llm/data/sources.py: resolved from the config and checked) are text files (each file is one
document, streamed in pieces of lines) or pre-tokenized TFRecord shards written by `tpu-llm data
prepare` (tpu_llm/data/prepare.py, balanced by tokens). Training reads parts of them in lanes, in one
global order whatever the number of hosts (`make_dataset_fn`; docs/data.md).

This module puts the pipeline together (and holds the validation stream); its parts are modules of
their own: reading.py (the files, their parts, the shards' meta.json), lanes.py (the training stream,
resumable from a position table) and input_checks.py (the ids checked as they leave the pipeline).
"""

from __future__ import annotations

from typing import Callable

import tensorflow as tf

from tpu_llm.data.input_checks import bounded_ids
from tpu_llm.data.lanes import training_fn
from tpu_llm.data.reading import AUTOTUNE, NO_AUTOGRAPH, file_bounds, read_documents
from tpu_llm.data.sources import Source

FILES_PER_PIPELINE = 4  # validation: fewer files per input pipeline: split by window, not by file


def tokens_of(source: Source, tokenizer, eos) -> Callable:
    """(document part, last) -> int32 tokens; the end-of-text token after a text file's last piece."""
    @NO_AUTOGRAPH
    def tokens(part, last):
        if source.format != "text":
            return part
        ids = tf.cast(tokenizer.encode_tf(part[None])[0], tf.int32)
        return tf.cond(last, lambda: eos, lambda: ids)
    return tokens


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


def make_dataset_fn(source: Source, tokenizer, seq_len: int, global_batch: int, *, training: bool,
                    seed: int | None, shuffle_buffer: int, skip_steps: int = 0, start=None,
                    with_position: bool = False, vocab_size: int = 0) -> Callable:
    """A function of `tf.distribute.InputContext` returning this host's batched dataset.

    Each element is `(inputs, targets)`, both int32 `(per_replica_batch, seq_len)`; targets are the
    inputs shifted by one token. Validation is read in order, so every evaluation sees the same
    batches. Training data repeats forever and is a pure function of the seed and a position
    (`POSITION_FIELDS`), the same whatever the number of input pipelines, so a resumed run continues
    it exactly without replaying it, on this slice or another:

      parts        the files cut into parts (`training_units`: ~UNIT_BYTES of text, ~UNIT_TOKENS of
                   a shard); epoch e reads them in a permutation drawn from (seed, e)
                   (`index_shuffle`, computed per slot: starting at epoch e, part i costs nothing)
      lanes        `lanes_for(batch, parts)` streams (lane l reads the slots l, l + lanes, ...), each
                   packed into windows tagged with where their first token is (`pack_located`; no
                   token lost); every pass over a part starts at a random offset (`_random_start`)
      chunks       each lane permutes its windows in chunks of `chunk_size` (shuffle_buffer / lanes,
                   at least one step's worth), by (seed, lane, chunk): a shuffle whose state is one number
      steps        global step s takes the next batch // lanes windows of every lane, lane 0 first

    With more input pipelines (one per host), pipeline p reads only lanes p * lanes / pipelines ..
    when the pipelines divide the lanes (otherwise it reads all and keeps its rows), and its rows of
    every global batch are the same as a single process's. Only lanes divide the data: a run resumed
    on another slice continues the same global order from the saved table, neither repeating nor
    skipping a window.

    `vocab_size` (> 0): every batch's ids are checked against it as they leave the pipeline (`bounded_ids`:
    an id outside stops the host call; `input_error` says so in one line).

    `with_position` adds a third element, the position after the batch, as an int64
    `(lanes, len(POSITION_FIELDS))` update: this pipeline's lanes' rows in the first of its replicas'
    batches of a step, zeros elsewhere, so that summing over replicas (a SUM-on-read variable, see
    `build.build_run`) gives every lane's position. `start` is such a table from a checkpoint:
    the stream resumes from it, reading at most one file's part and one chunk per lane again. Without
    a usable `start`, `skip_steps` replays that many global steps (checkpoints that hold no position).
    A position made over another list of training files (files added, removed or renamed: it would
    land elsewhere) is not used, nor is the stream replayed: it starts over on the new list ("files").
    After it was called, `dataset_fn.resumed` says which happened ("position", "files", "replay" or
    "") and `dataset_fn.rows` is the position table's rows (lanes).

    Empty files have no parts; with no part at all, or a lane that reads as many parts as there are
    without a token, a one-line error rather than a stream that waits forever. `seed=None` draws the
    order from each pipeline's clock instead: parameter-server workers build the same dataset graph,
    and a fixed seed would give them all the same batches.
    """
    window = seq_len + 1
    eos = tf.constant([tokenizer.eos_id], tf.int32)
    tokens = tokens_of(source, tokenizer, eos)

    @NO_AUTOGRAPH
    def split(w):  # a batch of windows -> (inputs, targets), its ids checked first
        w = bounded_ids(w, vocab_size) if vocab_size else w
        return w[:, :-1], w[:, 1:]
    if not training:
        return _validation_fn(source, tokens, window, global_batch, split)
    return training_fn(source, tokens, window, global_batch, seed, shuffle_buffer, skip_steps, start, with_position,
                       split)


def _validation_fn(source: Source, tokens: Callable, window: int, global_batch: int, split: Callable) -> Callable:
    """make_dataset_fn's validation stream: the files in order, each pipeline its share (of the files when
    there are enough of them, else of the windows), repeated."""
    def validation(ctx):
        pipelines, index = ctx.num_input_pipelines, ctx.input_pipeline_id
        bounds = file_bounds(source)
        files = tf.data.Dataset.from_tensor_slices((source.files, tf.constant([b[0] for b in bounds], tf.int64),
                                                    tf.constant([b[1] for b in bounds], tf.int64)))
        shard_files = pipelines > 1 and len(source.files) >= FILES_PER_PIPELINE * pipelines
        if shard_files:
            files = files.shard(pipelines, index)
        read = read_documents(source)
        docs = files.flat_map(lambda f, lo, hi: read(f, lo, hi, True))
        docs = docs.map(tokens, num_parallel_calls=AUTOTUNE)
        windows = pack(docs, window)
        if pipelines > 1 and not shard_files:
            windows = windows.shard(pipelines, index)
        batches = windows.batch(ctx.get_per_replica_batch_size(global_batch), drop_remainder=True)
        # an eval pass may ask for more batches than one epoch holds
        return batches.map(split, num_parallel_calls=AUTOTUNE).repeat()

    def dataset_fn(ctx: tf.distribute.InputContext | None = None) -> tf.data.Dataset:
        return validation(ctx or tf.distribute.InputContext()).prefetch(AUTOTUNE)
    dataset_fn.resumed, dataset_fn.rows = "", 1
    return dataset_fn

