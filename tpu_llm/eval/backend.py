"""`TpuLM`: a model backend of lm-evaluation-harness (a subclass of its `TemplateLM`) on a loaded run.

It follows the rules of lm-eval's own `hf` backend (lm_eval/models/huggingface.py, 0.4.13) for a causal model,
so that the same task gives the same requests and the same numbers:
- text is encoded as the tokenizer does by default (special tokens added: Llama's BOS leads), unless it already
  begins with the prefix token's text or lm-eval asks for no special tokens; an empty context is the prefix
  token (the BOS token, else EOS); context and continuation are split as TemplateLM._encode_pair splits them
  (trailing spaces of the context move to the continuation);
- a context and continuation longer than max_len + 1 tokens lose tokens from the left (said once);
- loglikelihood_rolling scores disjoint windows of max_len tokens (lm_eval.utils.get_rolling_token_windows,
  context_len 1), the first one after the prefix token;
- generate_until encodes the context left-truncated to max_len - max_gen_toks, generates greedily at
  temperature 0 (stopping at end-of-text, or after the chunk of `gen_chunk` tokens whose text holds an `until`
  string) and cuts the text at the first `until` string.

Scoring is batched: requests sorted longest first, `batch_size` rows a batch (short batches padded with empty
rows), each row padded on the right to the smallest of a few static lengths (powers of two up to max_len). One
XLA-compiled function per length computes logits -> log_softmax -> the continuation's log-probabilities and
whether each continuation token is the argmax, so only (batch,) arrays come back to the host.

Data parallel: given a tf.distribute strategy of R replicas whose scope holds the model's variables (`from_run`
with `strategy=`), each call scores R x batch_size rows, replica r its rows [r B, (r+1) B), through the
strategy's own `run` (TPUStrategy compiles the replica function for the TPU cores; MirroredStrategy runs the
XLA-compiled function on each device). A row's numbers do not depend on which replica scores it. Generation
stays on one device (the first replica's copy of the weights).
"""

from __future__ import annotations

import copy
import sys
from typing import Callable

import numpy as np
import tensorflow as tf
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from tqdm import tqdm

from tpu_llm.errors import UserError
from tpu_llm.model.sampling import Sampler
from tpu_llm.training.checkpoint import load_for_generation

SMALLEST_BUCKET = 16


def buckets(max_len: int) -> list[int]:
    """The padded lengths rows are scored at: powers of two from SMALLEST_BUCKET, then max_len itself."""
    out, n = [], SMALLEST_BUCKET
    while n < max_len:
        out.append(n)
        n *= 2
    return out + [max_len]


class TpuLM(TemplateLM):
    """lm-eval's model interface on a run's Keras `model` and tpu_llm `tokenizer` (see `from_run`).

    `batch_size` rows are scored at once; `max_gen_toks` is generate_until's default when a task gives none;
    `say` gets the one-line notes (left truncation), default standard error; `bars=False` shows no progress
    bars of requests (the training loop's evaluations, between its own progress lines)."""

    def __init__(self, model, tokenizer, config, batch_size: int = 8, max_gen_toks: int = 256,
                 say: Callable[[str], None] | None = None, bars: bool = True, strategy=None):
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model, self.tok, self.run_config = model, tokenizer, config
        self.max_length = config.model.max_len
        self.batch_size = batch_size
        self.max_gen_toks = max_gen_toks
        self.vocab = tokenizer.vocab_size  # columns past it only pad the embedding table
        self.say = say or (lambda line: print(line, file=sys.stderr))
        self._encode = getattr(tokenizer, "encode_plain", tokenizer.encode)
        self._scorers: dict[int, Callable] = {}
        self._sampler: Sampler | None = None
        self._truncated = False
        self._covered: set[str] = set()  # each character seen in a request (the lacking ones said once)
        self._lacking_said = False
        self.gen_chunk = 32  # new tokens per sampler call in generate_until, between checks for `until`
        self.bars = bars
        # data parallel over the replicas of `strategy` (None or one replica: this device alone)
        self.strategy = strategy if strategy is not None and strategy.num_replicas_in_sync > 1 else None
        self.replicas = strategy.num_replicas_in_sync if self.strategy else 1

    @classmethod
    def from_run(cls, run_dir: str, strategy=None, **kwargs) -> "TpuLM":
        """The backend on the newest readable checkpoint of `run_dir` (as `tpu-llm generate` loads it); with a
        `strategy`, the weights are its variables and scoring is data parallel over its replicas."""
        model, tokenizer, config = load_for_generation(run_dir, strategy=strategy)
        return cls(model, tokenizer, config, strategy=strategy, **kwargs)

    # ---- TemplateLM's tokenization --------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    @property
    def prefix_token_id(self) -> int:
        bos = getattr(self.tok, "bos_id", None)
        return self.tok.eos_id if bos is None else bos

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs) -> list[int]:
        if add_special_tokens is None:  # the tokenizer's default, unless the text already begins with BOS
            add_special_tokens = not (self._prefix_text and string.startswith(self._prefix_text))
        self._check_covered(string)
        ids = self.tok.encode(string) if add_special_tokens else self._encode(string)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def _check_covered(self, text: str) -> None:
        """Say once that the tasks' text holds characters the run's vocabulary does not (a char vocabulary built
        from other data): they encode to the unknown id, or to nothing, which training never showed the model.
        Not a refusal: one emoji in one of thousands of documents should not stop an evaluation."""
        new = [ch for ch in dict.fromkeys(text) if ch not in self._covered]
        if not new:
            return
        self._covered.update(new)
        lacking = self.tok.missing("".join(new))  # (each character is checked on its own: one pass for all)
        if lacking and not self._lacking_said:
            self._lacking_said = True
            shown = ", ".join(repr(ch) for ch in lacking[:10])
            self.say(f"note: the tasks' text holds characters the run's {self.tok.kind} vocabulary does not hold "
                     f"({shown}): they are scored as the tokenizer encodes them (the unknown id, or nothing), which "
                     "the model never saw in training, so those requests' numbers mean little (said once)")

    def tok_decode(self, tokens) -> str:
        return self.tok.decode(tokens)

    def _special_text(self, token_id: int) -> str | None:
        """A special token's text (e.g. "<|endoftext|>"), where the tokenizer can tell it (HF tokenizers)."""
        inner = getattr(self.tok, "_tok", None)
        return inner.decode([token_id], skip_special_tokens=False) if inner is not None else None

    @property
    def _prefix_text(self) -> str | None:
        return self._special_text(self.prefix_token_id)

    # ---- loglikelihood ----------------------------------------------------------------------------------

    def _scorer(self, length: int) -> Callable:
        """The compiled function for rows padded to `length`: (tokens, targets, mask) (R B, length) ->
        (sum of the targets' log-probabilities where mask is 1, whether each of them is the argmax), (R B,)."""
        if length not in self._scorers:
            B, V, R = self.batch_size, self.vocab, self.replicas
            spec = [tf.TensorSpec([R * B, length], tf.int32)] * 2 + [tf.TensorSpec([R * B, length], tf.float32)]

            def score(tokens, targets, mask):  # (B, length) -> (B,), (B,)
                logits = tf.cast(self.model(tokens, training=False)[..., :V], tf.float32)
                logprobs = tf.nn.log_softmax(logits, axis=-1)
                picked = tf.gather(logprobs, targets, axis=2, batch_dims=2)  # (B, length)
                greedy = tf.argmax(logits, axis=-1, output_type=tf.int32)
                return (tf.reduce_sum(picked * mask, axis=-1),
                        tf.reduce_all((greedy == targets) | (mask == 0), axis=-1))

            if self.strategy is None:
                self._scorers[length] = tf.function(score, jit_compile=True, input_signature=spec)
            else:
                self._scorers[length] = self._replicated(score, spec)
        return self._scorers[length]

    def _replicated(self, score: Callable, spec: list) -> Callable:
        """`score` on every replica of the strategy, replica r taking rows [r B, (r+1) B) of the (R B, length)
        inputs; the results concatenated in replica order. MirroredStrategy runs the replica function as is
        (an XLA-compiled call on each device); TPUStrategy compiles the whole replica function for its cores."""
        B, strategy = self.batch_size, self.strategy
        on_tpu = isinstance(strategy, tf.distribute.TPUStrategy)
        compiled = score if on_tpu else tf.function(score, jit_compile=True)

        def replica(tokens, targets, mask):
            r = tf.distribute.get_replica_context().replica_id_in_sync_group
            rows = [a[r * B:(r + 1) * B] for a in (tokens, targets, mask)]
            return compiled(*rows)

        @tf.function(input_signature=spec)
        def scored(tokens, targets, mask):
            totals, greedy = strategy.run(replica, args=(tokens, targets, mask))
            return (tf.concat(strategy.experimental_local_results(totals), axis=0),
                    tf.concat(strategy.experimental_local_results(greedy), axis=0))

        return scored

    def _row(self, context: list[int], continuation: list[int]):
        """(input tokens, targets, mask) of one request, unpadded, as lm-eval's hf backend cuts it."""
        if not context or not continuation:
            raise ValueError("a loglikelihood request needs a context and a continuation of at least one token")
        whole = context + continuation
        if len(whole) > self.max_length + 1 and not self._truncated:
            self._truncated = True
            self.say(f"note: a context and continuation of {len(whole)} tokens is longer than the model's max_len="
                     f"{self.max_length} (+1): tokens are dropped from the left, as lm-eval's hf backend does "
                     "(said once)")
        inp = whole[-(self.max_length + 1):][:-1]
        n, c = len(inp), min(len(continuation), len(inp))
        targets = [0] * (n - c) + continuation[-c:]
        return inp, targets, [0.0] * (n - c) + [1.0] * c

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(log-probability of the continuation, whether greedy decoding gives it) per request
        ((context text, continuation text) or None, context ids, continuation ids), in the order given."""
        order = sorted(range(len(requests)), key=lambda i: (-len(requests[i][1]) - len(requests[i][2]),
                                                           tuple(requests[i][1] + requests[i][2])))
        out: list[tuple[float, bool] | None] = [None] * len(requests)
        B, sizes = self.batch_size * self.replicas, buckets(self.max_length)
        with tqdm(total=len(requests), disable=disable_tqdm or not self.bars, desc="loglikelihood requests") as bar:
            for start in range(0, len(order), B):
                chunk = order[start:start + B]
                rows = [self._row(requests[i][1], requests[i][2]) for i in chunk]
                length = next(s for s in sizes if s >= max(len(r[0]) for r in rows))
                arrays = [np.zeros([B, length], dtype) for dtype in (np.int32, np.int32, np.float32)]
                for j, row in enumerate(rows):
                    for array, values in zip(arrays, row):
                        array[j, :len(values)] = values
                total, greedy = self._scorer(length)(*[tf.constant(a) for a in arrays])
                total, greedy = total.numpy(), greedy.numpy()
                for j, i in enumerate(chunk):
                    out[i] = (float(total[j]), bool(greedy[j]))
                    if requests[i][0] is not None:
                        self.cache_hook.add_partial("loglikelihood", requests[i][0], out[i])
                bar.update(len(chunk))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """The log-probability of each request's whole text, summed over windows of max_len tokens."""
        windows, owner = [], []
        for k, (text,) in enumerate(req.args for req in requests):
            for pair in lm_utils.get_rolling_token_windows(token_list=self.tok_encode(text),
                                                           prefix_token=self.prefix_token_id,
                                                           max_seq_len=self.max_length, context_len=1):
                windows.append((None,) + lm_utils.make_disjoint_window(pair))
                owner.append(k)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals = [0.0] * len(requests)
        for k, (logprob, _) in zip(owner, scores):
            totals[k] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ---- generation -------------------------------------------------------------------------------------

    def _generate(self, prompt: list[int], max_gen_toks: int, until: list[str], **sampling) -> list[int]:
        """Up to `max_gen_toks` new ids after `prompt`, `gen_chunk` at a time, stopping at end-of-text or after
        the chunk whose text holds an `until` string (the text is cut there afterwards, as lm-eval's hf backend
        cuts it: a greedy continuation's beginning does not depend on where generation stops)."""
        ids: list[int] = []
        while len(ids) < max_gen_toks:
            n = min(self.gen_chunk, max_gen_toks - len(ids))
            new = self._sampler.generate(prompt + ids, n, seed=len(ids), stop_at_eos=True, **sampling)
            ids += new
            if len(new) < n:  # end-of-text
                break
            text = self.tok_decode(ids)
            if any(term and term in text for term in until):
                break
        return ids

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each request's continuation, greedy at temperature 0 (the task's default), cut at its `until`."""
        if self._sampler is None:
            self._sampler = Sampler(self.model, self.tok.eos_id, self.vocab)
        eos = self._special_text(self.eot_token_id) or self.tok_decode([self.eot_token_id]) or None
        out = []
        for req in tqdm(requests, disable=disable_tqdm or not self.bars, desc="generate_until requests"):
            context, gen_kwargs = req.args
            kwargs = normalize_gen_kwargs(copy.deepcopy(gen_kwargs), self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen_toks = int(kwargs.pop("max_gen_toks"))
            temperature = float(kwargs.pop("temperature", 0.0) or 0.0) if kwargs.pop("do_sample", False) else 0.0
            room = self.max_length - max_gen_toks
            if room <= 0:
                raise UserError(f"a task asks for up to {max_gen_toks} new tokens (its max_gen_toks), which leaves no "
                                f"room for its prompt in this model's max_len={self.max_length}; evaluate a model with a "
                                "longer context, or give the task a smaller max_gen_toks in its YAML")
            prompt = self.tok_encode(context, left_truncate_len=room) or [self.eot_token_id]
            ids = self._generate(prompt, max_gen_toks, until, temperature=temperature,
                                 top_k=int(kwargs.pop("top_k", 0) or 0), top_p=float(kwargs.pop("top_p", 1.0) or 1.0))
            text = postprocess_generated_text(self.tok_decode(ids), stop=until, think_end_token=None)
            out.append(text)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
        return out
