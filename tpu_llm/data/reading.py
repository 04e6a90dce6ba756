"""Reading the training and validation files, as the input pipeline (dataset.py) and `data prepare`
(prepare.py) do: a text file's bytes [lo, hi) streamed in pieces of lines (memory holds a piece, never
the file; offsets are 64-bit), a TFRecord shard's records as token vectors, each file's bounds, and the
parts of the data that training lanes read side by side (lanes.py). Also what training reads of a shard
folder's meta.json: each shard's records and tokens (how shards are cut into parts) and the highest
token id (checked against the model's vocabulary before training).
"""

from __future__ import annotations

import json
import os
from typing import Callable

import tensorflow as tf

from tpu_llm.data.sources import TFRECORD_FEATURE, Source
from tpu_llm.errors import UserError
from tpu_llm.platform import files

AUTOTUNE = tf.data.AUTOTUNE
NO_AUTOGRAPH = tf.autograph.experimental.do_not_convert  # plain graph code: converting it costs seconds per pipeline

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
