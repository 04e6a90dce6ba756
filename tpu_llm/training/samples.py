"""The samples a run prints at its end (and `tpu-llm generate` / `LoadedRun.samples` print): texts drawn
from the prompt with the sample.* settings, by a copy of the model on this process's own device."""

from __future__ import annotations

from typing import Callable

from tpu_llm.config import Config
from tpu_llm.model import GPT
from tpu_llm.model.beam_search import BeamSearcher
from tpu_llm.model.sampling import Sampler, continuation


def local_copy(model: GPT, cfg: Config) -> GPT:
    """The model's weights in a model of this process's default device, outside any strategy: sampling
    needs no replicas, and variables on ps tasks or TPU cores cannot be read by a host-compiled step."""
    copy = GPT.from_config(cfg).build_weights()
    copy.set_weights(model.get_weights())
    return copy


def print_samples(model: GPT, tokenizer, cfg: Config, say: Callable[[str], None]) -> list[str]:
    """cfg.sample.num_samples texts, each the prompt and its continuation, each told to `say` with a line
    naming its settings before it (sample i draws with seed sample.seed + i)."""
    s = cfg.sample
    if s.num_beams > 1:
        return print_beams(model, tokenizer, cfg, say)
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


def print_beams(model: GPT, tokenizer, cfg: Config, say: Callable[[str], None]) -> list[str]:
    """sample.num_return_sequences texts from a beam search (each without its final end-of-text)."""
    s = cfg.sample
    prompt = tokenizer.encode(s.prompt)
    beams = BeamSearcher(model, tokenizer.eos_id, tokenizer.vocab_size).generate(
        prompt, s.max_new_tokens, s.num_beams, s.length_penalty, s.early_stopping, s.num_return_sequences)
    texts = []
    for i, beam in enumerate(beams):
        ids = beam.ids[:-1] if beam.ids[-1] == tokenizer.eos_id else beam.ids
        texts.append(s.prompt + continuation(tokenizer, prompt, ids))
        say(f"--- beam {i + 1} of {s.num_beams} (score {beam.score:.4f}, length_penalty {s.length_penalty}, "
            f"early_stopping {s.early_stopping})")
        say(texts[-1])
    return texts
