"""`tpu-llm import` and `export --format hf` against the reference implementation, transformers (PyTorch, CPU).

Tiny random GPT2LMHeadModel and LlamaForCausalLM (grouped-query attention, untied head, a rotary base
other than the default), every parameter moved off its initial value (norms and biases too, so a
mapping that swapped two of them shows), saved with save_pretrained in float32 and bfloat16 and
imported through the CLI. Each model is built once per module (torch and transformers take seconds to
import). The comparisons: logits within 1e-4 on sequences of several lengths, greedy generation of 32
tokens identical to transformers' generate, the export loaded by transformers with no missing or
unexpected weights and the same logits, and import then export bit-identical, bfloat16 included.

The families of issue 41, in float32 only (the dtype handling is the families' common path above):
Llama 3.x (rope_type llama3 with every frequency band in use, tied head), Qwen2 (q/k/v biases, tied
head), Qwen3 (issue 47: an RMSNorm over each head of q and k, heads wider than hidden_size / heads, tied
head) and Mistral (untied, a sliding window as long as the context): logits within 1e-5, greedy
generation through the KV cache, and the round trip.
"""

from __future__ import annotations

import contextlib
import io

import numpy as np
import pytest
import tensorflow as tf
from hf_reference import VOCAB, build, torch, transformers  # (skips without them)

from tpu_llm import cli
from tpu_llm.interop import safetensors_io

LENGTHS = (1, 7, 20)  # padding-free batches, one per length


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    return build("gpt2", tmp_path_factory.mktemp("gpt2"))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from tpu_llm.config import ModelConfig

    if not hasattr(ModelConfig, "kv_heads"):
        pytest.skip("this tree has no llama family (model.family)")
    return build("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    return build("llama3", tmp_path_factory.mktemp("llama3"), dtypes=("float32",))


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return build("qwen2", tmp_path_factory.mktemp("qwen2"), dtypes=("float32",))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return build("qwen3", tmp_path_factory.mktemp("qwen3"), dtypes=("float32",))


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    return build("mistral", tmp_path_factory.mktemp("mistral"), dtypes=("float32",))


FAMILIES = ["gpt2", "llama"]
NEW_FAMILIES = ["llama3", "qwen2", "qwen3", "mistral"]  # issues 41 and 47


@pytest.fixture(params=FAMILIES)
def ref(request):
    return request.getfixturevalue(request.param)


@pytest.fixture(params=NEW_FAMILIES)
def new_ref(request):
    return request.getfixturevalue(request.param)


def tokens(length: int, batch: int = 2) -> np.ndarray:
    return np.random.default_rng(length).integers(0, VOCAB, size=(batch, length)).astype(np.int32)


def torch_logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(ids, dtype=torch.long)).logits.float().numpy()


_RESTORED: dict = {}


def restored(run_dir: str):
    """(model, tokenizer, config) as `tpu-llm generate` restores them, once per run directory."""
    from tpu_llm.training.checkpoint import load_for_generation

    if run_dir not in _RESTORED:
        _RESTORED[run_dir] = load_for_generation(run_dir)
    return _RESTORED[run_dir]


def test_imported_logits_match_transformers(ref):
    model, _, cfg = restored(ref["float32"]["run_dir"])
    assert cfg.model.vocab_size == VOCAB and cfg.data.tokenizer == "hf"
    for length in LENGTHS:
        ids = tokens(length)
        expected = torch_logits(ref["model"], ids)
        np.testing.assert_allclose(model(tf.constant(ids)).numpy(), expected, rtol=0, atol=1e-4)
    assert np.abs(expected).max() > 1.0  # a real model's logits, not a near-zero one


def test_bfloat16_checkpoint_imports_to_the_same_values(ref):
    model, _, cfg = restored(ref["bfloat16"]["run_dir"])
    assert cfg.model.max_len == (48 if cfg.model.family == "llama" else 64)
    ids = tokens(9)
    np.testing.assert_allclose(model(tf.constant(ids)).numpy(), torch_logits(ref["bf16_model"], ids), rtol=0, atol=1e-4)
    assert np.abs(torch_logits(ref["bf16_model"], ids) - torch_logits(ref["model"], ids)).max() > 1e-3  # rounded


def test_greedy_generation_gives_the_ids_of_transformers(ref):
    from tpu_llm.model.sampling import Sampler

    model, tokenizer, _ = restored(ref["float32"]["run_dir"])
    prompt = tokens(8, batch=1)
    with torch.no_grad():
        expected = ref["model"].generate(torch.tensor(prompt, dtype=torch.long), max_new_tokens=32, do_sample=False,
                                         eos_token_id=None, pad_token_id=0)[0, 8:].tolist()
    got = Sampler(model, tokenizer.eos_id, VOCAB).generate(prompt[0].tolist(), 32, temperature=0.0)
    assert len(expected) == 32 and got == expected


def export_hf(run_dir: str, output: str, *extra: str) -> str:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert cli.main(["export", "--run_dir", run_dir, "--format", "hf", "--output", output, *extra]) == 0
    return printed.getvalue()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_import_then_export_is_bit_identical_and_loads_in_transformers(ref, dtype, tmp_path):
    source, out = ref[dtype]["hf_dir"], str(tmp_path / "hf")
    printed = export_hf(ref[dtype]["run_dir"], out)
    assert f"in {dtype}" in printed
    original, exported = safetensors_io.Reader(source), safetensors_io.Reader(out)
    assert exported.names() == original.names()  # no tensor more or fewer (the tied GPT-2 head is not saved)
    for name in original.names():
        a, b = original.get(name), exported.get(name)
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), name
    if dtype == "bfloat16":
        return
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert type(loaded) is type(ref["model"])
    assert not any(info.values()), info  # no missing, unexpected or mismatched weights
    ids = tokens(11)
    np.testing.assert_array_equal(torch_logits(loaded.eval(), ids), torch_logits(ref["model"], ids))
    tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "The quick brown fox, café 日本"
    assert tok(text)["input_ids"] == restored(ref["float32"]["run_dir"])[1].encode(text)


# ---- issue 41's families ---------------------------------------------------------------------------------


def test_new_families_import_to_the_logits_of_transformers_within_1e_5(new_ref):
    model, _, cfg = restored(new_ref["float32"]["run_dir"])
    hf = new_ref["model"].config
    assert cfg.model.family == {"LlamaConfig": "llama", "Qwen2Config": "qwen2", "Qwen3Config": "qwen3",
                                "MistralConfig": "mistral"}[
        type(hf).__name__]
    assert cfg.model.tie_embeddings == hf.tie_word_embeddings and cfg.model.kv_heads() == 2
    assert cfg.model.head_size() == (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
    assert cfg.model.rope_scaling == ("llama3" if hf.rope_parameters["rope_type"] == "llama3" else "none")
    for length in (1, 7, 20, 100 if cfg.model.max_len >= 100 else 60):  # past the original context (llama3: 64)
        ids = tokens(length)
        np.testing.assert_allclose(model(tf.constant(ids)).numpy(), torch_logits(new_ref["model"], ids), rtol=0,
                                   atol=1e-5)


def test_new_families_generate_greedily_the_ids_of_transformers(new_ref):
    test_greedy_generation_gives_the_ids_of_transformers(new_ref)


def test_new_families_export_bit_identical_and_load_in_transformers(new_ref, tmp_path):
    out = str(tmp_path / "hf")
    export_hf(new_ref["float32"]["run_dir"], out)
    original, exported = safetensors_io.Reader(new_ref["float32"]["hf_dir"]), safetensors_io.Reader(out)
    assert exported.names() == original.names()  # the biases (qwen2) included, a tied head not saved
    for name in original.names():
        assert original.get(name).tobytes() == exported.get(name).tobytes(), name
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(loaded) is type(new_ref["model"])
    assert loaded.config.rope_parameters == new_ref["model"].config.rope_parameters
    ids = tokens(loaded.config.max_position_embeddings)  # the whole context: Mistral's window included
    np.testing.assert_array_equal(torch_logits(loaded.eval(), ids), torch_logits(new_ref["model"], ids))
