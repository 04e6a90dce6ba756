"""parallel.shard_optimizer=state (ZeRO-1, training/sharded_adamw.py): AdamW's moments divided over the
replicas train exactly like whole ones, their checkpoints move between replica counts and settings, a
replica keeps 1/R of them, and the settings it cannot run with are refused in one line. `grads` (ZeRO-2,
the accumulated gradients divided too: training/trainer.py divided_loss_and_grads) trains like them to
float32 summation order (each micro-batch's gradients are summed over the replicas before the
micro-batches are summed)."""

import shutil

import numpy as np
import pytest
import tensorflow as tf
from helpers import quiet, tiny_config, train_losses, write_corpus

from tpu_llm.config import load_config
from tpu_llm.errors import UserError
from tpu_llm.training.controller import build_run, train
from tpu_llm.training.sharded_adamw import ShardedAdamW, owned, shard_rows

# clipping that triggers on every step (the tiny model's gradient norm is above 1), weight decay, and the
# update outside XLA's program either way: the subject is the optimizer, so the step runs as a graph
EXACT = {"train.steps": 4, "train.steps_per_loop": 2, "train.batch_size": 8, "train.clip_norm": 0.1,
         "train.weight_decay": 0.1, "train.lr": 3e-3, "execution": "graph"}


def checkpoint_values(run_dir) -> dict:
    """Every saved tensor of the run's newest checkpoint but the bookkeeping: weights, moments, counters."""
    path = tf.train.latest_checkpoint(str(run_dir / "checkpoints"))
    reader = tf.train.load_checkpoint(path)
    return {name: reader.get_tensor(name) for name, _ in tf.train.list_variables(path)
            if name.startswith(("model/", "optimizer/")) and "seed_generator" not in name}


class FourReplicas(dict):
    """The same 4 steps on 4 logical CPU replicas with accumulation 2, moments whole (`none`) and divided
    (`state`), and moments and gradients divided (`grads`), a checkpoint every 2 steps: `[setting]` is its
    run directory, trained at first use (pytest-xdist may give this module's tests to both workers: each
    trains only what its tests read). `grads` runs the default execution, XLA (each micro-batch a call of
    the compiled step, its collective between the calls); the others graphs, whose float32 sums XLA's
    agree with to rounding (tests/test_pipeline.py)."""

    def __init__(self, tmp):
        super().__init__()
        self.tmp = tmp
        write_corpus(tmp / "corpus")

    def __missing__(self, setting):
        execution = {"execution": "xla"} if setting == "grads" else {}
        train(tiny_config(self.tmp / setting, **{**EXACT, **execution}, cpu_devices=4, **{
            "data.train": str(self.tmp / "corpus" / "*.txt"), "train.grad_accum": 2, "checkpoint.every_steps": 2,
            "parallel.shard_optimizer": setting}), say=quiet)
        self[setting] = self.tmp / setting / "run"
        return self[setting]


@pytest.fixture(scope="module")
def four_replicas(tmp_path_factory):
    return FourReplicas(tmp_path_factory.mktemp("four"))


def assert_same_state(run, reference, rtol: float = 0.0) -> None:
    """The two runs' every loss and every saved weight, moment and counter, bit for bit (rtol 0), or
    the losses within `rtol` and every saved tensor within 10 `rtol` of its largest entry (Adam's update,
    m / sqrt(v), carries the last bits of an entry with a tiny gradient into the weight: 2.6e-4 of one
    step of 3e-3 at most here; a micro-batch or replica summed twice or left out moves weights by a step)."""
    whole, divided = checkpoint_values(reference), checkpoint_values(run)
    assert sorted(divided) == sorted(whole)  # the same keys: Keras' AdamW's, moments under optimizer/_variables
    assert any(k.startswith("optimizer/_variables/") for k in whole)
    if rtol == 0:
        assert train_losses(run) == train_losses(reference)
        for name, value in whole.items():
            np.testing.assert_array_equal(divided[name], value, err_msg=name)
        return
    np.testing.assert_allclose(train_losses(run), train_losses(reference), rtol=rtol)
    for name, value in whole.items():
        np.testing.assert_allclose(divided[name], value, rtol=0, atol=10 * rtol * np.abs(value).max(), err_msg=name)


def test_divided_moments_train_exactly_like_whole_ones(four_replicas):
    assert_same_state(four_replicas["state"], four_replicas["none"])


def test_divided_gradients_train_like_whole_ones_to_summation_order(four_replicas):
    assert_same_state(four_replicas["grads"], four_replicas["none"], rtol=1e-5)


def test_with_lora_on_a_bfloat16_step_and_a_skipped_bad_step_too(tmp_path, poison):
    runs = {}
    for setting in ("none", "state", "grads"):
        poison(1)  # NaN gradients at the second step: skipped, every weight and moment kept (the guard)
        train(tiny_config(tmp_path / setting, **EXACT, cpu_devices=2, **{"train.lora_rank": 4,
              "precision": "mixed_bfloat16", "parallel.shard_optimizer": setting}), say=quiet)
        runs[setting] = tmp_path / setting / "run"
    assert_same_state(runs["state"], runs["none"])
    assert_same_state(runs["grads"], runs["none"], rtol=1e-5)


def test_a_checkpoint_moves_between_replica_counts_and_settings(four_replicas, tmp_path):
    # the 4-replica run's step-2 checkpoint (divided moments) continued at 2 replicas (divided) and at 1
    # (whole): the 4-replica run's losses, to float32 summation order (the replica count changes only the
    # order of the gradient sums)
    straight = four_replicas["state"]
    for name, devices, setting in (("two", 2, "state"), ("one", 1, "none"), ("two-grads", 2, "grads")):
        shutil.copytree(straight.parent, tmp_path / name)
        for later in (tmp_path / name / "run" / "checkpoints").glob("ckpt-4.*"):
            later.unlink()  # (the state file still names it: skipped, with a warning, for ckpt-2)
        cfg = tiny_config(tmp_path / name, **EXACT, cpu_devices=devices, **{
            "data.train": str(straight.parent.parent / "corpus" / "*.txt"), "train.grad_accum": 2,
            "checkpoint.every_steps": 2, "parallel.shard_optimizer": setting})
        assert build_run(cfg).resumed_from.endswith("ckpt-2")
        train(cfg, say=quiet)
        resumed = train_losses(tmp_path / name / "run")
        assert len(resumed) == len(train_losses(straight)) == 2  # a line per host call: the copied one, its own
        np.testing.assert_allclose(resumed, train_losses(straight), rtol=1e-5)


def test_each_replica_keeps_a_quarter_of_the_moments(tmp_path):
    def optimizer_bytes_on(device: str, setting: str) -> int:
        cfg = tiny_config(tmp_path / setting, cpu_devices=4, **{"parallel.shard_optimizer": setting})
        run = build_run(cfg)
        variables = [v if isinstance(v, tf.Variable) else v.value for v in run.optimizer.variables]  # (Keras')
        components = [c for v in variables for c in run.dist.strategy.experimental_local_results(v)]
        return sum(c.shape.num_elements() * c.dtype.size for c in components if c.device.endswith(device)
                   and c.shape.rank)  # (the step counter is a scalar)

    whole, divided = optimizer_bytes_on("CPU:1", "none"), optimizer_bytes_on("CPU:1", "state")
    assert 0 < divided <= 0.3 * whole, (divided, whole)


def test_rows_are_divided_with_padding_at_the_end():
    assert [shard_rows(n, 4) for n in (1, 3, 4, 5, 257)] == [1, 1, 1, 2, 65]
    assert [owned(257, 4, r) for r in range(4)] == [65, 65, 65, 62]
    assert [owned(2, 4, r) for r in range(4)] == [1, 1, 0, 0]  # replicas past the rows keep padding only


@pytest.mark.parametrize("overrides, message", [
    ({"parallel.shard_optimizer": "all"}, "parallel.shard_optimizer='all'; valid choices: none, state, grads"),
    ({"parallel.shard_optimizer": "grads", "comm.compression": "powersgd", "cpu_devices": 2},
     "comm.compression=powersgd compresses whole gradients: set comm.compression=none or parallel.shard_optimizer=state"),
    ({"parallel.shard_optimizer": "state", "strategy": "parameter_server"},
     "strategy=parameter_server is not supported yet: set parallel.shard_optimizer=none"),
    ({"parallel.shard_optimizer": "state", "parallel.pipeline_stages": 2, "cpu_devices": 4},
     "with pipeline stages or tensor groups is not supported yet"),
    ({"parallel.shard_optimizer": "state", "comm.sync_every": 4, "cpu_devices": 2},
     "and local SGD (comm.sync_every=4)"),
    ({"parallel.shard_optimizer": "state", "precision": "mixed_float16"}, "does not support precision=mixed_float16"),
])
def test_settings_it_cannot_run_with_are_refused_in_one_line(overrides, message):
    with pytest.raises(UserError) as e:
        load_config(None, overrides)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_one_replica_says_the_setting_has_no_effect(tmp_path):
    run = build_run(tiny_config(tmp_path, **{"parallel.shard_optimizer": "state"}))
    assert not isinstance(run.optimizer, ShardedAdamW)
    from tpu_llm.training.header import describe_run
    lines = describe_run(run, 0, 1e12, "test")
    assert "optimizer parallel.shard_optimizer=state has no effect: one replica" in lines


@pytest.mark.parametrize("setting, accum", [("state", 1), ("grads", 2)])
def test_the_compiled_tpu_step_takes_each_replicas_rows_of_the_moments(setting, accum):
    # the step TPUStrategy compiles (offline, tf2xla's own compiler: tpu_llm/harness/), 2 replicas: every
    # moment reaches the program as its replica's rows, half the variable's first dimension rounded up;
    # `grads`: its accumulation loop (a tf.while_loop holding a collective) compiles too
    from tpu_llm.harness import compiled_step, offline_tpu

    step = offline_tpu.build_step(1, 1, precision="float32", dropout=0.0, grad_accum=accum, shard_optimizer=setting)
    hlo, owners = compiled_step.step_hlo(step)
    module = compiled_step.Module.parse(hlo)
    moments = {id(m.value): m for m in step.optimizer.m + step.optimizer.v}
    seen = 0
    for i, owner in enumerate(owners):
        if owner is not None and id(owner) in moments:
            moment = moments[id(owner)]
            assert module.parameters[i].dims() == (shard_rows(moment.shape[0], 2), *moment.shape[1:])
            seen += 1
    assert seen == len(moments) == 2 * len(step.model.trainable_variables)
