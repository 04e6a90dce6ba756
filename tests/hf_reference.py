"""Tiny random transformers models (the reference implementation, PyTorch on the CPU), saved with
save_pretrained and imported with `tpu-llm import`: the builders tests/test_hf.py and tests/test_eval.py share.
Importing this module skips the importing test module where torch or transformers is missing (the
`reference` extra)."""

from __future__ import annotations

import contextlib
import copy
import io

import pytest

torch = pytest.importorskip("torch", reason="the reference tests need torch: pip install -e '.[reference]'")
transformers = pytest.importorskip("transformers", reason="the reference tests need transformers 5: pip install "
                                   "-e '.[reference]' (Python >= 3.11)")

from helpers import write_bpe_tokenizer  # noqa: E402

from tpu_llm import cli  # noqa: E402

VOCAB = 300


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


def build(family: str, root, dtypes=("float32", "bfloat16"), tokenizer=write_bpe_tokenizer):
    """The tiny reference model of `family`, saved in `dtypes` with the tokenizer `tokenizer(folder)` writes
    (write_bpe_tokenizer's by default), and imported from each."""
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
        tokenizer(hf_dir)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            # llama in bfloat16: also a context shorter than config.json's (--max_len: the KV cache's size)
            shorter = ["--max_len", "48"] if family == "llama" and dtype == "bfloat16" else []
            assert cli.main(["import", "--from", hf_dir, "--run_dir", run_dir, *shorter]) == 0
        out[dtype] = {"hf_dir": hf_dir, "run_dir": run_dir, "printed": printed.getvalue()}
    return out
