"""LoRA (train.lora_*) against Hugging Face PEFT, the reference implementation (PyTorch, CPU).

A tiny random GPT2LMHeadModel, LlamaForCausalLM (grouped-query attention, untied head), Qwen2ForCausalLM
(q/k/v biases under the adapters, tied head, as Qwen2.5 0.5B and 1.5B) and MistralForCausalLM (a sliding
window covering the context), saved with save_pretrained and imported through `tpu-llm import`; PEFT's
get_peft_model puts adapters on every projection of each (gpt2: c_attn, c_proj (the attention's and the
MLP's), c_fc; the rotary families: all seven) and
ours get the same random values (B non-zero, or the adapters would add nothing to compare). Then: the
logits within 1e-5, and the gradients of one batch's next-token loss with respect to every adapter
within 1e-5 (PEFT's lora_A.weight (r, in) and lora_B.weight (out, r) are our A (in, r) and B (r, out)
transposed). Each model is built and imported once per module.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil

import numpy as np
import pytest
import tensorflow as tf

torch = pytest.importorskip("torch", reason="the reference tests need torch: pip install -e '.[reference]'")
transformers = pytest.importorskip("transformers", reason="the reference tests need transformers 5: pip install "
                                   "-e '.[reference]' (Python >= 3.11)")
peft = pytest.importorskip("peft", reason="the LoRA reference tests need peft: pip install -e '.[reference]'")

from helpers import write_bpe_tokenizer  # noqa: E402

from tpu_llm import cli  # noqa: E402
from tpu_llm.config import load_config  # noqa: E402
from tpu_llm.interop import peft as peft_format  # noqa: E402
from tpu_llm.model import families  # noqa: E402
from tpu_llm.model import GPT  # noqa: E402
from tpu_llm.model import adapters as lora  # noqa: E402
from tpu_llm.model import loss_fn
from tpu_llm.training.checkpoint import Checkpointer, load_for_generation  # noqa: E402

VOCAB, RANK, ALPHA = 300, 4, 8.0  # VOCAB: write_bpe_tokenizer's


# the rotary families' tiny layout: 4 query heads over 2 kv heads of size 8
LAYOUT = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=32, bos_token_id=0, eos_token_id=0)


def reference_model(family: str):
    if family == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0))
    if family == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            **LAYOUT, rope_theta=50000.0, tie_word_embeddings=False))
    if family == "qwen2":  # Qwen2.5 0.5B/1.5B's shape: q/k/v biases (the adapted layers keep them), tied head
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
            **LAYOUT, rope_theta=20000.0, tie_word_embeddings=True))
    if family == "qwen3":  # q/k norms per head, heads 16 wide over a width of 32 (head_dim apart), tied head
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
            **LAYOUT, head_dim=16, rope_theta=40000.0, tie_word_embeddings=True))
    return transformers.MistralForCausalLM(transformers.MistralConfig(  # a window that covers the whole context
        **LAYOUT, sliding_window=32, rope_theta=30000.0, tie_word_embeddings=False))


def lora_overrides(family: str) -> dict:
    targets = families.get(family).peft_targets
    return {"train.lora_rank": RANK, "train.lora_alpha": ALPHA, "train.lora_targets": ",".join(targets)}


def build(family: str, root) -> dict:
    """The reference model with PEFT adapters, and ours imported from its files with the same adapters."""
    torch.manual_seed(0)
    base = reference_model(family)
    with torch.no_grad():  # norms at 1 and biases at 0 would hide a swap
        for p in base.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    hf_dir, run_dir = str(root / "hf"), str(root / "run")
    base.save_pretrained(hf_dir)
    write_bpe_tokenizer(hf_dir)
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli.main(["import", "--from", hf_dir, "--run_dir", run_dir]) == 0
    imported, _, cfg = load_for_generation(run_dir)
    assert cfg.model.family == family  # (qwen2 and mistral are their own families, not llama's)
    cfg = load_config(None, lora_overrides(family), base=cfg)
    ours = GPT(cfg.model, cfg.model.vocab_size, lora.adapters_for(cfg)).build_weights()
    lora.copy_base(imported, ours)

    names = sorted(families.get(family).peft_targets)
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=names,
                             fan_in_fan_out=family == "gpt2")  # GPT-2's Conv1D stores (in, out)
    reference = peft.get_peft_model(base, config)
    reference.eval()
    layers = {layer.path.split("/", 1)[1]: layer for layer in lora.adapted(ours)}
    pairs = []  # (PEFT's LoRA module, our LoraDense)
    rng = np.random.default_rng(3)
    for module_name, path in peft_format.adapter_modules(cfg.model):
        module = reference.base_model.model.get_submodule(module_name)
        layer = layers.pop(path)
        a = rng.normal(0, 0.1, tuple(layer.lora_a.shape)).astype(np.float32)
        b = rng.normal(0, 0.1, tuple(layer.lora_b.shape)).astype(np.float32)
        layer.lora_a.assign(a)
        layer.lora_b.assign(b)
        with torch.no_grad():
            module.lora_A["default"].weight.copy_(torch.from_numpy(a.T.copy()))
            module.lora_B["default"].weight.copy_(torch.from_numpy(b.T.copy()))
        pairs.append((module, layer))
    assert not layers  # every adapter of ours has PEFT's counterpart
    # a LoRA run of these adapters, as training would leave it: the imported run's files, its config with the
    # train.lora_* settings and a checkpoint of the adapted model
    lora_run = str(root / "lora-run")
    shutil.copytree(run_dir, lora_run)
    shutil.rmtree(os.path.join(lora_run, "checkpoints"))
    with open(os.path.join(lora_run, "config.yaml"), "w") as f:
        f.write(cfg.to_yaml())
    Checkpointer(lora_run, keep=1, model_config=cfg.model, model=ours).save(0)
    return {"ours": ours, "reference": reference, "pairs": pairs, "base": imported, "hf_dir": hf_dir,
            "lora_run": lora_run, "family": family}


@pytest.fixture(scope="module", params=["gpt2", "llama", "qwen2", "qwen3", "mistral"])
def models(request, tmp_path_factory):
    return build(request.param, tmp_path_factory.mktemp(request.param))


IDS = np.random.default_rng(0).integers(0, VOCAB, size=(2, 13)).astype(np.int32)


def test_logits_equal_peft_within_1e_6_of_the_largest(models):
    """Within 1e-6 of the largest logit (about 2 here: a few float32 steps; torch and TF sum in other orders)."""
    with torch.no_grad():
        want = models["reference"](torch.tensor(IDS, dtype=torch.long)).logits.numpy()
    got = models["ours"](tf.constant(IDS)).numpy()
    assert np.abs(got - models["base"](tf.constant(IDS)).numpy()).max() > 0.05  # the adapters change the logits
    np.testing.assert_allclose(got, want, atol=1e-6 * np.abs(want).max(), rtol=0)


def test_gradients_of_one_batch_equal_peft_within_1e_5(models):
    ours, reference = models["ours"], models["reference"]
    reference.zero_grad()
    logits = reference(torch.tensor(IDS, dtype=torch.long)).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB),
                                             torch.tensor(IDS[:, 1:], dtype=torch.long).reshape(-1))
    loss.backward()
    with tf.GradientTape() as tape:
        # (no dropout: the reference is in eval mode, and GPT-2's config has 0.1)
        ours_loss = loss_fn(ours(tf.constant(IDS[:, :-1])), tf.constant(IDS[:, 1:]))
    # positions 0..T-2 only depend on the ids before them: the same loss as the reference's over its T - 1
    np.testing.assert_allclose(float(ours_loss), loss.item(), rtol=1e-6)
    assert {v.path.rsplit("/", 1)[1] for v in ours.trainable_variables} == {"lora_a", "lora_b"}
    grads = dict(zip((id(v) for v in ours.trainable_variables), tape.gradient(ours_loss, ours.trainable_variables)))
    for module, layer in models["pairs"]:
        for got, want in ((grads[id(layer.lora_a)], module.lora_A["default"].weight.grad),
                          (grads[id(layer.lora_b)], module.lora_B["default"].weight.grad)):
            assert float(torch.abs(want).max()) > 1e-4
            np.testing.assert_allclose(got.numpy(), want.numpy().T, atol=1e-5, rtol=0, err_msg=layer.path)


def cli_quietly(*args: str) -> str:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert cli.main(list(args)) == 0
    return printed.getvalue()


def logits_of(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(IDS, dtype=torch.long)).logits.numpy()


def test_an_exported_peft_adapter_loads_in_peft_onto_the_base_and_gives_our_logits(models, tmp_path):
    out = str(tmp_path / "adapter")
    printed = cli_quietly("export", "--run_dir", models["lora_run"], "--format", "peft", "--output", out)
    adapters = 4 * 2 if models["family"] == "gpt2" else 7 * 2
    assert f"saved     {adapters} LoRA adapters of rank {RANK} in PEFT's format" in printed
    config = json.load(open(os.path.join(out, "adapter_config.json")))
    assert config["r"] == RANK and config["lora_alpha"] == ALPHA and config["peft_type"] == "LORA"
    base = transformers.AutoModelForCausalLM.from_pretrained(models["hf_dir"])
    loaded = peft.PeftModel.from_pretrained(base, out)
    loaded.eval()
    np.testing.assert_allclose(logits_of(loaded), models["ours"](tf.constant(IDS)).numpy(), atol=1e-5, rtol=0)


def test_export_format_hf_of_a_lora_run_writes_the_merged_model(models, tmp_path):
    out = str(tmp_path / "merged")
    cli_quietly("export", "--run_dir", models["lora_run"], "--format", "hf", "--output", out)
    merged = transformers.AutoModelForCausalLM.from_pretrained(out)
    merged.eval()
    np.testing.assert_allclose(logits_of(merged), models["ours"](tf.constant(IDS)).numpy(), atol=1e-5, rtol=0)


def test_a_peft_adapter_imported_gives_peft_logits_in_a_lora_run(models, tmp_path):
    adapter, run = str(tmp_path / "peft"), str(tmp_path / "run")
    models["reference"].save_pretrained(adapter)  # PEFT's own files
    printed = cli_quietly("import", "--from", models["hf_dir"], "--adapter", adapter, "--run_dir", run)
    assert f"with the LoRA adapter {adapter} (rank {RANK})" in printed
    model, _, cfg = load_for_generation(run)
    assert (cfg.train.lora_rank, cfg.train.lora_alpha) == (RANK, ALPHA)
    np.testing.assert_allclose(model(tf.constant(IDS)).numpy(), logits_of(models["reference"]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("edit, words", [
    ({"use_dora": True}, "adapter_config.json: use_dora=true is not supported; tpu-llm reads plain LoRA adapters"),
    ({"peft_type": "IA3"}, "peft_type \"IA3\" is not LORA"),
    ({"target_modules": ["lm_head"]}, "target_modules [\"lm_head\"] is not a list of gpt2 modules (c_attn, c_proj, c_fc)"),
    ({"r": 2}, "tensor base_model.model.transformer.h.0.attn.c_attn.lora_A.weight is F32 [4, 32], this model's "
               "adapter of rank 2 needs [2, 32]"),
])
def test_an_adapter_that_cannot_be_read_exactly_is_one_line_and_writes_nothing(models, tmp_path, capsys, edit, words):
    if models["family"] != "gpt2":
        pytest.skip("the checks are the families' common path")
    adapter, run = tmp_path / "peft", tmp_path / "run"
    models["reference"].save_pretrained(str(adapter))
    config = json.load(open(adapter / "adapter_config.json"))
    (adapter / "adapter_config.json").write_text(json.dumps({**config, **edit}))
    assert cli.main(["import", "--from", models["hf_dir"], "--adapter", str(adapter), "--run_dir", str(run)]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1 and not run.exists()
