"""Beam search (tpu_llm/model/beam_search.py) against transformers' generate(num_beams=4, do_sample=False).

A tiny random GPT2LMHeadModel and LlamaForCausalLM (grouped-query attention, untied head), built and
imported once per module through `tpu-llm import`; one BeamSearcher each, so the decode step compiles
once. The end-of-text id is set to a token the model likes (one its own greedy continuation reaches
within a few tokens), so that beams end there and finished hypotheses compete with running ones: each
test checks that they did. Every comparison is token for token, over several prompts, with the scores
(sequences_scores) within 1e-4. Without transformers: the scores are the log-probabilities of the ids
under the model, past the context too (the cache refilled), and one beam is greedy decoding.
"""

from __future__ import annotations

import contextlib
import io

import numpy as np
import pytest
import tensorflow as tf

from tpu_llm.config import ModelConfig
from tpu_llm.model import GPT
from tpu_llm.model.beam_search import BeamSearcher
from tpu_llm.model.sampling import Sampler

VOCAB, BEAMS, NEW = 300, 4, 10
PROMPT_LENGTHS = (3, 6, 11)


def build(family: str, root):
    """The tiny reference model of `family`, imported; (torch model, our model, eos id, prompts)."""
    import torch
    import transformers
    from helpers import write_bpe_tokenizer

    from tpu_llm import cli
    from tpu_llm.training.checkpoint import load_for_generation

    torch.manual_seed(1)
    if family == "gpt2":
        config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                         initializer_range=0.2)
        reference = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                          tie_word_embeddings=False, initializer_range=0.2)
        reference = transformers.LlamaForCausalLM(config)
    reference.eval()
    reference.save_pretrained(root / "hf")
    write_bpe_tokenizer(root / "hf")
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli.main(["import", "--from", str(root / "hf"), "--run_dir", str(root / "run")]) == 0
    model, _, _ = load_for_generation(str(root / "run"))
    rng = np.random.default_rng(7)
    prompts = [rng.integers(1, VOCAB, n).tolist() for n in PROMPT_LENGTHS]
    with torch.no_grad():  # the end-of-text id: the 3rd token of the first prompt's greedy continuation
        greedy = reference.generate(torch.tensor([prompts[0]]), max_new_tokens=3, do_sample=False, num_beams=1,
                                    eos_token_id=None, pad_token_id=0)[0, -1]
    return reference, model, int(greedy), prompts


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def ref(request, tmp_path_factory):
    pytest.importorskip("torch", reason="the reference tests need torch: pip install -e '.[reference]'")
    pytest.importorskip("transformers", reason="the reference tests need transformers: pip install -e '.[reference]'")
    reference, model, eos, prompts = build(request.param, tmp_path_factory.mktemp(request.param))
    return {"torch": reference, "searcher": BeamSearcher(model, eos, VOCAB), "eos": eos, "prompts": prompts}


def transformers_beams(ref, prompt, returned: int = 1, **settings) -> list[tuple[list[int], float]]:
    """(new ids, score) of transformers' best `returned` beams; the padding after an eos cut off."""
    import torch

    eos = ref["eos"]
    with torch.no_grad():
        out = ref["torch"].generate(torch.tensor([prompt]), max_new_tokens=NEW, num_beams=BEAMS, do_sample=False,
                                    eos_token_id=eos, pad_token_id=eos, num_return_sequences=returned,
                                    return_dict_in_generate=True, output_scores=True, **settings)
    rows = out.sequences[:, len(prompt):].tolist()
    return [(row[:row.index(eos) + 1] if eos in row else row, float(score))
            for row, score in zip(rows, out.sequences_scores)]


def ours(ref, prompt, returned: int = 1, **settings) -> list[tuple[list[int], float]]:
    beams = ref["searcher"].generate(prompt, NEW, BEAMS, num_return_sequences=returned, **settings)
    return [(beam.ids, beam.score) for beam in beams]


def assert_equal_to_transformers(ref, returned: int = 1, **settings) -> list[list[int]]:
    """Our beams equal transformers' for every prompt; the ids of all of them."""
    found = []
    for prompt in ref["prompts"]:
        expected, got = transformers_beams(ref, prompt, returned, **settings), ours(ref, prompt, returned, **settings)
        assert [ids for ids, _ in got] == [ids for ids, _ in expected], (prompt, settings)
        np.testing.assert_allclose([s for _, s in got], [s for _, s in expected], rtol=0, atol=1e-4)
        found += [ids for ids, _ in got]
    return found


def ended_early(ref, beams) -> bool:
    return any(ids[-1] == ref["eos"] and len(ids) < NEW for ids in beams)


def test_beam_search_equals_transformers_with_the_default_length_penalty(ref):
    beams = assert_equal_to_transformers(ref, length_penalty=1.0, early_stopping=False)
    assert ended_early(ref, beams)  # a hypothesis that ended at eos won


@pytest.mark.parametrize("length_penalty", [2.0, -0.5], ids=["favours long", "favours short"])
def test_a_length_penalty_scores_and_orders_the_finished_beams_as_transformers_does(ref, length_penalty):
    assert_equal_to_transformers(ref, BEAMS, length_penalty=length_penalty, early_stopping=False)


def test_early_stopping_true_ends_at_num_beams_finished_hypotheses(ref):
    beams = assert_equal_to_transformers(ref, BEAMS, length_penalty=2.0, early_stopping=True)
    assert ended_early(ref, beams)
    # without it the search goes on, and a long-favouring penalty picks longer beams
    assert beams != [ids for prompt in ref["prompts"] for ids, _ in ours(ref, prompt, BEAMS, length_penalty=2.0)]


def test_early_stopping_never_estimates_with_the_longest_length(ref):
    beams = assert_equal_to_transformers(ref, BEAMS, length_penalty=1.0, early_stopping="never")
    assert ended_early(ref, beams)


# ---- without transformers -------------------------------------------------------------------------


EOS = 39


@pytest.fixture(scope="module")
def small():
    """A random GPT with a context of 8 tokens (generations of 12 run past it: the cache is refilled) and
    its beam searcher, end-of-text id 39."""
    tf.keras.utils.set_random_seed(3)
    model = GPT(ModelConfig(n_layer=2, n_head=2, n_embd=32, max_len=8), 40).build_weights()
    return model, BeamSearcher(model, eos_id=EOS, vocab_size=40)


def naive_log_prob(model, prompt: list[int], ids: list[int]) -> float:
    """Sum of log p(ids) by running the model on the whole window for each token (no cache), the window
    following the cache's rule: the newest max_len tokens first, then on a full cache its newest half."""
    L = model.cfg.max_len
    context, start, total = list(prompt), max(0, len(prompt) - L), 0.0
    for t, token in enumerate(ids):
        if t and len(context) - 1 - start == L:  # the cache held L tokens: refilled with the newest L // 2
            start = len(context) - L // 2
        logits = model(tf.constant([context[start:]]))[0, -1].numpy().astype(np.float64)
        total += logits[token] - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
        context.append(token)
    return total


@pytest.mark.parametrize("prompt", [[5, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]], ids=["short", "longer than the context"])
def test_scores_are_the_log_probabilities_of_the_ids_past_the_context(small, prompt):
    model, searcher = small
    beams = searcher.generate(prompt, 12, num_beams=3, length_penalty=0.5, num_return_sequences=3)
    assert len({tuple(b.ids) for b in beams}) == 3 and [b.score for b in beams] == sorted(
        [b.score for b in beams], reverse=True)
    for beam in beams:
        expected = naive_log_prob(model, prompt, beam.ids) / len(beam.ids) ** 0.5
        assert beam.score == pytest.approx(expected, abs=1e-4), beam


def test_one_beam_is_greedy_decoding(small):
    model, searcher = small
    prompt = [3, 1, 4, 1, 5]
    greedy = Sampler(model, eos_id=EOS, vocab_size=40).generate(prompt, 20, temperature=0.0)
    assert EOS not in greedy  # (else the beam would end there)
    (beam,) = searcher.generate(prompt, 20, num_beams=1)
    assert beam.ids == greedy
