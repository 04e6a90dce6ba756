"""Tokenizers: lossless round trips (non-ASCII, whitespace, invalid UTF-8), TF ops equal Python, save/load."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import tensorflow as tf
from helpers import CORPUS_LINES, write_corpus

from tpu_llm.errors import UserError
from tpu_llm.platform.run_layout import MARKER_FILE
from tpu_llm.tokenizers import (SP_MODEL_FILE, SPEC_FILE, ByteTokenizer, CharTokenizer, SentencePieceTokenizer,
                                build_tokenizer, load_tokenizer, save_tokenizer, train_sentencepiece)

SP_VOCAB = 400  # 256 byte pieces + specials + the corpus's ~110 distinct characters + a few merges
TEXTS = ["héllo wörld ✓ 日本語", "", "a", "def f(x):\n\treturn x  # two  spaces\n\n", "  lead and trail  ",
         "emoji 🎉 and 𝔘 (outside the BMP)", "Ελληνικά русский"]


def encode_tf(tok, texts):
    return tok.encode_tf(tf.constant(texts)).to_list()


@pytest.fixture(scope="module")
def corpus_files(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def sp(tmp_path_factory, corpus_files):
    path = str(tmp_path_factory.mktemp("sp") / "sub" / "sp.model")
    tok = train_sentencepiece(corpus_files, SP_VOCAB, path)
    assert os.path.getsize(path) > 0  # written, parent directory created
    return tok, path


# --- byte ------------------------------------------------------------------------------------------


def test_byte_round_trip_non_ascii():
    tok = ByteTokenizer()
    text = "héllo wörld ✓ 日本語"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and len(ids) > len(text)
    assert tok.decode(ids) == text
    assert (tok.vocab_size, tok.eos_id) == (257, 256)
    assert tok.decode(ids + [tok.eos_id]) == text  # end-of-text is not a byte


def test_byte_invalid_utf8_is_lossless():
    tok = ByteTokenizer()
    raw = b"\xff\xfe\x80abc"
    ids = tok.encode(raw)
    assert ids == [255, 254, 128, 97, 98, 99]
    assert tok.decode_bytes(ids) == raw
    assert tok.decode(ids) == raw.decode("utf-8", errors="replace")  # never raises
    assert encode_tf(tok, [raw]) == [ids]


def test_byte_encode_tf_matches_encode():
    tok = ByteTokenizer()
    assert encode_tf(tok, TEXTS) == [tok.encode(t) for t in TEXTS]
    assert tok.encode_tf(tf.constant(TEXTS)).dtype == tf.int32


def test_byte_core_ops_give_byte_splitter_ids(corpus_files):
    # the ids of the tensorflow-text ByteSplitter this tokenizer used before (checkpoints stay valid)
    tf_text = pytest.importorskip("tensorflow_text")
    texts = CORPUS_LINES + TEXTS + [open(p, encoding="utf-8").read() for p in corpus_files] + ["\xff\xfe\x80abc"]
    texts = [t.encode("latin-1") if t.startswith("\xff") else t for t in texts]  # invalid UTF-8 too
    splitter = tf_text.ByteSplitter()
    assert encode_tf(ByteTokenizer(), texts) == splitter.split(tf.constant(texts)).to_list()
    for scalar in (TEXTS[0], ""):  # one string: a dense vector, as ByteSplitter gives
        got = ByteTokenizer().encode_tf(tf.constant(scalar))
        assert got.dtype == tf.int32 and got.numpy().tolist() == splitter.split(tf.constant(scalar)).numpy().tolist()


# A TF server on a remote TPU host has no tensorflow-text: this process cannot import it at all.
NO_TF_TEXT = textwrap.dedent("""
    import json, sys
    sys.modules["tensorflow_text"] = None  # `import tensorflow_text` raises ImportError
    import tensorflow as tf
    from tpu_llm.data import dataset as data
    from tpu_llm.data import sources
    from tpu_llm.errors import UserError
    from tpu_llm.tokenizers import SentencePieceTokenizer, build_tokenizer
    sp_model, files = sys.argv[1], sys.argv[2:]
    source = sources.Source(files, "text")
    out = {}
    for kind in ("byte", "char"):
        tok = build_tokenizer(kind, text_files=files)
        for training in (True, False):
            fn = data.make_dataset_fn(source, tok, 16, 4, training=training, seed=0, shuffle_buffer=8)
            inputs, _ = next(iter(fn()))[:2]
            out[f"{kind}-{training}"] = inputs.numpy().tolist()
    try:
        SentencePieceTokenizer(open(sp_model, "rb").read()).encode_tf(tf.constant(["x"]))
    except UserError as e:
        out["sentencepiece"] = str(e)
    print(json.dumps(out))
""")


@pytest.mark.slow
def test_byte_and_char_pipelines_run_without_tensorflow_text(tmp_path, corpus_files, sp):
    from tpu_llm.data import dataset as data
    from tpu_llm.data import sources

    script = tmp_path / "no_tf_text.py"
    script.write_text(NO_TF_TEXT)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, str(script), sp[1], *corpus_files], capture_output=True, text=True,
                          timeout=120, cwd=repo, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": repo})
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    source = sources.Source(corpus_files, "text")
    for kind in ("byte", "char"):  # the same batches as this process, which has tensorflow-text
        tok = build_tokenizer(kind, text_files=corpus_files)
        for training in (True, False):
            fn = data.make_dataset_fn(source, tok, 16, 4, training=training, seed=0, shuffle_buffer=8)
            assert got[f"{kind}-{training}"] == next(iter(fn()))[0].numpy().tolist()
    assert got["sentencepiece"].startswith("data.tokenizer=sentencepiece needs tensorflow-text")
    assert "tpu-llm[cpu,sentencepiece]" in got["sentencepiece"] and "\n" not in got["sentencepiece"]


# --- char ------------------------------------------------------------------------------------------


def test_char_round_trip_and_unknown():
    tok = CharTokenizer("héllo wörld ✓ 日本語\n\t")
    assert tok.chars == "".join(sorted(set("héllo wörld ✓ 日本語\n\t")))
    assert (tok.eos_id, tok.unk_id, tok.vocab_size) == (len(tok.chars), len(tok.chars) + 1, len(tok.chars) + 2)
    text = "wörld\t日本 héllo\n"
    assert tok.decode(tok.encode(text)) == text
    ids = tok.encode("hé Z語€")
    assert ids[3] == tok.unk_id and ids[5] == tok.unk_id and ids.count(tok.unk_id) == 2
    assert tok.decode(ids) == "hé \ufffd語\ufffd"
    assert tok.decode(tok.encode(text) + [tok.eos_id]) == text


def test_char_encode_tf_matches_encode():
    tok = CharTokenizer("abcé日 \n")
    texts = ["abc", "é日 x\n", "", "zzz", "日本"]
    assert encode_tf(tok, texts) == [tok.encode(t) for t in texts]


def test_char_from_files_covers_the_corpus(corpus_files):
    tok = build_tokenizer("char", text_files=corpus_files)
    for path in corpus_files:
        text = open(path, encoding="utf-8").read()
        ids = tok.encode(text)
        assert tok.unk_id not in ids and tok.decode(ids) == text
    assert encode_tf(tok, TEXTS) == [tok.encode(t) for t in TEXTS]


def test_char_tokenizer_in_several_graphs():
    # One tokenizer feeds the train and the validation pipelines (two tf.data graphs) and eager code.
    tok = CharTokenizer("abc")
    texts = tf.constant(["abcd", "cab"])
    for _ in range(2):
        ds = tf.data.Dataset.from_tensors(texts).map(tok.encode_tf)
        assert next(iter(ds)).to_list() == [[0, 1, 2, 4], [2, 0, 1]]
    assert tf.function(lambda t: tok.encode_tf(t).flat_values)(texts).numpy().tolist() == [0, 1, 2, 4, 2, 0, 1]
    assert encode_tf(tok, ["ba"]) == [[1, 0]]


def test_char_needs_text_files():
    with pytest.raises(UserError, match="data.tokenizer=char"):
        build_tokenizer("char", text_files=[])


# --- sentencepiece ---------------------------------------------------------------------------------


def test_sentencepiece_trained(sp):
    tok, _ = sp
    assert tok.kind == "sentencepiece" and tok.vocab_size == SP_VOCAB and tok.eos_id == 2
    assert len(tok.encode("The quick brown fox")) < len("The quick brown fox")  # merges were learned


@pytest.mark.parametrize("text", TEXTS + ["tabs\t\tand\nnewlines\n\n  and   spaces", "\n", "x\r\ny"])
def test_sentencepiece_round_trip_is_exact(sp, text):
    tok, _ = sp
    assert tok.decode(tok.encode(text)) == text


def test_sentencepiece_encode_tf_matches_encode(sp):
    tok, _ = sp
    assert encode_tf(tok, TEXTS) == [tok.encode(t) for t in TEXTS]
    assert tok.decode(tok.encode(TEXTS[0]) + [tok.eos_id]) == TEXTS[0]


def test_sentencepiece_from_file_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        SentencePieceTokenizer.from_file(str(tmp_path / "missing.model"))
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"not a model")
    with pytest.raises(UserError, match="not a SentencePiece model"):
        SentencePieceTokenizer.from_file(str(bad))


def test_sentencepiece_vocab_too_small(tmp_path, corpus_files):
    with pytest.raises(UserError, match="sentencepiece training failed: .*vocab_size"):
        train_sentencepiece(corpus_files, 280, str(tmp_path / "small.model"))
    assert not (tmp_path / "small.model").exists()


# --- save / load -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["byte", "char", "sentencepiece"])
def test_save_load_round_trip(tmp_path, sp, kind):
    tok = {"byte": lambda: ByteTokenizer(), "char": lambda: CharTokenizer("héllo ✓ 日本語\n\t\"\\"),
           "sentencepiece": lambda: SentencePieceTokenizer.from_file(sp[1])}[kind]()
    run_dir = str(tmp_path / "run")
    assert load_tokenizer(run_dir) is None
    save_tokenizer(tok, run_dir)
    assert os.path.exists(os.path.join(run_dir, SPEC_FILE))
    assert os.path.exists(os.path.join(run_dir, SP_MODEL_FILE)) == (kind == "sentencepiece")
    loaded = load_tokenizer(run_dir)
    assert type(loaded) is type(tok) and loaded.kind == kind
    assert loaded.spec() == tok.spec()
    assert (loaded.vocab_size, loaded.eos_id) == (tok.vocab_size, tok.eos_id)
    text = "héllo ✓ 日本語\n\t\"\\"
    assert loaded.encode(text) == tok.encode(text) and loaded.decode(loaded.encode(text)) == text


def test_a_sentencepiece_model_path_that_is_a_directory_is_one_line(tmp_path):
    with pytest.raises(UserError, match=r"data.tokenizer_model='.*' is a directory; give a .model file"):
        build_tokenizer("sentencepiece", str(tmp_path))


def test_missing_names_the_characters_a_char_vocabulary_lacks():
    assert CharTokenizer("Helo !").missing("Hello Жук €!") == ["Ж", "у", "к", "€"]
    assert ByteTokenizer().missing("Hello Жук €!") == []


def test_a_torn_tokenizer_file_is_one_line_exit_2_and_the_run_directory_is_untouched(tmp_path, capsys):
    """A tokenizer.json cut short by a kill or a full disk (the torn file `make faults` writes)."""
    from tpu_llm import cli

    write_corpus(tmp_path / "corpus")
    run = tmp_path / "run"
    run.mkdir()
    (run / MARKER_FILE).write_text("a tpu-llm run directory\n")  # a run of ours, its tokenizer torn
    (run / SPEC_FILE).write_text('{"kind": "byte", "vocab')
    assert cli.main(["train", f"--run_dir={run}", f"--data.train={tmp_path / 'corpus' / '*.txt'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {run / SPEC_FILE} is not a readable tokenizer file (") and err.count("\n") == 1, err
    assert "move the run directory away to start over" in err
    assert sorted(p.name for p in run.iterdir()) == sorted([MARKER_FILE, SPEC_FILE]) and (run / SPEC_FILE).read_text() == '{"kind": "byte", "vocab'
