"""The doctor's `hlo default` / `hlo mlir` lines (tools/doctor/hlo.py): selected only on a TPU VM, so
here every layer below the TPU: XLA's own dump of the fake-TPU train step compiled by the CPU (asked
for after TensorFlow is imported, as the doctor asks), the choice of the train step's module and of its
stage, the per-core counts and the verdict, and the check around a training run (its seam)."""

import json
import os
import subprocess
import sys

import pytest
import tensorflow as tf

from tpu_llm.platform import tf_compat, xla_flags
from tpu_llm.tools.doctor import hlo
from tpu_llm.tools.doctor.report import FIX

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# XLA reads XLA_FLAGS once per process, on first use: the dump needs a process of its own. TensorFlow works
# first (as the doctor's imports and device search do), then the flags, then an unrelated module (a
# forward-only jit function the audit must pass over) and the 2 x 1 train step (mixed_bfloat16, dropout
# 0.1, grad_accum 2) compiled through XLA's CPU passes; it prints the offline audit's counts to compare.
DUMP = """
import json, sys
import tensorflow as tf
tf.matmul(tf.ones([2, 2]), tf.ones([2, 2]))
from tpu_llm.platform import xla_flags
xla_flags.ask_dump(sys.argv[1])
tf.function(lambda x: tf.matmul(x, x), jit_compile=True)(tf.ones([4, 4]))
from tpu_llm.harness import compiled_step, placement_audit
from tpu_llm.harness.offline_tpu import build_step
step = build_step(2, 1)
function = step.function("train")
cluster = compiled_step.cluster(function)
args, _ = compiled_step.arguments(function, cluster, step.variables())
compiled_step.compile_hlo(cluster, args, compiled_step.argument_cores(cluster), stage="optimized_hlo")
audit = placement_audit.compiled(2, 1, step=step)
print(json.dumps({k: {str(c): n for c, n in v.items()} for k, v in audit.counts.items() if "matmul" in k}))
"""


@pytest.fixture(scope="module")
def dumped(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("hlo"))
    env = {**os.environ, "PYTHONPATH": REPO}
    env.pop("XLA_FLAGS", None)
    done = subprocess.run([sys.executable, "-c", DUMP, directory], env=env, capture_output=True, text=True,
                          timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return directory, json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_xla_dumps_the_fake_tpu_step_and_its_tf2xla_module_passes_with_the_offline_audits_counts(dumped):
    directory, offline = dumped
    assert len(hlo.modules(directory)) == 2  # the forward-only function and the train step
    check = hlo.audit_dump(directory, 2, 1, stage="before")
    assert check.status == "PASS", check.line()
    assert check.values["module"].split(".")[1].startswith("tpu_replica_computation")  # not the jit function
    before = check.values["counts"]["before"]
    assert before == offline, (before, offline)  # the doctor's counts are the offline audit's
    assert check.numbers.startswith("2 x 1, default bridge (before optimizations of module_")
    assert f"forward matmuls per core {[offline['forward matmuls'][c] for c in ('0', '1')]}" in check.numbers


@pytest.mark.slow
def test_the_cpus_optimized_module_is_core_0_heavy_and_the_line_fails_naming_it(dumped):
    # XLA's CPU passes rewrite the attention's batched matmuls without their sharding (a CPU has one device
    # and no sharding passes): the after-optimizations module leaves them to core 0. A real core-0-heavy
    # module, from XLA itself (and the reason the doctor's verdict reads the module before XLA's passes).
    directory, offline = dumped
    check = hlo.audit_dump(directory, 2, 1, bridge="mlir", stage="after")
    assert check.status == "FAIL" and check.values["stage"] == "after optimizations", check.line()
    assert check.name == "hlo mlir" and check.fix == FIX["hlo mlir"]
    assert check.numbers.startswith("2 x 1, mlir bridge (after optimizations): forward matmuls of the stages: [")
    assert "(core 0 heavy)" in check.numbers and "without a core, on core 0" in check.numbers, check.numbers
    after = check.values["counts"]["after"]["forward matmuls"]
    assert after["None"] > 0 and after["0"] > (1 + 0.25) * after["1"], after


def _module(name: str, body: str) -> str:
    return f"HloModule {name}\n\n{body}\n"


# two stages: each core's forward and backward dot; core 1's backward inside a fusion, whose sharding it takes
EVEN = _module("even", """%fused_computation.1 (p0: f32[4,4], p1: f32[4,4]) -> f32[4,4] {
  %p0 = f32[4,4]{1,0} parameter(0)
  %p1 = f32[4,4]{1,0} parameter(1)
  ROOT %dot.9 = f32[4,4]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="while/gradient_tape/block_1/MatMul"}
}

ENTRY %main (a: f32[4,4]) -> f32[4,4] {
  %a = f32[4,4]{1,0} parameter(0), sharding={maximal device=0}
  %dot.1 = f32[4,4]{1,0} dot(%a, %a), lhs_contracting_dims={1}, rhs_contracting_dims={0}, sharding={maximal device=0}, metadata={op_name="while/block_0/MatMul"}
  %dot.2 = f32[4,4]{1,0} dot(%dot.1, %a), lhs_contracting_dims={1}, rhs_contracting_dims={0}, sharding={maximal device=1}, metadata={op_name="while/block_1/MatMul"}
  %dot.3 = f32[4,4]{1,0} dot(%dot.2, %a), lhs_contracting_dims={1}, rhs_contracting_dims={0}, sharding={maximal device=0}, metadata={op_name="while/gradient_tape/block_0/MatMul"}
  ROOT %fusion.1 = f32[4,4]{1,0} fusion(%dot.3, %a), kind=kOutput, calls=%fused_computation.1, sharding={maximal device=1}
}""")
# the same program with core 1's forward matmul lost its core: a TPU runs it on core 0
HEAVY = EVEN.replace("HloModule even", "HloModule heavy").replace(
    "sharding={maximal device=1}, metadata={op_name=\"while/block_1", "metadata={op_name=\"while/block_1")
FORWARD_ONLY = _module("forward", """ENTRY %main (a: f32[4,4]) -> f32[4,4] {
  %a = f32[4,4]{1,0} parameter(0)
  ROOT %dot.1 = f32[4,4]{1,0} dot(%a, %a), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="MatMul"}
}""")


def _write(directory, files: dict):
    for name, text in files.items():
        (directory / name).write_text(text)


def test_a_core_0_heavy_module_is_a_fail_line_naming_the_layout_and_the_counts(tmp_path):
    _write(tmp_path, {"module_0001.forward.before_optimizations.txt": FORWARD_ONLY,
                      "module_0002.step.before_optimizations.txt": HEAVY,
                      "module_0002.step.tpu_after_optimizations.txt": EVEN})
    check = hlo.audit_dump(str(tmp_path), 2, 1)  # the module the bridge handed XLA
    assert check.status == "FAIL" and check.values["module"] == "module_0002.step", check.line()
    assert check.line() == ("FAIL  hlo default    2 x 1, default bridge (before optimizations): forward matmuls of the "
                            "stages: [2, 0] (not within 25% of an even split) (core 0 heavy); forward matmuls per "
                            "core [2, 0] (1 without a core, on core 0); backward matmuls per core [1, 1]; dump in "
                            f"{tmp_path}")
    check = hlo.audit_dump(str(tmp_path), 2, 1, stage="after")
    assert check.status == "PASS" and check.numbers.endswith(
        "forward matmuls per core [1, 1]; backward matmuls per core [1, 1]"), check.line()
    assert check.values["counts"]["after"]["backward matmuls"] == {"0": 1, "1": 1}  # the fusion's core
    # one stage of two tensor groups: the same rule within the stage
    assert hlo.audit_dump(str(tmp_path), 1, 2).numbers.startswith(
        "1 x 2, default bridge (before optimizations): forward matmuls of stage 0's tensor groups: [2, 0]")


def test_no_dump_or_no_train_step_is_a_warning_naming_the_directory(tmp_path):
    check = hlo.audit_dump(str(tmp_path / "none"), 2, 2)
    assert check.status == "WARN" and "XLA wrote no HLO module to" in check.numbers, check.line()
    _write(tmp_path, {"module_0001.forward.before_optimizations.txt": FORWARD_ONLY})
    check = hlo.audit_dump(str(tmp_path), 2, 2)
    assert check.status == "WARN" and "has a backward matmul" in check.numbers, check.line()


def test_the_dump_is_added_to_xla_flags_and_a_dump_directory_already_given_is_kept():
    env = {"XLA_FLAGS": "--xla_cpu_enable_fast_math=false"}
    assert xla_flags.ask_dump("/d", env) == "/d"
    assert env["XLA_FLAGS"] == "--xla_cpu_enable_fast_math=false --xla_dump_to=/d --xla_dump_hlo_as_text"
    env = {"XLA_FLAGS": "--xla_dump_to=/mine"}
    assert xla_flags.ask_dump("/d", env) == "/mine" and env["XLA_FLAGS"] == "--xla_dump_to=/mine --xla_dump_hlo_as_text"


class _Config:
    def __init__(self, p, t, precision, where):
        self.args = (p, t, precision, where)
        self.model = type("M", (), {"dropout": 0.0})()
        self.train = type("T", (), {"grad_accum": 1})()


def test_check_hlo_trains_the_settings_issue_38_broke_under_each_bridge_and_audits_only_its_module(
        tmp_path, monkeypatch):
    _write(tmp_path, {"module_0001.earlier.before_optimizations.txt": HEAVY})  # the float32 run's, say: not read
    seen = []

    def train(cfg, found):
        seen.append((cfg.args, cfg.model.dropout, cfg.train.grad_accum, tf_compat.mlir_bridge_forced()))
        _write(tmp_path, {f"module_000{len(seen) + 1}.step.before_optimizations.txt": EVEN})
        return 5.5
    monkeypatch.setattr(hlo, "train_one_step", train)
    was = tf_compat.mlir_bridge_forced()
    for bridge in hlo.BRIDGES:
        check = hlo.check_hlo(_Config, None, 2, 1, bridge, str(tmp_path))
        assert check.status == "PASS" and check.name == f"hlo {bridge}", check.line()
        assert check.values["module"] == f"module_000{len(seen) + 1}.step" and "loss 5.5000" in check.numbers
    assert seen == [((2, 1, "mixed_bfloat16", "hlo-default"), 0.1, 2, was),
                    ((2, 1, "mixed_bfloat16", "hlo-mlir"), 0.1, 2, True)]
    assert tf_compat.mlir_bridge_forced() == was  # the bridge is put back

    def broken(cfg, found):
        raise RuntimeError("MLIR bridge: unsupported op\nmore")
    monkeypatch.setattr(hlo, "train_one_step", broken)
    check = hlo.check_hlo(_Config, None, 2, 1, "mlir", str(tmp_path))
    assert check.status == "WARN" and check.line() == (
        "WARN  hlo mlir       2 x 1, mlir bridge did not compile or train: RuntimeError: MLIR bridge: unsupported op")
    assert hlo.check_hlo(_Config, None, 2, 1, "default", str(tmp_path)).status == "FAIL"
    assert tf_compat.mlir_bridge_forced() == was
    assert hlo.check_hlo(_Config, None, 1, 1, "default", str(tmp_path)).status == "SKIP"


def test_the_cli_asks_for_the_dump_before_tensorflow_only_where_this_process_compiles(monkeypatch):
    from tpu_llm import cli
    from tpu_llm.tools import doctor

    environ = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "TPU_NAME", "TPU_LOAD_LIBRARY")}
    monkeypatch.setattr(os, "environ", environ)  # a copy: this process's own environment stays as it is
    seen = {}
    monkeypatch.setattr(doctor, "main", lambda **kw: seen.update(kw, flags=os.environ.get("XLA_FLAGS")))
    cli.COMMANDS["doctor"].run(tpu="local")
    dump = seen["hlo_dump"]
    assert os.path.basename(dump).startswith(xla_flags.PREFIX) and os.path.isdir(dump)
    assert seen["flags"] == f"--xla_dump_to={dump} --xla_dump_hlo_as_text"
    os.rmdir(dump)
    environ.pop("XLA_FLAGS")
    cli.COMMANDS["doctor"].run(tpu="my-pod")  # its hosts compile: nothing to dump here
    assert seen["hlo_dump"] == "" and seen["flags"] is None


def test_the_settings_train_as_the_doctor_builds_them(tmp_path):
    # the real training step behind check_hlo, on 4 logical CPUs (2 replicas of 2 x 1, graph mode): the
    # doctor's config with mixed_bfloat16, dropout 0.1 and grad_accum 2 builds and trains; no XLA
    # compile here, so no module: the WARN naming the directory
    from tpu_llm.parallel.distribute import Found
    from tpu_llm.tools import doctor

    def make_cfg(p, t, precision="float32", where="mp"):
        cfg = doctor.tiny_config(str(tmp_path / where), "", "auto", 4, p, t, 2, precision=precision, layers=2)
        cfg.train.batch_size, cfg.execution = 4 * cfg.parallel.microbatches * 4, "graph"
        return cfg
    check = hlo.check_hlo(make_cfg, Found(), 2, 1, "default", str(tmp_path / "dump"))
    assert check.status == "WARN" and "XLA wrote no HLO module" in check.numbers, check.line()
    assert 5.0 < check.values["loss"] < 6.0 and check.values["seconds"] > 0, check.values
    assert tf.keras.mixed_precision.global_policy().name == "float32"


def test_on_a_tpu_the_doctor_adds_a_line_per_bridge_or_says_why_not(monkeypatch):
    from tpu_llm.tools import doctor

    lines = doctor._hlo_lines(None, None, 2, 2, "", 4)  # a TPU over the network: no dump here
    assert [(c.name, c.status) for c in lines] == [("hlo default", "SKIP"), ("hlo mlir", "SKIP")]
    assert "the TPU's hosts compile its programs" in lines[0].numbers
    assert doctor._hlo_lines(None, None, 2, 2, "/dump", 2)[0].numbers == "2 x 2 does not fit (model parallel line)"

    def check(make_cfg, found, stages, tensor, bridge, directory):
        if bridge == "mlir":
            raise ValueError("unreadable dump")
        return hlo.Check(f"hlo {bridge}", "PASS", f"{stages} x {tensor} in {directory}")
    monkeypatch.setattr(hlo, "check_hlo", check)
    lines = doctor._hlo_lines(None, None, 2, 2, "/dump", 8)
    assert [c.line() for c in lines] == ["PASS  hlo default    2 x 2 in /dump",
                                         "FAIL  hlo mlir       the check stopped: ValueError: unreadable dump"]
