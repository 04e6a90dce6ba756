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
"""

from __future__ import annotations

import json
import os
import struct
from typing import Callable, Iterable

import ml_dtypes
import numpy as np
import tensorflow as tf

from tpu_llm.errors import UserError

DTYPES = {"F32": np.dtype(np.float32), "BF16": np.dtype(ml_dtypes.bfloat16), "F16": np.dtype(np.float16),
          "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "U8": np.dtype(np.uint8), "BOOL": np.dtype(bool)}
CODES = {dtype: code for code, dtype in DTYPES.items()}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_MAX_HEADER = 100 << 20  # the reference implementation's own limit


def _read_header(path: str) -> tuple[dict, int]:
    """(the JSON header, where the data starts) of the safetensors file at `path`."""
    with tf.io.gfile.GFile(path, "rb") as f:
        head = f.read(8)
        size = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < size <= _MAX_HEADER:
            raise UserError(f"{path} is not a safetensors file (bad header length); download it again")
        try:
            header = json.loads(f.read(size))
        except ValueError:
            raise UserError(f"{path} has a truncated or corrupt safetensors header; download it again") from None
    return header, 8 + size


class Reader:
    """The tensors of a checkpoint directory: `model.safetensors`, or the shards its index names."""

    def __init__(self, directory: str):
        self.directory = directory
        self.where: dict[str, tuple[str, dict, int]] = {}  # name -> (file, header entry, data start)
        index = os.path.join(directory, INDEX_FILE)
        if tf.io.gfile.exists(index):
            with tf.io.gfile.GFile(index) as f:
                weight_map = json.load(f).get("weight_map", {})
            files = sorted(set(weight_map.values()))
        elif tf.io.gfile.exists(os.path.join(directory, SINGLE_FILE)):
            files = [SINGLE_FILE]
        else:
            raise UserError(f"{directory} has neither {SINGLE_FILE} nor {INDEX_FILE}; download the model's "
                            "safetensors weights (pytorch_model.bin is not read)")
        for name in files:
            path = os.path.join(directory, name)
            if not tf.io.gfile.exists(path):
                raise UserError(f"{INDEX_FILE} names shard {name}, which is not in {directory}; download every shard")
            header, start = _read_header(path)
            for key, entry in header.items():
                if key != "__metadata__":
                    self.where[key] = (path, entry, start)

    def names(self) -> list[str]:
        return sorted(self.where)

    def dtype(self, name: str) -> str:
        return self.where[name][1]["dtype"]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.where[name][1]["shape"])

    def get(self, name: str) -> np.ndarray:
        """The tensor `name`, in its stored dtype (bfloat16 stays bfloat16)."""
        path, entry, start = self.where[name]
        if entry["dtype"] not in DTYPES:
            raise UserError(f"{path}: tensor {name} has dtype {entry['dtype']}; supported: {', '.join(DTYPES)}")
        begin, end = entry["data_offsets"]
        with tf.io.gfile.GFile(path, "rb") as f:
            f.seek(start + begin)
            raw = f.read(end - begin)
        dtype = DTYPES[entry["dtype"]]
        if len(raw) != end - begin or len(raw) != dtype.itemsize * int(np.prod(entry["shape"], dtype=np.int64)):
            raise UserError(f"{path} is truncated (tensor {name}); download it again")
        return np.frombuffer(raw, dtype=dtype.newbyteorder("<")).reshape(entry["shape"])


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


def write_all(path: str, tensors: Iterable[tuple[str, np.ndarray]]) -> None:
    """Write already-made arrays (tests)."""
    tensors = dict(tensors)
    write(path, [(k, v.shape, v.dtype) for k, v in tensors.items()], tensors.__getitem__)
