"""The samples a run prints at its end (and `tpu-llm generate` / `LoadedRun.samples` print): texts drawn
from the prompt with the sample.* settings, by a copy of the model on this process's own device."""

from __future__ import annotations

from typing import Callable

from tpu_llm.config import Config
from tpu_llm.model import GPT
from tpu_llm.model.sampling import Sampler, continuation


def local_copy(model: GPT, cfg: Config) -> GPT:
    """The model's weights in a model of this process's default device, outside any strategy: sampling
    needs no replicas, and variables on ps tasks or TPU cores cannot be read by a host-compiled step."""
    copy = GPT(cfg.model, cfg.model.vocab_size).build_weights()
    copy.set_weights(model.get_weights())
    return copy


def print_samples(model: GPT, tokenizer, cfg: Config, say: Callable[[str], None]) -> list[str]:
    """cfg.sample.num_samples texts, each the prompt and its continuation, each told to `say` with a line
    naming its settings before it (sample i draws with seed sample.seed + i)."""
    s = cfg.sample
    sampler = Sampler(model, tokenizer.eos_id, tokenizer.vocab_size)
    prompt = tokenizer.encode(s.prompt)  # "" gives [] (or an hf tokenizer's BOS)
    texts = []
    for i in range(s.num_samples):
        ids = sampler.generate(prompt, s.max_new_tokens, s.temperature, s.top_k, s.top_p, seed=s.seed + i)
        texts.append(s.prompt + continuation(tokenizer, prompt, ids))
        say(f"--- sample {i + 1} (temperature {s.temperature}, top_k {s.top_k}, top_p {s.top_p}, "
            f"seed {s.seed + i})")
        say(texts[-1])
    return texts
