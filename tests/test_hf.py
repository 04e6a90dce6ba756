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
import copy
import io

import numpy as np
import pytest
import tensorflow as tf

torch = pytest.importorskip("torch", reason="the reference tests need torch: pip install -e '.[reference]'")
transformers = pytest.importorskip("transformers", reason="the reference tests need transformers 5: pip install "
                                   "-e '.[reference]' (Python >= 3.11)")

from helpers import write_bpe_tokenizer  # noqa: E402

from tpu_llm import cli  # noqa: E402
from tpu_llm.interop import safetensors_io

VOCAB = 300
LENGTHS = (1, 7, 20)  # padding-free batches, one per length


# Llama's layout, tiny: 4 query heads over 2 kv heads of size 8
LAYOUT = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, initializer_range=0.2, bos_token_id=0, eos_token_id=0)
# wavelengths 2 pi 10000^(i/4) = 6.3, 63, 628, 6283 against 64/4 and 64/1: kept, smoothed, scaled, scaled
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def reference_model(family: str):
    """A tiny random transformers model of `family` (a family of tpu-llm's, or llama3)."""
    if family == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4, initializer_range=0.2, bos_token_id=0,
            eos_token_id=0))
    if family == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            **LAYOUT, max_position_embeddings=64, rope_theta=50000.0, tie_word_embeddings=False))
    if family == "llama3":  # Llama 3.2's shape of config: scaled rotary frequencies, tied head
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            **LAYOUT, max_position_embeddings=128, rope_parameters=LLAMA3_ROPE, tie_word_embeddings=True))
    if family == "qwen2":  # Qwen2.5 0.5B/1.5B's: q/k/v biases, tied head
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
            **LAYOUT, max_position_embeddings=64, rope_theta=20000.0, tie_word_embeddings=True))
    if family == "qwen3":  # Qwen3 0.6B's shape: q/k norms per head, heads wider than hidden / heads, tied head
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
            **LAYOUT, head_dim=16, max_position_embeddings=64, rope_theta=1000000.0, tie_word_embeddings=True))
    return transformers.MistralForCausalLM(transformers.MistralConfig(  # a window that covers the whole context
        **LAYOUT, max_position_embeddings=64, sliding_window=64, rope_theta=30000.0, tie_word_embeddings=False))


def build(family: str, root, dtypes=("float32", "bfloat16")):
    """The tiny reference model of `family`, saved in `dtypes` and imported from each."""
    torch.manual_seed(0)
    model = reference_model(family)
    with torch.no_grad():  # norms start at 1 and biases at 0: move them, so that a swap would show
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.eval()
    rounded = copy.deepcopy(model)  # the parameter values a bfloat16 file holds (not .to(): it rounds buffers too,
    with torch.no_grad():           # such as Llama's rotary inv_freq, which a loaded model recomputes)
        for p in rounded.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    out = {"model": model, "bf16_model": rounded}
    for dtype in dtypes:
        hf_dir, run_dir = str(root / f"{family}-{dtype}"), str(root / f"{family}-{dtype}-run")
        # (.to converts in place); bfloat16 in shards: model.safetensors.index.json, read shard by shard
        copy.deepcopy(model).to(getattr(torch, dtype)).save_pretrained(hf_dir, **({"max_shard_size": "20KB"} if dtype == "bfloat16" else {}))
        write_bpe_tokenizer(hf_dir)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            # llama in bfloat16: also a context shorter than config.json's (--max_len: the KV cache's size)
            shorter = ["--max_len", "48"] if family == "llama" and dtype == "bfloat16" else []
            assert cli.main(["import", "--from", hf_dir, "--run_dir", run_dir, *shorter]) == 0
        out[dtype] = {"hf_dir": hf_dir, "run_dir": run_dir, "printed": printed.getvalue()}
    return out


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
