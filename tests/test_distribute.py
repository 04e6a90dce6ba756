"""Strategy selection and MirroredStrategy over logical CPU devices: same training as one device."""

import json

import numpy as np
import pytest
from conftest import tiny_config

from tpu_llm.config import load_config
from tpu_llm.controller import build_run, train
from tpu_llm.distribute import get_strategy
from tpu_llm.errors import UserError


def quiet(*_):
    pass


def train_losses(run_dir):
    return [l["loss"] for l in map(json.loads, open(run_dir / "metrics.jsonl")) if l["split"] == "train"]


@pytest.mark.parametrize("devices", [2, 4])
def test_mirrored_over_logical_cpus_trains_like_one_device(tmp_path, devices):
    common = {"train.steps": 6, "train.steps_per_loop": 2, "train.batch_size": 8, "train.eval_every": 0,
              "checkpoint.every_steps": 0}
    single = tiny_config(tmp_path / "one", **common)
    mirrored = tiny_config(tmp_path / "many", **common, cpu_devices=devices, strategy="mirrored")
    train(single, say=quiet, samples=False)
    train(mirrored, say=quiet, samples=False)
    np.testing.assert_allclose(train_losses(tmp_path / "many" / "run"), train_losses(tmp_path / "one" / "run"),
                               rtol=1e-5)
    one, many = build_run(single), build_run(mirrored)
    assert one.dist.num_replicas == 1 and many.dist.num_replicas == devices
    for a, b in zip(one.model.weights, many.model.weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-5)


def test_checkpoints_move_between_mirrored_and_one_device(tmp_path):
    base = {"train.steps": 4, "checkpoint.every_steps": 2, "train.batch_size": 8}
    train(tiny_config(tmp_path, **base, cpu_devices=2), say=quiet)
    run = build_run(tiny_config(tmp_path, **{**base, "train.steps": 6}))  # resumed on one device
    assert run.dist.num_replicas == 1 and run.resumed_from.endswith("ckpt-4")
    assert run.data_resume == "data stream replayed to step 4"  # the mirrored run saved no iterator
    train(tiny_config(tmp_path, **{**base, "train.steps": 6}), say=quiet)
    back = build_run(tiny_config(tmp_path, **{**base, "train.steps": 8}, cpu_devices=2))  # and back
    assert back.dist.num_replicas == 2 and back.resumed_from.endswith("ckpt-6")


def test_selection_and_its_errors(tmp_path):
    assert get_strategy(load_config(None, {})).name == "default"
    assert get_strategy(load_config(None, {"cpu_devices": 2})).name == "mirrored"
    with pytest.raises(UserError, match="strategy=mirrored found one device"):
        get_strategy(load_config(None, {"strategy": "mirrored"}))
    with pytest.raises(UserError, match="needs strategy=mirrored or auto"):
        get_strategy(load_config(None, {"strategy": "default", "cpu_devices": 2}))
    with pytest.raises(UserError, match="already started in this process with 4 CPU"):
        get_strategy(load_config(None, {"cpu_devices": 8}))
    with pytest.raises(UserError, match="nearest valid values: 9 or 12"):
        build_run(tiny_config(tmp_path, **{"train.batch_size": 10}, cpu_devices=3))


def test_mirrored_resume_replays_the_stream_to_the_exact_position(tmp_path):
    def cfg(run, steps):
        return tiny_config(tmp_path / run, **{"train.steps": steps, "train.decay_steps": 8,
                                              "checkpoint.every_steps": 4, "train.batch_size": 8}, cpu_devices=2)

    train(cfg("straight", 8), say=quiet)
    train(cfg("resumed", 4), say=quiet)
    train(cfg("resumed", 8), say=quiet)
    assert train_losses(tmp_path / "resumed" / "run") == train_losses(tmp_path / "straight" / "run")
