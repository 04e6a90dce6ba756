"""Input pipeline: packing, batches and targets, source resolution, bad input, TFRecord shards."""

import glob
import os
import random

import numpy as np
import pytest
import tensorflow as tf
from helpers import write_corpus

from tpu_llm.config import DataConfig
from tpu_llm.data import dataset as data
from tpu_llm.data import lanes, prepare, reading, sources
from tpu_llm.errors import UserError
from tpu_llm.tokenizers import ByteTokenizer, load_tokenizer

SEQ, BATCH = 16, 4


@pytest.fixture(scope="module")
def corpus_files(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def token_stream(files, tok) -> list[int]:
    """What the pipeline must read, in order: each document's tokens, then end-of-text."""
    out = []
    for path in files:
        out += tok.encode(open(path, "rb").read()) + [tok.eos_id]
    return out


def first_batches(dataset, n):
    return [(x.numpy(), y.numpy()) for x, y in dataset.take(n)]


def text_dataset(files, training=False, seed=0, tok=None):
    fn = data.make_dataset_fn(sources.Source(list(files), "text"), tok or ByteTokenizer(), SEQ, BATCH,
                              training=training, seed=seed, shuffle_buffer=32)
    return fn()


# --- pack ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("window", [1, 5, 17])
def test_pack_keeps_every_token_in_order(window):
    rng = random.Random(window)
    docs = [list(range(i * 1000, i * 1000 + n)) for i, n in enumerate([7, 0, 3, 40, 1, window, 2 * window, 11])]
    docs += [[rng.randrange(300) for _ in range(rng.randrange(30))] for _ in range(10)]
    dataset = tf.data.Dataset.from_generator(lambda: iter(docs), output_signature=tf.TensorSpec([None], tf.int32))
    packed = data.pack(dataset, window)
    assert packed.element_spec.shape.as_list() == [window]
    windows = [w.tolist() for w in packed.as_numpy_iterator()]
    assert all(len(w) == window for w in windows)
    flat = [t for d in docs for t in d]
    keep = len(flat) // window * window
    assert [t for w in windows for t in w] == flat[:keep]
    assert len(windows) == len(flat) // window


# --- make_dataset_fn ---------------------------------------------------------------------------------


def test_batches_are_shifted_windows_of_the_token_stream(corpus_files):
    tok = ByteTokenizer()
    stream = token_stream(corpus_files, tok)
    dataset = text_dataset(corpus_files, tok=tok)
    for spec in dataset.element_spec:
        assert spec.dtype == tf.int32 and spec.shape.is_fully_defined() and spec.shape.as_list() == [BATCH, SEQ]
    n = len(stream) // (SEQ + 1) // BATCH  # whole batches in one pass
    batches = first_batches(dataset, n)
    windows = np.array(stream[: n * BATCH * (SEQ + 1)], np.int32).reshape(n, BATCH, SEQ + 1)
    for (x, y), w in zip(batches, windows):
        assert x.dtype == np.int32 and y.dtype == np.int32
        np.testing.assert_array_equal(x, w[:, :-1])
        np.testing.assert_array_equal(y, w[:, 1:])
    doc_ends = np.cumsum([len(tok.encode(open(f, "rb").read())) + 1 for f in corpus_files]) - 1
    covered = int((doc_ends < windows.size).sum())
    assert covered >= 2 and int((windows == tok.eos_id).sum()) == covered  # one after each document
    # Evaluation may want more batches than one pass holds: the validation data repeats.
    assert len(first_batches(dataset, n + 2)) == n + 2


def test_training_batches_static_shapes_and_shifted_targets(corpus_files):
    dataset = text_dataset(corpus_files, training=True, seed=1)
    for spec in dataset.element_spec:
        assert spec.shape.is_fully_defined() and spec.shape.as_list() == [BATCH, SEQ] and spec.dtype == tf.int32
    docs = [open(f, "rb").read() for f in corpus_files]
    for x, y in first_batches(dataset, 8):
        np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
        for row_x, row_y in zip(x, y):  # each window: pieces of documents (in shuffled order), EOS between
            window = row_x.tolist() + [int(row_y[-1])]
            pieces = bytes(t if t != 256 else 0 for t in window).split(b"\0")
            assert all(any(p in d for d in docs) for p in pieces)
            if len(pieces) > 1:  # a document ends here; the next starts at a random offset < one window
                assert any(d.endswith(pieces[0]) for d in docs)
                assert any(pieces[-1] in d[:SEQ + 1 + len(pieces[-1])] for d in docs)


def test_each_training_pass_over_a_document_starts_at_a_new_random_offset(tmp_path):
    path = tmp_path / "one.txt"
    doc = bytes(range(32, 127)) * 5 + b"\n"  # 476 tokens: offsets up to min(SEQ, 476 // 8) = 16
    path.write_bytes(doc)
    fn = data.make_dataset_fn(sources.Source([str(path)], "text"), ByteTokenizer(), SEQ, 1, training=True,
                              seed=3, shuffle_buffer=1)  # buffer 1: windows in stream order
    stream = [t for x, y in first_batches(fn(), 200) for t in x[0].tolist() + [int(y[0, -1])]]
    passes = bytes(t if t != 256 else 0 for t in stream).split(b"\0")[1:-1]  # whole passes only
    assert len(passes) >= 4
    offsets = [len(doc) - len(p) for p in passes]
    assert all(doc[o:] == p and 0 <= o <= SEQ for o, p in zip(offsets, passes))
    assert len(set(offsets)) > 1
    again = [t for x, y in first_batches(fn(), 200) for t in x[0].tolist() + [int(y[0, -1])]]
    assert again == stream  # the offsets are a function of the seed: the stream is reproducible


def test_one_epoch_of_a_one_file_corpus_covers_the_whole_file(tmp_path):
    # lanes read files side by side; more lanes than files would read this file's beginning four
    # times over (tinyshakespeare trained on its first 40% only)
    path = tmp_path / "one.txt"
    path.write_text("".join(f"{i:04d}\n" for i in range(400)))  # 2,000 bytes
    fn = data.make_dataset_fn(sources.Source([str(path)], "text"), ByteTokenizer(), SEQ, BATCH, training=True,
                              seed=0, shuffle_buffer=8)
    doc, covered = path.read_bytes(), set()
    for x, y in first_batches(fn(), 2000 // (SEQ + 1) // BATCH):  # one pass's worth of batches
        for window in np.concatenate([x, y[:, -1:]], axis=1).tolist():
            at = doc.find(bytes(t for t in window if t < 256))  # unique: holds two whole line numbers
            covered.update(range(at, at + SEQ + 1))
    assert len(covered) > 0.85 * len(doc)  # four lanes over one file: about a quarter


def test_validation_is_deterministic(corpus_files):
    a, b = text_dataset(corpus_files), text_dataset(corpus_files)
    first = first_batches(a, 4)
    for again in (first_batches(a, 4), first_batches(b, 4)):
        for (x1, y1), (x2, y2) in zip(first, again):
            np.testing.assert_array_equal(x1, x2)
            np.testing.assert_array_equal(y1, y2)


# --- resolve_sources ---------------------------------------------------------------------------------


def test_embedded_corpus_split_is_disjoint_and_stable():
    train, val = sources.resolve_sources(DataConfig())
    assert train.files and val.files and train.format == val.format == "text"
    assert not set(train.files) & set(val.files)
    assert len(val.files) < len(train.files)
    assert all(f.endswith(".py") for f in train.files + val.files)
    again = sources.resolve_sources(DataConfig())
    assert (again[0].files, again[1].files) == (train.files, val.files)


def test_few_files_split_by_byte_range(tmp_path):
    path = tmp_path / "one.txt"
    text = "".join(f"line {i}: héllo ✓\n" for i in range(200))
    path.write_text(text, encoding="utf-8")
    train, val = sources.resolve_sources(DataConfig(train=str(path), validation_fraction=0.2))
    assert train.files == val.files == [str(path)]
    assert (train.byte_range, val.byte_range) == ((0.0, 0.8), (0.8, 1.0))

    def read(source):
        [(lo, hi)] = reading.file_bounds(source)
        parts = reading.read_documents(source)(tf.constant(str(path)), tf.constant(lo, tf.int64), hi, False)
        return b"".join(part for part, _ in parts.as_numpy_iterator())

    raw = text.encode("utf-8")
    head, tail = read(train), read(val)
    assert head + tail == raw  # head and tail: disjoint and complete, cut at a line boundary
    assert head.endswith(b"\n") and int(len(raw) * 0.8) <= len(head) < int(len(raw) * 0.8) + 30


def test_explicit_validation_files(tmp_path, corpus_files):
    other = write_corpus(tmp_path / "val", files=1)
    train, val = sources.resolve_sources(DataConfig(train=",".join(corpus_files), validation=other[0]))
    assert train.files == corpus_files and val.files == other
    assert train.byte_range == val.byte_range == (0.0, 1.0)


# --- bad input -------------------------------------------------------------------------------------


def resolve_error(**kwargs) -> str:
    with pytest.raises(UserError) as e:
        sources.resolve_sources(DataConfig(**kwargs))
    assert "\n" not in str(e.value)
    return str(e.value)


def test_missing_glob(tmp_path, corpus_files):
    pattern = str(tmp_path / "nothing" / "*.txt")
    message = resolve_error(train=pattern)
    assert message.startswith("data.train:") and pattern in message
    message = resolve_error(train=corpus_files[0], validation=pattern)
    assert message.startswith("data.validation:") and pattern in message


def test_empty_files(tmp_path):
    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_bytes(b"")
    message = resolve_error(train=str(tmp_path / "*.txt"))
    assert message.startswith("data.train:") and "empty" in message


def test_binary_file(tmp_path, corpus_files):
    binary = tmp_path / "blob.bin"
    binary.write_bytes(bytes(range(256)) * 8)
    message = resolve_error(train=f"{corpus_files[0]},{binary}")
    assert message.startswith("data.train:") and str(binary) in message and "binary" in message


@pytest.mark.parametrize("text", ["café crème brûlée\n" * 50, "café"])  # long, and short with the bad byte last
def test_latin1_file(tmp_path, text):
    path = tmp_path / "latin1.txt"
    path.write_bytes(text.encode("latin-1"))
    message = resolve_error(train=str(path))
    assert message.startswith("data.train:") and str(path) in message and "not UTF-8" in message
    assert "0xe9" in message


def test_character_cut_by_the_sniffed_head_is_not_an_error(tmp_path):
    path = tmp_path / "cut.txt"
    path.write_bytes(b"x" * (sources.SNIFF_BYTES - 1) + "é and more text\n".encode("utf-8"))
    train, _ = sources.resolve_sources(DataConfig(train=str(path)))
    assert train.files == [str(path)]


# --- TFRecord shards ---------------------------------------------------------------------------------


def test_shards_give_the_same_stream_as_text(tmp_path, corpus_files, monkeypatch):
    monkeypatch.setattr(prepare, "RECORD_MAX_TOKENS", 1000)  # split each document across several records
    tok = ByteTokenizer()
    out = str(tmp_path / "shards")
    meta = prepare.write_shards(sources.Source(corpus_files, "text"), tok, out, num_shards=2)
    shards = sorted(glob.glob(os.path.join(out, "*.tfrecord")))
    assert [os.path.basename(s) for s in shards] == ["data-00000-of-00002.tfrecord", "data-00001-of-00002.tfrecord"]
    assert not glob.glob(os.path.join(out, "*.tmp"))
    stream = token_stream(corpus_files, tok)
    assert meta["tokens"] == len(stream) and meta["files"] == len(corpus_files) and meta["records"] > len(corpus_files)
    assert load_tokenizer(out).spec() == tok.spec()

    assert sources.detect_format(shards, "auto", "data.train") == "tfrecord"
    fn = data.make_dataset_fn(sources.Source(shards, "tfrecord"), tok, SEQ, BATCH, training=False, seed=0,
                              shuffle_buffer=32)
    dataset = fn()
    assert [s.shape.as_list() for s in dataset.element_spec] == [[BATCH, SEQ], [BATCH, SEQ]]
    n = len(stream) // (SEQ + 1) // BATCH
    for (x1, y1), (x2, y2) in zip(first_batches(dataset, n), first_batches(text_dataset(corpus_files, tok=tok), n)):
        np.testing.assert_array_equal(x1, x2)
        np.testing.assert_array_equal(y1, y2)


def test_few_shards_hold_out_the_last_and_one_shard_is_refused(tmp_path, corpus_files):
    out = tmp_path / "shards"
    prepare.write_shards(sources.Source(corpus_files, "text"), ByteTokenizer(), str(out), num_shards=8)
    names = sorted(str(p) for p in out.glob("*.tfrecord"))
    train, val = sources.resolve_sources(DataConfig(train=str(out / "*.tfrecord")))
    assert (train.files, val.files) == (names[:7], names[7:])  # data prepare's default 8: the tail held out
    one = tmp_path / "one"
    prepare.write_shards(sources.Source(corpus_files, "text"), ByteTokenizer(), str(one), num_shards=1)
    message = resolve_error(train=str(one / "*.tfrecord"))
    assert "none can be held out" in message and "--shards N" in message and "data.validation" in message


def test_a_shard_cut_short_is_refused_before_training(tmp_path, corpus_files):
    # TensorFlow reads a truncated TFRecord file as if it ended there: the recorded size catches it
    out = tmp_path / "shards"
    prepare.write_shards(sources.Source(corpus_files, "text"), ByteTokenizer(), str(out), num_shards=2)
    first, second = sorted(out.glob("*.tfrecord"))
    assert sources.detect_format([str(first), str(second)], "auto", "data.train") == "tfrecord"
    first.write_bytes(first.read_bytes()[: first.stat().st_size // 2])
    with pytest.raises(UserError, match=rf"data.train: shard {first} is [\d,]+ bytes, but its meta.json records "
                                        r"[\d,]+: it was cut short or changed"):
        sources.detect_format([str(first), str(second)], "auto", "data.train")
    assert sources.detect_format([str(second)], "auto", "data.train") == "tfrecord"


def test_write_shards_refuses_to_overwrite(tmp_path, corpus_files):
    tok, out = ByteTokenizer(), str(tmp_path / "shards")
    source = sources.Source(corpus_files, "text")
    prepare.write_shards(source, tok, out, num_shards=3)
    before = {p: open(p, "rb").read() for p in glob.glob(os.path.join(out, "*"))}
    with pytest.raises(UserError, match="already holds 3 shards; pass --overwrite"):
        prepare.write_shards(source, tok, out, num_shards=2)
    assert {p: open(p, "rb").read() for p in glob.glob(os.path.join(out, "*"))} == before
    # With overwrite, the new set replaces the old one entirely: no stale shard of the 3-shard set.
    prepare.write_shards(sources.Source(corpus_files[:1], "text"), tok, out, num_shards=2, overwrite=True)
    assert sorted(os.path.basename(p) for p in glob.glob(os.path.join(out, "*.tfrecord"))) == [
        "data-00000-of-00002.tfrecord", "data-00001-of-00002.tfrecord"]


# TensorFlow's error for a gs:// path without a network (first of its lines; then 20 of retries)
NO_NETWORK = ("Error executing an HTTP request: libcurl code 6 meaning 'Could not resolve hostname', error details: "
              "Could not resolve host: www.googleapis.com\n\t when reading gs://my-bucket/shards")


def test_an_output_bucket_out_of_reach_is_one_line_naming_it(tmp_path, corpus_files, monkeypatch, capsys):
    from tpu_llm import cli

    real_glob = tf.io.gfile.glob

    def no_network(pattern):
        if pattern.startswith("gs://"):
            raise tf.errors.FailedPreconditionError(None, None, NO_NETWORK)
        return real_glob(pattern)

    monkeypatch.setattr(tf.io.gfile, "glob", no_network)
    capsys.readouterr()
    assert cli.main(["data", "prepare", "--input", corpus_files[0], "--output", "gs://my-bucket/shards"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: --output 'gs://my-bucket/shards' cannot be reached or written (FailedPreconditionError: Error "
        "executing an HTTP request: libcurl code 6 meaning 'Could not resolve hostname', error details: Could not "
        "resolve host: www.googleapis.com); check the network, your credentials (gcloud auth application-default "
        "login) and that the bucket gs://my-bucket exists (`python -m tpu_llm.cloud check gs://my-bucket/shards` "
        "tests it); nothing was written")

    def lost_half_way(*_args, **_kwargs):  # the network goes while the shards are written
        raise tf.errors.UnavailableError(None, None, "Error executing an HTTP request: HTTP response code 503")

    monkeypatch.setattr(tf.io.gfile, "rename", lost_half_way)
    out = tmp_path / "shards"
    with pytest.raises(UserError, match=rf"^--output '{out}' cannot be reached or written \(UnavailableError: Error "
                                        r"executing an HTTP request: HTTP response code 503\); check the path and its "
                                        r"permissions; a shard is renamed from its .tmp name only once complete; "
                                        r"run the same command again with --overwrite$"):
        prepare.write_shards(sources.Source(corpus_files, "text"), ByteTokenizer(), str(out), num_shards=2)
    assert not glob.glob(str(out / "*.tfrecord"))  # no shard under its final name


@pytest.mark.slow
def test_data_prepare_without_a_network_is_one_line(tmp_path, corpus_files):
    """The real thing: `tpu-llm data prepare --output gs://...` in a network namespace of its own, which
    holds only a loopback interface, down."""
    import shutil
    import subprocess
    import sys

    if not shutil.which("unshare") or subprocess.run(
            ["unshare", "--net", *([] if os.geteuid() == 0 else ["--map-root-user"]), "true"]).returncode:
        pytest.skip("this system gives no network namespace (unshare --net fails)")
    done = subprocess.run(["unshare", "--net", *([] if os.geteuid() == 0 else ["--map-root-user"]), sys.executable,
                           "-m", "tpu_llm", "data", "prepare", "--input", corpus_files[0], "--output",
                           "gs://tpu-llm-test-no-such-bucket-0/shards"], capture_output=True, text=True, timeout=300)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith("error: --output 'gs://tpu-llm-test-no-such-bucket-0/shards' cannot be reached or "
                               "written (FailedPreconditionError: ") and lines[0].endswith("; nothing was written")
    assert "Could not resolve host" in lines[0] and "that the bucket gs://tpu-llm-test-no-such-bucket-0 exists" in \
        lines[0]


# --- resuming the training stream from a position --------------------------------------------------


# (1, 2): one lane, both pipelines read it and keep their rows; (8, 2): each pipeline reads its own 4 lanes
@pytest.mark.parametrize("files, pipelines", [(3, 1), (1, 2), (8, 2)])
def test_the_training_stream_resumes_exactly_from_a_saved_position(tmp_path, files, pipelines):
    source = sources.Source(write_corpus(tmp_path, files=files), "text")
    replicas = 2 * pipelines  # two replicas per pipeline: the position rides on the first one's batch

    def pipeline_fns(start=None):
        fn = data.make_dataset_fn(source, ByteTokenizer(), SEQ, 8, training=True, seed=3, shuffle_buffer=7,
                                  with_position=True, start=start)
        contexts = [tf.distribute.InputContext(pipelines, i, replicas) for i in range(pipelines)]
        return fn, [iter(fn(c)) for c in contexts]

    fn, straight = pipeline_fns()
    batches = [[next(it) for _ in range(2 * 30)] for it in straight]  # 30 global steps
    stop = 2 * 17  # after 17 steps: the first replica's element of step 17 carries each pipeline's rows
    table = sum(b[stop - 2][2].numpy() for b in batches)  # what the SUM-on-read variable would hold
    assert table.shape == (fn.rows, len(lanes.POSITION_FIELDS)) and fn.rows == lanes.lanes_for(8, files)
    assert all(b[stop - 1][2].numpy().sum() == 0 for b in batches)  # the other replica carries zeros
    fn, resumed = pipeline_fns(start=table)
    assert fn.resumed == "position"
    for p, it in enumerate(resumed):  # the next 13 steps, exactly, without replaying the 17 before
        for j in range(stop, 2 * 30):
            x, y, _ = next(it)
            np.testing.assert_array_equal(x.numpy(), batches[p][j][0].numpy())
            np.testing.assert_array_equal(y.numpy(), batches[p][j][1].numpy())


def test_a_position_that_does_not_fit_falls_back_to_replaying(tmp_path):
    source = sources.Source(write_corpus(tmp_path, files=9), "text")
    fn = data.make_dataset_fn(source, ByteTokenizer(), SEQ, 8, training=True, seed=3, shuffle_buffer=7,
                              with_position=True)
    table = next(iter(fn()))[2].numpy()
    table[:, 1] += 1  # another chunk size (data.shuffle_buffer changed): the stream was cut differently
    fn = data.make_dataset_fn(source, ByteTokenizer(), SEQ, 8, training=True, seed=3, shuffle_buffer=7,
                              start=table, skip_steps=5)
    [(first, _)] = fn().take(1)
    [(fifth, _)] = data.make_dataset_fn(source, ByteTokenizer(), SEQ, 8, training=True, seed=3,
                                        shuffle_buffer=7)().skip(5).take(1)
    assert fn.resumed == "replay"
    np.testing.assert_array_equal(first.numpy(), fifth.numpy())


def test_a_position_made_over_other_training_files_starts_the_new_list_over(tmp_path):
    """A position indexes the shuffled list of training files: with a file added (a glob that now
    matches more), restoring it would land somewhere else. The stream starts over on the new list,
    and says so (`resumed == "files"`), rather than replaying or using the position."""
    files = write_corpus(tmp_path, files=4)

    def stream(source, **resume):
        fn = data.make_dataset_fn(source, ByteTokenizer(), SEQ, 8, training=True, seed=3, shuffle_buffer=7,
                                  with_position=True, **resume)
        return fn, iter(fn())

    old = sources.Source(files[:3], "text")
    _, it = stream(old)
    table = [next(it) for _ in range(5)][-1][2].numpy()  # the position after 5 steps (one replica)
    fn, _ = stream(old, start=table, skip_steps=5)
    assert fn.resumed == "position"  # the same files: resumed exactly (test above)
    moved = sources.Source([str(tmp_path / "elsewhere" / os.path.basename(f)) for f in files[:3]], "text")
    assert lanes.files_fingerprint(moved.files) == lanes.files_fingerprint(old.files)  # the folder moved
    new = sources.Source(files, "text")
    fn, resumed = stream(new, start=table, skip_steps=5)
    assert fn.resumed == "files"
    _, fresh = stream(new)
    for _ in range(3):
        np.testing.assert_array_equal(next(resumed)[0].numpy(), next(fresh)[0].numpy())
