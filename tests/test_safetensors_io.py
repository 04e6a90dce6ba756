"""tpu_llm/interop/safetensors_io.py against the format's reference implementation, the `safetensors` library.

safetensors_io reads and writes the format itself (through tf.io.gfile, so gs:// paths work, one tensor at
a time); the library is the oracle here: every file our writer makes, the library reads with the same
names, dtypes, shapes and bytes (and our metadata), and every file the library makes (metadata included,
shards with an index too), our reader reads so. Every dtype our format code supports is covered
(bfloat16 is ml_dtypes', which the library's numpy API also uses), 0-d and empty tensors too, then a
seeded randomised round trip both ways over many shapes, dtypes and names.
"""

from __future__ import annotations

import json
import random
import struct

import ml_dtypes
import numpy as np
import pytest
from helpers import sample, write_safetensors

from tpu_llm.errors import UserError
from tpu_llm.interop import safetensors_io

safetensors = pytest.importorskip("safetensors", reason="the oracle is the safetensors library: pip install -e '.[hf]'")
from safetensors import safe_open  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402

DTYPES = sorted(safetensors_io.DTYPES)  # F32, BF16, F16, I64, I32, U8, BOOL


def assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]):
    assert sorted(got) == sorted(want)
    for name, array in want.items():
        assert (got[name].dtype, got[name].shape) == (array.dtype, array.shape), name
        assert got[name].tobytes() == array.tobytes(), name


def aligned(path) -> bool:
    """The data starts 8-byte aligned, as the library writes it (so a memory map can view it in place)."""
    with open(path, "rb") as f:
        return struct.unpack("<Q", f.read(8))[0] % 8 == 0


def read_ours(directory) -> dict[str, np.ndarray]:
    reader = safetensors_io.Reader(str(directory))
    out = {name: reader.get(name) for name in reader.names()}
    for name, array in out.items():  # the header accessors agree with the tensors
        assert reader.shape(name) == array.shape and safetensors_io.DTYPES[reader.dtype(name)] == array.dtype
    return out


def every_dtype() -> dict[str, np.ndarray]:
    rng = random.Random(1)
    tensors = {f"{code.lower()}.{shape}": sample(rng, code, shape)
               for code in DTYPES for shape in ((3, 5), (7,), (), (0,), (2, 0, 4))}
    tensors["bf16.values"] = np.array([1.5, -0.0, np.inf, -np.inf, np.nan, 3e38, 1e-40], ml_dtypes.bfloat16)
    tensors["f16.values"] = np.array([65504, -0.0, np.inf, np.nan, 6e-8], np.float16)
    return tensors


def test_what_we_write_the_library_reads_identically(tmp_path):
    tensors = every_dtype()
    path = str(tmp_path / safetensors_io.SINGLE_FILE)
    safetensors_io.write(path, [(k, v.shape, v.dtype) for k, v in tensors.items()], tensors.__getitem__,
                         metadata={"step": "12", "note": "ünïcode"})
    assert_same(load_file(path), tensors)
    assert aligned(path)
    with safe_open(path, framework="np") as f:  # lazily, tensor by tensor, as our reader does
        assert f.metadata() == {"format": "pt", "step": "12", "note": "ünïcode"}  # format=pt: transformers needs it
        assert_same({k: f.get_tensor(k) for k in f.keys()}, tensors)
    assert_same(read_ours(tmp_path), tensors)


def test_what_the_library_writes_we_read_identically(tmp_path):
    tensors = every_dtype()
    save_file(tensors, str(tmp_path / safetensors_io.SINGLE_FILE), metadata={"format": "pt", "origin": "library"})
    assert_same(read_ours(tmp_path), tensors)  # __metadata__ is not a tensor


def test_shards_the_library_writes_are_read_through_the_index(tmp_path):
    tensors = every_dtype()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(tmp_path / shard), metadata={"format": "pt"})
    with open(tmp_path / safetensors_io.INDEX_FILE, "w") as f:
        json.dump({"metadata": {}, "weight_map": {k: shard for shard, keys in shards.items() for k in keys}}, f)
    assert_same(read_ours(tmp_path), tensors)


def test_a_dtype_we_do_not_read_is_named_with_the_ones_we_do(tmp_path):
    save_file({"x": np.zeros(2, np.float64)}, str(tmp_path / safetensors_io.SINGLE_FILE))
    reader = safetensors_io.Reader(str(tmp_path))
    assert reader.dtype("x") == "F64"
    with pytest.raises(UserError, match="has dtype F64; supported: F32, BF16, F16, I64, I32, U8, BOOL"):
        reader.get("x")


def test_metadata_the_library_would_refuse_is_not_written(tmp_path):
    path = str(tmp_path / "x.safetensors")
    with pytest.raises(TypeError, match="text to text"):
        safetensors_io.write(path, [], None, metadata={"step": 12})  # the library: "expected a string"
    safetensors_io.write(path, [], None, metadata={"step": "12"})
    with safe_open(path, framework="np") as f:
        assert f.metadata() == {"format": "pt", "step": "12"} and list(f.keys()) == []


def random_tensors(rng: random.Random) -> dict[str, np.ndarray]:
    alphabet = "abcxyz019._-/ éλ日"
    tensors = {}
    for _ in range(rng.randint(1, 6)):
        name = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12)))
        shape = tuple(rng.choice((0, 1, 1, 2, 3, 5, 8)) for _ in range(rng.randint(0, 4)))
        tensors[name] = sample(rng, rng.choice(DTYPES), shape)
    return tensors


def test_randomised_round_trips_both_ways(tmp_path):
    rng = random.Random(0)
    for case in range(200):
        tensors = random_tensors(rng)
        ours, theirs = tmp_path / f"ours{case}", tmp_path / f"theirs{case}"
        ours.mkdir()
        theirs.mkdir()
        write_safetensors(ours / safetensors_io.SINGLE_FILE, tensors)
        save_file(tensors, str(theirs / safetensors_io.SINGLE_FILE))
        try:
            assert_same(load_file(str(ours / safetensors_io.SINGLE_FILE)), tensors)
            assert aligned(ours / safetensors_io.SINGLE_FILE) and aligned(theirs / safetensors_io.SINGLE_FILE)
            assert_same(read_ours(theirs), tensors)
            assert_same(read_ours(ours), tensors)
        except AssertionError as e:
            raise AssertionError(f"case {case}: { {k: (v.dtype.name, v.shape) for k, v in tensors.items()} }") from e
