"""`tpu-llm doctor` on logical CPUs: every line passes here, and each check fails on a broken input."""

import dataclasses
import json
import os

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import make_topology, offline_tpu, tiny_model

from tpu_llm import cli
from tpu_llm.errors import UserError
from tpu_llm.model import transformer
from tpu_llm.parallel import pipeline, tpu
from tpu_llm.parallel.distribute import Found, get_strategy
from tpu_llm.parallel.mesh import Mesh, Placement
from tpu_llm.tools import doctor, plan
from tpu_llm.tools.doctor import data_parallel, memory, model_parallel
from tpu_llm.tools.doctor import devices as doctor_devices
from tpu_llm.training.build import build_run


def line_of(out: str) -> dict:
    """{check name: its line} of doctor's table."""
    return {line[6:20].strip(): line for line in out.splitlines() if line[:4] in ("PASS", "FAIL", "SKIP")}


def test_a_failing_model_parallel_run_leaves_every_data_parallel_line_measured(tmp_path, monkeypatch, capsys):
    # one full run (the CI budget allows one) on 4 logical CPUs: the data-parallel run (4 replicas) must
    # pass every line; the staged run, broken on purpose (any pipeline of 2+ stages fails to build, as a
    # TPU that refuses the layout would), is its own FAIL line with its fix, and the command exits 2.
    # Before issue 27 the staged run was the only run: this failure was one "run" line and nothing else.
    real = pipeline.Pipeline.__init__

    def broken(self, model, stages, *args, **kwargs):
        if len(stages) > 1:
            raise RuntimeError("staged run broken on purpose")
        real(self, model, stages, *args, **kwargs)
    monkeypatch.setattr(pipeline.Pipeline, "__init__", broken)
    tiny = doctor.tiny_config  # the compiled step is not the subject here (the notebook's doctor compiles it)
    monkeypatch.setattr(doctor, "tiny_config", lambda *a, **k: dataclasses.replace(tiny(*a, **k), execution="graph"))
    code = cli.main(["doctor", "--run_dir", str(tmp_path / "doc"), "--cpu_devices", "4", "--steps", "4"])
    out, err = capsys.readouterr()
    assert code == 2 and err.strip().startswith("error: doctor: model parallel failed"), err
    assert len(err.strip().splitlines()) == 1
    lines = line_of(out)
    assert list(lines) == ["devices", "replicas", "bfloat16", "checkpoint", "input", "plan", "profile", "memory",
                           "shard state", "shard grads", "model parallel"], out
    assert [n for n, line in lines.items() if not line.startswith("PASS")] == ["model parallel"], out
    assert "2 stage(s) x 2 tensor group(s) stopped: RuntimeError: staged run broken on purpose" in \
        lines["model parallel"]
    assert f"      fix: {doctor.FIX['model parallel']}" in out
    assert "4 replica(s) x 1 device(s)" in lines["devices"] and "bit-identical on 4 replicas" in lines["replicas"]
    report = json.loads((tmp_path / "doc" / "doctor.json").read_text())
    assert report["passed"] is False
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["model parallel"]["values"] == {"devices": 4, "kind": "logical CPU", "stages": 2, "tensor": 2}
    assert checks["checkpoint"]["values"]["exact"] and checks["input"]["values"]["ratio"] >= 1
    profile = checks["profile"]["values"]  # the first-contact trace: one host call, where TensorBoard looks
    assert profile["host_calls"] == 1 and profile["path"].endswith(".xplane.pb") and os.path.isfile(profile["path"])
    assert f"view: tensorboard --logdir {tmp_path / 'doc'}" in lines["profile"]
    assert data_parallel.PLAN_RATIO[0] <= checks["plan"]["values"]["ratio"] <= data_parallel.PLAN_RATIO[1]
    assert abs(checks["bfloat16"]["values"]["relative"]) < 0.02
    shard = checks["shard state"]["values"]  # 4 replicas: a quarter of the moments, bit-identical on CPUs
    assert shard["relative"] == 0.0 and shard["bytes"] <= 0.26 * shard["whole_bytes"], shard
    assert abs(shard["bytes"] / shard["planned_bytes"] - 1) <= data_parallel.SHARD_PLAN_TOLERANCE, shard
    grads = checks["shard grads"]["values"]  # the gradients of 2 micro-batches too: summed in another order
    assert grads["grad_accum"] == 2 and grads["relative"] < 1e-6 and grads["bytes"] == shard["bytes"], grads
    measured = checks["memory"]["values"]  # float32 on a CPU: the same sums in another order
    assert measured["loss_diff"] < 1e-5 and measured["grad_diff"] < 1e-5
    if measured["dense_peak"] is not None:  # this TF reports CPU allocations: the options must save memory
        assert measured["options_peak"] < measured["dense_peak"]
        assert all(memory.MEMORY_PLAN_RATIO[0] <= measured[f"ratio_{n}"] <= memory.MEMORY_PLAN_RATIO[1]
                   for n in ("dense", "options"))


def test_the_model_parallel_run_matches_the_data_parallel_one(tmp_path):
    # 2 replicas x 2 stages on 4 logical CPUs against the data-parallel run: the same model, weights and
    # batches give the same mean loss; each stage's variables and moments on its own device
    steps, layers = 2, 2

    def make_cfg(p, t, where="mp"):
        cfg = doctor.tiny_config(str(tmp_path / where), "", "auto", 4, p, t, steps, layers=layers)
        cfg.train.batch_size, cfg.execution = 4 * cfg.parallel.microbatches * 4, "graph"
        return cfg
    cfg = make_cfg(1, 1, "dp")
    cfg.cpu_devices = 1  # the reference on one device: the same global batches (one input pipeline) in one replica
    found = Found()
    dp = build_run(cfg, get_strategy(cfg, found))
    reference = dp.trainer.run(dp.train_iterator, steps, steps)["loss"]
    four = type("D", (), {"name": "mirrored", "num_replicas": 4, "device_kind": "CPU"})  # doctor's 4-replica run
    check = model_parallel.check_model_parallel(make_cfg, found, four, 2, 1, steps, reference)
    assert check.status == "PASS", check.line()
    values = check.values
    assert values["relative"] < 1e-5 and values["replicas"] == 2, values
    devices = sorted(d.split("device:")[-1] for d in values["placement"]["params_per_device"])
    assert devices == ["CPU:0", "CPU:1", "CPU:2", "CPU:3"]
    assert sorted(set(values["placement"]["params_per_device"].values())) == \
        sorted(values["placement"]["planned_params_per_stage"])
    assert "replicas bit-identical" in check.numbers


def test_the_model_parallel_line_fails_on_a_loss_apart_from_the_data_parallel_one(monkeypatch):
    # a stage or tensor group computing the wrong thing: the run goes through, the loss does not match
    passed = doctor.Check("x", "PASS", "fine")
    monkeypatch.setattr(model_parallel.distribute, "get_strategy", lambda cfg, found: type("D", (), {"num_replicas": 2})())
    monkeypatch.setattr(model_parallel.build, "build_run", lambda cfg, dist: None)
    monkeypatch.setattr(model_parallel, "check_placement", lambda run: passed)
    monkeypatch.setattr(model_parallel, "check_replicas", lambda run: passed)
    cpus = type("D", (), {"name": "mirrored", "num_replicas": 4, "device_kind": "CPU"})
    for loss, status in ((5.0 * 1.005, "PASS"), (5.0 * 1.05, "FAIL"), (float("nan"), "FAIL")):
        monkeypatch.setattr(model_parallel, "run_model_parallel", lambda run, steps: loss)
        check = model_parallel.check_model_parallel(lambda p, t: None, Found(), cpus, 2, 1, 4, 5.0)
        assert check.status == status, check.line()
    assert "vs data-parallel 5.0000" in check.numbers and check.fix == ""


@pytest.mark.parametrize("setting", ["state", "grads"])
def test_the_shard_lines_fail_on_a_loss_apart_or_moments_not_divided(tmp_path, monkeypatch, setting):
    # the divided run stubbed: its mean loss and the bytes its moments hold on replica 0's device
    make_cfg = lambda *_: doctor.tiny_config(str(tmp_path), "", "auto", 4, 1, 1, 4)  # noqa: E731
    cpu = plan.Accelerator("cpu", "CPU", 1, 1e11, 0.0, "")
    state = make_cfg()
    state.parallel.shard_optimizer = "state"
    planned = plan.plan(state, cpu, check=False).memory[0].optimizer  # with 4 replicas: a quarter
    whole_run = type("Run", (), {"optimizer": "whole"})()
    strategy = type("S", (), {"extended": type("E", (), {"worker_devices": ["/device:CPU:0"]})()})()
    dist = type("D", (), {"name": "mirrored", "num_replicas": 4, "strategy": strategy})()
    built = []
    for loss, held, status in ((5.0, planned, "PASS"), (5.0 * (1 + 1e-3), planned, "FAIL"),
                               (float("nan"), planned, "FAIL"), (5.0, 4 * planned, "FAIL")):
        trainer = type("T", (), {"run": lambda self, it, n, m, loss=loss: {"loss": loss}})()

        def build_run(cfg, d, trainer=trainer):
            built.append(cfg)
            return type("Run", (), {"optimizer": "state", "trainer": trainer, "train_iterator": None})()
        monkeypatch.setattr(data_parallel.build, "build_run", build_run)
        monkeypatch.setattr(data_parallel.sharded_adamw, "bytes_on",
                            lambda opt, s, device, held=held: held if opt == "state" else 4 * planned)
        check = data_parallel.check_shard(setting, make_cfg, dist, 4, whole_run, 5.0)
        assert check.status == status and check.name == f"shard {setting}", (check.line(), loss, held)
    # the run it trains: the setting, and with grads micro-batches whose gradients there are to divide
    assert {(c.parallel.shard_optimizer, c.train.grad_accum) for c in built} == \
        {(setting, data_parallel.SHARD_ACCUM if setting == "grads" else 1)}
    one = type("D", (), {"name": "default", "num_replicas": 1})()
    assert data_parallel.check_shard(setting, make_cfg, one, 4, whole_run, 5.0).status == "SKIP"
    workers = type("D", (), {"name": "multi_worker", "num_replicas": 4})()
    check = data_parallel.check_shard(setting, make_cfg, workers, 4, whole_run, 5.0)
    assert check.status == "SKIP" and "strategy=multi_worker is not supported yet" in check.numbers
    if setting == "grads":  # 16 sequences do not split into 16 replicas x 2 micro-batches: said, not a crash
        many = type("D", (), {"name": "mirrored", "num_replicas": 16, "strategy": strategy})()
        check = data_parallel.check_shard(setting, make_cfg, many, 4, whole_run, 5.0)
        assert check.status == "SKIP" and "does not split into 16 replicas x 2 micro-batches" in check.numbers


def test_a_layout_that_does_not_fit_names_the_cores_and_what_fits():
    tpu = type("D", (), {"name": "tpu", "num_replicas": 2, "device_kind": "TPU v5 lite"})
    check = model_parallel.check_model_parallel(None, Found(tpu="/dev/vfio present"), tpu, 2, 2, 4, 5.0)
    assert check.status == "FAIL" and check.fix.startswith("this TPU has 2 TPU core(s); 2 x 2 = 4 TPU core(s) per "
                                                            "replica needs a multiple of 4"), check.fix
    assert "(2 x 1)" in check.fix and "tpu-llm[tpu]" not in check.fix
    one = type("D", (), {"name": "tpu", "num_replicas": 1, "device_kind": "TPU v6 lite"})
    check = model_parallel.check_model_parallel(None, Found(tpu="/dev/vfio present"), one, 1, 1, 4, 5.0)
    assert check.status == "SKIP" and check.numbers.startswith("1 TPU core(s): nothing to split"), check.line()


def test_the_memory_check_fails_when_the_chunked_loss_is_wrong(monkeypatch):
    real = transformer.chunked_loss
    monkeypatch.setattr(transformer, "chunked_loss", lambda x, w, y, chunk: 1.05 * real(x, w, y, chunk))
    check = memory.check_memory("/job:localhost/replica:0/task:0/device:CPU:0")
    assert check.status == "FAIL" and 0.04 < check.values["loss_diff"] < 0.06, check.line()


def test_the_memory_probe_has_nothing_a_tpu_would_pad():
    # a TPU stores arrays in tiles of 128 lanes on the minor dimension: a head_dim of 32 takes 4x the
    # bytes the planner counts, so every minor dimension of the probe is a multiple of 128
    probe = memory.MEMORY_PROBE
    head_dim = probe["model.n_embd"] // probe["model.n_head"]
    assert head_dim >= 128 and probe["model.n_embd"] % probe["model.n_head"] == 0
    assert probe["model.n_head"] % probe["model.n_kv_head"] == 0 and probe["model.n_kv_head"] < probe["model.n_head"]
    for dim in (head_dim, probe["model.n_embd"], probe["data.seq_len"], probe["model.vocab_size"],
                memory.MEMORY_OPTIONS["train.loss_chunk"], memory.MEMORY_OPTIONS["model.attention_block"]):
        assert dim % 128 == 0, dim


def test_each_check_fails_on_a_broken_input(tmp_path):
    assert data_parallel.check_bfloat16(5.0, 5.2).status == "FAIL" and data_parallel.check_bfloat16(5.0, 5.05).status == "PASS"
    assert data_parallel.check_bfloat16(5.0, float("nan")).status == "FAIL"
    assert data_parallel.check_input(100.0, 0.1, 16).status == "FAIL"  # 100 windows/s, the step eats 160
    assert data_parallel.check_input(200.0, 0.1, 16).status == "PASS"

    class Dist:
        name, device_kind, chips = "default", "CPU", 0
    cfg = doctor.tiny_config(str(tmp_path), "", "auto", 4, 1, 1, 4)
    assert data_parallel.check_plan(cfg, Dist, 1e-9).status == "FAIL"  # far faster than the plan: its FLOPs are wrong
    Dist.device_kind = "GPU"
    assert data_parallel.check_plan(cfg, Dist, 1.0).status == "SKIP"

    # replicas: one replica's copy changed
    strategy = tf.distribute.MirroredStrategy(["/device:CPU:0", "/device:CPU:1"],
                                              cross_device_ops=tf.distribute.ReductionToOneDevice())
    with strategy.scope():
        weight = keras.Variable(np.ones(3, np.float32), name="w")
    weight.value.values[1].assign([1.0, 2.0, 1.0])
    run = _Run(weights=[weight], replicas=2)
    check = data_parallel.check_replicas(run)
    assert check.status == "FAIL" and check.values["differ"], check
    weight.value.values[1].assign([1.0, 1.0, 1.0])
    assert data_parallel.check_replicas(run).status == "PASS"

    # placement: a 2-stage pipeline whose variables were all built on one device (the old behaviour)
    model = tiny_model(n_layer=2)
    parts = pipeline.partition(model.cfg, model.vocab_size, 16, 2)
    pipe = pipeline.Pipeline(model, parts, Placement(Mesh(1, 2), (("/device:CPU:0", "/device:CPU:1"),)))
    check = model_parallel.check_placement(_Run(pipe=pipe, replicas=1, optimizer_variables=[]))
    assert check.status == "FAIL" and "2 stages x 1 replicas on 1 devices" in check.values["problems"], check
    placed = pipeline.build_weights(tiny_model(n_layer=2), parts, pipe.placement)
    pipe = pipeline.Pipeline(placed, parts, pipe.placement)
    assert model_parallel.check_placement(_Run(pipe=pipe, replicas=1, optimizer_variables=[])).status == "FAIL"  # no moments

    # checkpoint: a run directory that cannot be written
    class Broken:
        def save(self, step):
            raise UserError("cannot write checkpoints to gs://nowhere")
    check = data_parallel.check_checkpoint(_Run(weights=[], replicas=1, checkpointer=Broken(), model=tiny_model(n_layer=1)))
    assert check.status == "FAIL" and "gs://nowhere" in check.numbers


class _Run:
    """The parts of a build.Run the checks read."""

    def __init__(self, weights=(), replicas=1, pipe=None, optimizer_variables=(), checkpointer=None, model=None):
        self.model = model or type("M", (), {"weights": list(weights), "trainable_variables": list(weights)})()
        self.optimizer = type("O", (), {"variables": list(optimizer_variables), "iterations": tf.Variable(3)})()
        self.dist = type("D", (), {"num_replicas": replicas})()
        self.trainer = type("T", (), {"pipeline": pipe})()
        self.checkpointer = checkpointer


def test_doctor_refuses_too_few_steps():
    with pytest.raises(UserError, match="--steps=1 must be an integer >= 2"):
        doctor.run(steps=1)


def test_plan_accelerator_names():
    tpu = type("D", (), {"name": "tpu", "device_kind": "TPU v5 lite", "chips": 8})
    assert data_parallel.accelerator_name(tpu) == "v5litepod-8"
    tpu.device_kind, tpu.chips = "TPU v4", 4
    assert data_parallel.accelerator_name(tpu) == "v4-8"
    assert np.isfinite(data_parallel.PLAN_RATIO[1])


def test_layout_fits_the_devices_found(tmp_path):
    assert [model_parallel.layout(n) for n in (1, 2, 3, 4, 6, 8, 16)] == \
        [(1, 1), (2, 1), (1, 1), (2, 2), (1, 1), (2, 2), (2, 2)]
    assert model_parallel.layout(8, 2, 1) == (2, 1) and model_parallel.layout(8, 4, 0) == (4, 2) and model_parallel.layout(1, 2, 2) == (2, 2)

    class Dist:
        name, device_kind, chips = "default", "CPU", 0
    cfg = doctor.tiny_config(str(tmp_path), "", "auto", 8, 2, 2, 4)  # the planner has no CPU model of tensor groups
    check = data_parallel.check_plan(cfg, Dist, 0.05)
    assert check.status == "SKIP" and "parallel.tensor=2" in check.numbers


# TPUs of 1, 2, 4 and 8 cores (one host): mesh [x, y, z, cores per chip] as in tests/test_tpu.py
TOPOLOGIES = {
    "v5e-1 / v6e-1 (Colab, Kaggle)": ([1, 1, 1, 1], (1, 1)),
    "v5litepod-2": ([1, 2, 1, 1], (2, 1)),
    "one chip of two cores (v2/v3)": ([1, 1, 1, 2], (2, 1)),
    "v5e-4 / v4-8": ([2, 2, 1, 1], (2, 2)),
    "v5e-8 / v6e-8": ([2, 4, 1, 1], (2, 2)),
    "v3-8 / v2-8": ([2, 2, 1, 2], (2, 2)),
}


@pytest.mark.parametrize("name", list(TOPOLOGIES))
def test_doctor_sizes_both_runs_to_the_tpu_it_finds(name, tmp_path, monkeypatch):
    # TF's own TPUStrategy on a hand-built topology (helpers.offline_tpu): the data-parallel run has one
    # replica per core, the layout comes from that count, and the model-parallel strategy the doctor
    # then builds is one TF accepts on that topology, over the same TPU connection
    mesh, expected = TOPOLOGIES[name]
    topology = make_topology(mesh, mesh)
    cores = topology.num_tasks * topology.num_tpus_per_task
    initialized = offline_tpu(monkeypatch, topology)
    found = Found(tpu="/dev/accel0 present (TPU VM)")
    dist = get_strategy(doctor.tiny_config(str(tmp_path), "local", "auto", 1, 1, 1, 4), found)
    assert dist.name == "tpu" and model_parallel.device_count(dist) == cores
    stages, tensor = model_parallel.layout(model_parallel.device_count(dist))
    assert (stages, tensor) == expected
    assert (tpu.device_assignment(topology, stages * tensor) is None) == (stages * tensor == 1)
    if stages * tensor > 1:
        mp = get_strategy(doctor.tiny_config(str(tmp_path), "local", "auto", 1, stages, tensor, 4), found)
        assert mp.num_replicas == cores // (stages * tensor) and len(initialized) == 1
        assert (mp.placement.mesh.stage, mp.placement.mesh.tensor) == (stages, tensor)


def test_a_multi_host_slice_gets_two_by_two_blocks():
    topology = make_topology([4, 4, 1, 1], [2, 2, 1, 1])  # v5litepod-16: four hosts of 2x2 chips
    stages, tensor = model_parallel.layout(topology.num_tasks * topology.num_tpus_per_task)
    assert (stages, tensor) == (2, 2) and tpu.device_assignment(topology, 4).num_replicas == 4


def test_a_remote_tpu_gets_the_data_staged_beside_the_run(tmp_path):
    # a pod's hosts cannot read this machine's files: doctor copies a few embedded-corpus files into
    # the run directory (gs:// there) and trains on them
    from tpu_llm.data import sources

    pattern = doctor.stage_data(str(tmp_path / "data"))
    staged = sorted(tf.io.gfile.glob(pattern))
    originals = sources.embedded_corpus_files()[:doctor.STAGED_FILES]
    assert len(staged) == len(originals) == doctor.STAGED_FILES
    for copy, original in zip(staged, originals):
        with open(copy, "rb") as a, open(original, "rb") as b:
            assert a.read() == b.read()


def test_the_devices_fix_names_the_install_only_when_tensorflow_sees_no_tpu(monkeypatch):
    found = Found(tpu="/dev/vfio present and libtpu installed (TPU VM)")
    monkeypatch.setattr(doctor_devices, "_tensorflow_tpus", lambda: 1)  # e.g. the TPU is held by another process
    fix = doctor_devices.devices_fix(found)
    assert fix.startswith("TensorFlow sees this TPU (1 TPU device(s)), so its install is right") and "pip" not in fix
    monkeypatch.setattr(doctor_devices, "_tensorflow_tpus", lambda: 0)
    assert "pip install 'tpu-llm[tpu]': tensorflow-tpu 2.20.0 with libtpu 0.0.14" in doctor_devices.devices_fix(found)
    assert doctor_devices.devices_fix(Found(tpu="TPU_NAME=pod in the environment"), remote=True).startswith(
        "the TPU named is reached over the network")
    assert doctor_devices.devices_fix(found, name="mirrored").startswith("a TPU is attached")
    assert doctor_devices.devices_fix(Found(gpus=2), name="default").startswith("TensorFlow lists 2 GPU(s)")


@pytest.mark.parametrize("tpu,says", [("local", "TPU runtime: PJRT plugin; libtpu: /site-packages/libtpu/libtpu.so"),
                                      ("my-pod", "TPU runtime: the TF servers of the TPU's hosts")])
def test_doctor_says_which_tpu_runtime_and_libtpu_it_was_pointed_at(tmp_path, monkeypatch, tpu, says):
    # the CLI hands doctor the line cli/pjrt.describe() makes of the variables it set before TensorFlow
    # started; a TPU the strategy then cannot reach still gets the line (it is what to check first)
    from tpu_llm.cli import pjrt
    from tpu_llm.parallel import distribute

    monkeypatch.setattr(distribute, "look_around", lambda cfg: Found(tpu="/dev/vfio present (TPU VM)"))
    monkeypatch.setattr(distribute, "choose", lambda cfg, found: (_ for _ in ()).throw(UserError("no TPU here")))
    monkeypatch.setattr(pjrt, "wheel_libtpu", lambda: None)
    runtime = pjrt.describe({"NEXT_PLUGGABLE_DEVICE_USE_C_API": "true",
                             "TF_PLUGGABLE_DEVICE_LIBRARY_PATH": "/site-packages/libtpu/libtpu.so"})
    lines = []
    doctor.run(run_dir=str(tmp_path), tpu=tpu, say=lines.append, runtime=runtime)
    assert any(line.strip().startswith(says) for line in lines), lines
    seen = {}
    monkeypatch.setattr(os, "environ", dict(os.environ))  # what cli.main sets stays out of this process
    monkeypatch.setattr(doctor, "main", lambda **kw: seen.update(kw))
    monkeypatch.setattr(pjrt, "describe", lambda env=None: "TPU runtime: as described")
    assert cli.main(["doctor", "--run_dir", str(tmp_path)]) == 0 and seen["runtime"] == "TPU runtime: as described"
