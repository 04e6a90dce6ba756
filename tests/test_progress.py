"""Honest progress (issue 30): the ETA leaves compilation out, a line says what a run is doing while it
starts, compiles, evaluates and samples, the model line gives trainable of total parameters and the
frozen layers, and native log noise (absl's INFO lines, SentencePiece's) stays off stderr."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest
from helpers import tiny_config

from tpu_llm.platform import native_log, perf
from tpu_llm.training import progress
from tpu_llm.training.controller import train


def test_eta_is_unknown_until_a_call_after_the_compiling_one_is_timed():
    eta = progress.Eta()
    assert eta.seconds_left(475) is None
    eta.record(25, 60.0)  # the first call: tracing and XLA compilation, plus 25 steps
    assert eta.seconds_left(475) is None  # the 9m35s for a 4m26s run came from this call
    eta.record(25, 5.0)
    eta.record(50, 12.5)
    assert eta.seconds_left(450) == pytest.approx(450 * 17.5 / 75)


def test_progress_line_shows_the_eta_given_or_dashes():
    stream = io.StringIO()
    bar = perf.Progress(500, label="step ", stream=stream)
    bar.update(25, "loss 4.1", eta=None)
    bar.update(50, "loss 3.9", eta=125.0)
    assert stream.getvalue().splitlines() == [
        "step  25/500 [#-------------------] loss 4.1 | eta --",
        "step  50/500 [##------------------] loss 3.9 | eta 2m05s"]


def test_frozen_layers_in_words():
    assert progress.frozen_layers("embeddings,blocks:0-3,blocks:6", 8) == "embeddings, blocks 0-3 and 6"
    assert progress.frozen_layers("blocks:2, head", 4) == "head, block 2"
    assert progress.frozen_layers("blocks:0,blocks:1,blocks:3-4,blocks:7", 8) == "blocks 0-1, 3-4 and 7"


def test_run_prints_its_phases_in_order_and_trainable_of_total(tmp_path, capsys):
    cfg = tiny_config(tmp_path, **{"train.freeze": "embeddings,blocks:1", "sample.num_samples": 1,
                                   "sample.max_new_tokens": 2})
    said = []
    train(cfg, say=said.append)
    stdout_order = [line.split()[0] for line in said if not line.startswith("---")]
    first = {label: stdout_order.index(label) for label in ("starting", "model", "compile", "done", "sampling")}
    assert first["starting"] < first["model"] < first["compile"] < first["done"] < first["sampling"]
    compile_lines = [line for line in said if line.startswith("compile")]
    assert compile_lines[0].startswith("compile   compiling the train step (XLA) and running its first 2 step(s)")
    assert compile_lines[1].startswith("compile   done in ") and len(compile_lines) == 2
    model = next(line for line in said if line.startswith("model"))
    assert "trainable of" in model and "total parameters" in model and "frozen: embeddings, block 1)" in model
    trainable, total = (int(model.split()[i].replace(",", "")) for i in (1, 4))
    assert total - trainable == 257 * 32 + 32 * 32 + _block_params(32)  # byte ids, positions, block 1
    err = capsys.readouterr().err.splitlines()  # the progress bar's stream: step lines, eval lines
    steps = [i for i, line in enumerate(err) if line.startswith("step")]
    evals = [line for line in err if line.startswith("eval")]
    assert err[steps[0]].endswith("| eta --")  # the first call compiled: no estimate from it
    assert evals[0].startswith("eval      compiling the evaluation step and running 2 validation batch(es)")
    assert evals[1].startswith("eval      step 4: validation loss")


def _block_params(width: int) -> int:
    """A GPT-2 block's parameters: two layer norms, qkv and projection, a 4x MLP, with biases."""
    return 2 * 2 * width + (3 * width * width + 3 * width) + (width * width + width) + \
        (4 * width * width + 4 * width) + (4 * width * width + width)


def test_dropping_native_lines_keeps_everything_else(capfd):
    with native_log.dropping_native_lines(native_log.SENTENCEPIECE_INFO):
        os.write(2, b"normalizer.cc(51) LOG(INFO) precompiled_charsmap is empty. use identity normalization.\n"
                    b"a real error\nnormalizer.cc(60) LOG(ERROR) kept\n")
    assert capfd.readouterr().err == "a real error\nnormalizer.cc(60) LOG(ERROR) kept\n"


QUIET_ABSL = """
import socket, sys
from tpu_llm.platform.native_log import quiet_absl
if sys.argv[1] == "quiet":
    assert quiet_absl()
import tensorflow as tf
print(tf.function(lambda x: x + 1, jit_compile=True)(tf.ones([2])).numpy())  # XLA's compile notice
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
spec = tf.train.ClusterSpec({"worker": [f"127.0.0.1:{port}"]})
server = tf.distribute.Server(spec, job_name="worker", task_index=0, protocol="grpc", start=True)
tf.config.experimental_connect_to_cluster(  # the server's ConfigProto dump, as on a parameter-server task
    tf.distribute.cluster_resolver.SimpleClusterResolver(spec, master=f"grpc://127.0.0.1:{port}"))
print("connected", flush=True)
"""


@pytest.mark.slow
def test_absl_info_lines_are_silenced_at_their_source():
    """Without the CLI's fd filter (a notebook, the Python API): TF_CPP_MIN_LOG_LEVEL=3 alone still lets
    absl's INFO lines through; quiet_absl stops them in TensorFlow's own library."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    runs = {mode: subprocess.run([sys.executable, "-c", QUIET_ABSL, mode], capture_output=True, text=True,
                                 env=env, timeout=120) for mode in ("loud", "quiet")}
    assert "connected" in runs["loud"].stdout and "connected" in runs["quiet"].stdout, runs["quiet"].stderr
    assert "Compiled cluster using XLA!" in runs["loud"].stderr and "SessionOptions:" in runs["loud"].stderr
    assert runs["quiet"].stderr == ""


def test_machine_peak_is_measured_once_and_cached(tmp_path):
    from tpu_llm.platform import peak

    path, measured, said = str(tmp_path / "cache" / "peak.json"), [], []
    first = peak.machine_peak("/CPU:0", lambda: measured.append(1) or 5e10, lambda: said.append("measuring"), path)
    second = peak.machine_peak("/CPU:0", lambda: measured.append(1) or 1e9, lambda: said.append("measuring"), path)
    assert measured == [1] and said == ["measuring"]  # the second process reads the first one's number
    assert first[0] == second[0] == 5e10
    assert first[1].startswith("measured now, once per machine, cached in ")
    assert second[1].startswith("measured once on this machine ") and "UTC, cached in " in second[1]
    assert peak.machine_peak("/GPU:0", lambda: 7e12, None, path)[0] == 7e12  # a key per device


def test_a_peak_measured_low_is_raised_by_a_run_that_reaches_more(tmp_path):
    """A peak measured on a busy machine makes MFU exceed 100%; the run that shows it raises the cache."""
    from tpu_llm.platform import peak

    path = str(tmp_path / "peak.json")
    peak.machine_peak("/CPU:0", lambda: 4e10, None, path)  # measured while busy
    assert peak.raise_peak("/CPU:0", 3e10, path) is None  # reached less: the peak stays
    assert peak.raise_peak("/CPU:0", 9e10, path) == 4e10  # reached more: raised, the old one returned
    flops, how = peak.machine_peak("/CPU:0", lambda: pytest.fail("measured again"), None, path)
    assert flops == 9e10 and "reached by a run" in how
    assert peak.raise_peak("/GPU:0", 1e13, path) is None  # nothing cached for that device: nothing to raise


@pytest.mark.parametrize("cluster, task, expected", [
    ({}, None, (1, 1)),
    # `tpu-llm launch --workers 2`: two processes on one machine share its peak (the 94% MFU)
    ({"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, ("worker", 1), (2, 1)),
    # parameter server: chief, 2 workers and a ps here; steps run on the workers only
    ({"chief": ["localhost:1"], "worker": ["localhost:2", "localhost:3"], "ps": ["localhost:4"]}, ("chief", 0), (4, 1)),
    # one worker per machine on two machines: twice the machine's peak
    ({"worker": ["10.0.0.1:2222", "10.0.0.2:2222"]}, ("worker", 0), (1, 2)),
])
def test_processes_of_a_run_share_their_machine_peak(cluster, task, expected):
    from tpu_llm.platform import peak

    assert peak.sharing(cluster, task) == expected


def test_two_local_workers_get_one_machine_peak(monkeypatch, tmp_path):
    """Each of two local workers divides the run's throughput by the one machine peak (not by a
    half-machine measurement of its own)."""
    import json

    from tpu_llm.parallel.distribute import Distribution
    from tpu_llm.platform import perf as perf_module

    monkeypatch.setattr(perf_module, "measured_matmul_flops", lambda *_, **__: 8e10)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
                                                "task": {"type": "worker", "index": 0}}))
    dist = Distribution(strategy=None, name="multi_worker", reason="", device_kind="CPU")
    flops, how = dist.peak_flops()
    assert flops == 8e10 and "its 2 processes of this run share it" in how and "this machine's CPU" in how
