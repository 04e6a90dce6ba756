"""tpu-llm from Python: train a config, or load a run and use its model, in a notebook or a script.

    import tpu_llm

    summary = tpu_llm.train("tiny", run_dir="runs/mine", train__steps=50)   # train.steps=50
    run = tpu_llm.load("runs/mine")               # the newest readable checkpoint
    run.generate("def ", max_new_tokens=40, seed=1)   # text
    run.logits(run.tokenizer.encode("def f"))     # (1, T, vocab) numpy array
    run.model                                     # the Keras model (tpu_llm.model.GPT)

`tpu-llm train` and `tpu-llm generate` call these same functions. Overrides are config keys, dotted
(`**{"train.steps": 50}`) or with `__` for the dot (`train__steps=50`); they are checked as on the
command line (an unknown key is a UserError naming the nearest one). Nothing here prints unless told:
`train` prints its progress lines as the CLI does, `generate` returns text.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import numpy as np
import tensorflow as tf

from tpu_llm.config import Config, SampleConfig, config_from_dict, load_config
from tpu_llm.eval import in_loop
from tpu_llm.eval import run as eval_run  # (lm_eval itself loads only when evaluate is called)
from tpu_llm.model.transformer import GPT
from tpu_llm.tokenizers import check_covers
from tpu_llm.training import controller
from tpu_llm.training.checkpoint import load_for_generation
from tpu_llm.training.samples import print_samples

__all__ = ["LoadedRun", "load", "train"]


def _overrides(overrides: dict[str, Any]) -> dict[str, Any]:
    return {key.replace("__", "."): value for key, value in overrides.items()}


def train(config: str | Config | None = None, *, say: Callable[[str], None] | None = None, samples: bool = True,
          started: float | None = None, unstated: str = "", **overrides: Any) -> dict:
    """Train `config` (a preset's name such as "tiny", a YAML file, or a Config) with `overrides`, resuming
    the run in its run_dir if there is one; returns the summary (steps, losses, tokens/s, MFU, goodput, ...).

    `say` receives each line the CLI would print (default: printed); `samples=False` skips the samples
    at the end; `started` is the Unix time the run's wall time counts from (default: now); `unstated`
    (for the CLI) names what the command left out ("no --run_dir"), should the run directory refuse.
    """
    if isinstance(config, Config):  # a copy, then the overrides, checked as on the command line
        cfg = load_config(None, _overrides(overrides), base=config)
    else:
        cfg = load_config(config, _overrides(overrides))
    started = started or time.time()
    # train.eval_tasks' names, checked before anything is built: a typo fails in seconds, not hours later
    tasks = in_loop.check(cfg, say or controller.say_now)
    return controller.train(cfg, say=say, samples=samples, started=started, unstated=unstated, tasks=tasks)


@dataclasses.dataclass
class LoadedRun:
    """A trained run: its Keras `model` (weights of `checkpoint`), `tokenizer` and `config`."""
    model: GPT
    tokenizer: Any
    config: Config
    checkpoint: str
    notes: list[str]  # warnings from loading, e.g. an unreadable newest checkpoint skipped for the one before

    def logits(self, tokens: Sequence[int] | Sequence[Sequence[int]] | np.ndarray) -> np.ndarray:
        """Next-token logits for each position: (T,) or (B, T) token ids -> (B, T, vocab) float32 array
        (a 1-D input is one sequence), vocab the tokenizer's (a model padded past it has columns no token
        has; they are left out, as sampling leaves them out). At most model.max_len tokens per sequence."""
        ids = np.asarray(tokens, dtype=np.int32)
        if ids.ndim == 1:
            ids = ids[None]
        if ids.ndim != 2 or ids.shape[1] == 0:
            raise ValueError(f"tokens: give (T,) or (B, T) token ids with T >= 1, got shape {ids.shape}")
        if ids.shape[1] > self.config.model.max_len:
            raise ValueError(f"tokens: {ids.shape[1]} positions, more than model.max_len={self.config.model.max_len}")
        vocab = self.tokenizer.vocab_size
        if ids.min() < 0 or ids.max() >= vocab:
            raise ValueError(f"tokens: ids must be in [0, {vocab}) (the tokenizer's), got {ids.min()}..{ids.max()}")
        logits = self.model(tf.constant(ids), training=False)[..., :vocab]  # (B, T, vocab)
        return np.asarray(tf.cast(logits, tf.float32))

    def samples(self, prompt: str = "", num_samples: int = 1, max_new_tokens: int = 200, temperature: float = 0.8,
                top_k: int = 0, top_p: float = 1.0, seed: int = 0, say: Callable[[str], None] | None = None,
                prompt_source: str = "prompt", num_beams: int = SampleConfig.num_beams,
                length_penalty: float = SampleConfig.length_penalty, early_stopping: bool | str = False,
                num_return_sequences: int = SampleConfig.num_return_sequences) -> list[str]:
        """`num_samples` texts, each the prompt and its continuation (sample i draws with seed + i); `say`
        gets the lines `tpu-llm generate` prints (default: nothing is printed). `num_beams` > 1: a beam
        search instead (temperature 0 only), as transformers' generate(num_beams=..., do_sample=False)
        with its `length_penalty` and `early_stopping` (True, False or "never"): the `num_return_sequences`
        best beams, best first, each ending before its end-of-text token."""
        sample = {"num_samples": num_samples, "max_new_tokens": max_new_tokens, "prompt": prompt,
                  "temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed, "num_beams": num_beams,
                  "length_penalty": length_penalty, "early_stopping": early_stopping,
                  "num_return_sequences": num_return_sequences}
        cfg = config_from_dict({**self.config.to_dict(), "sample": sample}, source="generate")  # checks the values
        check_covers(self.tokenizer, prompt, prompt_source)
        return print_samples(self.model, self.tokenizer, cfg, say or (lambda line: None))

    def generate(self, prompt: str = "", max_new_tokens: int = 200, temperature: float = 0.8, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0, num_beams: int = SampleConfig.num_beams,
                 length_penalty: float = SampleConfig.length_penalty, early_stopping: bool | str = False) -> str:
        """The prompt and its continuation: `max_new_tokens` tokens sampled with the given settings
        (temperature 0 = greedy); the same seed gives the same text. `num_beams` > 1 (with temperature 0):
        the best beam of a beam search (see `samples`)."""
        return self.samples(prompt, 1, max_new_tokens, temperature, top_k, top_p, seed, num_beams=num_beams,
                            length_penalty=length_penalty, early_stopping=early_stopping)[0]

    def evaluate(self, tasks: str | Sequence[str], include_path: str = "", num_fewshot: int | None = None,
                 limit: int | None = None, batch_size: int = 8, log_samples: bool = False) -> dict:
        """lm-evaluation-harness `tasks` (names, groups or tags; a list or comma-separated) on these weights, as
        `tpu-llm eval` runs them (the `eval` extra; docs/evaluation.md): lm-eval's results dictionary, whose
        `results[task]` holds each metric (e.g. `"acc,none"`). `include_path`: a folder of your own task YAML
        (trusted: a task YAML can run Python); `limit`: documents per task (None: all); `log_samples`: also
        lm-eval's per-sample records, in `results["samples"][task]`."""
        return eval_run.on_weights(self.model, self.tokenizer, self.config, list(tasks) if not isinstance(tasks, str)
                                   else tasks, include_path, num_fewshot, limit, batch_size, log_samples)

    def perplexity(self, text_file: str, batch_size: int = 8) -> dict:
        """The perplexity of a UTF-8 text file on these weights, the whole file as one document, as
        `tpu-llm eval --text` computes it (the `eval` extra): {"tokens", "words", "bytes", "loglikelihood",
        "word_perplexity", "byte_perplexity", "bits_per_byte"}, lm-eval's metrics of its wikitext task."""
        return eval_run.text_on_weights(self.model, self.tokenizer, self.config, text_file, batch_size)


def load(run_dir: str) -> LoadedRun:
    """The run in `run_dir` (local or gs://) at its newest readable checkpoint. Reads only: takes no lock,
    so it works while the run is still training."""
    model, tokenizer, cfg, checkpoint, notes = load_for_generation(run_dir, with_checkpoint=True, with_notes=True)
    return LoadedRun(model, tokenizer, cfg, checkpoint, list(notes))
