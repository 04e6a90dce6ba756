"""`tpu-llm doctor` on logical CPUs: every line passes here, and each check fails on a broken input."""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import tiny_model

from tpu_llm import cli
from tpu_llm.errors import UserError
from tpu_llm.parallel import pipeline
from tpu_llm.parallel.distribute import Placement
from tpu_llm.tools import doctor


def test_doctor_passes_on_logical_cpus_and_a_failed_line_exits_2_with_its_fix(tmp_path, monkeypatch, capsys):
    # one full run (the CI budget allows one): every check must pass on 2 replicas x 2 stages of logical
    # CPUs, except bfloat16, broken on purpose (a negative tolerance), which must fail the command
    monkeypatch.setattr(doctor, "BF16_TOLERANCE", -1.0)
    code = cli.main(["doctor", "--run_dir", str(tmp_path / "doc"), "--cpu_devices", "4", "--stages", "2",
                     "--tensor", "1", "--steps", "4"])
    out, err = capsys.readouterr()
    assert code == 2 and err.strip().startswith("error: doctor: bfloat16 failed") and len(err.strip().splitlines()) == 1
    lines = {line.split()[1]: line for line in out.splitlines() if line[:4] in ("PASS", "FAIL", "SKIP")}
    assert list(lines) == ["devices", "placement", "replicas", "bfloat16", "checkpoint", "input", "plan", "memory"], out
    assert [n for n, line in lines.items() if not line.startswith("PASS")] == ["bfloat16"], out
    assert f"      fix: {doctor.FIX['bfloat16']}" in out
    assert "2 replica(s) x 2 device(s)" in lines["devices"] and "bit-identical on 2 replicas" in lines["replicas"]
    report = json.loads((tmp_path / "doc" / "doctor.json").read_text())
    assert report["passed"] is False
    checks = {c["name"]: c for c in report["checks"]}
    placement = checks["placement"]["values"]
    assert sorted(d.split("device:")[-1] for d in placement["params_per_device"]) == ["CPU:0", "CPU:1", "CPU:2", "CPU:3"]
    assert sorted(set(placement["params_per_device"].values())) == sorted(placement["planned_params_per_stage"])
    assert checks["checkpoint"]["values"]["exact"] and checks["input"]["values"]["ratio"] >= 1
    assert doctor.PLAN_RATIO[0] <= checks["plan"]["values"]["ratio"] <= doctor.PLAN_RATIO[1]
    assert abs(checks["bfloat16"]["values"]["relative"]) < 0.02  # the real tolerance holds
    memory = checks["memory"]["values"]  # float32 on a CPU: the same sums in another order
    assert memory["loss_diff"] < 1e-5 and memory["grad_diff"] < 1e-5
    if memory["dense_peak"] is not None:  # this TF reports CPU allocations: the options must save memory
        assert memory["options_peak"] < memory["dense_peak"]


def test_the_memory_check_fails_when_the_chunked_loss_is_wrong(monkeypatch):
    real = pipeline.chunked_loss
    monkeypatch.setattr(pipeline, "chunked_loss", lambda x, w, y, chunk: 1.05 * real(x, w, y, chunk))
    check = doctor.check_memory("/job:localhost/replica:0/task:0/device:CPU:0")
    assert check.status == "FAIL" and 0.04 < check.values["loss_diff"] < 0.06, check.line()


def test_the_memory_probe_has_nothing_a_tpu_would_pad():
    # a TPU stores arrays in tiles of 128 lanes on the minor dimension: a head_dim of 32 takes 4x the
    # bytes the planner counts, so every minor dimension of the probe is a multiple of 128
    probe = doctor.MEMORY_PROBE
    head_dim = probe["model.n_embd"] // probe["model.n_head"]
    assert head_dim >= 128 and probe["model.n_embd"] % probe["model.n_head"] == 0
    assert probe["model.n_head"] % probe["model.n_kv_head"] == 0 and probe["model.n_kv_head"] < probe["model.n_head"]
    for dim in (head_dim, probe["model.n_embd"], probe["data.seq_len"], probe["model.vocab_size"],
                doctor.MEMORY_OPTIONS["train.loss_chunk"], doctor.MEMORY_OPTIONS["model.attention_block"]):
        assert dim % 128 == 0, dim


def test_each_check_fails_on_a_broken_input(tmp_path):
    assert doctor.check_bfloat16(5.0, 5.2).status == "FAIL" and doctor.check_bfloat16(5.0, 5.05).status == "PASS"
    assert doctor.check_bfloat16(5.0, float("nan")).status == "FAIL"
    assert doctor.check_input(100.0, 0.1, 16).status == "FAIL"  # 100 windows/s, the step eats 160
    assert doctor.check_input(200.0, 0.1, 16).status == "PASS"

    class Dist:
        name, device_kind, chips = "default", "CPU", 0
    cfg = doctor.tiny_config(str(tmp_path), "", "auto", 4, 1, 1, 4)
    assert doctor.check_plan(cfg, Dist, 1e-9).status == "FAIL"  # far faster than the plan: its FLOPs are wrong
    Dist.device_kind = "GPU"
    assert doctor.check_plan(cfg, Dist, 1.0).status == "SKIP"

    # replicas: one replica's copy changed
    strategy = tf.distribute.MirroredStrategy(["/device:CPU:0", "/device:CPU:1"],
                                              cross_device_ops=tf.distribute.ReductionToOneDevice())
    with strategy.scope():
        weight = keras.Variable(np.ones(3, np.float32), name="w")
    weight.value.values[1].assign([1.0, 2.0, 1.0])
    run = _Run(weights=[weight], replicas=2)
    check = doctor.check_replicas(run)
    assert check.status == "FAIL" and check.values["differ"], check
    weight.value.values[1].assign([1.0, 1.0, 1.0])
    assert doctor.check_replicas(run).status == "PASS"

    # placement: a 2-stage pipeline whose variables were all built on one device (the old behaviour)
    model = tiny_model(n_layer=2)
    parts = pipeline.partition(model.cfg, model.vocab_size, 16, 2)
    pipe = pipeline.Pipeline(model, parts, Placement(2, (("/device:CPU:0", "/device:CPU:1"),)))
    check = doctor.check_placement(_Run(pipe=pipe, replicas=1, optimizer_variables=[]))
    assert check.status == "FAIL" and "2 stages x 1 replicas on 1 devices" in check.values["problems"], check
    placed = pipeline.build_weights(tiny_model(n_layer=2), parts, pipe.placement)
    pipe = pipeline.Pipeline(placed, parts, pipe.placement)
    assert doctor.check_placement(_Run(pipe=pipe, replicas=1, optimizer_variables=[])).status == "FAIL"  # no moments

    # checkpoint: a run directory that cannot be written
    class Broken:
        def save(self, step):
            raise UserError("cannot write checkpoints to gs://nowhere")
    check = doctor.check_checkpoint(_Run(weights=[], replicas=1, checkpointer=Broken(), model=tiny_model(n_layer=1)))
    assert check.status == "FAIL" and "gs://nowhere" in check.numbers


class _Run:
    """The parts of a controller.Run the checks read."""

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
    assert doctor.accelerator_name(tpu) == "v5litepod-8"
    tpu.device_kind, tpu.chips = "TPU v4", 4
    assert doctor.accelerator_name(tpu) == "v4-8"
    assert np.isfinite(doctor.PLAN_RATIO[1])


def test_layout_fits_the_devices_found(tmp_path):
    from tpu_llm.parallel.distribute import Found
    assert doctor.layout(Found(), 8, 0, 0) == (2, 2) and doctor.layout(Found(), 4, 0, 0) == (2, 1)
    assert doctor.layout(Found(gpus=1), 8, 0, 0) == (1, 1)  # one GPU: no stages to place
    assert doctor.layout(Found(tpu="tpu='local' set"), 8, 2, 1) == (2, 1)

    class Dist:
        name, device_kind, chips = "default", "CPU", 0
    cfg = doctor.tiny_config(str(tmp_path), "", "auto", 8, 2, 2, 4)  # the planner has no CPU model of tensor groups
    check = doctor.check_plan(cfg, Dist, 0.05)
    assert check.status == "SKIP" and "parallel.tensor=2" in check.numbers


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
