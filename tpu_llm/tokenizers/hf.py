"""Hugging Face tokenizers (`data.tokenizer: hf`): the tokenizer that came with an imported checkpoint.

GPT-2's byte-level BPE and Llama's BPE with byte fallback have no TensorFlow ops, so they run in
Python, with Hugging Face's `tokenizers` library (the Rust library `transformers` uses): `tpu-llm data
prepare` writes TFRecord shards with it (`encode_tf` is a `tf.numpy_function`), and `generate`
encodes the prompt and decodes the sample with it. Training reads those shards only: a
`tf.numpy_function` cannot run in the TF servers of a TPU pod's hosts or of parameter-server
workers (`check_pretokenized`).

Ids are those of `transformers.AutoTokenizer.from_pretrained(DIR)(text)["input_ids"]` (special tokens
added, as transformers does by default): Llama's post-processor prepends BOS to every document and
prompt, GPT-2's adds nothing. The one difference: an end-of-text token that the post-processor appends
is dropped, because the data pipeline ends every document with exactly one EOS and a
prompt must not end with one. A shard document is therefore `[BOS] text EOS` for Llama and
`text <|endoftext|>` for GPT-2, which is how both were pre-trained. Decoding skips special tokens.

Three functions make the interface that `tpu-llm import/export --format hf` uses:
  load_hf_tokenizer(path)          an HF model directory or tokenizer.json -> HFTokenizer
  tokenizer.save_tokenizer / load_tokenizer   into / from a run or shard directory (hf_tokenizer.json)
  write_hf_tokenizer(tok, dir)     the HF files that `AutoTokenizer.from_pretrained(dir)` loads

The files come from outside: each is at most MAX_TOKENIZER_BYTES (checked before it is read), and
whatever it holds (not UTF-8, JSON nested too deeply, a tokenizer the library refuses or panics on, a
spec naming a file outside its directory) ends in one UserError naming it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex

import numpy as np
import tensorflow as tf

from tpu_llm.config import CAPS
from tpu_llm.errors import UserError
from tpu_llm.platform import files
from tpu_llm.platform.run_layout import HF_FILE, SPEC_FILE

# named special tokens that transformers registers (`SPECIAL_TOKENS_ATTRIBUTES`), then its lists
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
SPECIAL_LISTS = ("additional_special_tokens", "extra_special_tokens")
EOS_GUESSES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")  # when no config names one
# Bytes of one tokenizer file, checked before it is read: the largest published tokenizer.json (Gemma 3's)
# is 33 MB, and parsing takes about four times a file's size in memory.
MAX_TOKENIZER_BYTES = 100 << 20


def import_tokenizers():
    """Hugging Face's `tokenizers`, or a one-line UserError naming the extra that installs it."""
    try:
        import tokenizers
    except ImportError:
        raise UserError("data.tokenizer=hf needs Hugging Face's tokenizers library, which is not installed: "
                        "pip install 'tpu-llm[hf]'") from None
    return tokenizers


def _library_error(e: BaseException) -> str:
    """What `tokenizers` said, for a message; re-raises what is no error of the input (Ctrl-C). The Rust
    library raises a bare Exception with serde's message, or, where Rust panics, pyo3's PanicException,
    which is a BaseException."""
    if not isinstance(e, Exception) and type(e).__name__ != "PanicException":
        raise e
    lines = str(e).splitlines()
    return (lines[0] if lines else type(e).__name__)[:100]


def _parse(tokenizer_json: str, source: str):
    """A `tokenizers.Tokenizer` from the text of a tokenizer.json, or a one-line UserError naming `source`."""
    _check_ids(tokenizer_json, source)
    tokenizers = import_tokenizers()
    try:
        return tokenizers.Tokenizer.from_str(tokenizer_json)
    except BaseException as e:  # noqa: B036 (see _library_error)
        raise UserError(f"{source or 'tokenizer.json'}: Hugging Face's tokenizers {tokenizers.__version__} cannot "
                        f"read it ({_library_error(e)}); give the tokenizer.json that came with the "
                        "checkpoint, or upgrade tokenizers") from None


def _check_ids(tokenizer_json: str, source: str) -> None:
    """Refuse, before the library reads it, a tokenizer.json whose vocabulary ids pass config.CAPS'
    vocabulary cap: the library allocates a table up to its largest id (one id of 4e9 in a 4 KB file
    allocated until the process was killed). Text that is not JSON is left to the library's message."""
    try:
        spec = parse_json(tokenizer_json)
    except ValueError:
        return
    model = spec.get("model") if isinstance(spec, dict) else None
    vocab = model.get("vocab") if isinstance(model, dict) else None
    ids = list(vocab.values()) if isinstance(vocab, dict) else []
    added = spec.get("added_tokens") if isinstance(spec, dict) else None
    ids += [t.get("id") for t in added if isinstance(t, dict)] if isinstance(added, list) else []
    cap = CAPS["model.vocab_size"][0]
    top = max((i for i in ids if isinstance(i, (int, float)) and not isinstance(i, bool)), default=0)
    if top >= cap or (isinstance(vocab, list) and len(vocab) > cap):
        raise UserError(f"{source or 'tokenizer.json'}: a vocabulary id of {str(top)[:24]} passes tpu-llm's cap of "
                        f"{cap:,} ids ({CAPS['model.vocab_size'][1]}); give the tokenizer.json that came with the "
                        "checkpoint")


def _content(token) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) and token else None


class HFTokenizer:
    """A `tokenizers.Tokenizer` with the interface of tokenizers.core's tokenizers.

    Made by `load_hf_tokenizer` (from an HF directory) or by `load_tokenizer` (from a run directory):
    `json` is the whole tokenizer (special tokens and post-processor included), `eos_token` and
    `bos_token` name its end- and beginning-of-text tokens (bos may be None: GPT-2 has no BOS of its own).
    """

    kind = "hf"

    def __init__(self, tokenizer_json: str, eos_token: str, bos_token: str | None = None, source: str = ""):
        self._tok = _parse(tokenizer_json, source)
        try:
            self._setup(eos_token, bos_token, source)
        except UserError:
            raise
        except BaseException as e:  # noqa: B036 (a tokenizer the library read, then failed to run: _library_error)
            raise UserError(f"{source or 'tokenizer.json'}: Hugging Face's tokenizers cannot encode with it "
                            f"({_library_error(e)}); give the tokenizer.json that came with the checkpoint") from None

    def _setup(self, eos_token: str, bos_token: str | None, source: str) -> None:
        self.json = self._tok.to_str()  # canonical: the same tokenizer gives the same text and checksum
        self.eos_token, self.bos_token = eos_token, bos_token
        self.eos_id = self._tok.token_to_id(eos_token)
        if self.eos_id is None:
            raise UserError(f"{source or 'tokenizer.json'}: its end-of-text token {eos_token!r} is not in the vocabulary; "
                            "set eos_token in the directory's tokenizer_config.json")
        self.bos_id = self._tok.token_to_id(bos_token) if bos_token else None
        self.vocab_size = max(self._tok.get_vocab(with_added_tokens=True).values()) + 1
        model = json.loads(self.json).get("model", {})
        self.unk_id = self._tok.token_to_id(model["unk_token"]) if model.get("unk_token") else None
        # What the post-processor adds around a text: BOS in front (Llama), perhaps EOS behind
        plain = self._tok.encode("a", add_special_tokens=False).ids
        full = self._tok.encode("a").ids
        at = next((i for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain), 0)
        self.add_bos = self.bos_id is not None and full[:at][:1] == [self.bos_id]
        self._drop_eos = full[at + len(plain):][-1:] == [self.eos_id]
        # the same ids without character offsets: a third faster (tokenizers >= 0.21)
        self._encode_batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)

    def encode(self, text: str | bytes) -> list[int]:
        """HF's ids for `text` (special tokens added, so Llama's BOS leads), without a trailing EOS."""
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._trim(self._tok.encode(text).ids)

    def encode_plain(self, text: str) -> list[int]:
        """HF's ids for `text` with no special tokens added (no BOS): how lm-eval's hf backend encodes a
        causal model's context and continuation (tpu_llm/eval/backend.py)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def _trim(self, ids: list[int]) -> list[int]:
        return ids[:-1] if self._drop_eos and ids[-1:] == [self.eos_id] else ids

    def encode_tf(self, texts: tf.Tensor) -> tf.RaggedTensor:
        """`encode` inside tf.data, through `tf.numpy_function` (Python: this process's input pipeline only).
        Invalid UTF-8 becomes U+FFFD, as in `encode` and the char tokenizer."""
        texts = tf.convert_to_tensor(texts, tf.string)

        def run(array):  # numpy array of bytes -> (flat ids, row lengths)
            batch = [t.decode("utf-8", errors="replace") for t in np.reshape(array, [-1]).tolist()]
            ids = [self._trim(e.ids) for e in self._encode_batch(batch)]
            lengths = np.array([len(i) for i in ids], np.int64)
            return np.array([t for i in ids for t in i], np.int32), lengths

        values, lengths = tf.numpy_function(run, [texts], [tf.int32, tf.int64], stateful=False)
        values.set_shape([None])
        if texts.shape.rank == 0:
            return values
        return tf.RaggedTensor.from_row_lengths(values, tf.reshape(lengths, [-1]), validate=False)

    def missing(self, text: str) -> list[str]:
        """Characters of `text` the vocabulary cannot represent: they encode to the unknown token, to
        nothing (a BPE without unknown token drops what it lacks), or to bytes that do not decode back."""
        out = []
        for ch in dict.fromkeys(text):
            ids = self._tok.encode(ch, add_special_tokens=False).ids
            if not ids or (self.unk_id is not None and self.unk_id in ids) or (
                    "\ufffd" in self._tok.decode(ids) and ch != "\ufffd"):
                out.append(ch)
        return out

    def decode(self, ids) -> str:
        """The text of `ids`, special tokens (BOS, EOS, padding) left out; ids past the vocabulary ignored."""
        return self._tok.decode([int(i) for i in ids if 0 <= int(i) < self.vocab_size], skip_special_tokens=True)

    def spec(self) -> dict:
        return {"kind": self.kind, "model": HF_FILE, "sha256": hashlib.sha256(self.json.encode()).hexdigest(),
                "eos_token": self.eos_token, "bos_token": self.bos_token}


# --------------------------------------------------------------------------------------------------
# An HF model directory


def read_text(path: str) -> str:
    """The UTF-8 text of the tokenizer file `path`; refused in one line, before it is read, when it is
    larger than MAX_TOKENIZER_BYTES, and when it is not UTF-8."""
    size = tf.io.gfile.stat(path).length
    if size > MAX_TOKENIZER_BYTES:
        raise UserError(f"{path} is {size:,} bytes, more than the {MAX_TOKENIZER_BYTES:,} a tokenizer file may have "
                        "(the largest published tokenizer.json is 33 MB); give the tokenizer files that came with the "
                        "checkpoint")
    raw = files.read_regular(path, MAX_TOKENIZER_BYTES, "the tokenizer file", "give the tokenizer files that came "
                             "with the checkpoint", follow_links=True)  # a regular file (not a FIFO), bounded
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); give the tokenizer "
                        "files that came with the checkpoint") from None



def parse_json(text: str):
    """json.loads, with ValueError for anything it cannot parse: nesting thousands deep is a
    RecursionError in Python's parser."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _read_json(path: str) -> dict:
    try:
        value = parse_json(read_text(path))
    except ValueError as e:
        raise UserError(f"{path} is not valid JSON ({str(e)[:80]}); restore it from the checkpoint's files") from None
    if not isinstance(value, dict):
        raise UserError(f"{path} is not a JSON object; restore it from the checkpoint's files")
    return value


def _gpt2_from_vocab_merges(folder: str) -> str:
    """GPT-2's vocab.json + merges.txt as a tokenizer.json: the pipeline transformers' GPT2Converter builds."""
    tokenizers = import_tokenizers()
    from tokenizers import decoders, models, pre_tokenizers, processors

    vocab = _read_json(os.path.join(folder, "vocab.json"))
    merges = [tuple(line.split(" ")) for line in read_text(os.path.join(folder, "merges.txt")).splitlines()
              if line and not line.startswith("#version")]
    try:
        tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, continuing_subword_prefix="",
                                              end_of_word_suffix="", fuse_unk=False))
    except BaseException as e:  # noqa: B036 (see _library_error)
        raise UserError(f"{folder}: vocab.json and merges.txt do not make a BPE tokenizer "
                        f"({_library_error(e)}); restore them from the checkpoint's files") from None
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok.to_str()


def _with_config_specials(tok, config: dict) -> str:
    """Give `tok` what transformers adds on loading, and return its JSON: the special tokens that
    tokenizer_config.json names, as special added tokens (so that their text is one id). What is added
    around a text is tokenizer.json's post-processor: transformers 5 ignores the config's add_bos_token
    and add_eos_token (4.x applied them for some classes; Llama-2's agree with its tokenizer.json)."""
    from tokenizers import AddedToken

    have = {t.content for t in tok.get_added_tokens_decoder().values()}
    wanted = [AddedToken(d["content"], special=bool(d.get("special", True)), lstrip=bool(d.get("lstrip", False)),
                         rstrip=bool(d.get("rstrip", False)), normalized=bool(d.get("normalized", False)),
                         single_word=bool(d.get("single_word", False)))
              for _, d in sorted(config.get("added_tokens_decoder", {}).items(), key=lambda kv: int(kv[0]))
              if isinstance(d, dict) and d.get("content")]
    named = [_content(config.get(n)) for n in SPECIAL_NAMES]
    named += [_content(t) for key in SPECIAL_LISTS if isinstance(config.get(key), list) for t in config[key]]
    wanted += [AddedToken(t, special=True, normalized=False) for t in named if t]
    added = set()
    for token in wanted:
        if token.content not in have and token.content not in added:
            added.add(token.content)
            (tok.add_special_tokens if token.special else tok.add_tokens)([token])
    return tok.to_str()


def model_file(directory: str, spec: dict, path: str) -> str:
    """The path of the model file that our spec `spec` (read from `path`) names: a plain file name in
    `directory`, so a spec from elsewhere (a copied shard directory) cannot make us read another file."""
    name = spec.get("model")
    if not isinstance(name, str) or name in ("", ".", "..") or os.path.basename(name) != name or "\\" in name:
        raise UserError(f"{path} names the model file {name!r}, which is not a file name in {directory}; restore it "
                        "from a copy of the directory, or move the run directory away to start over")
    model = os.path.join(directory, name)
    if not tf.io.gfile.exists(model):
        raise UserError(f"{path} names {name}, which is not in {directory}; restore it from a copy of the "
                        "directory, or move the run directory away to start over")
    return model


def from_spec(directory: str, spec: dict, path: str) -> HFTokenizer:
    """The hf tokenizer that our spec `spec` (read from `path`, tokenizer.json) names in `directory`."""
    if (not isinstance(spec, dict) or "model" not in spec or not isinstance(spec.get("eos_token"), str)
            or not isinstance(spec.get("bos_token"), (str, type(None)))):
        raise UserError(f"{path} is not a readable tokenizer file (kind hf without model and eos_token); restore it "
                        "from a copy of the run directory (or the shards' tokenizer.json), or move the run directory "
                        "away to start over")
    model = model_file(directory, spec, path)
    return HFTokenizer(read_text(model), spec["eos_token"], spec.get("bos_token"), source=model)


def load_hf_tokenizer(path: str) -> HFTokenizer:
    """The tokenizer of a Hugging Face model directory (or of a tokenizer.json file in one).

    Reads, in this order: `tokenizer.json`; or GPT-2's `vocab.json` + `merges.txt`. Special tokens come
    from `tokenizer_config.json` (else `special_tokens_map.json`), added as transformers adds them
    (`_with_config_specials`); the end-of-text token is the config's `eos_token`, else the first of
    `EOS_GUESSES` in the vocabulary; the beginning-of-text token is the config's `bos_token` (GPT-2's is
    its EOS, `<|endoftext|>`). The result's `eos_id`, `bos_id` (None without one) and `add_bos` (whether
    encode prepends it) are what generation_config.json and the model config need.
    A run or shard directory of ours (its tokenizer.json is our spec of kind hf) is read with
    `from_spec`, so `data prepare --tokenizer hf --tokenizer_model RUN_DIR` reuses an imported run's.
    A directory with only SentencePiece's `tokenizer.model` (Llama-2-era) is refused in one line: the
    sentencepiece kind would not prepend Llama's BOS, so the data would not match the model's training.
    """
    if not path:
        raise UserError("data.tokenizer=hf needs data.tokenizer_model: an HF model directory or its tokenizer.json "
                        "(--tokenizer_model for `data prepare`)")
    if not tf.io.gfile.exists(path):
        raise UserError(f"data.tokenizer_model={path!r} does not exist; give an HF model directory or its "
                        "tokenizer.json")
    folder, file = (path, "") if tf.io.gfile.isdir(path) else (os.path.dirname(path), path)
    if not file and tf.io.gfile.exists(os.path.join(folder, SPEC_FILE)):
        file = os.path.join(folder, SPEC_FILE)
    if file:
        text = read_text(file)
        try:
            ours = parse_json(text).get("kind") if text.lstrip().startswith("{") else None
        except (ValueError, AttributeError):
            ours = None  # not ours: the tokenizers library reads it, or says why it cannot
        if ours is not None:  # one of our run or shard directories
            if ours != "hf":
                raise UserError(f"{file} is a tpu-llm tokenizer of kind {ours}, not hf; give an HF model directory")
            return from_spec(folder, parse_json(text), file)
    elif all(tf.io.gfile.exists(os.path.join(folder, name)) for name in ("vocab.json", "merges.txt")):
        text = _gpt2_from_vocab_merges(folder)
        file = os.path.join(folder, "vocab.json")
    elif tf.io.gfile.exists(os.path.join(folder, "tokenizer.model")):
        convert = f"t.AutoTokenizer.from_pretrained('{folder}').save_pretrained('{folder}')"
        raise UserError(f"{folder} has only a SentencePiece tokenizer.model, no tokenizer.json; write one with "
                        f"`python -c \"import transformers as t; {convert}\"` (transformers converts it) and retry")
    else:
        raise UserError(f"{folder} has no tokenizer.json (nor GPT-2's vocab.json + merges.txt); give the directory the "
                        "checkpoint came in, with its tokenizer files")
    config: dict = {}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if tf.io.gfile.exists(os.path.join(folder, name)):
            config = {**_read_json(os.path.join(folder, name)), **config}  # tokenizer_config.json wins
    tok = _parse(text, file)
    try:
        text = _with_config_specials(tok, config)
    except BaseException as e:  # noqa: B036 (e.g. a template naming a token the vocabulary lacks; _library_error)
        raise UserError(f"{folder}: the special tokens of its tokenizer_config.json do not fit its tokenizer "
                        f"({_library_error(e)}); restore the checkpoint's tokenizer files") from None
    vocab = tok.get_vocab(with_added_tokens=True)
    eos = _content(config.get("eos_token")) or next((t for t in EOS_GUESSES if t in vocab), None)
    if eos is None:
        raise UserError(f"{folder}: no end-of-text token (no eos_token in tokenizer_config.json, none of "
                        f"{', '.join(EOS_GUESSES)} in the vocabulary); add eos_token to tokenizer_config.json")
    return HFTokenizer(text, eos, _content(config.get("bos_token")), source=file)


def write_hf_tokenizer(tok: HFTokenizer, folder: str, model_max_length: int | None = None) -> list[str]:
    """Write `tok` as Hugging Face tokenizer files into `folder` (an export directory); returns their names.

    `tokenizer.json` is the whole tokenizer; `tokenizer_config.json` names the class
    `PreTrainedTokenizerFast`, which every transformers version loads from tokenizer.json as it is (a
    model class such as LlamaTokenizer would rebuild parts of it in transformers 5), and the special
    tokens, without add_bos_token/add_eos_token (in transformers 4.x those could replace the
    post-processor, which already adds what the model expects). So `AutoTokenizer.from_pretrained(folder)(text)["input_ids"]` equals
    `tok.encode(text)` (plus the trailing EOS, for a post-processor that appends one).
    """
    tf.io.gfile.makedirs(folder)
    specials = {"eos_token": tok.eos_token}
    if tok.bos_token:
        specials["bos_token"] = tok.bos_token
    model = json.loads(tok.json).get("model", {})
    if model.get("unk_token"):
        specials["unk_token"] = model["unk_token"]
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **specials, "clean_up_tokenization_spaces": False}
    if model_max_length:
        config["model_max_length"] = int(model_max_length)
    files = {"tokenizer.json": tok.json, "tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False),
             "special_tokens_map.json": json.dumps(specials, indent=2, ensure_ascii=False)}
    for name, text in files.items():
        with tf.io.gfile.GFile(os.path.join(folder, name), "w") as f:
            f.write(text)
    return list(files)


def check_pretokenized(kind: str, sources, text: str = "", model: str = "") -> None:
    """Training with data.tokenizer=hf reads TFRecord shards only (see the module docstring). `text` and
    `model` (data.train, data.tokenizer_model) go into the command the refusal names, as given."""
    if kind == "hf" and any(s.format == "text" for s in sources):
        text, model = shlex.quote(text) if text else "FILES", shlex.quote(model) if model else "DIR"
        raise UserError("data.tokenizer=hf trains on pre-tokenized shards only (Hugging Face's tokenizers run in Python, "
                        "which the input pipelines of TPU hosts and remote workers cannot call); run `tpu-llm data prepare "
                        f"--tokenizer hf --input {text} --output SHARDS --tokenizer_model {model}` first, then train with "
                        "--data.train='SHARDS/*.tfrecord'")
