"""data.tokenizer=hf: ids identical to transformers' AutoTokenizer (and, for Llama, to SentencePiece) on a
mixed-script corpus; save/load and export; `data prepare` shards; one-line errors. No network: the
tokenizers are trained here, tiny, once per module."""

import io
import json
import os

import pytest
import tensorflow as tf

tokenizers = pytest.importorskip("tokenizers", reason="data.tokenizer=hf needs the hf extra (tokenizers)")
transformers = pytest.importorskip("transformers", reason="the reference tokenizer is transformers' AutoTokenizer")

from helpers import CORPUS_LINES, snapshot, tiny_config, write_corpus  # noqa: E402

from tpu_llm import cli  # noqa: E402
from tpu_llm.errors import UserError  # noqa: E402
from tpu_llm.model.sampling import continuation  # noqa: E402
from tpu_llm.platform.run_layout import HF_FILE  # noqa: E402
from tpu_llm.tokenizers import SPEC_FILE, build_tokenizer, load_tokenizer, save_tokenizer  # noqa: E402
from tpu_llm.tokenizers.hf import HFTokenizer, load_hf_tokenizer, write_hf_tokenizer  # noqa: E402

# Mixed scripts, whitespace at the edges, control characters, combining marks, emoji sequences, RTL,
# characters outside the BMP, text that spells a special token: most of it never seen in training, so
# the GPT-2 BPE falls back to single bytes and the Llama BPE to its <0xNN> byte pieces.
MIXED = ["héllo wörld ✓ 日本語", "", "a", "  lead and trail  ", "def f(x):\n\treturn x  # two  spaces\n\n",
         "emoji 🎉 👩‍👩‍👧 and 𝔘 (outside the BMP)", "Ελληνικά русский", "שלום עולם مرحبا بالعالم",
         "ctrl \x00\x07\x1b[0m\x7f\r\n end", "e\u0301 vs é, ﬁ ligature, \u200b zero width", "x<|endoftext|>y</s>z",
         "中文和한국어 mixed with ASCII 123", " leading space", "\n"]
TRAIN_LINES = CORPUS_LINES * 20  # ASCII, accents, CJK, Greek, Cyrillic; no emoji, Hebrew or Arabic


def mixed_ids_match(ours, ref):
    for text in MIXED:
        assert ours.encode(text) == ref(text)["input_ids"], text
        want = ref.decode(ref(text)["input_ids"], skip_special_tokens=True)
        assert ours.decode(ours.encode(text)) == want, text
    assert ours.encode_tf(tf.constant(MIXED)).to_list() == [ours.encode(t) for t in MIXED]


@pytest.fixture(scope="module")
def gpt2_dirs(tmp_path_factory):
    """A GPT-2-style byte-level BPE, as tokenizer.json and as vocab.json + merges.txt."""
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.train_from_iterator(TRAIN_LINES, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    config = {"tokenizer_class": "GPT2Tokenizer", "eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>",
              "unk_token": "<|endoftext|>"}
    dirs = {}
    for layout in ("tokenizer.json", "vocab+merges"):
        d = tmp_path_factory.mktemp(layout.replace(".", "_").replace("+", "_"))
        tok.save(str(d / "tokenizer.json")) if layout == "tokenizer.json" else tok.model.save(str(d))
        (d / "tokenizer_config.json").write_text(json.dumps(config))
        dirs[layout] = str(d)
    return dirs


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A Llama-style tokenizer: SentencePiece BPE with byte fallback trained as Llama's was, as Llama-2's
    tokenizer.json lays it out (legacy normalizer, BOS template), and as transformers 5 saves it."""
    import sentencepiece as spm
    from tokenizers import decoders, models, normalizers, processors

    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TRAIN_LINES), model_writer=proto, vocab_size=400, model_type="bpe", byte_fallback=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=True, split_digits=True,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_proto=proto.getvalue())
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    normal = {sp.id_to_piece(i): (sp.get_score(i), i) for i in range(sp.get_piece_size())
              if not (sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i))}
    ranked = sorted((-normal[p][0], normal[p][1], p[:k], p[k:]) for p in normal for k in range(1, len(p))
                    if p[:k] in normal and p[k:] in normal)
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[(a, b) for *_, a, b in ranked], unk_token="<unk>",
                                          fuse_unk=True, byte_fallback=True))
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                        special_tokens=[("<s>", 1)])
    legacy = tmp_path_factory.mktemp("llama2")
    tok.save(str(legacy / "tokenizer.json"))
    (legacy / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
         "add_bos_token": True, "add_eos_token": False}))  # as Llama-2's
    only_model = tmp_path_factory.mktemp("llama_sp")
    (only_model / "tokenizer.model").write_bytes(proto.getvalue())
    (only_model / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "bos_token": "<s>", "eos_token": "</s>",
         "unk_token": "<unk>"}))
    saved = tmp_path_factory.mktemp("llama_v5")  # the tokenizer.model converted by transformers, as it saves it
    transformers.AutoTokenizer.from_pretrained(str(only_model)).save_pretrained(str(saved))
    return {"sp": sp, "legacy": str(legacy), "only_model": str(only_model), "saved": str(saved)}


# --- ids against the reference ---------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["tokenizer.json", "vocab+merges"])
def test_gpt2_byte_level_bpe_ids_equal_transformers(gpt2_dirs, layout):
    ours = load_hf_tokenizer(gpt2_dirs[layout])
    ref = transformers.AutoTokenizer.from_pretrained(gpt2_dirs[layout])
    mixed_ids_match(ours, ref)
    assert (ours.eos_id, ours.bos_id, ours.add_bos) == (ref.eos_token_id, ref.bos_token_id, False)
    assert ours.vocab_size == len(ref)
    for text in MIXED:  # byte-level BPE is lossless, special-token text aside
        if "<|endoftext|>" not in text:
            assert ours.decode(ours.encode(text)) == text
    raw = b"\xff\xfe caf\xc3\xa9 \x80"  # invalid UTF-8 is read as U+FFFD, in Python and in tf.data alike
    assert ours.encode(raw) == ref(raw.decode("utf-8", errors="replace"))["input_ids"]
    assert ours.encode_tf(tf.constant([raw])).to_list() == [ours.encode(raw)]
    assert ours.encode_tf(tf.constant("scalar ✓")).numpy().tolist() == ours.encode("scalar ✓")


def test_llama_ids_equal_transformers_and_sentencepiece(llama):
    ours = load_hf_tokenizer(llama["legacy"])
    ref = transformers.AutoTokenizer.from_pretrained(llama["legacy"])
    mixed_ids_match(ours, ref)
    assert (ours.bos_id, ours.eos_id, ours.add_bos) == (1, 2, True)
    sp = llama["sp"]
    for text in MIXED:  # how the model was trained: BOS, then SentencePiece's pieces (byte fallback included)
        if "</s>" not in text:
            assert ours.encode(text) == [1] + sp.encode(text), text
            assert ours.decode(ours.encode(text)) == text, text
    assert any(piece.startswith("<0x") for piece in
               (sp.id_to_piece(i) for i in ours.encode("🎉 שלום")))  # bytes the vocabulary lacks


def test_an_eos_the_post_processor_appends_is_left_to_the_data_pipeline(tmp_path, llama):
    from tokenizers import processors

    tok = tokenizers.Tokenizer.from_file(os.path.join(llama["legacy"], "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(open(os.path.join(llama["legacy"], "tokenizer_config.json")).read())
    ours, ref = load_hf_tokenizer(str(tmp_path)), transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for text in MIXED:
        assert ref(text)["input_ids"][-1] == ours.eos_id and ours.encode(text) == ref(text)["input_ids"][:-1], text
    assert ours.encode_tf(tf.constant(MIXED)).to_list() == [ours.encode(t) for t in MIXED]


def test_llama_as_transformers_5_converts_and_saves_it(llama):
    ours = load_hf_tokenizer(llama["saved"])
    mixed_ids_match(ours, transformers.AutoTokenizer.from_pretrained(llama["saved"]))
    assert ours.add_bos and ours.decode(ours.encode("wörld 🎉")) == "wörld 🎉"


def test_a_byte_level_bpe_that_lacks_bytes_drops_them_as_transformers_does_and_missing_names_them(tmp_path):
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(["abc abc"], trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    ours = load_hf_tokenizer(str(tmp_path))  # no tokenizer_config.json: <|endoftext|> is the EOS
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), tokenizer_class="PreTrainedTokenizerFast")
    assert ours.encode("ab€c") == ref("ab€c")["input_ids"] and ours.eos_id == 0
    assert ours.missing("ab€cz") == ["€", "z"] and ours.missing("cab") == []


def test_continuation_keeps_the_space_llama_decoding_drops(llama):
    ours = load_hf_tokenizer(llama["legacy"])
    prompt, whole = ours.encode("the quick"), ours.encode("the quick brown fox")
    assert whole[:len(prompt)] == prompt
    assert continuation(ours, prompt, whole[len(prompt):]) == " brown fox"
    assert ours.decode(whole[len(prompt):]) == "brown fox"  # alone, the first word loses its space


# --- run directory, export, data prepare -----------------------------------------------------------


@pytest.mark.parametrize("which", ["gpt2", "llama"])
def test_save_load_and_export_give_the_same_ids(tmp_path, gpt2_dirs, llama, which):
    tok = load_hf_tokenizer(gpt2_dirs["vocab+merges"] if which == "gpt2" else llama["legacy"])
    run = str(tmp_path / "run")
    save_tokenizer(tok, run)
    assert sorted(os.listdir(run)) == sorted([SPEC_FILE, HF_FILE])
    loaded = load_tokenizer(run)
    assert isinstance(loaded, HFTokenizer) and loaded.spec() == tok.spec()
    assert (loaded.eos_id, loaded.bos_id, loaded.add_bos) == (tok.eos_id, tok.bos_id, tok.add_bos)
    assert [loaded.encode(t) for t in MIXED] == [tok.encode(t) for t in MIXED]
    assert build_tokenizer("hf", run).spec() == tok.spec()  # data prepare --tokenizer_model RUN_DIR
    export = str(tmp_path / "export")
    write_hf_tokenizer(tok, export, model_max_length=64)
    ref = transformers.AutoTokenizer.from_pretrained(export)
    mixed_ids_match(tok, ref)
    assert (ref.eos_token_id, ref.bos_token_id, ref.model_max_length) == (tok.eos_id, tok.bos_id, 64)
    assert load_hf_tokenizer(export).spec() == tok.spec()  # and back: import after export


def test_data_prepare_writes_the_ids_of_transformers(tmp_path, llama, capsys):
    docs = [t for t in MIXED if t.strip() and "\x00" not in t]  # each a file (a NUL reads as binary)
    for i, text in enumerate(docs):
        (tmp_path / f"doc{i:02d}.txt").write_text(text, encoding="utf-8")
    out = tmp_path / "shards"
    assert cli.main(["data", "prepare", f"--input={tmp_path}/doc*.txt", f"--output={out}", "--tokenizer=hf",
                     f"--tokenizer_model={llama['legacy']}", "--shards=2"]) == 0
    assert "--data.tokenizer=hf" in capsys.readouterr().out
    ref = transformers.AutoTokenizer.from_pretrained(llama["legacy"])
    spec = {"tokens": tf.io.RaggedFeature(tf.int64)}
    got = [tf.io.parse_single_example(r, spec)["tokens"].numpy().tolist()
           for r in tf.data.TFRecordDataset(sorted(str(p) for p in out.glob("*.tfrecord")))]
    # [BOS] text EOS for each document, in input order (shards are balanced by tokens: records are pieces
    # of that stream; each file is tokenized whole, so the ids are the document's)
    assert sum(got, []) == sum((ref(t)["input_ids"] + [ref.eos_token_id] for t in docs), [])
    assert load_tokenizer(str(out)).spec() == load_hf_tokenizer(llama["legacy"]).spec()


# --- one-line errors -------------------------------------------------------------------------------


def one_line(excinfo, *fragments):
    message = str(excinfo.value)
    assert "\n" not in message and all(f in message for f in fragments), message


def test_missing_unreadable_and_sentencepiece_only_tokenizers_are_one_line(tmp_path, llama):
    with pytest.raises(UserError) as e:
        build_tokenizer("hf", str(tmp_path / "nowhere"))
    one_line(e, "does not exist")
    with pytest.raises(UserError) as e:
        build_tokenizer("hf", "")
    one_line(e, "needs data.tokenizer_model")
    with pytest.raises(UserError) as e:
        build_tokenizer("hf", str(tmp_path))  # an empty directory
    one_line(e, "has no tokenizer.json")
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "Nonsense"}}')
    with pytest.raises(UserError) as e:
        build_tokenizer("hf", str(tmp_path / "tokenizer.json"))
    one_line(e, "tokenizer.json", "cannot read it")
    with pytest.raises(UserError) as e:
        build_tokenizer("hf", llama["only_model"])
    one_line(e, "only a SentencePiece tokenizer.model", "save_pretrained")


def test_training_on_text_with_the_hf_tokenizer_is_refused_and_the_run_directory_untouched(tmp_path, gpt2_dirs,
                                                                                               capsys):
    write_corpus(tmp_path / "corpus")
    run = tmp_path / "run"
    before = snapshot(tmp_path)
    code = cli.main(["train", f"--run_dir={run}", f"--data.train={tmp_path / 'corpus' / '*.txt'}",
                     "--data.tokenizer=hf", f"--data.tokenizer_model={gpt2_dirs['tokenizer.json']}"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: data.tokenizer=hf trains on pre-tokenized shards only") and \
        err.count("\n") == 1 and "tpu-llm data prepare" in err, err
    # the command it names reads this run's text with its tokenizer (issue 50: a hint works as printed)
    assert f"`tpu-llm data prepare --tokenizer hf --input '{tmp_path / 'corpus' / '*.txt'}' --output SHARDS " \
           f"--tokenizer_model {gpt2_dirs['tokenizer.json']}`" in err, err
    assert snapshot(tmp_path) == before


def test_without_the_tokenizers_library_the_error_names_the_extra(monkeypatch, gpt2_dirs):
    import sys

    monkeypatch.setitem(sys.modules, "tokenizers", None)  # `import tokenizers` raises ImportError
    with pytest.raises(UserError) as e:
        build_tokenizer("hf", gpt2_dirs["tokenizer.json"])
    one_line(e, "pip install 'tpu-llm[hf]'")



def test_a_run_takes_the_hf_tokenizer_from_its_shards_and_samples_with_it(tmp_path, gpt2_dirs, llama):
    """What `train` on hf shards and `generate` do with the tokenizer (a whole run costs ~25 s of compiling:
    `tpu-llm data prepare`, `train` and `generate` on the command line are in docs/tokenizers.md)."""
    from tpu_llm.data import sources
    from tpu_llm.model import GPT
    from tpu_llm.training.build import setup_tokenizer
    from tpu_llm.training.samples import print_samples

    write_corpus(tmp_path / "corpus")
    for name, model in (("llama", llama["legacy"]), ("gpt2", gpt2_dirs["tokenizer.json"])):
        assert cli.main(["data", "prepare", f"--input={tmp_path / 'corpus'}/*.txt", f"--output={tmp_path / name}",
                         "--tokenizer=hf", f"--tokenizer_model={model}", "--shards=1"]) == 0
    cfg = tiny_config(tmp_path, **{"data.train": f"{tmp_path / 'llama'}/*.tfrecord", "data.tokenizer": "hf",
                                   "data.validation": f"{tmp_path / 'llama'}/*.tfrecord", "sample.prompt": "The quick",
                                   "sample.num_samples": 1, "sample.max_new_tokens": 1, "sample.temperature": 0})
    splits = sources.resolve_sources(cfg.data)
    tok = setup_tokenizer(cfg, *splits)
    assert tok.spec() == load_hf_tokenizer(llama["legacy"]).spec()
    save_tokenizer(tok, cfg.run_dir)
    other = sources.resolve_sources(tiny_config(tmp_path, **{"data.train": f"{tmp_path / 'gpt2'}/*.tfrecord",
                                                          "data.validation": f"{tmp_path / 'gpt2'}/*.tfrecord",
                                                          "data.tokenizer": "hf"}).data)
    with pytest.raises(UserError, match="does not match the one saved in"):  # another checkpoint's tokenizer
        setup_tokenizer(cfg, *other)
    cfg.model.vocab_size = tok.vocab_size
    model = GPT(cfg.model, tok.vocab_size).build_weights()
    [text] = print_samples(model, tok, cfg, say=lambda *_: None)
    prompt = tok.encode("The quick")
    assert prompt[0] == tok.bos_id and text.startswith("The quick") and len(text) > len("The quick")
