"""Host-side input pipeline: sources -> tokenize -> append EOS -> pack -> shuffle -> batch.

Everything here runs in tf.data on the host CPU. The step only ever sees int32 batches of a fixed
shape `(per_replica_batch, seq_len)`, so it compiles once (TPU rule: static shapes, drop_remainder).

Sources (tpu_llm/data/sources.py: resolved from the config and checked) are text files (each file is one
document, streamed in pieces of lines) or pre-tokenized TFRecord shards written by `tpu-llm data
prepare` (tpu_llm/data/prepare.py, balanced by tokens). Training reads parts of them in lanes, in one
global order whatever the number of hosts (`make_dataset_fn`; docs/data.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Callable

import tensorflow as tf

from tpu_llm.data.sources import TFRECORD_FEATURE, Source
from tpu_llm import files
from tpu_llm.errors import UserError

FILES_PER_PIPELINE = 4  # validation: fewer files per input pipeline: split by window, not by file
AUTOTUNE = tf.data.AUTOTUNE
NO_AUTOGRAPH = tf.autograph.experimental.do_not_convert  # plain graph code: converting it costs seconds per pipeline


# --------------------------------------------------------------------------------------------------
# Building the pipeline

LINES_PER_PIECE = 256  # text is read this many lines at a time: memory holds a piece, never a whole file


def byte_bounds(size: int, byte_range: tuple[float, float]) -> tuple[int, int]:
    """[lo, hi) byte offsets of `byte_range` in a file of `size` bytes, as Python integers (64-bit in
    the graph): 90% of a 3 GB file is 2.7e9, past int32."""
    start, end = byte_range
    return int(size * start), int(size * end)


def file_sizes(files: list[str]) -> list[int]:
    """Each file's size in bytes (stat in parallel threads: on gs:// each one is a request)."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(min(32, max(1, len(files)))) as pool:
        return list(pool.map(lambda f: int(tf.io.gfile.stat(f).length), files))


def lines_in_range(lines: tf.data.Dataset, lo, hi, base=0) -> tf.data.Dataset:
    """The lines (newline stripped) that start at a byte offset in [lo, hi): a file split at line
    boundaries. A line starts at `base` plus the lengths of the lines before it plus one newline each
    (a file with CRLF line ends counts one byte fewer per line). int64 throughout."""
    @NO_AUTOGRAPH
    def step(start, line):
        return start + tf.cast(tf.strings.length(line), tf.int64) + 1, (start, line)

    located = lines.scan(tf.constant(base, tf.int64), step)
    located = located.take_while(lambda start, line: start < hi)
    return located.filter(lambda start, line: start >= lo).map(lambda start, line: line)


def text_pieces(path, lo=None, hi=None) -> tf.data.Dataset:
    """A text file (or its bytes [lo, hi), cut at line boundaries), streamed as strings of at most
    LINES_PER_PIECE lines, each line ending in a newline: memory holds one piece (and one line,
    however long), never the file. A last line without a newline gets one."""
    lines = tf.data.TextLineDataset(path)
    if lo is not None:
        lines = lines_in_range(lines, lo, hi)
    return lines.batch(LINES_PER_PIECE).map(lambda b: tf.strings.reduce_join(b + "\n"))


def read_documents(source: Source) -> Callable:
    """(file path, lo, hi, ends) -> dataset of (document part, last). Text files stream as pieces of
    lines starting at bytes lo .. hi - 1 (int64), then, when `ends` (the part reaches the file's end),
    an empty string with `last` True: the end of text. TFRecord shards give int32 token vectors, one
    per record lo .. hi - 1 (hi < 0: to the end; end-of-text already inside)."""
    if source.format == "tfrecord":
        spec = {TFRECORD_FEATURE: tf.io.RaggedFeature(tf.int64)}

        @NO_AUTOGRAPH
        def read(path, lo, hi, ends):
            records = tf.data.TFRecordDataset(path).skip(lo).take(tf.where(hi < 0, tf.constant(-1, tf.int64), hi - lo))
            return records.map(lambda r: (tf.cast(tf.io.parse_single_example(r, spec)[TFRECORD_FEATURE],
                                                  tf.int32), False))
        return read

    @NO_AUTOGRAPH
    def read(path, lo, hi, ends):
        end = tf.data.Dataset.from_tensors((tf.constant(""), True)).take(tf.cast(ends, tf.int64))
        return text_pieces(path, lo, hi).map(lambda p: (p, False)).concatenate(end)
    return read


def file_bounds(source: Source) -> list[tuple[int, int]]:
    """Each file's [lo, hi) read by `source`: bytes for text (a stat each), all records for shards."""
    if source.format == "tfrecord":
        return [(0, -1)] * len(source.files)
    return [byte_bounds(s, source.byte_range) for s in file_sizes(source.files)]


UNIT_BYTES = 8 << 20  # text files are read in parts of about this many bytes (lanes read parts side by side)
UNIT_TOKENS = 4 << 20  # shards, in parts of about this many tokens (from their meta.json; else whole)


def training_units(source: Source) -> list[tuple[int, int, int, int]]:
    """The parts of the training files that lanes read, in order: (file, lo, hi, ends) as
    `read_documents` takes them. A text file's [lo, hi) bytes are cut into parts of about UNIT_BYTES
    (each starts at a line boundary: its first line starting at or after lo); a shard's records into
    parts of about UNIT_TOKENS, when its meta.json records how many it holds. Empty files have none."""
    units = []
    if source.format == "tfrecord":
        recorded = _shard_meta(source.files)
        for i, path in enumerate(source.files):
            records, tokens = recorded.get(path, (0, 0))
            if records == 0 and tokens == 0 and path in recorded:
                continue  # written empty by an earlier `data prepare`
            parts = max(1, min(records, tokens // UNIT_TOKENS)) if records else 1
            units += [(i, k * records // parts, (k + 1) * records // parts if records else -1, 1)
                      for k in range(parts)]
        nonempty = {u[0] for u in units}
        sizes = file_sizes([f for i, f in enumerate(source.files) if i in nonempty])
        empty = {i for i, size in zip(sorted(nonempty), sizes) if size == 0}
        return [u for u in units if u[0] not in empty]
    for i, size in enumerate(file_sizes(source.files)):
        lo, hi = byte_bounds(size, source.byte_range)
        parts = max(1, (hi - lo) // UNIT_BYTES)
        units += [(i, lo + k * (hi - lo) // parts, lo + (k + 1) * (hi - lo) // parts, int(k == parts - 1))
                  for k in range(parts) if hi > lo]
    return units


def _shard_meta(files: list[str]) -> dict[str, tuple[int, int]]:
    """path -> (records, tokens) of the shards whose folder's meta.json records them."""
    out: dict[str, tuple[int, int]] = {}
    for folder in sorted({os.path.dirname(f) for f in files}):
        meta = read_meta(folder)
        records, tokens = meta.get("shard_records"), meta.get("shard_tokens")
        if not isinstance(records, dict) or not isinstance(tokens, dict):
            continue
        for name, n in records.items():
            if _count(n) and _count(tokens.get(name, 0)):
                out[os.path.join(folder, name)] = (n, tokens.get(name, 0))
    return {f: out[f] for f in files if f in out}


MAX_META_BYTES = 1 << 26  # a shard directory's meta.json: about 100 bytes per shard


def read_meta(folder: str) -> dict:
    """The meta.json `data prepare` wrote in `folder`, {} if there is none or it is not a JSON object (written
    by something else, or torn); it comes with the shards from anywhere: a regular file of a bounded
    size (files.read_regular), else one UserError."""
    try:
        raw = files.read_regular(os.path.join(folder, "meta.json"), MAX_META_BYTES, "the shards' meta.json",
                                 "run data prepare again", follow_links=True)
        meta = json.loads(raw)
    except (FileNotFoundError, tf.errors.NotFoundError, ValueError, RecursionError):
        return {}
    return meta if isinstance(meta, dict) else {}


def check_shard_ids(files: list[str], vocab_size: int) -> None:
    """Refuse (UserError) shards whose meta.json records a token id (`max_id`, written by data prepare) the
    model's vocabulary does not hold: XLA gathers such an id silently (a finite loss of nonsense), a TF
    graph fails with a traceback. Shards without that record (an earlier prepare) are not checked."""
    for folder in sorted({os.path.dirname(f) for f in files}):
        top = read_meta(folder).get("max_id")
        if _count(top) and top >= vocab_size:
            raise UserError(f"the shards in {folder} hold token id {top:,} (their meta.json), past the model's "
                            f"{vocab_size:,} ids (model.vocab_size, or the tokenizer's): their tokenizer.json is "
                            "not the one that made them; prepare the shards again")


def _count(n) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 1 << 62


# The pipeline's own assertions start their message with INPUT_CHECK; `input_error` turns the TensorFlow
# error they end a host call with into one line (training/actions.user_errors).
INPUT_CHECK = "tpu-llm input check: "
IDS_CHECK = "token ids outside the vocabulary"


def bounded_ids(windows: tf.Tensor, vocab_size: int) -> tf.Tensor:
    """`windows` (a batch of token windows), once every id in it is in [0, vocab_size): checked on the host,
    in tf.data, as the ids leave the pipeline. A shard's ids index the embedding, and XLA gathers an id past
    it without an error (on TPU: rows of garbage, a finite loss of nonsense); check_shard_ids trusts what
    meta.json records, this holds when it lies or is missing. Two reductions over the batch: about 30 us per
    batch of 64 x 1025 ids (docs/data.md)."""
    top, bottom = tf.reduce_max(windows), tf.reduce_min(windows)
    check = tf.debugging.Assert(tf.logical_and(bottom >= 0, top < vocab_size), [INPUT_CHECK + IDS_CHECK, top, bottom])
    with tf.control_dependencies([check]):
        return tf.identity(windows)


def input_error(error: Exception, split: str, source: Source, vocab_size: int) -> UserError | None:
    """The one line for a host call that one of the pipeline's own assertions stopped (`error` a TensorFlow
    error), else None (another error: not the pipeline's to explain)."""
    found = re.search(re.escape(INPUT_CHECK) + r"([^\]]*)\]((?: \[-?\d+\])*)", getattr(error, "message", "") or "")
    if not found:
        return None
    what, values = found.group(1), [int(v) for v in re.findall(r"-?\d+", found.group(2))]
    data = f"the {split} data ({source.description or ', '.join(source.files[:3])})"
    if what == IDS_CHECK and len(values) == 2:
        top, bottom = values
        bad = top if top >= vocab_size else bottom
        return UserError(f"{data} holds token id {bad:,}, outside the model's {vocab_size:,} ids (model.vocab_size, "
                         "or the tokenizer's): the shards were made by another tokenizer (their meta.json does not "
                         "say so, or is missing); prepare them again with this run's tokenizer")
    return UserError(f"{data}: {what}")


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


MAX_LANES = 512  # streams of the data read side by side (see make_dataset_fn): at most one window each per step
# The training stream's position: one int64 row per lane. How the stream was cut (lanes, windows per
# lane chunk, and which files it indexes: `files_fingerprint`), then the lane's place: `taken` windows
# of its chunk number `chunk` were consumed; the chunk starts at token `token` of document (piece or
# record) `document` of the lane's `slot`-th file read (epoch slot // files, in that epoch's order).
POSITION_FIELDS = ("lanes", "chunk_size", "units", "files_fingerprint", "chunk", "taken", "slot", "document",
                   "token")
FIXED = 4  # the fields that say how the stream was cut


def lanes_for(batch: int, parts: int) -> int:
    """Lanes of a training stream: the most, up to MAX_LANES and one per part of the data, that divide
    the global batch (each lane gives batch // lanes windows to every step)."""
    return max(n for n in range(1, min(MAX_LANES, parts, batch) + 1) if batch % n == 0)


def files_fingerprint(files: list[str]) -> int:
    """A number fixed by the list of training files, in order (paths relative to their common folder,
    so that moving the whole folder keeps it): a saved position indexes this list."""
    root = os.path.commonpath(files) if len(set(files)) > 1 else os.path.dirname(files[0]) if files else ""
    text = "\n".join(os.path.relpath(f, root) if root else f for f in files)
    return int(hashlib.sha256(text.encode()).hexdigest()[:15], 16)  # 60 bits: a positive int64


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
    return _training_fn(source, tokens, window, global_batch, seed, shuffle_buffer, skip_steps, start, with_position,
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


def _training_fn(source: Source, tokens: Callable, window: int, global_batch: int, seed: int | None,
                 shuffle_buffer: int, skip_steps: int, start, with_position: bool, split: Callable) -> Callable:
    """make_dataset_fn's training stream: lanes over the parts of the data, resumable from `start`."""
    units = training_units(source)
    if not units:
        raise UserError(f"the training data ({source.description or ', '.join(source.files[:3])}) is empty: "
                        f"its {len(source.files)} files hold nothing to read; point data.train at your data")
    fingerprint = files_fingerprint(source.files)
    lanes = lanes_for(global_batch, len(units))
    per_lane = global_batch // lanes  # windows each lane gives to every global step
    size = max(-(-shuffle_buffer // lanes), per_lane)  # windows per lane chunk: the buffer, over the lanes
    header = (lanes, size, len(units), fingerprint)
    table = _start_table(start, header)
    files_changed = table is None and _other_files(start, fingerprint)
    resumed = "position" if table is not None else "files" if files_changed else "replay" if skip_steps else ""
    if table is None:
        table = [(0, 0, lane, 0, 0) for lane in range(lanes)]
    read = read_documents(source)

    def dataset_fn(ctx: tf.distribute.InputContext | None = None) -> tf.data.Dataset:
        ctx = ctx or tf.distribute.InputContext()
        pipelines, index = ctx.num_input_pipelines, ctx.input_pipeline_id
        per_replica = ctx.get_per_replica_batch_size(global_batch)
        replicas = ctx.num_replicas_in_sync // pipelines  # fed by this pipeline
        take = per_replica * replicas  # this pipeline's windows per step
        order = seed if seed is not None else tf.cast(tf.timestamp() * 1e6, tf.int64) % (2 ** 31)
        own = lanes % pipelines == 0  # each pipeline reads its own lanes; else all, keeping its rows
        first = index * lanes // pipelines if own else 0
        count = lanes // pipelines if own else lanes
        windows = _lane_steps(source.files, units, read, tokens, window, order, lanes, per_lane, size, header, table,
                              first, count, source.format == "tfrecord")
        rows = 0 if own else index * take  # its slice of the global batch (all lanes read)

        @NO_AUTOGRAPH
        def per_replica_batches(w, where):  # w (count, per_lane, window), where (count, fields)
            w = tf.reshape(w, [count * per_lane, window])[rows:rows + take]
            mine = tf.pad(where, [[first, lanes - first - count], [0, 0]])  # (lanes, fields)
            if not own:
                mine = mine * tf.cast(tf.equal(index, 0), tf.int64)  # one pipeline writes the table
            updates = tf.concat([mine[None], tf.zeros([replicas - 1, lanes, len(POSITION_FIELDS)], tf.int64)], 0)
            return tf.reshape(w, [replicas, per_replica, window]), updates

        steps = windows.batch(count, drop_remainder=True)
        if skip_steps and resumed == "replay":
            steps = steps.skip(skip_steps)
        batches = steps.map(per_replica_batches, num_parallel_calls=AUTOTUNE).unbatch()
        if with_position:
            batches = batches.map(lambda w, u: (*split(w), u), num_parallel_calls=AUTOTUNE)
        else:
            batches = batches.map(lambda w, u: split(w), num_parallel_calls=AUTOTUNE)
        return batches.prefetch(AUTOTUNE)

    dataset_fn.resumed, dataset_fn.rows = resumed, lanes
    return dataset_fn


def _lane_steps(files: list[str], units: list[tuple[int, int, int, int]], read, tokens, window: int, order,
                lanes: int, per_lane: int, size: int, header: tuple, table, first: int, count: int,
                shards: bool) -> tf.data.Dataset:
    """Lanes first .. first + count - 1, interleaved: for each step, each lane's `per_lane` windows
    (per_lane, window) and its position row after them. Lane l reads the slots l, l + lanes, ...
    (slot s is part s % len(units) of epoch s // len(units), in that epoch's permutation), starting
    from its row of `table` (chunk, taken, slot, document, token). One lane function serves all
    lanes (built once: tf.data traces it once)."""
    n, paths, parts = len(units), tf.constant(files), tf.constant(units, tf.int64)  # parts: (units, 4)
    rows = tf.constant([list(r) for r in table], tf.int64)  # (lanes, 5)
    head = tf.constant(header, tf.int64)

    @NO_AUTOGRAPH
    def lane_windows(lane):
        chunk, taken, slot, doc0, token0 = (rows[lane][i] for i in range(5))

        @NO_AUTOGRAPH
        def documents(s):
            i = tf.random.experimental.index_shuffle(s % n, _seed(order, FILE_ORDER, s // n), n - 1)
            skip = tf.where(tf.equal(s, slot), doc0, 0)
            unit = parts[i]
            parts_ = read(tf.gather(paths, unit[0]), unit[1], unit[2], unit[3] > 0).enumerate().skip(skip)
            end = tf.data.Dataset.from_tensors((tf.constant(-1, tf.int64), tf.zeros([0], tf.int32), True))
            return parts_.map(lambda d, part: (d, tokens(*part), part[1])).concatenate(end).map(
                lambda d, doc, last: (s, d, doc, last))

        @NO_AUTOGRAPH
        def located(s, d, doc, last):
            if shards:  # every record a fresh start: records are documents (or parts of one)
                doc = _random_start(doc, window, _seed(order, START_OFFSET, s, d))
            else:  # a text file's first piece; its later pieces and its end-of-text follow on
                doc = tf.cond(tf.equal(d, 0), lambda: _random_start(doc, window, _seed(order, START_OFFSET, s, d)),
                              lambda: doc)
            here = tf.logical_and(tf.equal(s, slot), tf.equal(d, doc0))
            cut = tf.where(here, token0, 0)  # the resumed document: from its token
            return doc[cut:], tf.stack([s, d, cut])

        @NO_AUTOGRAPH
        def guard(empty, element):  # files read in a row without a token: a full pass is an error
            s, d, doc, last = element
            empty = tf.where(tf.equal(d, -1), empty + 1, tf.where(tf.size(doc) > 0, tf.constant(0, tf.int64), empty))
            check = tf.debugging.assert_less(empty, tf.cast(n + 1, tf.int64), message=(
                f"{INPUT_CHECK}a training input lane read all {n} parts of the data without a token; the data is empty"))
            with tf.control_dependencies([check]):
                return tf.identity(empty), element

        # no threads of its own: the lanes run in parallel (hundreds of thread pools would cost seconds to start)
        docs = tf.data.Dataset.range(slot, tf.int64.max, lanes).flat_map(documents)  # one part at a time
        docs = docs.scan(tf.constant(0, tf.int64), guard).filter(lambda s, d, doc, last: d >= 0)
        packed = pack_located(docs.map(located), window)

        @NO_AUTOGRAPH
        def permute(c, chunk_):
            w, starts = chunk_  # the chunk's first window (before the permutation) is where it starts
            k = tf.range(size, dtype=tf.int64)
            where = tf.tile(tf.concat([head, tf.stack([c, tf.constant(0, tf.int64)]), starts[0]], 0)[None], [size, 1])
            where = tf.concat([where[:, :FIXED + 1], (k + 1)[:, None], where[:, FIXED + 2:]], 1)  # taken: k + 1
            shuffled = tf.random.experimental.index_shuffle(k, _seed(order, CHUNK_ORDER, lane, c), size - 1)
            return tf.gather(w, shuffled), where

        stream = packed.batch(size, drop_remainder=True).enumerate(start=chunk).map(permute)
        stream = stream.prefetch(1).unbatch().skip(taken)  # the next chunk is packed while one is consumed
        return stream.batch(per_lane, drop_remainder=True).map(lambda w, where: (w, where[-1]))

    return tf.data.Dataset.range(first, first + count).interleave(
        lane_windows, cycle_length=count, block_length=1, num_parallel_calls=min(count, 16), deterministic=True)


def _start_table(start, header: tuple):
    """The lanes' (chunk, taken, slot, document, token) rows of a saved position table, or None when
    the table does not fit this run (other lanes, chunk size or files: the stream was cut differently)."""
    if start is None or len(start) == 0:
        return None
    rows = [tuple(int(v) for v in r) for r in start]
    if not any(any(r) for r in rows):  # saved before any step ran (still the variable's zeros): the start
        return [(0, 0, lane, 0, 0) for lane in range(header[0])]
    if len(rows) != header[0] or any(len(r) != len(POSITION_FIELDS) or r[:FIXED] != header for r in rows):
        return None
    return [r[FIXED:] for r in rows]


def _other_files(start, fingerprint: int) -> bool:
    """Whether a saved position table was made over another list of training files."""
    if start is None or len(start) == 0 or len(start[0]) != len(POSITION_FIELDS):
        return False
    return any(any(int(v) for v in r) and int(r[FIXED - 1]) != fingerprint for r in start)
