"""Where the data comes from: `data.train` / `data.validation` resolved to files (globs, `builtin:`
corpora, the embedded corpus), their format told apart, and the checks made before training starts
(shard sizes, text that is text, a split that holds a batch, characters the char vocabulary lacks).

With no `data.train`, the embedded corpus is used: the running interpreter's own standard-library
`.py` sources, split into train/validation by a stable hash of each file's path, so `make train` needs
no download. `builtin:NAME` names a corpus shipped in the package (tpu_llm/data/corpora.py: the benchmark's
tinyshakespeare). dataset.py builds the input pipeline over the `Source`s this returns; prepare.py writes
shards from one.
"""

from __future__ import annotations

import codecs
import dataclasses
import hashlib
import json
import os
import re
import struct
import sys
import sysconfig

import tensorflow as tf

from tpu_llm.config import DataConfig
from tpu_llm.data import corpora
from tpu_llm.errors import UserError

TFRECORD_FEATURE = "tokens"  # the int64 list of token ids in each tf.train.Example of a shard
SNIFF_BYTES = 4096  # bytes read from each file to tell text from binary
SNIFF_MAX_FILES = 256  # files sniffed up front (each costs a request on gs://)


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
    if fmt == "tfrecord":  # few shards (data prepare's default is 8): the last ones, the stream's tail
        if len(train_files) < 2:
            raise UserError(f"data.train={cfg.train!r} is one shard: none can be held out for validation; write "
                            "2 or more with `tpu-llm data prepare --output DIR --shards N`, or set data.validation")
        ordered = sorted(train_files)
        held = max(1, round(frac * len(ordered)))
        return (Source(ordered[:-held], fmt, description=f"{cfg.train}: {len(ordered) - held} files"),
                Source(ordered[-held:], fmt, description=f"{cfg.train}: the last {held} shard(s), held out"))
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


# TensorFlow's DataLossError for a record whose checksum does not match names its byte offset, not its file
_BAD_RECORD = re.compile(r"(corrupted|truncated) record at (\d+)")


def corrupt_record(error: Exception, source: Source, split: str, in_run: bool = False,
                   newest: str | None = None) -> UserError:
    """The one line for a TFRecord shard that fails its checksum while it is read (one flipped byte:
    a disk or a copy that damaged it; TensorFlow's own error is 30 lines naming neither the file nor
    the fix). It names the shard, found by the offset TensorFlow gives, and the fix. `in_run`: read by
    a running training (`newest`: its newest checkpoint, unchanged: nothing is saved on the way out)."""
    message = str(getattr(error, "message", "") or error)
    found = _BAD_RECORD.search(message)
    offset = int(found.group(2)) if found else None
    path = _shard_with_bad_record(source.files, offset) if offset is not None else None
    if path:
        where = f"shard {path} has a corrupt record at byte {offset:,}"
    elif offset is not None:
        where = f"one of its {len(source.files)} shard(s) has a corrupt record at byte {offset:,}"
    else:  # TensorFlow's own words, the line that says what (not the graph node it happened in)
        lines = [line.strip() for line in message.splitlines() if line.strip()]
        said = next((line for line in lines if "record" in line.lower()), lines[0] if lines else type(error).__name__)
        where = f"one of its {len(source.files)} shard(s) cannot be read ({said[:160]})"
    kept = "" if not in_run else (f"; the newest checkpoint, {newest}, is unchanged: run the same command again "
                                  "to resume from it" if newest else "; no checkpoint was saved yet")
    return UserError(f"{split} data ({source.description}): {where}: its checksum does not match, so the file "
                     "was damaged on disk or in a copy; copy the shard again, or re-run `tpu-llm data prepare` to "
                     f"write the shards anew{kept}")


def _masked_crc(data: bytes) -> int | None:
    try:
        import google_crc32c  # comes with google-cloud-storage
    except ImportError:
        return None
    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _shard_with_bad_record(files: list[str], offset: int) -> str | None:
    """The file among `files` whose record at `offset` fails its CRC32C. A TFRecord is a length (u64),
    its masked CRC (u32), the data and the data's masked CRC (u32); TensorFlow gives the offset of the
    part that failed: the record's start for its length, 12 bytes on for its data. Each file is walked
    from the start by its record headers, so only a file with a record there is a candidate."""
    for path in files:
        try:
            if tf.io.gfile.stat(path).length <= offset:
                continue
            with tf.io.gfile.GFile(path, "rb") as f:
                position, header = 0, b""
                while position <= offset:
                    f.seek(position)
                    header = f.read(12)
                    if len(header) < 12 or offset in (position, position + 12):
                        break
                    position += 12 + struct.unpack("<Q", header[:8])[0] + 4
                if len(header) < 12 or offset not in (position, position + 12):
                    continue
                length, crc = struct.unpack("<QI", header)
                expected = _masked_crc(header[:8])
                if expected is None or expected != crc:
                    return path  # (without a crc32c module: the first file with a record there)
                data, footer = f.read(min(length, 1 << 30)), f.read(4)
                if len(data) < length or len(footer) < 4 or _masked_crc(data) != struct.unpack("<I", footer)[0]:
                    return path
        except (tf.errors.OpError, OSError):
            continue
    return None


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
    Run before training, so that the run directory is left alone (training/build.py: build_run)."""
    window = seq_len + 1
    try:
        held = count_tokens(source, tokenizer, stop_at=batch_size * window)
    except tf.errors.DataLossError as e:  # a damaged shard among the first records, before anything is written
        raise corrupt_record(e, source, split) from None
    if held < batch_size * window:
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
