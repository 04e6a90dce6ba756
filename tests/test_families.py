"""Model families (issue 18): the llama family against a NumPy reference of Hugging Face Llama's maths
(RMSNorm, rotate_half rotary embeddings, repeat_kv grouped-query attention, SwiGLU, untied head), its
size and cost as the planner counts them, and its config checks. Pipeline, tensor, KV-cache and local
SGD equivalence are the gpt2 tests parametrized by family (test_pipeline, test_tensor, test_model,
test_comm)."""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import tiny_config

from tpu_llm.config import ModelConfig, load_config
from tpu_llm.errors import UserError
from tpu_llm.model import GPT, families, loss_fn, spec
from tpu_llm.parallel import pipeline
from tpu_llm.tools import plan

VOCAB = 61
# GQA (2 query heads per kv head), untied head, non-default theta and eps, a hidden size of its own
LLAMA = dict(family="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=32, max_len=16, bias=False,
             mlp_hidden=48, rope_theta=500.0, norm_eps=1e-6, tie_embeddings=False)


def llama(**kw) -> GPT:
    keras.utils.set_random_seed(0)
    model = GPT(ModelConfig(**{**LLAMA, **kw}), VOCAB).build_weights()
    rng = np.random.default_rng(1)  # norm scales away from 1, so a missing scale would show
    model.set_weights([w + rng.normal(0, 0.1, w.shape).astype(w.dtype) for w in model.get_weights()])
    return model


def reference_logits(model: GPT, ids: np.ndarray) -> np.ndarray:
    """HF LlamaForCausalLM's forward pass in NumPy, from the model's weights by name."""
    cfg = model.cfg
    w = {v.path.split("/", 1)[1]: v.numpy().astype(np.float64) for v in model.weights}
    H, Hkv, hd = cfg.n_head, cfg.n_kv_head, cfg.n_embd // cfg.n_head
    T = ids.shape[1]

    def rms(x, scale):
        return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + cfg.norm_eps) * scale

    inv_freq = 1.0 / cfg.rope_theta ** (np.arange(0, hd, 2) / hd)
    emb = np.concatenate([np.outer(np.arange(T), inv_freq)] * 2, axis=-1)  # (T, hd)

    def rotate(x):  # x (B, heads, T, hd): x cos + rotate_half(x) sin
        return x * np.cos(emb) + np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], -1) * np.sin(emb)

    def split(x, n):
        return x.reshape(x.shape[0], T, n, hd).transpose(0, 2, 1, 3)

    x = w["wte/embeddings"][ids]
    for i in range(cfg.n_layer):
        p = f"block_{i}/"
        h = rms(x, w[p + "ln1/scale"])
        q = rotate(split(h @ w[p + "attn/q/kernel"], H))
        k = rotate(split(h @ w[p + "attn/k/kernel"], Hkv))
        v = split(h @ w[p + "attn/v/kernel"], Hkv)
        k, v = np.repeat(k, H // Hkv, axis=1), np.repeat(v, H // Hkv, axis=1)  # HF repeat_kv
        scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(hd) + np.triu(np.full((T, T), -np.inf), 1)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        y = (probs @ v).transpose(0, 2, 1, 3).reshape(x.shape)
        x = x + y @ w[p + "attn/proj/kernel"]
        h = rms(x, w[p + "ln2/scale"])
        gate = h @ w[p + "mlp/gate/kernel"]
        x = x + (gate / (1 + np.exp(-gate)) * (h @ w[p + "mlp/up/kernel"])) @ w[p + "mlp/down/kernel"]
    return rms(x, w["ln_f/scale"]) @ w["lm_head/embeddings"].T


@pytest.mark.parametrize("n_kv_head", [2, 1])  # grouped-query, multi-query
def test_llama_logits_match_a_numpy_reference_of_hf_llama(n_kv_head):
    model = llama(n_kv_head=n_kv_head)
    ids = np.random.default_rng(0).integers(0, VOCAB, (2, 11))
    got = model(tf.constant(ids, tf.int32)).numpy()
    np.testing.assert_allclose(got, reference_logits(model, ids), atol=1e-4, rtol=1e-4)
    names = {v.path.split("/", 1)[1] for v in model.weights}  # the contract import/export rely on
    assert {"block_1/attn/k/kernel", "block_1/mlp/down/kernel", "lm_head/embeddings", "ln_f/scale"} <= names
    assert not any("wpe" in n or "bias" in n for n in names)


def test_rmsnorm_keeps_its_epsilon_inside_the_root_for_small_inputs():
    from tpu_llm.model import RMSNorm

    x = 1e-3 * np.random.default_rng(0).normal(size=(2, 3, 8)).astype(np.float32)  # mean(x^2) ~ eps
    norm = RMSNorm(1e-6)
    got = norm(tf.constant(x)).numpy()
    want = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(got, want, rtol=1e-4)
    assert [v.path for v in norm.weights] == ["rms_norm/scale"]


def test_llama_size_and_cost_agree_with_the_planner_and_the_partition():
    model = llama()
    C, L, F, kv = 32, 2, 48, 2 * 8
    per_block = 2 * C + 2 * C * C + 2 * C * kv + 3 * C * F  # 2 norms, q + proj, k + v, gate + up + down
    expected = 2 * VOCAB * C + L * per_block + C  # wte, lm_head, blocks, ln_f
    assert model.num_params() == model.num_params(include_positions=False) == expected
    assert model.flops_per_token(16) == 6 * (expected - VOCAB * C) + 12 * L * C * 16  # the lookup is free
    cfg = load_config(None, {**{f"model.{k}": v for k, v in LLAMA.items()}, "data.seq_len": 16,
                             "model.vocab_size": VOCAB})
    assert spec.params(cfg.model, VOCAB) == expected
    assert spec.flops_per_token(cfg.model, VOCAB, 16) == model.flops_per_token(16)
    stages = pipeline.partition(cfg.model, VOCAB, 16, 2)
    assert sum(s.params for s in stages) == expected
    assert ModelConfig(family="llama", n_embd=4096).hidden() == 11008  # Meta's rule, Llama 2 7B's size


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_llama_under_mixed_precision_has_float32_weights_and_logits_near_float32(policy):
    ids = tf.constant(np.random.default_rng(0).integers(0, VOCAB, (2, 12)), tf.int32)
    want = llama()(ids)
    try:
        keras.mixed_precision.set_global_policy(policy)
        low = llama()
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert {v.dtype for v in low.weights} == {"float32"}
    assert low.blocks[0].attn.q.compute_dtype == policy.split("_")[1]
    got = low(ids)
    assert got.dtype == tf.float32
    assert abs(float(loss_fn(got, ids)) - float(loss_fn(want, ids))) < 0.02


def test_llama_1b_plans_on_v5p_16_and_v6e_8():
    cfg = load_config("configs/llama_1b.yaml")
    assert spec.params(cfg.model, cfg.model.vocab_size) == 1_235_814_400  # Llama 3.2 1B's published count
    for name in ("v5p-16", "v6e-8"):
        result = plan.plan(cfg, name)
        assert result.fits(plan.TIGHT), name


@pytest.mark.parametrize("preset, published", [("qwen2_5_0_5b", 494_032_768), ("qwen2_5_1_5b", 1_543_714_304)])
def test_qwen2_5_presets_have_the_published_parameter_counts_and_plan(preset, published):
    cfg = load_config(f"configs/{preset}.yaml")
    assert spec.params(cfg.model, cfg.model.vocab_size) == published  # the q/k/v biases counted
    fits = {"qwen2_5_0_5b": [("v5litepod-1", {}), ("v5litepod-8", {})],
            "qwen2_5_1_5b": [("v6e-8", {"parallel.pipeline_stages": 2})]}[preset]
    for name, overrides in fits:  # the presets' comments
        assert plan.plan(load_config(f"configs/{preset}.yaml", overrides), name).fits(plan.TIGHT), name


@pytest.mark.parametrize("overrides, message", [
    ({"model.family": "gemma"}, "model.family='gemma'; valid choices: gpt2, llama, qwen2, qwen3, mistral"),
    ({"model.family": "llama", "model.bias": True}, "model.bias=true: the llama family has no biases; set "
                                                    "model.bias=false"),
    ({"model.family": "mistral", "model.bias": True}, "model.bias=true: the mistral family has no biases; set "
                                                      "model.bias=false"),
    ({"model.family": "qwen3", "model.bias": True}, "model.bias=true: the qwen3 family has no biases"),
    ({"model.head_dim": 16}, "model.head_dim=16: gpt2's heads are n_embd / n_head wide"),
    ({"model.family": "qwen3", "model.head_dim": 15}, r"model.n_embd / model.n_head\) = 15 is odd"),
    ({"model.family": "qwen2", "model.bias": False}, "the qwen2 family has q/k/v biases .*use model.family=llama"),
    ({"model.rope_scaling": "llama3"}, "model.rope_scaling='llama3': gpt2 learns its positions"),
    ({"model.family": "llama", "model.bias": False, "model.rope_scaling": "yarn"},
     "model.rope_scaling='yarn'; valid choices: none, llama3"),
    ({"model.family": "llama", "model.bias": False, "model.rope_scaling": "llama3", "model.rope_factor": 0.5},
     "model.rope_factor=0.5 must be >= 1"),
    ({"model.family": "llama", "model.bias": False, "model.rope_scaling": "llama3", "model.rope_low_freq_factor": 4.0},
     "need 0 < low < high"),
    ({"model.family": "llama", "model.bias": False, "model.n_kv_head": 3},
     "model.n_kv_head=3 must divide model.n_head=4; valid values: 1, 2, 4"),
    ({"model.n_kv_head": 2}, "grouped-query attention is for model.family=llama"),
    ({"model.tie_embeddings": False}, "gpt2's output head is the embedding table"),
    ({"model.family": "llama", "model.bias": False, "model.n_embd": 12, "model.n_head": 4},
     "rotary embeddings rotate pairs"),
    ({"model.family": "llama", "model.bias": False, "model.n_kv_head": 2, "parallel.tensor": 4},
     "parallel.tensor=4 must divide model.n_kv_head=2 .*valid values: 1, 2"),
    ({"model.mlp_hidden": 30, "parallel.tensor": 4}, "must divide the MLP's hidden size 30"),
    ({"model.rope_theta": 0}, "model.rope_theta .* must be > 0"),
    ({"model.rope_theta": 500000.0}, r"model.rope_theta=500000.0: gpt2 learns its positions \(no rotary embeddings\)"),
])
def test_family_settings_that_cannot_work_are_one_line_errors(overrides, message):
    with pytest.raises(UserError, match=message):
        load_config(None, overrides)


def test_a_family_brings_its_defaults_where_the_config_gives_none(tmp_path):
    """model.family alone is enough: llama, mistral and qwen3 have no biases, qwen2 and gpt2 have them (the
    schema's default); a value the file or a flag gives is the user's, and the family checks it."""
    assert {name: load_config(None, {"model.family": name}).model.bias for name in families.NAMES} == {
        "gpt2": True, "llama": False, "qwen2": True, "qwen3": False, "mistral": False}
    (tmp_path / "llama.yaml").write_text("model:\n  family: llama\n  bias: true\n")
    with pytest.raises(UserError, match="model.bias=true: the llama family has no biases"):
        load_config(str(tmp_path / "llama.yaml"))
    (tmp_path / "plain.yaml").write_text("model:\n  family: mistral\n")
    assert load_config(str(tmp_path / "plain.yaml")).model.bias is False


def test_llama_run_exports_a_savedmodel_whose_logits_and_greedy_ids_match(tmp_path):
    """`export` for llama (tests/test_export.py does the gpt2 run in full): the SavedModel's logits and
    its generate loop, which runs past max_len so the KV cache (Hkv heads) is refilled, match the model."""
    from tpu_llm.interop.export import export
    from tpu_llm.model.sampling import Sampler
    from tpu_llm.tokenizers import ByteTokenizer
    from tpu_llm.training.checkpoint import Checkpointer, load_for_generation
    from tpu_llm.training.run_directory import open_run_dir

    cfg = tiny_config(tmp_path, **{f"model.{k}": v for k, v in LLAMA.items()}, **{"data.seq_len": 8})
    cfg.model.vocab_size = ByteTokenizer().vocab_size
    open_run_dir(cfg, ByteTokenizer())
    keras.utils.set_random_seed(0)
    trained = GPT(cfg.model, cfg.model.vocab_size).build_weights()
    rng = np.random.default_rng(0)
    trained.set_weights([w + rng.normal(0, 0.3, w.shape).astype(w.dtype) for w in trained.get_weights()])
    Checkpointer(cfg.run_dir, keep=3, model=trained).save(1)
    export(cfg.run_dir)
    model, tokenizer, _ = load_for_generation(cfg.run_dir)
    loaded = tf.saved_model.load(f"{cfg.run_dir}/export")
    tokens = tf.constant([[72, 101, 108, 108, 111, 32, 119]], tf.int32)
    got = loaded.signatures["logits"](tokens=tokens)["logits"].numpy()
    np.testing.assert_allclose(got, model(tokens).numpy()[..., :tokenizer.vocab_size], atol=1e-5)
    ids = loaded.signatures["generate"](tokens=tokens, max_new_tokens=tf.constant(20), temperature=tf.constant(0.0),
                                        top_k=tf.constant(0), top_p=tf.constant(1.0), seed=tf.constant(0, tf.int64))
    sampler = Sampler(model, tokenizer.eos_id, tokenizer.vocab_size)
    assert ids["ids"].numpy()[0].tolist() == sampler.generate(tokens.numpy()[0].tolist(), 20, 0.0)


def test_families_benchmark_prints_both_tables(monkeypatch, capsys):
    """`tpu-llm bench families` (training stubbed: its runs are the shakespeare_char benchmark's)."""
    from tpu_llm import cli
    from tpu_llm.tools import bench

    runs = []

    def fake_run(name, prefix, config, steps, flags):
        runs.append((name, load_config(bench.config_path(config), {}).model.family, steps))
        return {"params": 800_000, "val_loss": 1.5, "tokens_per_sec": 10_000.0, "mfu": 0.01}

    monkeypatch.setattr(bench, "_run_case", fake_run)
    assert cli.main(["bench", "families", "--steps", "7"]) == 0
    assert runs == [("gpt2", "gpt2", 7), ("llama", "llama", 7)]
    out = capsys.readouterr().out
    assert "| llama   | configs/shakespeare_char_llama.yaml" in out and "1,235,814,400 parameters" in out
    assert "| v5p-16 " in out and "| v6e-8 " in out
