"""End-to-end training through the controller: learning, checkpoints, resume, run-directory safety."""

import json
import os

import numpy as np
import pytest
import tensorflow as tf
from helpers import quiet, snapshot, tiny_config

from tpu_llm.errors import UserError
from tpu_llm.tokenizers import train_sentencepiece
from tpu_llm.training.controller import build_run, train


def cfg_for(run_dir, **overrides):
    """`tiny_config` with its run directory at `run_dir` (and its small corpus beside it)."""
    return tiny_config(run_dir.parent, **{"run_dir": str(run_dir), "train.steps": 8, "train.steps_per_loop": 4,
                                          "checkpoint.every_steps": 4, **overrides})


# the step as a TF graph, for the tests of what a run directory holds, refuses and logs: none depends on
# XLA, whose compile costs seconds per run (learning, restore and exact resume keep it)
GRAPH = {"execution": "graph"}


def weights(model):
    return [v.numpy() for v in model.weights]


def test_loss_falls_on_the_embedded_corpus(tmp_path):
    result = train(cfg_for(tmp_path / "run", **{"data.train": "", "data.seq_len": 32, "train.batch_size": 8,
                                                "train.steps": 40, "train.steps_per_loop": 10,
                                                "train.lr": 3e-3, "checkpoint.every_steps": 0}), say=quiet)
    lines = [json.loads(l) for l in open(tmp_path / "run" / "metrics.jsonl")]
    losses = [l["loss"] for l in lines if l["split"] == "train"]
    assert losses[0] > 4.5  # about ln(257) = 5.55 at the start
    # each batch mixes windows of several files (lanes, data.make_dataset_fn), so the training loss is not the loss
    # on one file the model has just seen a thousand windows of: validation shows the learning too
    assert losses[-1] < losses[0] - 1.2
    assert result["val_loss"] is not None and result["val_loss"] < 5.55 - 1.5 and result["step"] == 40


def test_checkpoint_restore_is_bit_identical(tmp_path):
    cfg = cfg_for(tmp_path / "run")
    train(cfg, say=quiet)
    run = build_run(cfg_for(tmp_path / "run"))  # a fresh process would do exactly this
    assert run.resumed_from.endswith("ckpt-8")
    # what the run holds now, saved under the same names, against what the checkpoint file holds
    tf.train.Checkpoint(model=run.model, optimizer=run.optimizer).write(str(tmp_path / "now" / "state"))
    now, saved = tf.train.load_checkpoint(str(tmp_path / "now" / "state")), tf.train.load_checkpoint(run.resumed_from)
    names = [n for n in now.get_variable_to_shape_map() if n.startswith(("model/", "optimizer/"))]
    assert len(names) > 30 and any("optimizer/_variables/" in n for n in names)  # weights and Adam moments
    for name in names:
        np.testing.assert_array_equal(now.get_tensor(name), saved.get_tensor(name), err_msg=name)
    assert int(run.optimizer.iterations.numpy()) == 8


def test_resume_continues_exactly_like_an_uninterrupted_run(tmp_path):
    def cfg(run, steps):  # an explicit decay length: the schedule must not depend on train.steps
        return cfg_for(tmp_path / run, **{"train.steps": steps, "train.decay_steps": 12})

    train(cfg("straight", 12), say=quiet)
    train(cfg("resumed", 8), say=quiet)  # stops at a checkpoint
    train(cfg("resumed", 12), say=quiet)  # the same command with more steps resumes

    def losses(run):
        return [l["loss"] for l in map(json.loads, open(tmp_path / run / "metrics.jsonl"))
                if l["split"] == "train"]
    assert losses("resumed") == losses("straight")
    for x, y in zip(weights(build_run(cfg("straight", 12)).model), weights(build_run(cfg("resumed", 12)).model)):
        np.testing.assert_array_equal(x, y)


def test_a_run_directory_of_another_model_is_refused_and_left_untouched(tmp_path):
    train(cfg_for(tmp_path / "run", **{"train.steps": 4}, **GRAPH), say=quiet)
    before = snapshot(tmp_path / "run")
    with pytest.raises(UserError, match=r"model.n_layer=2 \(this config has 3\)"):
        train(cfg_for(tmp_path / "run", **{"model.n_layer": 3}), say=quiet)
    with pytest.raises(UserError, match="data.tokenizer=byte"):
        train(cfg_for(tmp_path / "run", **{"data.tokenizer": "char"}), say=quiet)
    assert snapshot(tmp_path / "run") == before


def test_a_checkpoint_without_its_config_is_refused_when_it_does_not_fit(tmp_path):
    train(cfg_for(tmp_path / "run", **{"train.steps": 4}, **GRAPH), say=quiet)
    os.remove(tmp_path / "run" / "config.yaml")
    before = {k: v for k, v in snapshot(tmp_path / "run").items() if k.startswith("checkpoints")}
    with pytest.raises(UserError, match="does not fit this model"):
        build_run(cfg_for(tmp_path / "run", **{"model.n_embd": 64}))
    assert {k: v for k, v in snapshot(tmp_path / "run").items() if k.startswith("checkpoints")} == before


def test_run_dir_that_is_a_file_is_refused(tmp_path):
    path = tmp_path / "not-a-dir"
    path.write_text("keep me")
    with pytest.raises(UserError, match="is a file, not a directory"):
        train(cfg_for(path), say=quiet)
    assert path.read_text() == "keep me"


def test_training_data_smaller_than_one_batch_is_a_clear_error(tmp_path):
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("just a few words\n" * 3)
    with pytest.raises(UserError, match="less than one batch"):
        train(cfg_for(tmp_path / "run", **{"data.train": str(tiny), "data.validation": str(tiny)}),
              say=quiet)


def test_samples_are_printed_after_training(tmp_path):
    lines = []
    train(cfg_for(tmp_path / "run", **{"train.steps": 4, "sample.num_samples": 2,
                                       "sample.max_new_tokens": 40, "sample.prompt": "import "}),
          say=lines.append)
    samples = [l for l in lines if l.startswith("--- sample")]
    assert len(samples) == 2
    texts = [lines[lines.index(s) + 1] for s in samples]
    assert all(t.startswith("import ") for t in texts) and texts[0] != texts[1]
    assert tf.io.gfile.exists(str(tmp_path / "run" / "logs" / "train"))


def test_a_different_sentencepiece_model_is_refused_on_resume(tmp_path):
    cfg_for(tmp_path / "run")  # writes the small corpus beside the run
    files = sorted(str(p) for p in (tmp_path / "corpus").glob("*.txt"))
    train_sentencepiece(files, 400, str(tmp_path / "a.model"))
    train_sentencepiece(files, 420, str(tmp_path / "b.model"))
    sp = {"data.tokenizer": "sentencepiece", "train.steps": 2, "train.steps_per_loop": 2, **GRAPH}
    train(cfg_for(tmp_path / "run", **sp, **{"data.tokenizer_model": str(tmp_path / "a.model")}), say=quiet)
    before = snapshot(tmp_path / "run")
    with pytest.raises(UserError, match="different SentencePiece model"):
        train(cfg_for(tmp_path / "run", **sp, **{"data.tokenizer_model": str(tmp_path / "b.model")}), say=quiet)
    assert snapshot(tmp_path / "run") == before


def test_a_resume_logs_every_step_once_in_metrics_and_tensorboard(tmp_path):
    """Resumed from step 2 after ckpt-4 was lost: the entries of steps 3-4 the first run logged are
    dropped (metrics.jsonl and the TensorBoard event files), so each step is logged once."""
    cfg = cfg_for(tmp_path / "run", **{"train.steps": 4, "train.steps_per_loop": 2, "checkpoint.every_steps": 2,
                                       "train.eval_every": 2, **GRAPH})
    train(cfg, say=quiet)
    for path in (tmp_path / "run" / "checkpoints").glob("ckpt-4.*"):
        path.unlink()  # the newest checkpoint is lost: the next run resumes from ckpt-2
    said = []
    train(cfg, say=said.append)
    lines = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [(m["split"], m["step"]) for m in lines] == [("train", 2), ("validation", 2), ("goodput", 2), ("train", 4),
                                                         ("validation", 4), ("goodput", 4), ("summary", 4)]
    for split in ("train", "validation", "goodput"):  # (goodput: with each checkpoint)
        steps = [event.step for path in sorted((tmp_path / "run" / "logs" / split).glob("events.out.tfevents.*"))
                 for event in tf.compat.v1.train.summary_iterator(str(path))
                 if any(value.tag in ("loss", "goodput") for value in event.summary.value)]
        assert steps == [2, 4], (split, steps)
    assert any(line.startswith("resumed   from") for line in said)
    assert any(line.startswith("metrics   dropped 4 entries logged after step 2") for line in said), said
