"""The safetensors file format, read and written tensor by tensor with numpy (no torch, no copy of the
whole file in memory).

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON
({name: {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, "__metadata__": {..}}), then the
raw little-endian tensor bytes, offsets counted from the end of the header. A sharded checkpoint adds
`model.safetensors.index.json` ({"weight_map": {name: shard file}}). bfloat16 is numpy's
`ml_dtypes.bfloat16` (ml_dtypes comes with TensorFlow).

Reading opens the file once per tensor and reads only that tensor's bytes, so importing a model holds
one tensor at a time beside the model's variables; writing computes every offset first from the shapes,
then writes each tensor as it is produced. Both go through tf.io.gfile, so `gs://` paths work. That is why
this module exists beside the `safetensors` library, the format's reference (tests/test_safetensors_io.py
checks this module against it): the library reads a local file (or a whole file's bytes) and writes from
every tensor at once.

The files come from outside (a download), so nothing in them is trusted: `read_header` checks a whole
header before any tensor is read (at most MAX_HEADER bytes and inside the file; a JSON object whose
entries each have a known dtype, a shape of non-negative integers and offsets inside the data spanning
exactly the bytes of that shape and dtype, no two tensors overlapping), and a shard index may name only
files inside the checkpoint directory. Each failure is one UserError naming the file, the tensor and
what is wrong, before anything is read out of bounds or allocated from a size the file claims.
"""

from __future__ import annotations

import json
import math
import os
import reprlib
import struct
from typing import Callable

import ml_dtypes
import numpy as np
import tensorflow as tf

from tpu_llm.errors import UserError
from tpu_llm.platform import files

DTYPES = {"F32": np.dtype(np.float32), "BF16": np.dtype(ml_dtypes.bfloat16), "F16": np.dtype(np.float16),
          "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "U8": np.dtype(np.uint8), "BOOL": np.dtype(bool)}
CODES = {dtype: code for code, dtype in DTYPES.items()}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Every dtype of the format (the reference's list, whole-byte ones), with its size: a file holding one
# we do not read (F64, say) is still checked in full, and refused by `get` only for that tensor.
ITEMSIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2,
             "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8}
MAX_HEADER = 100 << 20  # bytes of JSON header: the reference implementation's own limit
MAX_INDEX = 100 << 20  # bytes of model.safetensors.index.json (a 405B model's is about 100 KB)
MAX_RANK = 32  # dimensions of one tensor: numpy's limit (1.x; 2.x allows 64); real weights have at most 5
_FIX = "download the file again (it is damaged, or not a safetensors file)"


def _fail(path: str, what: str) -> UserError:
    return UserError(f"{path}: {what}; {_FIX}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON true is not a size


def _unique_keys(pairs: list) -> dict:
    """json's object_pairs_hook: a name given twice would hide the first tensor's bytes from every check."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen = set()
        twice = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"the name {twice!r} appears twice")
    return out


_REPR = reprlib.Repr()  # a value of the header in a message: cut short, however long or deep it is
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 2, 40, 40, 40


def _short(value) -> str:
    return _REPR.repr(value)


def _check_entry(path: str, name: str, entry, data_size: int) -> tuple[int, int]:
    """(begin, end) of the tensor `name` once its header entry is known sound: a known dtype, a shape
    of non-negative ints, offsets inside the data, exactly the bytes the shape and dtype need."""
    where = f"tensor {name!r}"
    if not isinstance(entry, dict):
        raise _fail(path, f"{where} is {type(entry).__name__} {_short(entry)} in the header, not an object with "
                          "dtype, shape and data_offsets")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in ITEMSIZES:
        raise _fail(path, f"{where} has dtype {_short(dtype)}, which safetensors does not define "
                          f"({', '.join(ITEMSIZES)})")
    if (not isinstance(shape, list) or len(shape) > MAX_RANK
            or not all(_is_int(d) and d >= 0 for d in shape)):
        raise _fail(path, f"{where} has shape {_short(shape)}; a shape is a list of at most {MAX_RANK} "
                          "non-negative integers")
    if math.prod(max(d, 1) for d in shape) * ITEMSIZES[dtype] >= 2**63:  # numpy's strides: even with a 0 in it
        raise _fail(path, f"{where} has shape {_short(shape)}, too large for any array")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets):
        raise _fail(path, f"{where} has data_offsets {_short(offsets)}; they are two integers [begin, end]")
    begin, end = offsets
    if not 0 <= begin <= end <= data_size:
        raise _fail(path, f"{where} has data_offsets [{begin}, {end}], outside the file's {data_size} bytes of "
                          "data (0 <= begin <= end <= data size)")
    need = ITEMSIZES[dtype] * math.prod(shape)  # Python integers: no overflow, whatever the shape
    if end - begin != need:
        raise _fail(path, f"{where} spans {end - begin} bytes (data_offsets [{begin}, {end}]), but {dtype} of "
                          f"shape {shape} is {need} bytes")
    return begin, end


def read_header(path: str) -> tuple[dict, int]:
    """(the tensors' header entries by name, where the data starts) of the safetensors file at `path`,
    every entry checked against the file before any tensor is read; a UserError names the file, the
    tensor and what is wrong. `__metadata__` (text to text) is left out."""
    if "://" not in path:  # a regular file (a FIFO would block the read below; the HF cache's links are followed)
        os.close(files.open_regular(path, "the safetensors file", follow_links=True))
    try:
        file_size = tf.io.gfile.stat(path).length
        with tf.io.gfile.GFile(path, "rb") as f:
            head = f.read(8)
            size = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if not 0 < size <= min(MAX_HEADER, file_size - 8):  # before reading (or allocating) that much
                why = "the file is shorter than 8 bytes" if size < 0 else (
                    f"header length {size} > the {MAX_HEADER} bytes allowed" if size > MAX_HEADER else
                    f"header length {size}, file {file_size} bytes" if size else "header length 0")
                raise _fail(path, f"not a safetensors file ({why})")
            raw = f.read(size)
    except tf.errors.OpError as e:  # a directory, no permission
        raise UserError(f"{path} cannot be read ({str(e).splitlines()[0][:100]}); check the path") from None
    try:
        header = json.loads(raw, object_pairs_hook=_unique_keys)
    except (ValueError, RecursionError) as e:  # RecursionError: JSON nested thousands deep
        reason = str(e).splitlines()[0][:100] if isinstance(e, ValueError) else "nested too deeply"
        raise _fail(path, f"the safetensors header is not valid JSON ({reason})") from None
    if not isinstance(header, dict):
        raise _fail(path, f"the safetensors header is a JSON {type(header).__name__}, not an object")
    metadata = header.pop("__metadata__", None)
    metadata = {} if metadata is None else metadata  # null: none, as the reference reads it
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _fail(path, "its __metadata__ is not an object of text values")
    data_size = file_size - 8 - size
    spans = sorted((_check_entry(path, name, entry, data_size), name) for name, entry in header.items())
    end, last = 0, ""
    for (begin, stop), name in spans:
        if begin == stop:  # an empty tensor reads no bytes: it cannot overlap anything
            continue
        if begin < end:
            raise _fail(path, f"tensors {last!r} and {name!r} overlap (data_offsets up to {end} and from {begin})")
        end, last = stop, name
    return header, 8 + size


def _confined(directory: str, name, named_by: str) -> str:
    """The path of the weights file `name` in `directory` (named by the file `named_by`), refused unless
    it stays inside `directory`: a downloaded index must not make import read files from elsewhere (an
    absolute path, `..`, a link out). A link into a Hugging Face cache's blobs/ is inside: a cache's
    snapshot folders hold links (models--ORG--NAME/snapshots/REV/model.safetensors -> ../../blobs/HASH)."""
    parts = name.replace("\\", "/").split("/") if isinstance(name, str) else []
    if (not parts or "://" in name or os.path.isabs(name) or any(p in ("", ".", "..") for p in parts)
            or parts[0][1:2] == ":" or "\0" in name):  # a Windows drive, C:; a NUL (os.stat: ValueError)
        raise UserError(f"{named_by} names shard {_short(name)}; a shard is a file inside {directory} (no absolute "
                        "path, no .., no NUL byte); download the checkpoint again")
    path = os.path.join(directory, name)
    if "://" not in directory:  # a local directory: follow links (object stores have none)
        root = os.path.realpath(directory)
        snapshots, _ = os.path.split(root)
        model_folder, folder_name = os.path.split(snapshots)
        if folder_name == "snapshots" and os.path.basename(model_folder).startswith("models--"):
            root = model_folder  # the cached model's folder, whose blobs/ the snapshot links into
        real = os.path.realpath(path)
        if os.path.commonpath([root, real]) != root:
            raise UserError(f"{path} is a link to {real}, outside {directory}; copy the file itself into the "
                            "checkpoint directory")
    return path


class Reader:
    """The tensors of a checkpoint directory: `model.safetensors`, or the shards its index names.

    Every header is read and checked when the Reader is made (read_header): the names, dtypes and
    shapes it then reports are sound, and `get` reads only bytes inside the file."""

    def __init__(self, directory: str, single: str = SINGLE_FILE):
        """`single`: the one file to read instead of the model's (a PEFT adapter's adapter_model.safetensors)."""
        self.directory = directory
        self.where: dict[str, tuple[str, dict, int]] = {}  # name -> (file, header entry, data start)
        index = os.path.join(directory, INDEX_FILE)
        if single == SINGLE_FILE and tf.io.gfile.exists(index):
            files = sorted(set(_weight_map(index).values()))
        elif tf.io.gfile.exists(os.path.join(directory, single)):
            files = [single]
        elif single != SINGLE_FILE:
            raise UserError(f"{directory} has no {single}; give the directory PEFT's save_pretrained wrote")
        else:
            raise UserError(f"{directory} has neither {SINGLE_FILE} nor {INDEX_FILE}; download the model's "
                            "safetensors weights (pytorch_model.bin is not read)")
        for name in files:
            path = _confined(directory, name, INDEX_FILE)
            if not tf.io.gfile.exists(path):
                raise UserError(f"{INDEX_FILE} names shard {name}, which is not in {directory}; download every shard")
            header, start = read_header(path)
            for key, entry in header.items():
                if key in self.where:
                    raise UserError(f"tensor {key!r} is in both {self.where[key][0]} and {path}; download the "
                                    "checkpoint again")
                self.where[key] = (path, entry, start)

    def names(self) -> list[str]:
        return sorted(self.where)

    def file(self, name: str) -> str:
        """The file that holds the tensor `name` (a shard's, or model.safetensors)."""
        return self.where[name][0]

    def dtype(self, name: str) -> str:
        return self.where[name][1]["dtype"]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.where[name][1]["shape"])

    def get(self, name: str) -> np.ndarray:
        """The tensor `name`, in its stored dtype (bfloat16 stays bfloat16)."""
        path, entry, start = self.where[name]
        if entry["dtype"] not in DTYPES:
            raise UserError(f"{path}: tensor {name} has dtype {entry['dtype']}; supported: {', '.join(DTYPES)}")
        begin, end = entry["data_offsets"]  # checked by read_header: inside the file, the shape's size
        with tf.io.gfile.GFile(path, "rb") as f:
            f.seek(start + begin)
            raw = f.read(end - begin)
        if len(raw) != end - begin:  # the file shrank since its header was read
            raise UserError(f"{path} is truncated (tensor {name}); download it again")
        return np.frombuffer(raw, dtype=DTYPES[entry["dtype"]].newbyteorder("<")).reshape(entry["shape"])


def read_capped(path: str, cap: int, what: str, fix: str) -> bytes:
    """The bytes of `path` (local or gs://), refused in one line before reading when over `cap` bytes."""
    size = tf.io.gfile.stat(path).length
    if size > cap:
        raise UserError(f"{path} is {size:,} bytes, more than the {cap:,} {what} may have; {fix}")
    return files.read_regular(path, cap, what, fix, follow_links=True)  # a regular file (not a FIFO), bounded


def _weight_map(index: str) -> dict[str, str]:
    """The weight_map of the shard index `index` (tensor name -> shard file), checked for its shape."""
    raw = read_capped(index, MAX_INDEX, "an index", "download it again")
    try:
        weight_map = json.loads(raw).get("weight_map", {})
    except (ValueError, RecursionError, AttributeError):
        weight_map = None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise UserError(f"{index} is not a shard index (a JSON object whose weight_map maps tensor names to shard "
                        "files); download it again")
    return weight_map


def write(path: str, specs: list[tuple[str, tuple[int, ...], np.dtype]], produce: Callable[[str], np.ndarray],
          metadata: dict[str, str] | None = None) -> None:
    """Write the tensors `specs` (name, shape, dtype), in that order, to the safetensors file `path`;
    `produce(name)` gives each one when its turn comes (so only one is held at a time)."""
    header, offset = {}, 0
    for name, shape, dtype in specs:
        size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        header[name] = {"dtype": CODES[np.dtype(dtype)], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {"format": "pt", **(metadata or {})}  # transformers refuses a file without it
    if not all(isinstance(v, str) for kv in header["__metadata__"].items() for v in kv):
        raise TypeError(f"safetensors metadata maps text to text: {metadata}")  # readers reject anything else
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with tf.io.gfile.GFile(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for name, shape, dtype in specs:
            # asarray, not ascontiguousarray: that one turns a 0-d tensor into shape (1,)
            array = np.asarray(produce(name), dtype=np.dtype(dtype).newbyteorder("<"), order="C")
            assert array.shape == tuple(shape), (name, array.shape, shape)
            f.write(array.tobytes())
