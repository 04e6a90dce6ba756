"""Fine-tuning an imported checkpoint: `tpu-llm import`, `data prepare --tokenizer hf`, then `train
--config <run_dir>/config.yaml` with train.freeze, as docs/hugging-face.md tells. No torch here: the
tiny GPT-2 checkpoint is written with tpu_llm.safetensors_io in the layout save_pretrained writes (the
reference tests in test_hf.py check that layout against transformers itself); `import` refusals too.
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
from helpers import GPT2_CONFIG, snapshot, write_corpus, write_gpt2

from tpu_llm import cli

pytest.importorskip("tokenizers", reason="the hf tokenizer kind needs tokenizers: pip install -e '.[hf]'")

def run_cli(*argv) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = cli.main(list(argv))
    return status, out.getvalue()


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    root = tmp_path_factory.mktemp("finetune")
    write_gpt2(root / "gpt2")
    status, printed = run_cli("import", "--from", str(root / "gpt2"), "--run_dir", str(root / "run"))
    assert status == 0, printed
    return root


@pytest.fixture(scope="module")
def shards(imported):
    """The test corpus in two shards, tokenized with the imported run's tokenizer (train, validation)."""
    corpus = write_corpus(imported / "corpus")
    status, printed = run_cli("data", "prepare", "--input", ",".join(corpus), "--output", str(imported / "shards"),
                              "--tokenizer", "hf", "--tokenizer_model", str(imported / "run"), "--shards", "2")
    assert status == 0, printed
    return sorted(tf.io.gfile.glob(f"{imported}/shards/*.tfrecord")), corpus


def variables(model) -> dict:
    return {path: v.numpy() for path, v in model.by_path().items()}


def test_fine_tuning_an_imported_checkpoint_lowers_the_loss_and_keeps_frozen_layers(imported, shards, tmp_path):
    from tpu_llm.model import loss_fn
    from tpu_llm.training.checkpoint import load_for_generation

    run = str(tmp_path / "run")
    shutil.copytree(imported / "run", run)  # the module's import stays at step 0 for the other tests
    shards, corpus = shards
    model, tokenizer, _ = load_for_generation(run)
    ids = np.array(tokenizer.encode(open(corpus[0], encoding="utf-8").read())[:4 * 17]).reshape(4, 17)

    def loss(model):
        return float(loss_fn(model(tf.constant(ids[:, :-1])), tf.constant(ids[:, 1:])))

    before, loss_before = variables(model), loss(model)
    status, printed = run_cli("train", "--config", f"{run}/config.yaml", f"--run_dir={run}",  # (the copy's)
                              f"--data.train={shards[0]}", f"--data.validation={shards[1]}",
                              "--data.seq_len=16", "--train.batch_size=4", "--train.steps=8", "--train.steps_per_loop=4",
                              "--train.lr=3e-3", "--train.warmup_steps=1", "--train.eval_every=0",
                              "--train.eval_steps=1", "--sample.num_samples=0", "--train.freeze=blocks:0",
                              "--execution=eager")  # 8 tiny steps: compiling them would cost more than running them
    assert status == 0, printed
    model, _, _, checkpoint = load_for_generation(run, with_checkpoint=True)
    assert checkpoint.endswith("ckpt-8")  # continued from the imported step 0
    after = variables(model)
    frozen = [p for p in before if p.startswith("block_0/")]
    assert frozen and all(before[p].tobytes() == after[p].tobytes() for p in frozen)
    assert all(not np.array_equal(before[p], after[p]) for p in before if p not in frozen)
    assert loss(model) < loss_before - 0.1, (loss_before, loss(model))


def test_init_from_starts_a_new_run_with_the_imported_weights(imported, shards, tmp_path):
    from tpu_llm.config import config_from_dict
    from tpu_llm.errors import UserError
    from tpu_llm.training.checkpoint import load_for_generation, restore_init_from
    from tpu_llm.training.controller import build_run

    run, shards = imported / "run", shards[0]
    before = snapshot(run)
    settings = {**__import__("yaml").safe_load(open(run / "config.yaml")), "run_dir": str(tmp_path / "tuned")}
    settings["data"].update(train=shards[0], validation=shards[1], seq_len=16)
    settings["train"].update(init_from=str(run), batch_size=4, freeze="embeddings")
    built = build_run(config_from_dict(settings, source="test"))
    assert built.resumed_from is None and built.initialised_from == f"{run}/checkpoints/ckpt-0"
    assert int(built.optimizer.iterations.numpy()) == 0
    ours, imported_weights = variables(built.model), variables(load_for_generation(str(run))[0])
    assert ours.keys() == imported_weights.keys()
    assert all(ours[p].tobytes() == imported_weights[p].tobytes() for p in ours)  # not a random initialisation
    assert not any("wte" in v.path or "wpe" in v.path for v in built.model.trainable_variables)  # frozen
    assert snapshot(run) == before  # the imported run is only read
    other = config_from_dict({**settings, "model": {**settings["model"], "n_layer": 3}}, source="test")
    with pytest.raises(UserError, match=r"train.init_from=.* holds a model made with model.n_layer=2 \(this config has 3\)"):
        restore_init_from(str(run), other.model, built.model, built.tokenizer)  # (build_run: before writing anything)


def test_plan_takes_the_imported_config(imported):
    status, printed = run_cli("plan", "--config", f"{imported}/run/config.yaml", "--accelerator", "cpu")
    assert status == 0, printed
    assert "plan" in printed


def test_freeze_is_validated():
    from tpu_llm.config import load_config
    from tpu_llm.errors import UserError

    for value in ("blocks:4", "blocks:1-0", "block:0", "embeddings,blocks:x"):
        with pytest.raises(UserError, match=r"train.freeze item .*blocks:A-B or blocks:N.* 0 to model.n_layer - 1 = 3"):
            load_config(None, {"train.freeze": value})
    load_config(None, {"train.freeze": "embeddings, blocks:0-3"})


@pytest.mark.parametrize("change, expected", [
    ({"architectures": ["BertForMaskedLM"]}, 'architectures=["BertForMaskedLM"] is not supported'),
    ({"activation_function": "relu"}, 'activation_function="relu" is not supported'),
    ({"n_inner": 64}, "n_inner=64 is not supported by tpu-llm (4 x n_embd = 128)"),
    ({"architectures": ["LlamaForCausalLM"], "hidden_size": 32, "num_attention_heads": 2, "num_hidden_layers": 1,
      "intermediate_size": 64, "max_position_embeddings": 32, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     'rope_scaling.rope_type="yarn" is not supported'),
    ({"architectures": ["LlamaForCausalLM"], "hidden_size": 32, "num_attention_heads": 2, "num_hidden_layers": 1,
      "intermediate_size": 64, "max_position_embeddings": 32, "attention_bias": True}, "attention_bias=true is not supported"),
])
def test_unsupported_options_are_one_line_naming_the_field(tmp_path, capsys, change, expected):
    write_gpt2(tmp_path / "src")
    with open(tmp_path / "src" / "config.json", "w") as f:
        json.dump({**GPT2_CONFIG, **change}, f)
    assert cli.main(["import", "--from", str(tmp_path / "src"), "--run_dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: config.json: ") and expected in err and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()


def test_import_never_touches_an_existing_run_or_another_folder(imported, tmp_path, capsys):
    run = imported / "run"
    before = snapshot(run)
    assert cli.main(["import", "--from", str(imported / "gpt2"), "--run_dir", str(run)]) == 2
    assert "already holds a tpu-llm run; import into a new --run_dir" in capsys.readouterr().err
    assert snapshot(run) == before
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    assert cli.main(["import", "--from", str(imported / "gpt2"), "--run_dir", str(tmp_path / "other")]) == 2
    assert "is not empty and is not a tpu-llm run" in capsys.readouterr().err
    assert os.listdir(tmp_path / "other") == ["notes.txt"]


def test_the_hubs_gpt2_names_import_to_the_same_weights(imported, tmp_path):
    from tpu_llm.training.checkpoint import Checkpointer

    write_gpt2(tmp_path / "hub", hub=True)
    assert run_cli("import", "--from", str(tmp_path / "hub"), "--run_dir", str(tmp_path / "run"))[0] == 0
    ours, theirs = (Checkpointer(str(d), keep=1).latest for d in (imported / "run", tmp_path / "run"))
    read = {name: tf.train.load_checkpoint(path) for name, path in (("ours", ours), ("theirs", theirs))}
    names = [n for n, _ in tf.train.list_variables(ours) if n.startswith("model/")]
    assert len(names) >= 16 and names == [n for n, _ in tf.train.list_variables(theirs) if n.startswith("model/")]
    for name in names:
        assert read["ours"].get_tensor(name).tobytes() == read["theirs"].get_tensor(name).tobytes(), name


def test_max_len_is_for_llama_only(imported, tmp_path, capsys):
    assert cli.main(["import", "--from", str(imported / "gpt2"), "--run_dir", str(tmp_path / "run"), "--max_len", "16"]) == 2
    assert capsys.readouterr().err == ("error: --max_len=16: give a context shorter than config.json's 32, for a llama, "
                                       "qwen2, qwen3 or mistral model (a gpt2 model's learned position table fixes "
                                       "its own)\n")
    assert not (tmp_path / "run").exists()


def test_a_missing_tensor_or_shard_is_named(tmp_path, capsys):
    write_gpt2(tmp_path / "src", drop="transformer.h.1.mlp.c_fc.bias")
    assert cli.main(["import", "--from", str(tmp_path / "src"), "--run_dir", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err == ("error: the checkpoint lacks tensor transformer.h.1.mlp.c_fc.bias (1 missing); "
                                       "download every shard\n")
    os.rename(tmp_path / "src" / "model.safetensors", tmp_path / "src" / "model-00001-of-00002.safetensors")
    with open(tmp_path / "src" / "model.safetensors.index.json", "w") as f:
        json.dump({"weight_map": {"transformer.wte.weight": "model-00001-of-00002.safetensors",
                                  "transformer.h.0.ln_1.weight": "model-00002-of-00002.safetensors"}}, f)
    assert cli.main(["import", "--from", str(tmp_path / "src"), "--run_dir", str(tmp_path / "run")]) == 2
    assert "names shard model-00002-of-00002.safetensors, which is not in" in capsys.readouterr().err
    assert not tf.io.gfile.glob(f"{tmp_path}/run*")
