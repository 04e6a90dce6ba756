#!/usr/bin/env python3
"""A tiny random checkpoint in the Hugging Face hub's layout, standing in for `huggingface-cli download`
where nothing can be downloaded (the docs checker, scripts/docs_check.py; a try without a network):

    python scripts/tiny_hf.py gpt2 DIR     # GPT2LMHeadModel: 12 layers (as GPT-2 small), width 32, 32 positions, 300 ids
    python scripts/tiny_hf.py llama DIR    # LlamaForCausalLM: 2 layers, width 32, 4 heads over 2 kv heads, 64 positions
    python scripts/tiny_hf.py llama3 DIR   # LlamaForCausalLM as Llama 3.2's config: llama3 rotary scaling, tied head, 131072 positions
    python scripts/tiny_hf.py qwen2 DIR    # Qwen2ForCausalLM as Qwen2.5 0.5B/1.5B's: q/k/v biases, tied head, 32768 positions

All carry a byte-level BPE tokenizer.json of 300 ids. GPT-2 is written by the import tests' helper (the hub
file's names, no PyTorch needed); the others by transformers' own `save_pretrained` (the reference extra). The
weights are random: text generated from them is noise, and training them works like any import.
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's start-up lines
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
# Llama 3.2's published rotary settings (its config.json's rope_scaling)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("gpt2", "llama", "llama3", "qwen2"):
        print(__doc__.strip().splitlines()[0], "\nusage: tiny_hf.py gpt2|llama|llama3|qwen2 DIR", file=sys.stderr)
        return 2
    from helpers import GPT2_CONFIG, HF_VOCAB, write_bpe_tokenizer, write_gpt2

    family, folder = argv
    if family == "gpt2":
        write_gpt2(folder, {**GPT2_CONFIG, "n_layer": 12}, hub=True)  # 12: `train.freeze=blocks:0-5` as for GPT-2 small
    else:
        import torch
        import transformers

        torch.manual_seed(0)
        layout = dict(vocab_size=HF_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, bos_token_id=0, eos_token_id=0)
        # llama3 and qwen2 keep their published contexts, so a page's `import --max_len 2048` means what it says there
        if family == "llama":
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
                **layout, max_position_embeddings=64, tie_word_embeddings=False))
        elif family == "llama3":
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
                **layout, max_position_embeddings=131072, tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE))
        else:  # Qwen2's q/k/v biases and tied head are what a llama stand-in would not exercise
            model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
                **layout, max_position_embeddings=32768, rope_theta=1000000.0, tie_word_embeddings=True))
        model.save_pretrained(folder)
        write_bpe_tokenizer(folder)
    print(f"tiny_hf   a random {family} checkpoint in {folder} (stands in for a download)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
