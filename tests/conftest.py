"""Fixtures and test-process set-up; the plain helpers (`tiny_config`, `write_corpus`, `snapshot`, ...)
are in helpers.py (`from helpers import tiny_config`).

The test process splits its CPU into `CPU_DEVICES` logical devices before TensorFlow starts, so
multi-device code (MirroredStrategy, `cpu_devices`) runs in-process; single-device code uses the
first of them, exactly as it would without the split.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before anything imports TensorFlow
# the MFU peak's machine-wide cache (tpu_llm/platform/peak.py): one per test process, never the user's own
os.environ["XDG_CACHE_HOME"] = __import__("tempfile").mkdtemp(prefix="tpu-llm-test-cache-")

import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
from helpers import CPU_DEVICES, copy_run, terraform, write_corpus  # noqa: E402

tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0],
                                           [tf.config.LogicalDeviceConfiguration()] * CPU_DEVICES)

from tpu_llm.platform import perf  # noqa: E402

_measure_matmul_flops, _measured = perf.measured_matmul_flops, {}


def _measured_once(device: str = "/CPU:0", n: int = 2048, repeats: int = 4) -> float:
    """The MFU peak that every `train` and CPU `plan` measures (five 2048^3 matmuls, about a CPU-second),
    measured once per test process and device: the tests' runs share the cores, so each would measure
    the same number (a subprocess still measures its own)."""
    if (device, n, repeats) not in _measured:
        _measured[device, n, repeats] = _measure_matmul_flops(device, n, repeats)
    return _measured[device, n, repeats]


perf.measured_matmul_flops = _measured_once


@pytest.fixture
def corpus_dir(tmp_path) -> Path:
    """`tmp_path/corpus`, holding the small corpus of `write_corpus` (glob: `corpus_dir / "*.txt"`)."""
    write_corpus(tmp_path / "corpus")
    return tmp_path / "corpus"


@pytest.fixture
def poison(monkeypatch):
    """poison(*steps): the loss and gradients become NaN at those optimizer steps (0-based), once each
    (a rolled-back run passes the same step number again). Under MirroredStrategy the replicas share
    the flag: at least the first replica's batch is poisoned."""
    armed = tf.Variable(tf.zeros([64], tf.int32), trainable=False)
    from tpu_llm.training.trainer import Trainer

    original = Trainer._micro_fn  # (a step's first micro-batch: NaN in one makes the step's sum NaN)

    def loss_and_grads(self, inputs, targets):
        loss, grads = original(self, inputs, targets)
        step = tf.cast(self.optimizer.iterations, tf.int32)
        bad = tf.gather(armed, step) > 0
        armed.scatter_nd_update([[step]], [0])  # after the read (TF orders ops on a variable as written)
        nan = tf.constant(float("nan"))
        return tf.where(bad, nan, loss), [tf.where(bad, nan, g) for g in grads]

    monkeypatch.setattr(Trainer, "_micro_fn", loss_and_grads)
    return lambda *steps: [armed[s].assign(1) for s in steps]


@pytest.fixture(scope="module")
def rule(tmp_path_factory):
    """choose(versions, family, multi_host) -> infra/runtime's outputs, by `terraform apply` on the module alone."""
    work = tmp_path_factory.mktemp("runtime")
    shutil.copytree(Path(__file__).resolve().parent.parent / "infra" / "runtime", work / "runtime")
    (work / "main.tf").write_text("""
variable "versions" { type = list(string) }
variable "family" { type = string }
variable "multi_host" { type = bool }
module "runtime" {
  source             = "./runtime"
  versions           = var.versions
  tensorflow_version = "2.20.0"
  accelerator_family = var.family
  multi_host         = var.multi_host
}
output "choice" { value = module.runtime }
""")
    tf = terraform()
    env = {**os.environ, "TF_IN_AUTOMATION": "1", "CHECKPOINT_DISABLE": "1"}
    subprocess.run([tf, "init", "-input=false"], cwd=work, capture_output=True, check=True, env=env)

    def choose(versions: list[str], family: str, multi_host: bool) -> dict:
        done = subprocess.run([tf, "apply", "-auto-approve", "-input=false", f"-var=versions={json.dumps(versions)}",
                               f"-var=family={family}", f"-var=multi_host={str(multi_host).lower()}"], cwd=work,
                              capture_output=True, text=True, env=env)
        assert done.returncode == 0, done.stdout + done.stderr
        out = subprocess.run([tf, "output", "-json", "choice"], cwd=work, capture_output=True, text=True, env=env)
        return json.loads(out.stdout)

    return choose


@pytest.fixture
def run_copy(trained, tmp_path):
    """A copy of the requesting module's `trained` run (its fixture: the run and its flags), to damage."""
    return copy_run(trained, tmp_path)


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    """A trained base run (no adapters) for train.init_from, in the returned folder's base/."""
    from helpers import quiet, tiny_config

    from tpu_llm.training.controller import train

    tmp = tmp_path_factory.mktemp("lora")
    train(tiny_config(tmp, **{"run_dir": str(tmp / "base"), "train.steps": 2, "train.steps_per_loop": 2,
                              "execution": "graph"}), say=quiet)
    return tmp
