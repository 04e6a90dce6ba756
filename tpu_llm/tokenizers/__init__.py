"""Tokenizers: byte, char and SentencePiece (core.py) and Hugging Face's tokenizers (hf.py); building a
tokenizer from the config, and saving it into and loading it from a run, shard or export directory.

Every tokenizer turns a batch of strings into ids on the host CPU (`encode_tf` in tf.data, or `encode`
in Python for hf), never inside the training step. It is saved into the run directory
(`tokenizer.json`, our spec, plus its model file) so `generate` and resumed runs use exactly the one
the model was trained with.
"""

from __future__ import annotations

import hashlib
import json
import os
import reprlib

import tensorflow as tf

from tpu_llm.errors import UserError
from tpu_llm.platform.files import write_atomically
from tpu_llm.platform.run_layout import HF_FILE, SP_MODEL_FILE, SPEC_FILE
from tpu_llm.tokenizers import hf
from tpu_llm.tokenizers.core import (REMOTE_OK, ByteTokenizer, CharTokenizer, SentencePieceTokenizer, Tokenizer,
                                     check_covers, import_tensorflow_text, train_sentencepiece)
from tpu_llm.tokenizers.hf import HFTokenizer, check_pretokenized, load_hf_tokenizer, write_hf_tokenizer

__all__ = ["REMOTE_OK", "SP_MODEL_FILE", "SPEC_FILE", "HF_FILE", "ByteTokenizer", "CharTokenizer", "HFTokenizer",
           "SentencePieceTokenizer", "Tokenizer", "build_tokenizer", "check_covers", "check_pretokenized",
           "content_hash", "import_tensorflow_text", "load_hf_tokenizer", "load_tokenizer", "save_tokenizer",
           "train_sentencepiece", "write_hf_tokenizer"]


def build_tokenizer(kind: str, model_path: str = "", text_files: list[str] | None = None) -> Tokenizer:
    """A fresh tokenizer from the data config (char vocabularies are built from `text_files`)."""
    if kind == "byte":
        return ByteTokenizer()
    if kind == "char":
        if not text_files:
            raise UserError("data.tokenizer=char builds its vocabulary from text files, but the data "
                            "has none; use data.tokenizer=byte or point data.train at text files")
        return CharTokenizer.from_files(text_files)
    if kind == "sentencepiece":
        return SentencePieceTokenizer.from_file(model_path)
    if kind == "hf":
        return hf.load_hf_tokenizer(model_path)
    raise UserError(f"data.tokenizer={kind!r}; valid choices: byte, char, sentencepiece, hf")


def content_hash(tok: Tokenizer) -> str:
    """sha256 of the tokenizer's canonical serialization (its spec, keys sorted; a SentencePiece or Hugging
    Face spec holds its model file's own sha256): the same for the same ids, whoever wrote the file.
    Checkpoints record it (training/checkpoint.Checkpointer): a tokenizer.json replaced since, even by one
    of the same size, is refused on resume, generate and export."""
    return hashlib.sha256(json.dumps(tok.spec(), sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def save_tokenizer(tok: Tokenizer, run_dir: str) -> None:
    """`tok` into a run, shard or export directory: tokenizer.json (the spec) and its model file, if any
    (tokenizer.model for SentencePiece; hf_tokenizer.json, Hugging Face's tokenizer.json, for hf)."""
    tf.io.gfile.makedirs(run_dir)  # each file written whole and anew (a link at its name replaced, not written through)
    if isinstance(tok, SentencePieceTokenizer):
        write_atomically(os.path.join(run_dir, SP_MODEL_FILE), tok.model_proto)
    if tok.kind == "hf":
        write_atomically(os.path.join(run_dir, tok.spec()["model"]), tok.json)
    write_atomically(os.path.join(run_dir, SPEC_FILE), json.dumps(tok.spec(), ensure_ascii=False))


def load_tokenizer(run_dir: str) -> Tokenizer | None:
    """The tokenizer saved in `run_dir`, or None if the directory has none. The spec may come from
    elsewhere (a copied run or shard directory): its size, its JSON and its fields are checked, and the
    model file it names must be a file of `run_dir`; each failure is one UserError naming the file."""
    path = os.path.join(run_dir, SPEC_FILE)
    if not tf.io.gfile.exists(path):
        return None
    text = hf.read_text(path)
    types = {"kind": str, "chars": str, "model": str, "eos_token": str}
    try:  # a file torn by a kill or a full disk mid-write must not become a traceback
        spec = hf.parse_json(text)
        needs = {"byte": (), "char": ("chars",), "sentencepiece": ("model",), "hf": ("model", "eos_token")}
        if spec["kind"] not in needs or any(key not in spec for key in needs[spec["kind"]]):
            raise ValueError(f"kind {reprlib.repr(spec['kind'])} without {needs.get(spec['kind'], ('a known kind',))}")
        wrong = next((k for k in needs[spec["kind"]] if not isinstance(spec[k], types[k])), None)
        if wrong:
            raise ValueError(f"{wrong} is not text")
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"{path} is not a readable tokenizer file ({str(e)[:80]}); restore it from a copy of the run "
                        "directory (or the shards' tokenizer.json), or move the run directory away to start "
                        "over") from None
    if spec["kind"] == "byte":
        return ByteTokenizer()
    if spec["kind"] == "char":
        return CharTokenizer(spec["chars"])
    if spec["kind"] == "hf":
        return hf.from_spec(run_dir, spec, path)
    model = hf.model_file(run_dir, spec, path)
    size = tf.io.gfile.stat(model).length
    if size > hf.MAX_TOKENIZER_BYTES:
        raise UserError(f"{model} is {size:,} bytes, more than the {hf.MAX_TOKENIZER_BYTES:,} a tokenizer file may "
                        "have; restore it from a copy of the directory")
    with tf.io.gfile.GFile(model, "rb") as f:
        return SentencePieceTokenizer(f.read(), source=model)
