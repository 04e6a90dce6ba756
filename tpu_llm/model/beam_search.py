"""Beam search with a KV cache, as Hugging Face transformers defines it (`generate(num_beams=N,
do_sample=False)`, GenerationMixin._beam_search): the same hypotheses, scores and stopping rules.

Each step extends every running beam by every token and keeps the 2 x num_beams best continuations by
summed log-probability (twice num_beams, so that num_beams of them go on even when every beam's best
continuation is the end-of-text token). Of those:
  - the num_beams best that did not stop (at eos, or at the last token allowed) are the running beams;
  - those among the first num_beams that stopped compete with the finished hypotheses for num_beams
    places, scored sum_logprobs / generated_length ** length_penalty (the length counts the eos; > 0
    favours long hypotheses, < 0 short ones).
The search ends at max_new_tokens, or earlier by `early_stopping`:
  true   as soon as num_beams hypotheses are finished;
  false  once the best running beam, scored at its current length, cannot beat the worst finished one;
  never  the same, at the length most favourable to it (max_new_tokens when length_penalty > 0).

XLA: the num_beams beams are the rows of one KV cache. One compiled step selects the beams (a top_k
over num_beams x vocab), reorders the cache rows to the beams they continue (a gather on the batch
axis) and runs the model on their new tokens. Finished hypotheses live in fixed (B, num_beams)
tensors: score, whether finished, the step they ended at, the running beam they continue and their
last token. The host keeps each step's (origin, token) back-pointers and follows them at the end to
rebuild the ids, so the compiled step does not depend on max_new_tokens and no (beams, length)
buffer is copied each step. A full cache is refilled with the newest half of each beam's context,
as the sampler does (sampling.py).
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from tpu_llm.config import EARLY_STOPPING
from tpu_llm.model.sampling import prefill
from tpu_llm.model.transformer import GPT

STOP_TRUE, STOP_NEVER = EARLY_STOPPING.index("true"), EARLY_STOPPING.index("never")  # its codes in the step
IMPOSSIBLE = -1.0e9  # added to a score that must not be chosen (transformers' value)


@dataclasses.dataclass
class Hypothesis:
    ids: list[int]  # the new token ids, the eos included when it ended there
    score: float  # sum of the ids' log-probabilities / len(ids) ** length_penalty


def _pick(x, index):
    """x (B, M, ...) at `index` (B, k) along axis 1 -> (B, k, ...)."""
    return tf.gather(x, index, batch_dims=1)


class BeamSearcher:
    def __init__(self, model: GPT, eos_id: int, vocab_size: int):
        self.model, self.eos_id = model, eos_id
        self.vocab_size = vocab_size  # the tokenizer's; ids past it only pad the embedding table
        self.max_len = model.cfg.max_len
        self._prefill = tf.function(self._prefill_fn, reduce_retracing=True)
        self._step = tf.function(self._step_fn, jit_compile=True)

    def _prefill_fn(self, tokens, repeats):
        """Last logits (B * repeats, V) and cache of `tokens` (B, T), each row repeated `repeats` times."""
        logits, cache = prefill(self.model, tokens, self.vocab_size)
        return tf.repeat(logits, repeats, axis=0), [(tf.repeat(k, repeats, axis=0), tf.repeat(v, repeats, axis=0)) for k, v in cache]

    def _select_fn(self, logits, state, t, max_new_tokens, length_penalty, early_stopping):
        """Step t (0-based) of the search, from the logits (B * nb, V) of the running beams. Returns the
        new state, each new running beam's origin (the beam it continues) and token (B, nb), and
        whether the search is over."""
        B, nb = state["running"].shape
        V = logits.shape[-1]
        log_probs = tf.nn.log_softmax(tf.cast(logits, tf.float32))  # (B * nb, V)
        total = tf.reshape(log_probs, [B, nb, V]) + state["running"][:, :, None]  # (B, nb, V)
        top, index = tf.math.top_k(tf.reshape(total, [B, nb * V]), 2 * nb)  # (B, 2 nb), best first
        beam, token = index // V, index % V
        stops = (token == self.eos_id) | (t + 1 >= max_new_tokens)  # (B, 2 nb)
        # the nb best continuations that did not stop run on
        running, keep = tf.math.top_k(top + IMPOSSIBLE * tf.cast(stops, tf.float32), nb)  # (B, nb)
        origin, next_token = _pick(beam, keep), _pick(token, keep)
        # those of the first nb that stopped join the finished hypotheses, if they beat one
        candidate = stops & (tf.range(2 * nb) < nb)[None, :]
        score = top / tf.cast(t + 1, tf.float32) ** length_penalty
        stop_when_full = early_stopping == STOP_TRUE  # early_stopping true: num_beams finished hypotheses are the result
        full = tf.reduce_all(state["finished"], -1, keepdims=True) & stop_when_full
        score += IMPOSSIBLE * tf.cast(full, tf.float32)
        score += IMPOSSIBLE * tf.cast(~state["open"], tf.float32)
        score += IMPOSSIBLE * tf.cast(~candidate, tf.float32)
        scores, best = tf.math.top_k(tf.concat([state["scores"], score], 1), nb)  # (B, nb)

        def merged(old, new):
            return _pick(tf.concat([old, new], 1), best)

        finished = merged(state["finished"], candidate)
        new_state = {"running": running, "scores": scores, "finished": finished,
                     "end": merged(state["end"], tf.fill([B, 2 * nb], t)), "parent": merged(state["parent"], beam),
                     "last": merged(state["last"], token)}
        # can the best running beam still beat the worst finished hypothesis? (never again once not)
        length = tf.where((early_stopping == STOP_NEVER) & (length_penalty > 0), max_new_tokens, t + 1)
        best_possible = running[:, :1] / tf.cast(length, tf.float32) ** length_penalty  # (B, 1)
        worst = tf.where(finished, tf.reduce_min(scores, -1, keepdims=True), IMPOSSIBLE)  # (B, nb)
        new_state["open"] = state["open"] & tf.reduce_any(best_possible > worst, -1, keepdims=True)
        all_full = tf.reduce_all(finished) & stop_when_full
        done = ~(tf.reduce_any(new_state["open"]) & ~all_full & ~tf.reduce_all(stops))
        return new_state, origin, next_token, done

    def _step_fn(self, logits, cache, pos, state, t, max_new_tokens, length_penalty, early_stopping):
        """_select_fn, then the cache rows reordered to the new beams and their tokens run at `pos`."""
        state, origin, token, done = self._select_fn(logits, state, t, max_new_tokens, length_penalty,
                                                     early_stopping)
        B, nb = origin.shape
        rows = tf.reshape(origin + nb * tf.range(B)[:, None], [-1])  # (B * nb,) rows of the cache
        cache = [(tf.gather(k, rows), tf.gather(v, rows)) for k, v in cache]
        logits, cache = self.model.call_with_cache(tf.reshape(token, [-1, 1]), cache, pos)
        return logits[:, -1, :self.vocab_size], cache, state, origin, token, done

    def generate(self, prompt: list[int], max_new_tokens: int, num_beams: int = 4, length_penalty: float = 1.0,
                 early_stopping: bool | str = False, num_return_sequences: int = 1) -> list[Hypothesis]:
        """The `num_return_sequences` best hypotheses after `prompt` (which may be empty: starts after
        end-of-text), best first. `early_stopping`: True, False or "never" (or their names)."""
        stopping = str(early_stopping).lower()
        if max_new_tokens < 1 or not 1 <= num_return_sequences <= num_beams or stopping not in EARLY_STOPPING:
            raise ValueError(f"beam search: needs max_new_tokens >= 1 (got {max_new_tokens}), num_return_sequences "
                             f"in 1..num_beams={num_beams} (got {num_return_sequences}) and early_stopping True, "
                             f"False or 'never' (got {early_stopping!r})")
        context = list(prompt) or [self.eos_id]
        window = context[-self.max_len:]
        logits, cache = self._prefill(tf.constant([window], tf.int32), tf.constant(num_beams))
        pos = len(window)
        settings = (tf.constant(max_new_tokens, tf.int32), tf.constant(length_penalty, tf.float32),
                    tf.constant(EARLY_STOPPING.index(stopping), tf.int32))
        state = initial_state(1, num_beams)
        trail = []  # per step: the running beams' origins and tokens, (nb,) numpy arrays
        for t in range(max_new_tokens):
            # the step also runs the new tokens; on the last step or a full cache those logits go unused (and
            # the position is clamped into the cache, which is dropped or refilled next): one compiled program
            logits, cache, state, origin, token, done = self._step(
                logits, cache, tf.constant(min(pos, self.max_len - 1), tf.int32), state, tf.constant(t), *settings)
            trail.append((origin.numpy()[0], token.numpy()[0]))  # (the host waits for `done` anyway)
            if t == max_new_tokens - 1 or bool(done):
                break
            if pos == self.max_len:  # cache full: re-run the newest half of each beam's context
                keep = self.max_len // 2 or 1
                rows = [(context + _follow(trail, t, j))[-keep:] for j in range(num_beams)]
                logits, cache = self._prefill(tf.constant(rows, tf.int32), tf.constant(1))
                pos = keep
            else:
                pos += 1
        out = []
        for j in range(num_return_sequences):
            end, parent = int(state["end"][0, j]), int(state["parent"][0, j])
            ids = (_follow(trail, end - 1, parent) if end else []) + [int(state["last"][0, j])]
            out.append(Hypothesis(ids, float(state["scores"][0, j])))
        return out


def initial_state(batch: int, num_beams: int) -> dict:
    """Only beam 0 runs at first (the others' -1e9 keep num_beams copies of one continuation out);
    no hypothesis is finished."""
    shape = [batch, num_beams]
    first = tf.one_hot(tf.zeros([batch], tf.int32), num_beams, on_value=0.0, off_value=IMPOSSIBLE)
    zeros = tf.zeros(shape, tf.int32)
    return {"running": first, "scores": tf.fill(shape, IMPOSSIBLE), "finished": tf.zeros(shape, tf.bool),
            "end": zeros, "parent": zeros, "last": zeros, "open": tf.ones([batch, 1], tf.bool)}


def _follow(trail, step: int, beam: int) -> list[int]:
    """The ids of running beam `beam` after `step`, by following the back-pointers of `trail`."""
    ids = []
    for origin, token in reversed(trail[:step + 1]):
        ids.append(int(token[beam]))
        beam = int(origin[beam])
    return ids[::-1]
