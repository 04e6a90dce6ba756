"""Files from outside (issue 28, trust boundaries): a safetensors checkpoint and its shard index, a
Hugging Face config.json, a tokenizer.json or our own tokenizer spec, a YAML config. Whatever they
hold, reading them ends in success or in one UserError (one line, naming the file and the fix) within
a bound of time and memory: never another exception, a read outside the file, a crash or a hang.

First the defects found, one test each (every one failed before its fix); then property-based
tests (hypothesis, derandomized: the same examples on every run) for each parser, over random and
damaged inputs. A hang shows as a failure (`time_limit`, SIGALRM), memory as the growth of the
process's peak resident size.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from helpers import GPT2_CONFIG, peak_rss_mb, sample, snapshot, time_limit, write_gpt2
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tpu_llm import cli
from tpu_llm.config import CAPS, MAX_PARAMS, load_config
from tpu_llm.errors import UserError
from tpu_llm.interop import hf, hf_config, safetensors_io
from tpu_llm.model import spec

pytest.importorskip("tokenizers", reason="the checkpoints here carry an hf tokenizer: pip install -e '.[hf]'")
WTE = "transformer.wte.weight"  # the first tensor of write_gpt2's file: (300, 32) float32
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory) -> Path:
    """A valid tiny GPT-2 checkpoint (config.json, model.safetensors, tokenizer); copy it before damaging it."""
    folder = tmp_path_factory.mktemp("gpt2") / "gpt2"
    write_gpt2(folder)
    return folder


def copy_of(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def read_file(path) -> tuple[object, bytes]:
    """(the JSON header, the data bytes) of a safetensors file."""
    raw = Path(path).read_bytes()
    size = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + size]), raw[8 + size:]


def write_file(path, header, data: bytes) -> None:
    text = json.dumps(header).encode()
    Path(path).write_bytes(struct.pack("<Q", len(text)) + text + data)


def damaged(folder: Path, edit) -> Path:
    """`folder`'s model.safetensors with its header replaced by `edit(header)` (the data kept)."""
    path = folder / safetensors_io.SINGLE_FILE
    header, data = read_file(path)
    write_file(path, edit(header), data)
    return folder


def with_entry(name: str, **changes):
    def edit(header):
        header[name] = {**header[name], **changes}
        return header
    return edit


def import_(source, run_dir, capsys) -> tuple[int, str]:
    """`tpu-llm import` in this process: (exit status, stderr); stdout must be empty on a refusal."""
    with contextlib.redirect_stdout(io.StringIO()) as out:
        status = cli.main(["import", "--from", str(source), "--run_dir", str(run_dir)])
    err = capsys.readouterr().err
    if status:
        assert out.getvalue() == "", out.getvalue()
    return status, err


def assert_one_line(err: str, *words: str) -> None:
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for word in words:
        assert word in err, (word, err)


# ---- safetensors: the defects --------------------------------------------------------------------------

OFFSETS = [0, 300 * 32 * 4]  # WTE's place in write_gpt2's file: the first tensor
DAMAGES = {  # what a downloaded header may hold -> a word the refusal names
    "offsets-before-the-data": (with_entry(WTE, data_offsets=[-1000, OFFSETS[1] - 1000]), "data_offsets [-1000"),
    "end-offset-2^62": (with_entry(WTE, data_offsets=[0, 2**62]), "outside the file"),
    "offsets-past-the-data": (with_entry(WTE, data_offsets=[10**6, 10**6 + OFFSETS[1]]), "outside the file"),
    "overlapping-tensors": (with_entry("transformer.wpe.weight", data_offsets=[0, 32 * 32 * 4]), "overlap"),
    "size-not-the-shapes": (with_entry(WTE, shape=[300, 31]), "bytes"),
    "negative-shape": (with_entry(WTE, shape=[-300, -32]), "shape"),
    "float-shape": (with_entry(WTE, shape=[300.0, 32]), "shape"),
    "empty-shape-too-large": (with_entry(WTE, shape=[0, 2**62], data_offsets=[0, 0]), "too large for any array"),
    "bool-shape": (with_entry(WTE, shape=[True, 32]), "shape"),
    "shape-not-a-list": (with_entry(WTE, shape="300x32"), "shape"),
    "header-a-list": (lambda h: [1, 2], "not an object"),
    "entry-a-string": (lambda h: {**h, WTE: "x"}, WTE),
    "offsets-strings": (with_entry(WTE, data_offsets=[str(o) for o in OFFSETS]), "data_offsets"),
    "three-offsets": (with_entry(WTE, data_offsets=[0, 0, OFFSETS[1]]), "data_offsets"),
    "unknown-dtype": (with_entry(WTE, dtype="Q7"), "dtype"),
    "dtype-not-text": (with_entry(WTE, dtype=["F32"]), "dtype"),
    "no-dtype": (lambda h: {**h, WTE: {"shape": [300, 32], "data_offsets": OFFSETS}}, "dtype"),
    "metadata-not-text": (lambda h: {**h, "__metadata__": {"format": 1}}, "__metadata__"),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_header_is_refused_when_the_reader_is_made_naming_the_file_and_tensor(gpt2_dir, tmp_path, damage):
    edit, word = DAMAGES[damage]
    folder = damaged(copy_of(gpt2_dir, tmp_path / "src"), edit)
    with time_limit(5), pytest.raises(UserError) as refused:
        safetensors_io.Reader(str(folder))  # before any tensor is read: a bad offset never reaches a read
    message = str(refused.value)
    assert "\n" not in message and str(folder / "model.safetensors") in message and word in message, message
    assert "download the file again" in message, message


@pytest.mark.parametrize("damage", ["offsets-before-the-data", "overlapping-tensors", "float-shape", "header-a-list"])
def test_import_refuses_a_damaged_header_in_one_line_and_writes_nothing(gpt2_dir, tmp_path, capsys, damage):
    edit, word = DAMAGES[damage]
    folder = damaged(copy_of(gpt2_dir, tmp_path / "src"), edit)
    status, err = import_(folder, tmp_path / "run", capsys)
    assert status == 2
    assert_one_line(err, word, "model.safetensors")
    assert not (tmp_path / "run").exists()


def test_import_leaves_an_empty_target_as_it_was_when_it_refuses_a_checkpoint(gpt2_dir, tmp_path, capsys):
    folder = damaged(copy_of(gpt2_dir, tmp_path / "src"), DAMAGES["offsets-before-the-data"][0])
    (tmp_path / "run").mkdir()
    before = snapshot(tmp_path / "run")
    status, err = import_(folder, tmp_path / "run", capsys)
    assert status == 2 and snapshot(tmp_path / "run") == before
    assert_one_line(err, "outside the file")


@pytest.mark.parametrize("header_length", [0, 7, 1 << 40, 147_000])
def test_a_header_length_past_the_file_or_the_cap_is_refused_before_reading(gpt2_dir, tmp_path, header_length):
    folder = copy_of(gpt2_dir, tmp_path / "src")
    path = folder / "model.safetensors"
    path.write_bytes(struct.pack("<Q", header_length) + path.read_bytes()[8:])
    with time_limit(5), pytest.raises(UserError, match="not a safetensors file"):
        safetensors_io.Reader(str(folder))


def test_a_name_given_twice_in_a_header_is_refused(gpt2_dir, tmp_path):
    folder = copy_of(gpt2_dir, tmp_path / "src")
    path = folder / "model.safetensors"
    header, data = read_file(path)
    text = json.dumps(header)
    entry = json.dumps({WTE: header[WTE]})[1:-1]
    text = "{" + entry + ", " + text[1:]  # WTE twice: json keeps the last, hiding the first from the checks
    path.write_bytes(struct.pack("<Q", len(text)) + text.encode() + data)
    with pytest.raises(UserError, match="appears twice"):
        safetensors_io.Reader(str(folder))


def test_a_null_metadata_is_none_as_the_library_reads_it(gpt2_dir, tmp_path):
    """Found by the property test below: the safetensors library reads `"__metadata__": null`."""
    from safetensors.numpy import load_file

    folder = damaged(copy_of(gpt2_dir, tmp_path / "src"), lambda h: {**h, "__metadata__": None})
    assert safetensors_io.Reader(str(folder)).get(WTE).tobytes() == load_file(str(folder / "model.safetensors"))[WTE].tobytes()


@pytest.mark.slow
def test_an_end_offset_of_2_to_the_62_is_one_line_not_a_segfault(gpt2_dir, tmp_path):
    """Before: the import read (end - begin) bytes and the process died of SIGSEGV (exit 139)."""
    folder = damaged(copy_of(gpt2_dir, tmp_path / "src"), with_entry(WTE, data_offsets=[0, 2**62]))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "3"}
    done = subprocess.run([sys.executable, "-m", "tpu_llm", "import", "--from", str(folder), "--run_dir",
                           str(tmp_path / "run")], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert_one_line(done.stderr, "data_offsets [0, 4611686018427387904]", "outside the file")


# ---- the shard index --------------------------------------------------------------------------------------


def sharded(folder: Path, shard: str) -> Path:
    """`folder` with its one file named by an index as the shard `shard` (the file moved there when local)."""
    with open(folder / safetensors_io.INDEX_FILE, "w") as f:
        json.dump({"weight_map": {WTE: shard}}, f)
    return folder


@pytest.mark.parametrize("shard", ["/etc/passwd", "../outside.safetensors", "sub/../../outside.safetensors",
                                   "C:/model.safetensors", "gs://bucket/model.safetensors", "", ".",
                                   "model.safetensors\0.txt"])  # NUL: issue 50 #6 (os.stat raised ValueError)
def test_a_shard_index_names_files_inside_the_checkpoint_only(gpt2_dir, tmp_path, shard):
    (tmp_path / "outside.safetensors").write_bytes((gpt2_dir / "model.safetensors").read_bytes())
    folder = sharded(copy_of(gpt2_dir, tmp_path / "src"), shard)
    with pytest.raises(UserError, match=r"model.safetensors.index.json names shard .*a shard is a file inside"):
        safetensors_io.Reader(str(folder))


def test_a_shard_that_links_out_of_the_checkpoint_is_refused(gpt2_dir, tmp_path):
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes((gpt2_dir / "model.safetensors").read_bytes())
    folder = sharded(copy_of(gpt2_dir, tmp_path / "src"), "model-00001-of-00001.safetensors")
    (folder / "model-00001-of-00001.safetensors").symlink_to(outside)
    with pytest.raises(UserError, match=r"is a link to .*outside.safetensors, outside .*copy the file itself"):
        safetensors_io.Reader(str(folder))
    os.remove(folder / safetensors_io.INDEX_FILE)  # the single file too
    os.remove(folder / "model.safetensors")
    (folder / "model.safetensors").symlink_to(outside)
    with pytest.raises(UserError, match="is a link to"):
        safetensors_io.Reader(str(folder))


def test_a_hugging_face_cache_snapshot_links_into_its_blobs_and_is_read(gpt2_dir, tmp_path):
    """huggingface_hub's cache: models--ORG--NAME/snapshots/REV/FILE -> ../../blobs/HASH."""
    model = tmp_path / "hub" / "models--org--tiny"
    (model / "blobs").mkdir(parents=True)
    snapshot_dir = model / "snapshots" / "0123abc"
    snapshot_dir.mkdir(parents=True)
    (model / "blobs" / "f00d").write_bytes((gpt2_dir / "model.safetensors").read_bytes())
    (snapshot_dir / "model.safetensors").symlink_to("../../blobs/f00d")
    reader = safetensors_io.Reader(str(snapshot_dir))
    assert reader.get(WTE).shape == (300, 32)


def test_a_tensor_in_two_shards_or_an_index_of_the_wrong_shape_is_refused(gpt2_dir, tmp_path):
    folder = copy_of(gpt2_dir, tmp_path / "src")
    os.rename(folder / "model.safetensors", folder / "a.safetensors")
    (folder / "b.safetensors").write_bytes((folder / "a.safetensors").read_bytes())
    with open(folder / safetensors_io.INDEX_FILE, "w") as f:
        json.dump({"weight_map": {WTE: "a.safetensors", "transformer.wpe.weight": "b.safetensors"}}, f)
    with pytest.raises(UserError, match=f"tensor '{WTE}' is in both .*a.safetensors and .*b.safetensors"):
        safetensors_io.Reader(str(folder))
    for index in ("[1]", '{"weight_map": [1]}', '{"weight_map": {"x": 1}}', "{" * 100_000, "not json"):
        (folder / safetensors_io.INDEX_FILE).write_text(index)
        with pytest.raises(UserError, match="is not a shard index"):
            safetensors_io.Reader(str(folder))


# ---- config.json ------------------------------------------------------------------------------------------


def with_config(folder: Path, config) -> Path:
    (folder / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return folder


@pytest.mark.parametrize("config, words", [
    ({k: v for k, v in GPT2_CONFIG.items() if k != "n_embd"}, ["config.json has no n_embd"]),
    ([GPT2_CONFIG], ["config.json is a JSON list, not an object"]),
    ("{", ["config.json is not valid JSON"]),
    ("[" * 100_000, ["config.json is not valid JSON (nested too deeply)"]),
    ({**GPT2_CONFIG, "n_layer": "2"}, ['n_layer="2" is not an integer >= 1']),
    ({**GPT2_CONFIG, "n_head": 0}, ["n_head=0 is not an integer >= 1"]),
    ({**GPT2_CONFIG, "resid_pdrop": "x"}, ['resid_pdrop="x" is not a finite number']),
    ({**GPT2_CONFIG, "architectures": 5}, ["architectures=5 is not supported"]),
    ({**GPT2_CONFIG, "architectures": [{"a": 1}]}, ["architectures=[{\"a\": 1}] is not supported"]),
    ({**GPT2_CONFIG, "architectures": ["LlamaForCausalLM"], "hidden_size": 32, "num_attention_heads": 2,
      "num_hidden_layers": 1, "intermediate_size": 64, "max_position_embeddings": 32, "rope_scaling": "yes"},
     ['rope_scaling="yes" is not an object']),
    # issue 41: what the families cannot honour
    ({**GPT2_CONFIG, "architectures": ["Gemma2ForCausalLM"]},
     ["Gemma2ForCausalLM needs (1 + weight) RMSNorm", "logit soft-capping", "supported: GPT2LMHeadModel, "]),
    ({**GPT2_CONFIG, "architectures": ["Gemma3ForCausalLM"]}, ["Gemma3ForCausalLM needs", "sliding-window layers"]),
    ({**GPT2_CONFIG, "architectures": ["LlamaForCausalLM"], "hidden_size": 32, "num_attention_heads": 2,
      "num_hidden_layers": 1, "intermediate_size": 64, "max_position_embeddings": 32,
      "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     ['rope_scaling.rope_type="yarn" is not supported by tpu-llm (supported: default, llama3)']),
    ({**GPT2_CONFIG, "architectures": ["LlamaForCausalLM"], "hidden_size": 32, "num_attention_heads": 2,
      "num_hidden_layers": 1, "intermediate_size": 64, "max_position_embeddings": 32,
      "rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}},
     ["config.json: high_freq_factor=null is not a finite number"]),
    ({**GPT2_CONFIG, "architectures": ["MistralForCausalLM"], "hidden_size": 32, "num_attention_heads": 2,
      "num_hidden_layers": 1, "intermediate_size": 64, "max_position_embeddings": 32, "sliding_window": 16},
     ["sliding_window=16 is shorter than the context of 32 tokens", "import with --max_len 16 (or less)"]),
    ({**GPT2_CONFIG, "architectures": ["Qwen2ForCausalLM"], "hidden_size": 32, "num_attention_heads": 2,
      "num_hidden_layers": 2, "intermediate_size": 64, "max_position_embeddings": 32, "use_sliding_window": True,
      "sliding_window": 8, "max_window_layers": 1}, ["sliding_window=8 is shorter than the context of 32 tokens"]),
])
def test_a_config_json_tpu_llm_cannot_read_is_one_line(gpt2_dir, tmp_path, capsys, config, words):
    folder = with_config(copy_of(gpt2_dir, tmp_path / "src"), config)
    status, err = import_(folder, tmp_path / "run", capsys)
    assert status == 2
    assert_one_line(err, *words)


@pytest.mark.parametrize("field, value, cap", [("n_layer", 10**9, "model.n_layer"), ("n_embd", 2**21, "model.n_embd"),
                                               ("vocab_size", 10**8, "model.vocab_size"),
                                               ("n_positions", 2**30, "model.max_len")])
def test_sizes_in_config_json_are_capped_and_refused_at_once(gpt2_dir, tmp_path, capsys, field, value, cap):
    """Before: n_layer 10^9 grew without bound (1.67 GB after 137 s, no output)."""
    folder = with_config(copy_of(gpt2_dir, tmp_path / "src"), {**GPT2_CONFIG, field: value})
    start = time.perf_counter()
    with time_limit(10):
        status, err = import_(folder, tmp_path / "run", capsys)
    assert status == 2 and time.perf_counter() - start < 2
    assert_one_line(err, f"config.json: {field}={value} is more than tpu-llm's cap of {CAPS[cap][0]:,}")


def test_a_config_json_of_2e12_parameters_is_refused(gpt2_dir, tmp_path, capsys):
    config = {**GPT2_CONFIG, "n_layer": 9000, "n_embd": 8192, "n_head": 64}  # 12 L C^2 = 7.2e12
    with time_limit(10):  # before: building it, for hours
        status, err = import_(with_config(copy_of(gpt2_dir, tmp_path / "src"), config), tmp_path / "run", capsys)
    assert status == 2
    assert_one_line(err, "parameters", f"more than the cap of {MAX_PARAMS:.0e}")


@pytest.mark.parametrize("change, words", [
    ({"n_layer": 40}, ["the checkpoint lacks tensor transformer.h.2.ln_1.weight (456 missing)"]),
    ({"n_embd": 64}, [f"model.safetensors: tensor {WTE} has shape [300, 32], config.json implies [300, 64]"]),
    ({"vocab_size": 512}, [f"model.safetensors: tensor {WTE} has shape [300, 32], config.json implies [512, 32]"]),
])
def test_names_and_shapes_are_compared_with_config_json_before_a_model_is_built(gpt2_dir, tmp_path, capsys, monkeypatch,
                                                                                change, words):
    folder = with_config(copy_of(gpt2_dir, tmp_path / "src"), {**GPT2_CONFIG, **change})
    monkeypatch.setattr(hf, "GPT", lambda *a, **k: pytest.fail("the model was built before the checks"))
    status, err = import_(folder, tmp_path / "run", capsys)
    assert status == 2
    assert_one_line(err, *words)


def test_an_integer_dtype_on_a_weight_is_refused_before_the_model_is_built(gpt2_dir, tmp_path, capsys, monkeypatch):
    folder = damaged(copy_of(gpt2_dir, tmp_path / "src"), with_entry(WTE, dtype="I32"))  # same size: a valid file
    monkeypatch.setattr(hf, "GPT", lambda *a, **k: pytest.fail("the model was built before the checks"))
    status, err = import_(folder, tmp_path / "run", capsys)
    assert status == 2
    assert_one_line(err, f"model.safetensors: tensor {WTE} has dtype I32; a weight is F32, BF16, F16")


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2"])
def test_the_shapes_import_expects_are_the_built_models(family):
    """The model's spec (what a checkpoint is compared with before building: hf.tensor_shapes) against the
    variables."""
    from helpers import LLAMA, tiny_model

    families = {"llama": LLAMA, "qwen2": {**LLAMA, "family": "qwen2", "bias": True}}
    model = tiny_model(n_layer=2, **families.get(family, {}))
    model.cfg.vocab_size = model.vocab_size
    shapes = spec.shapes(model.cfg, model.vocab_size)
    variables = model.by_path()
    for _, path, _ in hf.weights(model.cfg):
        assert tuple(variables[path].shape) == shapes[path], path


# ---- the YAML config and its flags -------------------------------------------------------------------------


def test_a_width_of_4e9_is_refused_at_once_naming_the_cap():
    """Before: the message of a check that passed listed the divisors of n_embd, a loop of 4e9 steps."""
    start = time.perf_counter()
    with time_limit(5), pytest.raises(UserError) as refused:
        load_config(str(ROOT / "configs" / "tiny.yaml"), {"model.n_embd": 4_000_000_000})
    assert time.perf_counter() - start < 0.5
    assert str(refused.value) == ("config: model.n_embd=4000000000 is more than its cap of 1,048,576 (widths: 2^20; "
                                  "the widest published models are under 2^15)")


def test_a_failed_divisibility_check_lists_a_few_divisors_quickly():
    with time_limit(5), pytest.raises(UserError, match=r"valid grad_accum values: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, .*, 28, "
                                                       r"30 \(and 216 more\)$"):
        load_config(None, {"train.batch_size": 720720, "train.grad_accum": 17})
    with time_limit(5), pytest.raises(UserError, match=r"valid n_head values: 1, 2, 3, .*, 30 \(and 14 more\) "):
        load_config(None, {"model.n_embd": 720720, "model.n_head": 17})


@pytest.mark.parametrize("key", sorted(CAPS))
def test_every_capped_key_is_refused_one_past_its_cap(key):
    cap, why = CAPS[key]
    with time_limit(5), pytest.raises(UserError, match=rf"^config: {key}={cap + 1} is more than its cap of {cap:,} "):
        load_config(None, {key: cap + 1})


def test_every_cap_is_in_the_configuration_reference():
    caps = (ROOT / "docs" / "configuration.md").read_text().split("\n## Caps", 1)[-1]
    assert [key for key in CAPS if f"`{key}`" not in caps] == []


@pytest.mark.slow
def test_the_config_command_answers_a_huge_width_in_under_a_few_seconds():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "tpu_llm", "config", "--config", "configs/tiny.yaml",
                           "--model.n_embd=4000000000"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    seconds = time.perf_counter() - start
    assert done.returncode == 2 and done.stdout == "", done
    assert_one_line(done.stderr, "model.n_embd=4000000000 is more than its cap of 1,048,576")
    assert seconds < 5, seconds  # 0.1 s on a quiet machine: the CLI imports no TensorFlow for `config`


@pytest.mark.parametrize("text, words", [
    ("model:\n  n_layer: " + "9" * 5000 + "\n", ["a value YAML cannot hold"]),
    ("model: " + "[" * 50_000 + "\n", ["YAML"]),
    ("a: &a [x, x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
     "c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c]\n"
     "e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d]\nf: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e, *e]\n"
     "g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f, *f]\ndata:\n  train: *g\n", ["unknown config key 'a'"]),
    ("data:\n  train: &g [[[[[[x]]]]]]\nmodel:\n  n_layer: 1e999\n", ["'data.train' must be str"]),
    ("train:\n  lr: .inf\n", ["'train.lr' must be a finite number"]),
    ("train:\n  lr: " + "1" * 400 + "\n", ["'train.lr' must be float, got 1111"]),
    ("model:\n  \"n_\\nlayer\": 2\n", ["unknown config key 'model.n_\\nlayer'; did you mean 'model.n_layer'?"]),
])
def test_a_yaml_config_from_elsewhere_is_one_line(tmp_path, text, words):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    with time_limit(10), pytest.raises(UserError) as refused:
        load_config(str(path))
    message = str(refused.value)
    assert "\n" not in message and len(message) < 2000, message
    for word in words:
        assert word in message, message


def test_a_yaml_config_over_1_mb_is_refused_before_it_is_parsed(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text("# " + "x" * (1 << 20) + "\n")
    with time_limit(5), pytest.raises(UserError, match=r"big.yaml: 1,048,579 bytes, more than the 1,048,576"):
        load_config(str(path))


# ---- tokenizer files ---------------------------------------------------------------------------------------


def test_a_tokenizer_json_nested_100k_deep_is_one_line(gpt2_dir, tmp_path, capsys):
    """Before: RecursionError, a traceback."""
    from tpu_llm.tokenizers import load_hf_tokenizer

    folder = copy_of(gpt2_dir, tmp_path / "src")
    (folder / "tokenizer.json").write_text('{"a": ' * 100_000 + "1" + "}" * 100_000)
    with pytest.raises(UserError, match="tokenizer.json: Hugging Face's tokenizers .* cannot read it"):
        load_hf_tokenizer(str(folder))
    (folder / "tokenizer_config.json").write_text("[" * 100_000)
    with pytest.raises(UserError, match=r"tokenizer_config.json is not valid JSON \(nested too deeply\)"):
        load_hf_tokenizer(str(folder))


def test_a_500_mb_tokenizer_json_is_refused_before_it_is_read(gpt2_dir, tmp_path, capsys):
    """Before: read and parsed, 2.2 GB of memory. A sparse file: no disk used."""
    folder = copy_of(gpt2_dir, tmp_path / "src")
    with open(folder / "tokenizer.json", "r+b") as f:
        f.truncate(500 << 20)
    before = peak_rss_mb()
    start = time.perf_counter()
    status, err = import_(folder, tmp_path / "run", capsys)
    assert status == 2 and time.perf_counter() - start < 5
    assert_one_line(err, "tokenizer.json is 524,288,000 bytes, more than the 104,857,600 a tokenizer file may have")
    assert peak_rss_mb() - before < 100


@pytest.mark.parametrize("spec, words", [
    ('{"kind": "char", "chars": ' * 50_000, ["is not a readable tokenizer file"]),
    ('{"kind": "hf", "model": "../../../etc/passwd", "eos_token": "x"}', ["names the model file '../../../etc/passwd'"]),
    ('{"kind": "sentencepiece", "model": "/etc/passwd"}', ["names the model file '/etc/passwd'"]),
    ('{"kind": "hf", "model": ["x"], "eos_token": "x"}', ["model is not text"]),
    ('{"kind": "hf", "model": "hf_tokenizer.json", "eos_token": 5}', ["eos_token is not text"]),
    ('{"kind": "char", "chars": 12}', ["chars is not text"]),
    ('{"kind": [[[]]]}', ["is not a readable tokenizer file"]),
    ('["byte"]', ["is not a readable tokenizer file"]),
])
def test_our_tokenizer_spec_from_elsewhere_is_one_line(tmp_path, spec, words):
    from tpu_llm.tokenizers import load_tokenizer

    (tmp_path / "tokenizer.json").write_text(spec)
    (tmp_path / "hf_tokenizer.json").write_text("{}")
    with time_limit(5), pytest.raises(UserError) as refused:
        load_tokenizer(str(tmp_path))
    message = str(refused.value)
    assert "\n" not in message and all(word in message for word in words), message


# ---- properties: whatever the file holds, success or one UserError ---------------------------------------

# Derandomized (the same examples on every run: CI is reproducible) and small: all of them take well
# under 30 s. `deadline` flags a slow example; `bounded` below fails a hang or a large allocation.
PROPERTY = settings(max_examples=200, deadline=3000, derandomize=True, database=None, print_blob=False,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])
SECONDS, MEGABYTES = 10, 200  # per example: no input of a few KB may take more

SCALARS = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.text(max_size=12)
           | st.sampled_from([0, 1, -1, 2, 2**31, 2**32, 2**62, 2**63, 2**64, 10**9, -2**63])
           | st.floats(allow_nan=True, allow_infinity=True))
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                          max_size=4), max_leaves=10)


@pytest.fixture(scope="module", autouse=True)
def examples_independent_of_other_tests():
    """Hypothesis draws, one time in twenty, a constant found in the source of the project's modules
    imported at that moment (`_get_local_constants`, cached per process and on disk in .hypothesis/):
    a set that depends on which tests ran before in the process, so derandomized examples would too.
    Without them every run draws the same examples (the strategies here hold their own edge values)."""
    from hypothesis.internal.conjecture import providers

    if not hasattr(providers, "_get_local_constants"):  # a Hypothesis without the feature: nothing to do
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(providers, "_get_local_constants", providers.Constants)  # none
        patch.setattr(providers, "CONSTANTS_CACHE", {})  # nor those of a test run before
        yield


def refused_or_done(call):
    """Run `call`: its result, or the message of the one UserError it raised (one line); any other
    exception fails the test, as do more than SECONDS or a peak memory MEGABYTES above the one before."""
    before = peak_rss_mb()
    try:
        with time_limit(SECONDS):
            result = call()
        event("read")  # --hypothesis-show-statistics: how many examples were read, how many refused
        return result
    except UserError as e:
        message = str(e)
        assert "\n" not in message and 0 < len(message) < 4000, message
        event("refused")
        return message
    finally:
        assert peak_rss_mb() - before < MEGABYTES, f"{peak_rss_mb() - before:.0f} MB"


def mutate(data, value, values=JSON):
    """`value` (JSON) with one node, reached by a random walk from the root, replaced or deleted."""
    if not isinstance(value, (dict, list)) or not value or data.draw(st.integers(0, 3)) == 0:
        return data.draw(values)
    key = data.draw(st.sampled_from(sorted(value) if isinstance(value, dict) else range(len(value))))
    value = dict(value) if isinstance(value, dict) else list(value)
    if data.draw(st.integers(0, 5)) == 0:
        del value[key]
    else:
        value[key] = mutate(data, value[key], values)
    return value


def damage_bytes(data, raw: bytes) -> bytes:
    """`raw` with a few bytes flipped, cut short, or with bytes appended."""
    how = data.draw(st.sampled_from(["flip", "truncate", "append"]))
    if how == "truncate":
        return raw[:data.draw(st.integers(0, max(len(raw) - 1, 0)))]
    if how == "append":
        return raw + data.draw(st.binary(min_size=1, max_size=64))
    out = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 8))):
        at = data.draw(st.integers(0, len(out) - 1))
        out[at] ^= data.draw(st.integers(1, 255))
    return bytes(out)


# -- safetensors

NAMES = st.text(alphabet="abcxyz.0_", min_size=1, max_size=6)
SHAPES = st.lists(st.integers(0, 5), max_size=3)


def valid_file(data) -> tuple[bytes, dict]:
    """A small valid safetensors file (our writer) and its tensors."""
    rng = random.Random(data.draw(st.integers(0, 2**32)))
    codes = sorted(safetensors_io.DTYPES)
    tensors = {name: sample(rng, data.draw(st.sampled_from(codes)), tuple(data.draw(SHAPES)))
               for name in data.draw(st.lists(NAMES, min_size=1, max_size=4, unique=True))}
    buffer = io.BytesIO()
    header, offset = {}, 0
    for name, array in tensors.items():
        header[name] = {"dtype": safetensors_io.CODES[array.dtype], "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    text = json.dumps(header).encode()
    buffer.write(struct.pack("<Q", len(text)) + text + b"".join(a.tobytes() for a in tensors.values()))
    return buffer.getvalue(), header


ENTRY_VALUES = (JSON | st.sampled_from(sorted(safetensors_io.ITEMSIZES))
                | st.lists(st.integers(-2**64, 2**64) | st.sampled_from([0, 1, 2**62]), max_size=3))


def damaged_file(data) -> bytes:
    raw, header = valid_file(data)
    how = data.draw(st.sampled_from(["entry", "entry", "header", "bytes", "length"]))
    body = raw[8 + struct.unpack("<Q", raw[:8])[0]:]
    if how == "entry":  # one field of one entry: offsets, shape, dtype
        name = data.draw(st.sampled_from(sorted(header)))
        field = data.draw(st.sampled_from(["dtype", "shape", "data_offsets", "extra"]))
        header[name] = {**header[name], field: data.draw(ENTRY_VALUES)}
        if data.draw(st.booleans()):
            header["__metadata__"] = data.draw(JSON)
    elif how == "header":
        header = mutate(data, header, ENTRY_VALUES)
    elif how == "bytes":
        return damage_bytes(data, raw)
    else:  # the header length
        text = json.dumps(header).encode()
        return struct.pack("<Q", data.draw(st.integers(0, 2**64 - 1))) + text + body
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + body


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("scratch")


@PROPERTY
@given(data=st.data())
def test_property_the_safetensors_reader_reads_what_the_library_reads_or_refuses_in_one_line(scratch, data):
    from safetensors.numpy import load_file

    path = scratch / safetensors_io.SINGLE_FILE
    path.write_bytes(damaged_file(data))

    def read():
        reader = safetensors_io.Reader(str(scratch))
        return {n: reader.get(n) for n in reader.names() if reader.dtype(n) in safetensors_io.DTYPES}

    ours = refused_or_done(read)
    try:
        theirs = load_file(str(path))
    except BaseException as e:  # noqa: B036 (the library refuses, in its own way: no claim)
        if not isinstance(e, Exception) and type(e).__name__ != "PanicException":
            raise
        return
    if isinstance(ours, str):  # the library read it: we may refuse only what it does not check
        assert "appears twice" in ours or "which safetensors does not define" in ours, ours
        return
    for name, array in ours.items():
        assert array.dtype == theirs[name].dtype and array.shape == theirs[name].shape, name
        assert array.tobytes() == theirs[name].tobytes(), name


# -- config.json


GPT2_FIELDS = sorted(GPT2_CONFIG) + ["scale_attn_weights", "tie_word_embeddings", "add_cross_attention"]
LLAMA_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 300, "hidden_size": 32,
                "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "tie_word_embeddings": False,
                "attention_bias": False, "head_dim": 8}
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
FAMILY_CONFIGS = [  # issue 41: Llama 3.2's rope scaling (the 4.x rope_scaling field), Qwen2.5's and Mistral's fields
    {**LLAMA_CONFIG, "rope_parameters": None, "rope_scaling": {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"},
     "tie_word_embeddings": True},
    {**LLAMA_CONFIG, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": False,
     "sliding_window": 32, "max_window_layers": 1, "layer_types": ["full_attention"] * 2},
    {**LLAMA_CONFIG, "architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 64}]
SIZES = st.integers(-2, 70) | st.sampled_from([0, 2**20, 2**20 + 1, 10**7, 10**9, 2**63]) | JSON


def config_json(data) -> str:
    how = data.draw(st.sampled_from(["field", "field", "field", "tree", "document", "text"]))
    config = dict(data.draw(st.sampled_from([GPT2_CONFIG, LLAMA_CONFIG, *FAMILY_CONFIGS])))
    if how == "field":  # sizes and switches, one to three of them
        for _ in range(data.draw(st.integers(1, 3))):
            key = data.draw(st.sampled_from(sorted(set(GPT2_FIELDS).union(LLAMA_CONFIG, *FAMILY_CONFIGS))))
            config[key] = data.draw(SIZES)
        if data.draw(st.booleans()):  # and one of the rope scaling's numbers (its type: llama3, yarn, any)
            rope = dict(LLAMA3_ROPE)
            rope[data.draw(st.sampled_from(sorted(LLAMA3_ROPE)))] = data.draw(SIZES | st.sampled_from(["yarn", "llama3"]))
            config[data.draw(st.sampled_from(["rope_scaling", "rope_parameters"]))] = rope
    elif how == "tree":
        config = mutate(data, config)
    elif how == "document":
        config = data.draw(JSON)
    else:
        return data.draw(st.text(max_size=200))
    return json.dumps(config)


@PROPERTY
@given(data=st.data())
def test_property_a_config_json_maps_to_a_valid_config_or_one_userror(scratch, gpt2_reader, data):
    (scratch / "config.json").write_text(config_json(data))

    def check():
        cfg = hf_config.run_config(hf_config.read_config(str(scratch)), str(scratch), str(scratch / "run"))
        hf.check_tensors(gpt2_reader, cfg.model)  # the names and shapes of any config it accepts: no crash
        return cfg

    refused_or_done(check)


@pytest.fixture(scope="module")
def gpt2_reader(gpt2_dir):
    return safetensors_io.Reader(str(gpt2_dir))


# -- the YAML config

KEYS = st.sampled_from(["model.n_layer", "model.n_embd", "model.n_head", "model.max_len", "model.vocab_size",
                        "model.family", "model.dropout", "data.seq_len", "data.train", "train.batch_size",
                        "train.grad_accum", "train.steps", "train.lr", "train.freeze", "train.seed", "parallel.tensor",
                        "model.n_kv_head", "model.mlp_hidden", "cpu_devices", "sample.top_p", "model", "x.y", "model.x"])
YAML_VALUES = (st.integers(-3, 300) | st.sampled_from([2**20 + 1, 10**12, 720720, "blocks:0-9999999999", "llama",
                                                       ".nan", "1e999", "3e-4", "[a, b]"]) | JSON)


def yaml_config(data) -> str:
    how = data.draw(st.sampled_from(["values", "values", "tokens", "text"]))
    if how == "text":
        return data.draw(st.text(max_size=300))
    config: dict = {}
    for _ in range(data.draw(st.integers(0, 5))):
        section, _, key = data.draw(KEYS).rpartition(".")
        target = config.setdefault(section, {}) if section else config
        if isinstance(target, dict):
            target[key] = data.draw(YAML_VALUES)
    text = yaml.safe_dump(config, allow_unicode=True)
    if how == "tokens":  # YAML's own syntax where it does not belong: anchors, aliases, tags, flow brackets
        for _ in range(data.draw(st.integers(1, 4))):
            at = data.draw(st.integers(0, len(text)))
            token = data.draw(st.sampled_from(["&a ", "*a", "!!python/object:os.system ", "!!binary ", "[", "{", ": ",
                                               "\t", "- ", "? ", "!!set ", "'", '"', "\n  ", "%YAML 1.1\n---\n"]))
            text = text[:at] + token + text[at:]
    return text


@PROPERTY
@given(data=st.data())
def test_property_a_yaml_config_loads_or_is_one_userror(scratch, data):
    path = scratch / "config.yaml"
    path.write_text(yaml_config(data), encoding="utf-8")
    refused_or_done(lambda: load_config(str(path)))


@PROPERTY
@given(items=st.lists(st.tuples(KEYS, st.text(max_size=20) | st.integers(-2**70, 2**70).map(str)), max_size=4))
def test_property_command_line_overrides_load_or_are_one_userror(items):
    from tpu_llm.config.reading import parse_set_args

    refused_or_done(lambda: load_config(None, parse_set_args([f"{k}={v}" for k, v in items])))


# -- tokenizer files


@pytest.fixture(scope="module")
def tokenizer_json(gpt2_dir) -> dict:
    return json.loads((gpt2_dir / "tokenizer.json").read_text())


@PROPERTY
@given(data=st.data())
def test_property_a_tokenizer_json_loads_and_encodes_or_is_one_userror(scratch, tokenizer_json, data):
    from tpu_llm.tokenizers import load_hf_tokenizer

    folder = scratch / "tok"
    folder.mkdir(exist_ok=True)
    how = data.draw(st.sampled_from(["tree", "tree", "tree", "bytes", "config"]))
    text = json.dumps(tokenizer_json)
    config = {"eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>"}
    if how == "tree":
        text = json.dumps(mutate(data, tokenizer_json))
    elif how == "bytes":
        text = damage_bytes(data, text.encode()).decode("utf-8", errors="replace")
    else:
        config = mutate(data, {**config, "added_tokens_decoder": {"0": {"content": "<|endoftext|>"}}})
    (folder / "tokenizer.json").write_text(text, encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))

    def load_and_use():
        tokenizer = load_hf_tokenizer(str(folder))
        ids = tokenizer.encode("Hello wörld, 日本")  # a tokenizer we accept also works
        return tokenizer.decode(ids)

    refused_or_done(load_and_use)


SPEC = {"kind": "hf", "model": "hf_tokenizer.json", "eos_token": "<|endoftext|>", "bos_token": None}


@PROPERTY
@given(data=st.data())
def test_property_our_tokenizer_spec_loads_or_is_one_userror(scratch, gpt2_dir, data):
    from tpu_llm.tokenizers import load_tokenizer

    folder = scratch / "spec"
    folder.mkdir(exist_ok=True)
    (folder / "hf_tokenizer.json").write_text((gpt2_dir / "tokenizer.json").read_text())
    spec = data.draw(st.sampled_from([SPEC, {"kind": "char", "chars": "abc"}, {"kind": "byte"},
                                      {"kind": "sentencepiece", "model": "tokenizer.model"}]))
    text = json.dumps(mutate(data, spec, JSON | st.sampled_from(["hf", "char", "byte", "../x", "/etc/hostname"])))
    if data.draw(st.booleans()):
        text = damage_bytes(data, text.encode()).decode("utf-8", errors="replace")
    (folder / "tokenizer.json").write_text(text, encoding="utf-8")
    refused_or_done(lambda: load_tokenizer(str(folder)))
