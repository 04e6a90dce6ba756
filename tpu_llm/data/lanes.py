"""The training stream of the input pipeline (`make_dataset_fn`, dataset.py, with training=True): the
data's parts read in lanes side by side, each lane packed into windows tagged with where they start and
shuffled in chunks, in one global order whatever the number of input pipelines (hosts), and resumable
from a position table (`POSITION_FIELDS`, one row per lane) saved in every checkpoint. docs/data.md
tells the design; make_dataset_fn's docstring, the fields.
"""

from __future__ import annotations

import hashlib
import os
from typing import Callable

import tensorflow as tf

from tpu_llm.data.input_checks import INPUT_CHECK
from tpu_llm.data.reading import AUTOTUNE, NO_AUTOGRAPH, read_documents, training_units
from tpu_llm.data.sources import Source
from tpu_llm.errors import UserError


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


def training_fn(source: Source, tokens: Callable, window: int, global_batch: int, seed: int | None,
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

        # no threads of its own: the lanes run in parallel (hundreds of thread pools would cost seconds to start)
        docs = tf.data.Dataset.range(slot, tf.int64.max, lanes).flat_map(documents)  # one part at a time
        docs = docs.scan(tf.constant(0, tf.int64), _empty_pass_guard(n)).filter(lambda s, d, doc, last: d >= 0)
        packed = pack_located(docs.map(located), window)

        permute = _chunk_permutation(size, head, order, lane)
        stream = packed.batch(size, drop_remainder=True).enumerate(start=chunk).map(permute)
        stream = stream.prefetch(1).unbatch().skip(taken)  # the next chunk is packed while one is consumed
        return stream.batch(per_lane, drop_remainder=True).map(lambda w, where: (w, where[-1]))

    return tf.data.Dataset.range(first, first + count).interleave(
        lane_windows, cycle_length=count, block_length=1, num_parallel_calls=min(count, 16), deterministic=True)


def _empty_pass_guard(n: int) -> Callable:
    """A lane's `scan` over (slot, document, tokens, last), counting the parts read in a row without a token
    (document -1 ends a part): a whole pass over the `n` parts is an error, not a stream that waits forever."""
    @NO_AUTOGRAPH
    def guard(empty, element):  # files read in a row without a token: a full pass is an error
        s, d, doc, last = element
        empty = tf.where(tf.equal(d, -1), empty + 1, tf.where(tf.size(doc) > 0, tf.constant(0, tf.int64), empty))
        check = tf.debugging.assert_less(empty, tf.cast(n + 1, tf.int64), message=(
            f"{INPUT_CHECK}a training input lane read all {n} parts of the data without a token; the data is empty"))
        with tf.control_dependencies([check]):
            return tf.identity(empty), element
    return guard


def _chunk_permutation(size: int, head: tf.Tensor, order, lane) -> Callable:
    """(chunk number c, (windows, starts)) -> the chunk's `size` windows permuted by (seed, lane, c), each
    with its position row after it: how the stream was cut (`head`), the chunk, windows taken, and where
    the chunk starts."""
    @NO_AUTOGRAPH
    def permute(c, chunk_):
        w, starts = chunk_  # the chunk's first window (before the permutation) is where it starts
        k = tf.range(size, dtype=tf.int64)
        where = tf.tile(tf.concat([head, tf.stack([c, tf.constant(0, tf.int64)]), starts[0]], 0)[None], [size, 1])
        where = tf.concat([where[:, :FIXED + 1], (k + 1)[:, None], where[:, FIXED + 2:]], 1)  # taken: k + 1
        shuffled = tf.random.experimental.index_shuffle(k, _seed(order, CHUNK_ORDER, lane, c), size - 1)
        return tf.gather(w, shuffled), where
    return permute


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
