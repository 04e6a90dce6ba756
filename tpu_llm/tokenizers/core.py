"""The tokenizers of our own: byte-level, character-level and SentencePiece, applied with TF ops inside tf.data.

Every tokenizer turns a batch of strings into a RaggedTensor of int32 ids on the host CPU
(`encode_tf`), never inside the training step. It is saved into the run directory
(`tokenizer.json`, plus `tokenizer.model` for SentencePiece) so `generate` and resumed runs use
exactly the one the model was trained with.

- byte: ids 0..255 are the raw UTF-8 bytes, 256 is end-of-text. Lossless for any input, including
  invalid UTF-8.
- char: one id per Unicode character seen in the data, then end-of-text and unknown.
- sentencepiece: a model trained by `tpu-llm tokenizer train` (BPE with byte fallback), applied with
  tensorflow-text's SentencepieceTokenizer.
- hf: the tokenizer.json of a Hugging Face checkpoint (GPT-2, Llama), applied with Hugging Face's
  `tokenizers` in Python: for `data prepare` and `generate`, never on text while training (tpu_llm/tokenizers/hf.py).

Byte and char run on core TensorFlow ops only: a remote TPU host (a pod's TF servers, `tpu=grpc://`)
runs the input pipeline in a TF server that has no tensorflow-text ops, and a TPU environment cannot
install tensorflow-text at all (it depends on the CPU `tensorflow` wheel, which would overwrite
tensorflow-tpu's files). Only SentencePiece needs it: the `sentencepiece` extra (`REMOTE_OK` says which
kinds a remote host can run).
"""

from __future__ import annotations

import hashlib
import os

import tensorflow as tf

from tpu_llm.errors import UserError
from tpu_llm.platform.native_log import SENTENCEPIECE_INFO, dropping_native_lines
from tpu_llm.platform.run_layout import SP_MODEL_FILE, SPEC_FILE

REMOTE_OK = ("byte", "char")  # kinds whose encode_tf uses core TF ops only (runs in any TF server)


class ByteTokenizer:
    kind = "byte"
    vocab_size = 257
    eos_id = 256

    def encode_tf(self, texts: tf.Tensor) -> tf.RaggedTensor:
        """The same ids as tensorflow-text's ByteSplitter, from core ops: `bytes_split` cuts each string
        into one-byte strings, `decode_raw` reads each as a uint8."""
        pieces = tf.strings.bytes_split(texts)  # (batch, None) of 1-byte strings; (None,) for a scalar

        def ids(flat):  # (n,) 1-byte strings -> (n,) int32
            return tf.cast(tf.reshape(tf.io.decode_raw(flat, tf.uint8), [-1]), tf.int32)

        return tf.ragged.map_flat_values(ids, pieces) if isinstance(pieces, tf.RaggedTensor) else ids(pieces)

    def encode(self, text: str | bytes) -> list[int]:
        return list(text.encode("utf-8") if isinstance(text, str) else text)

    def missing(self, text: str) -> list[str]:
        """Characters of `text` this tokenizer cannot represent (bytes cover everything)."""
        return []

    def decode_bytes(self, ids) -> bytes:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256)

    def decode(self, ids) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def spec(self) -> dict:
        return {"kind": self.kind}


class CharTokenizer:
    """Characters seen in the data get ids 0..n-1 in code-point order; then end-of-text, unknown."""

    kind = "char"

    def __init__(self, chars: str):
        self.chars = "".join(sorted(set(chars)))
        self.eos_id = len(self.chars)
        self.unk_id = len(self.chars) + 1
        self.vocab_size = len(self.chars) + 2
        self._ids = {ch: i for i, ch in enumerate(self.chars)}
        self._table = None

    @classmethod
    def from_files(cls, files: list[str]) -> "CharTokenizer":
        chars: set[str] = set()
        for path in files:
            with tf.io.gfile.GFile(path, "rb") as f:
                chars.update(f.read().decode("utf-8", errors="replace"))
        return cls("".join(chars))

    def encode_tf(self, texts: tf.Tensor) -> tf.RaggedTensor:
        if self._table is None:  # built lazily, but eagerly (init_scope): every graph can capture it
            with tf.init_scope():
                keys = tf.constant([ord(c) for c in self.chars], tf.int32)
                values = tf.range(len(self.chars), dtype=tf.int32)
                self._table = tf.lookup.StaticHashTable(
                    tf.lookup.KeyValueTensorInitializer(keys, values), default_value=self.unk_id)
        codepoints = tf.strings.unicode_decode(texts, "UTF-8", errors="replace")
        return tf.ragged.map_flat_values(self._table.lookup, codepoints)

    def encode(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return [self._ids.get(ch, self.unk_id) for ch in text]

    def missing(self, text: str) -> list[str]:
        """Characters of `text` outside the vocabulary (each once, in order): they would become the
        unknown id, which training never showed the model (the vocabulary holds every training character)."""
        return list(dict.fromkeys(ch for ch in text if ch not in self._ids))

    def decode(self, ids) -> str:
        return "".join(self.chars[i] if i < len(self.chars) else "\ufffd" if i == self.unk_id else ""
                       for i in (int(i) for i in ids))

    def spec(self) -> dict:
        return {"kind": self.kind, "chars": self.chars}


class SentencePieceTokenizer:
    kind = "sentencepiece"

    def __init__(self, model_proto: bytes, source: str = ""):
        import sentencepiece as spm

        self.model_proto = model_proto
        try:
            self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
        except Exception:  # sentencepiece raises a bare RuntimeError with a C++ message
            raise UserError(f"{source or 'tokenizer'}: not a SentencePiece model; make one with "
                            "`tpu-llm tokenizer train --input ... --vocab_size N`") from None
        self._tf = None  # tensorflow-text's op, made by the first encode_tf: shards need no tensorflow-text
        self.vocab_size = self._sp.get_piece_size()
        self.eos_id = self._sp.eos_id()
        if self.eos_id < 0:
            raise UserError(f"{source}: the SentencePiece model has no end-of-text piece; "
                            "retrain it with `tpu-llm tokenizer train`")

    @classmethod
    def from_file(cls, path: str) -> "SentencePieceTokenizer":
        if not tf.io.gfile.exists(path) or tf.io.gfile.isdir(path):
            what = "is a directory" if tf.io.gfile.exists(path) else "does not exist"
            raise UserError(f"data.tokenizer_model={path!r} {what}; give a .model file, or train one with "
                            "`tpu-llm tokenizer train --input ... --vocab_size N --output PATH`")
        with tf.io.gfile.GFile(path, "rb") as f:
            return cls(f.read(), source=path)

    def encode_tf(self, texts: tf.Tensor) -> tf.RaggedTensor:
        if self._tf is None:  # eagerly (init_scope), so that every graph can capture it
            tf_text = import_tensorflow_text()
            # its SentencePiece copy logs `normalizer.cc(51) LOG(INFO) ...` as the op is built
            with tf.init_scope(), dropping_native_lines(SENTENCEPIECE_INFO):
                self._tf = tf_text.SentencepieceTokenizer(model=self.model_proto, out_type=tf.int32)
        return self._tf.tokenize(texts)

    def encode(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return list(self._sp.encode(text))

    def missing(self, text: str) -> list[str]:
        """Characters of `text` that encode to the unknown piece (none with byte fallback)."""
        unk = self._sp.unk_id()
        return list(dict.fromkeys(ch for ch in dict.fromkeys(text) if unk in self._sp.encode(ch)))

    def decode(self, ids) -> str:
        return self._sp.decode([int(i) for i in ids if int(i) != self.eos_id])

    def spec(self) -> dict:
        return {"kind": self.kind, "model": SP_MODEL_FILE,
                "sha256": hashlib.sha256(self.model_proto).hexdigest()}


Tokenizer = ByteTokenizer | CharTokenizer | SentencePieceTokenizer  # | tokenizers.hf.HFTokenizer


def import_tensorflow_text():
    """tensorflow_text, or a one-line UserError naming the extra that installs it."""
    try:
        import tensorflow_text
    except ImportError:
        raise UserError("data.tokenizer=sentencepiece needs tensorflow-text, which is not installed: pip install "
                        "'tpu-llm[cpu,sentencepiece]' (not on a TPU VM: it pulls in the CPU tensorflow wheel; there, "
                        "use data.tokenizer=byte or char, or shards from `tpu-llm data prepare` made elsewhere)") from None
    return tensorflow_text


def check_covers(tokenizer: Tokenizer, text: str, what: str) -> None:
    """UserError naming the characters of `text` (a prompt) that `tokenizer` cannot represent. Not a
    warning: they would become the unknown id, which the model never saw in training (a char vocabulary
    holds every character of its training data), so the sample would follow a prompt nobody wrote."""
    missing = tokenizer.missing(text) if text else []
    if missing:
        shown = ", ".join(repr(c) for c in missing[:20]) + (", ..." if len(missing) > 20 else "")
        raise UserError(f"{what} has {len(missing)} character(s) that the run's {tokenizer.kind} vocabulary does "
                        f"not hold: {shown}; remove or replace them (the model never saw them)")


def train_sentencepiece(files: list[str], vocab_size: int, output: str,
                        max_sentences: int = 2_000_000) -> SentencePieceTokenizer:
    """Train a BPE SentencePiece model with byte fallback on the lines of `files`.

    Normalisation is the identity and whitespace is kept as is, so decode(encode(text)) == text for
    any UTF-8 text (byte fallback covers characters the vocabulary lacks).
    """
    import io

    import sentencepiece as spm

    def lines():
        count = 0
        for path in files:
            with tf.io.gfile.GFile(path, "rb") as f:
                for line in f:
                    line = line.decode("utf-8", errors="replace").rstrip("\n")
                    if line.strip():
                        yield line
                        count += 1
                        if count >= max_sentences:
                            return

    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=lines(), model_writer=model, vocab_size=vocab_size, model_type="bpe",
            byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
            add_dummy_prefix=False, allow_whitespace_only_pieces=True, split_digits=True,
            user_defined_symbols=["\n", "\t"], character_coverage=0.9995, num_threads=os.cpu_count(),
            unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    except RuntimeError as e:
        raise UserError(f"sentencepiece training failed: {str(e).splitlines()[-1].strip()}; "
                        "change --vocab_size as it says, or give more input text") from None
    tok = SentencePieceTokenizer(model.getvalue(), source=output)
    parent = os.path.dirname(output)
    if parent:
        tf.io.gfile.makedirs(parent)
    with tf.io.gfile.GFile(output, "wb") as f:
        f.write(tok.model_proto)
    return tok
