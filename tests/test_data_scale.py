"""Input pipeline at pod scale (issue 16): balanced shards, no hang on empty data, 64-bit offsets,
decorrelated batches, resume on another number of input pipelines (exact resume on the same number:
test_data.py)."""

import glob
import json
import os
import threading

import numpy as np
import pytest
import tensorflow as tf
from helpers import write_corpus

from tpu_llm.data import dataset as data
from tpu_llm.data import input_checks, prepare, reading, sources
from tpu_llm.errors import UserError
from tpu_llm.tokenizers import ByteTokenizer


def write_token_shards(directory, docs_per_shard: list[list[list[int]]]) -> list[str]:
    """TFRecord shards, one record per document, with the meta.json `data prepare` writes."""
    os.makedirs(directory, exist_ok=True)
    names, meta = [], {"shard_records": {}, "shard_tokens": {}}
    for i, docs in enumerate(docs_per_shard):
        name = f"data-{i:05d}-of-{len(docs_per_shard):05d}.tfrecord"
        with tf.io.TFRecordWriter(os.path.join(directory, name)) as writer:
            for doc in docs:
                feature = tf.train.Feature(int64_list=tf.train.Int64List(value=doc))
                writer.write(tf.train.Example(features=tf.train.Features(
                    feature={sources.TFRECORD_FEATURE: feature})).SerializeToString())
        meta["shard_records"][name] = len(docs)
        meta["shard_tokens"][name] = sum(len(d) for d in docs)
        names.append(os.path.join(directory, name))
    with open(os.path.join(directory, "meta.json"), "w") as f:
        json.dump(meta, f)
    return names


def read_shard(path) -> list[int]:
    spec = {sources.TFRECORD_FEATURE: tf.io.RaggedFeature(tf.int64)}
    return [t for r in tf.data.TFRecordDataset(path).as_numpy_iterator()
            for t in tf.io.parse_single_example(r, spec)[sources.TFRECORD_FEATURE].numpy().tolist()]


# --- balanced shards ----------------------------------------------------------------------------------


def test_one_file_into_8_shards_is_balanced_and_none_is_empty(tmp_path):
    [path] = write_corpus(tmp_path / "in", files=1, lines=300)
    tok = ByteTokenizer()
    meta = prepare.write_shards(sources.Source([path], "text"), tok, str(tmp_path / "out"), num_shards=8)
    shards = sorted(glob.glob(str(tmp_path / "out" / "*.tfrecord")))
    counts = [len(read_shard(s)) for s in shards]
    assert len(shards) == 8 and min(counts) > 0
    assert max(counts) - min(counts) <= 0.01 * min(counts)  # within 1%
    assert sum(counts) == meta["tokens"] and list(meta["shard_tokens"].values()) == counts
    # in order, the shards are the file's tokens and its end-of-text: the large document split across them
    assert [t for s in shards for t in read_shard(s)] == tok.encode(open(path, "rb").read()) + [tok.eos_id]


def test_too_little_data_for_the_shard_count_names_the_count_that_fits(tmp_path):
    path = tmp_path / "tiny.txt"
    path.write_text("abc\n")  # 4 bytes + end-of-text: 5 tokens
    with pytest.raises(UserError) as e:
        prepare.write_shards(sources.Source([str(path)], "text"), ByteTokenizer(), str(tmp_path / "out"), num_shards=8)
    assert "\n" not in str(e.value) and "--shards=5 or fewer" in str(e.value)
    assert not (tmp_path / "out").exists()  # nothing written


def iterate_with_timeout(fn, seconds=60):
    """The first batch of fn(), or the exception it raised; fails the test if it takes longer (a hang)."""
    result = {}

    def run():
        try:
            result["batch"] = next(iter(fn()))
        except Exception as e:  # noqa: BLE001 - the exception is the result
            result["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "the input pipeline hangs on empty data"
    return result


def test_empty_inputs_give_a_one_line_error_not_a_hang(tmp_path):
    # 0-byte shards (what the old `data prepare` wrote for 1 file into 8 shards): refused up front
    empty = write_token_shards(tmp_path / "empty", [[] for _ in range(4)])
    with pytest.raises(UserError) as e:
        data.make_dataset_fn(sources.Source(empty, "tfrecord", description="shards"), ByteTokenizer(), 8, 4,
                             training=True, seed=0, shuffle_buffer=4)
    assert "\n" not in str(e.value) and "is empty" in str(e.value)
    # shards whose records hold no token: a lane that reads every part without one stops, with the message
    hollow = write_token_shards(tmp_path / "hollow", [[[]] for _ in range(2)])
    fn = data.make_dataset_fn(sources.Source(hollow, "tfrecord"), ByteTokenizer(), 8, 4, training=True, seed=0,
                              shuffle_buffer=4)
    error = iterate_with_timeout(fn).get("error")
    assert isinstance(error, tf.errors.InvalidArgumentError)
    assert "a training input lane read all 2 parts of the data without a token" in error.message
    line = str(input_checks.input_error(error, "training", sources.Source(hollow, "tfrecord", description="shards"), 257))
    assert line == "the training data (shards): a training input lane read all 2 parts of the data without a " \
        "token; the data is empty"  # train's one line (actions.user_errors), not a traceback


# --- 64-bit offsets -----------------------------------------------------------------------------------


def test_offsets_past_2_gib_are_exact(monkeypatch):
    size = 3 * 2**31 + 12345  # a 6 GB file, by its size only
    lo, hi = reading.byte_bounds(size, (0.9, 1.0))
    assert (lo, hi) == (int(size * 0.9), size) and lo > 2**32
    # its parts (lanes read them side by side) tile [0, 0.9 * size) exactly, past int32 and int32 * 2
    monkeypatch.setattr(reading, "file_sizes", lambda files: [size])
    units = reading.training_units(sources.Source(["big.txt"], "text", (0.0, 0.9)))
    assert units[0][1] == 0 and units[-1][2] == int(size * 0.9) and units[-1][3] == 1
    assert all(a[2] == b[1] for a, b in zip(units, units[1:])) and len(units) == int(size * 0.9) // reading.UNIT_BYTES
    # the line offsets the reader computes in the graph: lines starting in [lo, hi), at offsets > 2^31
    base = 2**31 + 2**32 - 7
    lines = tf.data.Dataset.from_tensor_slices(["aaaa", "bb", "", "cccccc", "d"])  # starts: +0 +5 +8 +9 +16
    picked = reading.lines_in_range(lines, tf.constant(base + 5, tf.int64), tf.constant(base + 16, tf.int64), base)
    assert [x.decode() for x in picked.as_numpy_iterator()] == ["bb", "", "cccccc"]


# --- batch diversity and resume on another slice -------------------------------------------------------


def doc_shards(tmp_path, shards, docs, length):
    """`shards` shards of `docs` documents of `length` tokens; every token of document d is d + 1."""
    return write_token_shards(tmp_path, [[[s * docs + d + 1] * length for d in range(docs)] for s in range(shards)])


def test_batches_of_512_over_64_shards_hold_mostly_distinct_documents(tmp_path, monkeypatch):
    monkeypatch.setattr(reading, "UNIT_TOKENS", 512, raising=False)  # parts of 8 documents (scaled down with the data)
    files = doc_shards(tmp_path, shards=64, docs=64, length=64)  # 262,144 tokens: documents of 16 windows
    fn = data.make_dataset_fn(sources.Source(files, "tfrecord"), ByteTokenizer(), 3, 512, training=True, seed=0,
                              shuffle_buffer=1024)
    distinct = [len(set(x[:, 0].tolist())) for x, _ in fn().take(4).as_numpy_iterator()]
    assert min(distinct) >= 256, distinct  # >= 50% of the batch: windows from distinct documents


def global_batches(fn, pipelines, steps, replicas_per_pipeline=1):
    """`steps` global batches (windows in global row order) of `pipelines` input pipelines, and the
    position table after them (as the SUM-on-read variable holds it)."""
    replicas = pipelines * replicas_per_pipeline
    its = [iter(fn(tf.distribute.InputContext(pipelines, i, replicas))) for i in range(pipelines)]
    batches, table = [], None
    for _ in range(steps):
        rows, table = [], 0
        for it in its:
            for r in range(replicas_per_pipeline):
                x, y, update = next(it)
                rows.append(np.concatenate([x.numpy(), y.numpy()[:, -1:]], 1))
                table = table + update.numpy()
        batches.append(np.concatenate(rows))
    return batches, table


def test_resume_on_another_number_of_pipelines_neither_repeats_nor_skips(tmp_path, monkeypatch):
    monkeypatch.setattr(reading, "UNIT_TOKENS", 64, raising=False)
    # 16 shards: enough that the old code split the files by pipeline (and could not resume on 4)
    files = write_token_shards(tmp_path, [[list(range(s * 250, s * 250 + 250))] for s in range(16)])  # unique
    source = sources.Source(files, "tfrecord")

    def make(start=None):
        return data.make_dataset_fn(source, ByteTokenizer(), 7, 16, training=True, seed=5, shuffle_buffer=32,
                                    with_position=True, start=start)

    epoch = 4000 // 8 // 16 // 2  # steps in about half an epoch of windows
    reference, _ = global_batches(make(), 1, 2 * epoch)
    before, table = global_batches(make(), 2, epoch, replicas_per_pipeline=2)
    resumed_fn = make(start=table)
    after, _ = global_batches(resumed_fn, 4, epoch)
    for got, want in zip(before + after, reference):  # the same global batches as one pipeline reads
        np.testing.assert_array_equal(got, want)
    starts = [w[0] for b in before + after for w in b]
    assert len(starts) == len(set(starts))  # no window twice
    assert resumed_fn.resumed == "position" and resumed_fn.rows == 16  # 16 shards of 250 tokens: 16 lanes
