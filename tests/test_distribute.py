"""Strategies: selection, Mirrored over logical CPUs, multi-worker and parameter-server clusters of
local processes (`tpu-llm launch`), and checkpoints moving between strategies."""

import glob
import io
import json
import os
import sys
import time

import numpy as np
import pytest
import tensorflow as tf
from helpers import metrics, quiet, tiny_config, train_losses

from tpu_llm import cli
from tpu_llm.config import load_config
from tpu_llm.errors import UserError
from tpu_llm.parallel import launch
from tpu_llm.parallel.distribute import Found, choose, get_strategy
from tpu_llm.training.checkpoint import load_for_generation, scratch_directory
from tpu_llm.training.controller import build_run, train


def checkpoint_weights(run_dir) -> dict:
    model, _, _ = load_for_generation(str(run_dir))
    return {w.path.split("/", 1)[1]: w.numpy() for w in model.weights}  # without the model's unique name


# ---- selection ------------------------------------------------------------------------------------

WORKERS = {"worker": ["a:1", "b:1"]}
PS_CLUSTER = {"chief": ["c:1"], "worker": ["a:1", "b:1"], "ps": ["p:1"]}


@pytest.mark.parametrize("overrides, found, chosen", [
    ({}, Found(), "default"),
    ({}, Found(gpus=1), "default"),
    ({}, Found(gpus=4), "mirrored"),
    ({"cpu_devices": 2}, Found(), "mirrored"),
    ({}, Found(tpu="/dev/accel0 present"), "tpu"),
    ({}, Found(gpus=4, tpu="TPU_NAME set"), "tpu"),
    ({}, Found(cluster=WORKERS, task=("worker", 1)), "multi_worker"),
    ({}, Found(gpus=4, cluster=WORKERS, task=("worker", 0)), "multi_worker"),  # each worker mirrors its GPUs
    ({}, Found(cluster={"worker": ["a:1"]}, task=("worker", 0)), "default"),  # a cluster of one
    ({}, Found(cluster=PS_CLUSTER, task=("chief", 0)), "parameter_server"),
    ({"strategy": "default"}, Found(gpus=4, tpu="x"), "default"),
    ({"strategy": "tpu", "tpu": "my-tpu"}, Found(), "tpu"),
    ({"strategy": "multi_worker"}, Found(cluster={"worker": ["a:1"]}, task=("worker", 0)), "multi_worker"),
    ({"cpu_devices": 4, "parallel.pipeline_stages": 2}, Found(), "mirrored"),  # 2 replicas x 2 stages
    ({"cpu_devices": 2, "parallel.pipeline_stages": 2}, Found(), "default"),  # 1 replica of 2 stages
    ({"parallel.pipeline_stages": 2}, Found(gpus=2), "default"),
])
def test_auto_and_explicit_choices(overrides, found, chosen):
    name, reason = choose(load_config(None, overrides), found)
    assert name == chosen and reason.startswith(f"strategy={overrides.get('strategy', 'auto')}")


@pytest.mark.parametrize("overrides, found, message", [
    ({"strategy": "tpu"}, Found(), "strategy=tpu found no TPU (looked for tpu=..., TPU_NAME, COLAB_TPU_ADDR"),
    ({"strategy": "mirrored"}, Found(gpus=1), "strategy=mirrored found one device"),
    ({"strategy": "multi_worker"}, Found(), "tpu-llm launch --workers 2 -- train"),
    ({"strategy": "multi_worker"}, Found(cluster=PS_CLUSTER, task=("chief", 0)), "and no ps tasks"),
    ({"strategy": "parameter_server"}, Found(cluster=WORKERS), "needs TF_CONFIG with chief, worker and ps"),
])
def test_a_strategy_that_cannot_run_here_names_what_was_looked_for(overrides, found, message):
    with pytest.raises(UserError) as e:
        choose(load_config(None, overrides), found)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_strategy_tpu_without_a_tpu_fails_in_one_line_from_the_command_line(capsys, monkeypatch):
    monkeypatch.delenv("TPU_NAME", raising=False)
    monkeypatch.delenv("COLAB_TPU_ADDR", raising=False)
    assert cli.main(["train", "--strategy=tpu", "--run_dir=/nonexistent/never-written"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: strategy=tpu found no TPU") and "strategy=auto" in err and "\n" not in err


def test_info_explains_the_choice(capsys, monkeypatch):
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": WORKERS, "task": {"type": "worker", "index": 1}}))
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "TF_CONFIG 2 worker; this process is worker 1" in out
    assert "strategy  multi_worker (strategy=auto: TF_CONFIG with 2 tasks)" in out
    monkeypatch.setenv("TF_CONFIG", "{not json")
    assert cli.main(["info"]) == 2
    assert "TF_CONFIG is not valid" in capsys.readouterr().err


def test_selection_in_process_and_batch_split(tmp_path):
    assert get_strategy(load_config(None, {})).name == "default"
    assert get_strategy(load_config(None, {"cpu_devices": 2})).name == "mirrored"
    with pytest.raises(UserError, match="already started in this process with 4 CPU"):
        get_strategy(load_config(None, {"cpu_devices": 8}))
    with pytest.raises(UserError, match="nearest valid values: 9 or 12"):
        build_run(tiny_config(tmp_path, **{"train.batch_size": 10}, cpu_devices=3))


# ---- Mirrored -------------------------------------------------------------------------------------


def test_a_tpu_refuses_float16_and_names_bfloat16():
    import keras

    from tpu_llm.parallel.distribute import Distribution
    from tpu_llm.training.build import set_precision

    tpu = Distribution(tf.distribute.get_strategy(), "tpu", "a fake TPU", "TPU v5 lite")
    try:
        with pytest.raises(UserError) as err:
            set_precision(load_config(None, {"precision": "mixed_float16"}), tpu)
        assert "precision=mixed_bfloat16" in str(err.value) and "\n" not in str(err.value)
        assert keras.mixed_precision.global_policy().name == "float32"  # refused before anything was set
        assert set_precision(load_config(None, {"precision": "auto"}), tpu) == "mixed_bfloat16"
        assert set_precision(load_config(None, {"precision": "mixed_bfloat16"}), tpu) == "mixed_bfloat16"
        cpu = Distribution(tf.distribute.get_strategy(), "default", "one CPU", "CPU")
        assert set_precision(load_config(None, {"precision": "mixed_float16"}), cpu) == "mixed_float16"  # GPUs' choice
    finally:
        keras.mixed_precision.set_global_policy("float32")


@pytest.mark.parametrize("devices", [4])  # (2 devices: the resume and checkpoint tests below)
def test_mirrored_over_logical_cpus_trains_like_one_device(tmp_path, devices):
    common = {"train.steps": 6, "train.steps_per_loop": 2, "train.batch_size": 8, "train.eval_every": 0,
              "checkpoint.every_steps": 0}
    single = tiny_config(tmp_path / "one", **common)
    mirrored = tiny_config(tmp_path / "many", **common, cpu_devices=devices, strategy="mirrored")
    train(single, say=quiet, samples=False)
    train(mirrored, say=quiet, samples=False)
    np.testing.assert_allclose(train_losses(tmp_path / "many" / "run"), train_losses(tmp_path / "one" / "run"),
                               rtol=1e-5)
    # AdamW and global-norm clipping do not see a uniform gradient scale, the logged norm does: the
    # replicas' gradients must be averaged (scaled by 1/replicas), not summed
    np.testing.assert_allclose([m["grad_norm"] for m in metrics(tmp_path / "many" / "run")],
                               [m["grad_norm"] for m in metrics(tmp_path / "one" / "run")], rtol=1e-4)
    one, many = build_run(single), build_run(mirrored)
    assert one.dist.num_replicas == 1 and many.dist.num_replicas == devices
    for a, b in zip(one.model.weights, many.model.weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-5)


def test_checkpoints_move_between_mirrored_and_one_device(tmp_path):
    # the checkpoints are the subject, not XLA (its mirrored step: the test above)
    base = {"train.steps": 4, "checkpoint.every_steps": 2, "train.batch_size": 8, "execution": "graph"}
    train(tiny_config(tmp_path, **base, cpu_devices=2), say=quiet)
    run = build_run(tiny_config(tmp_path, **{**base, "train.steps": 6}))  # resumed on one device
    assert run.dist.num_replicas == 1 and run.resumed_from.endswith("ckpt-4")
    assert run.data_resume == "data position restored"  # saved by the mirrored run, read on one device
    train(tiny_config(tmp_path, **{**base, "train.steps": 6}), say=quiet)
    back = build_run(tiny_config(tmp_path, **{**base, "train.steps": 8}, cpu_devices=2))  # and back
    assert back.dist.num_replicas == 2 and back.resumed_from.endswith("ckpt-6")


def test_mirrored_resume_replays_the_stream_to_the_exact_position(tmp_path):
    def cfg(run, steps):
        return tiny_config(tmp_path / run, **{"train.steps": steps, "train.decay_steps": 8,
                                              "checkpoint.every_steps": 4, "train.batch_size": 8}, cpu_devices=2,
                           execution="graph")  # the stream's position is the subject (the XLA step: the test above)

    train(cfg("straight", 8), say=quiet)
    train(cfg("resumed", 4), say=quiet)
    train(cfg("resumed", 8), say=quiet)
    assert train_losses(tmp_path / "resumed" / "run") == train_losses(tmp_path / "straight" / "run")


# ---- clusters of local processes ------------------------------------------------------------------

# the same tiny run, as command-line flags for `tpu-llm train` in each launched process
TINY_FLAGS = ["--model.n_layer=2", "--model.n_head=2", "--model.n_embd=32", "--model.max_len=32",
              "--data.seq_len=16", "--data.shuffle_buffer=64", "--train.batch_size=8", "--train.warmup_steps=1",
              "--train.eval_every=0", "--train.eval_steps=2", "--checkpoint.every_steps=0",
              "--sample.num_samples=0"]


def launched(tmp_path, workers, ps, steps, extra=()):
    cfg = tiny_config(tmp_path)  # writes the corpus; its run_dir is the cluster's
    out = io.StringIO()
    args = ["train", f"--run_dir={cfg.run_dir}", f"--data.train={cfg.data.train}", f"--train.steps={steps}",
            *TINY_FLAGS, *extra]
    code = launch.launch(workers, ps, args, out=out)
    return code, out.getvalue(), cfg


@pytest.mark.slow
def test_multi_worker_processes_end_identical_and_equal_to_one_process(tmp_path):
    code, log, cfg = launched(tmp_path / "cluster", workers=2, ps=0, steps=6, extra=["--train.steps_per_loop=3"])
    assert code == 0, log
    assert "[worker 0] strategy  multi_worker" in log and "2 replica(s)" in log
    prints = [line.split("fingerprint ")[1] for line in log.splitlines() if "fingerprint" in line]
    assert len(prints) == 2 and prints[0] == prints[1], log  # both workers hold the same weights
    single = tiny_config(tmp_path / "single", **{"train.steps": 6, "train.steps_per_loop": 3,
                                                 "train.batch_size": 8})
    train(single, say=quiet, samples=False)  # one process, the same global batches
    np.testing.assert_allclose(train_losses(tmp_path / "cluster" / "run"), train_losses(tmp_path / "single" / "run"),
                               rtol=1e-5)
    ours, theirs = checkpoint_weights(tmp_path / "cluster" / "run"), checkpoint_weights(tmp_path / "single" / "run")
    assert ours.keys() == theirs.keys() and len(ours) > 10
    for name in ours:
        np.testing.assert_allclose(ours[name], theirs[name], atol=1e-5, err_msg=name)
    assert not list((tmp_path / "cluster" / "run").glob(".scratch-*"))  # worker 1 saves on its own disk,
    assert not glob.glob(scratch_directory(str(tmp_path / "cluster" / "run"), "*"))  # and removes it after


@pytest.mark.slow
def test_parameter_server_cluster_trains_asynchronously_and_the_loss_falls(tmp_path):
    code, log, cfg = launched(tmp_path, workers=2, ps=1, steps=40,
                              extra=["--train.steps_per_loop=5", "--train.lr=3e-3"])
    assert code == 0, log
    assert "[chief 0] strategy  parameter_server" in log and "ASYNCHRONOUS" in log
    assert "[worker 1] serving   worker 1" in log and "[ps 0] serving   ps 0" in log
    losses = train_losses(tmp_path / "run")
    assert len(losses) == 2 and losses[-1] < losses[0] - 0.3, losses
    [summary] = metrics(tmp_path / "run", "summary")
    assert summary["strategy"] == "parameter_server" and summary["step"] == 40
    assert 0 <= summary["staleness"] <= summary["staleness_max"] <= 8
    # The 2 workers run their loops at the same time (2 loops per worker are queued per call): a step
    # that reads the weights while the other worker is mid-step sees that step's update land before
    # its own. Measured: about half of the 40 steps, in both calls (mean 0.5, max 1-2). Nothing but
    # workers that never overlap in 40 steps gives 0 everywhere.
    assert max(line["staleness_max"] for line in metrics(tmp_path / "run")) >= 1, metrics(tmp_path / "run")
    assert tf.train.load_checkpoint(str(tmp_path / "run" / "checkpoints")).get_tensor(
        "optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE") == 40


def test_staleness_counts_the_updates_other_workers_applied_between_read_and_write():
    """The cheap half of the test above (whose 2 workers may or may not overlap on a busy machine):
    the step's measurement, with 2 updates by other workers landing during its forward/backward."""
    from tpu_llm.config import ModelConfig, TrainConfig
    from tpu_llm.model import GPT
    from tpu_llm.parallel.distribute import Distribution
    from tpu_llm.training.optimizer import make_optimizer
    from tpu_llm.training.trainer import Staleness, Trainer

    model = GPT(ModelConfig(n_layer=1, n_head=2, n_embd=16, max_len=8), 32).build_weights()
    dist = Distribution(tf.distribute.get_strategy(), "parameter_server", "test", "CPU", jit_compile=False,
                        coordinator=object())  # asynchronous: the Trainer measures staleness
    trainer = Trainer(dist, model, make_optimizer(TrainConfig(), model), TrainConfig())
    assert isinstance(trainer.loss_and_grads, Staleness)
    updates = trainer.loss_and_grads.updates
    others = tf.Variable(0, dtype=tf.int64)

    def loss_and_grads(x, y):
        updates.assign_add(others)  # other workers apply their steps meanwhile
        return tf.constant(1.0), []

    trainer.loss_and_grads.loss_and_grads = loss_and_grads
    for n in (0, 2):
        others.assign(n)
        before = int(updates.numpy())
        _, _, staleness = trainer.loss_and_grads(None, None)
        assert float(staleness) == n and int(updates.numpy()) == before + n + 1


FAKE_TASK = """
import json, os, sys, time
task = json.loads(os.environ["TF_CONFIG"])["task"]
print("up", task["type"], task["index"], flush=True)
if task["index"] == 1:
    sys.exit(3)
time.sleep(120)
"""


@pytest.mark.slow
def test_launch_fails_fast_when_a_worker_dies(tmp_path):
    out, start = io.StringIO(), time.time()
    code = launch.launch(3, 0, ["-c", FAKE_TASK], out=out, program=[sys.executable])
    assert code == 3 and time.time() - start < 60
    log = out.getvalue()
    assert "[worker 1] up worker 1" in log and "launch    worker 1 exited with status 3: stopping every task" in log


SLEEPING_TASK = """
import json, os, signal, sys, time
task = json.loads(os.environ["TF_CONFIG"])["task"]
print("up", task["type"], task["index"], flush=True)
if task["type"] == os.environ.get("DIE", "-"):
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(120)
"""


@pytest.mark.slow
def test_launch_exits_with_128_plus_the_signal_and_4_for_a_killed_chief(tmp_path, monkeypatch):
    import os
    import signal
    import threading

    out = io.StringIO()

    def terminate_when_up():  # SIGTERM to the launcher (this process) once both tasks run
        deadline = time.time() + 60
        while out.getvalue().count("] up ") < 2 and time.time() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=terminate_when_up, daemon=True).start()
    assert launch.launch(2, 0, ["-c", SLEEPING_TASK], out=out, program=[sys.executable]) == 143, out.getvalue()
    assert "launch    SIGTERM: stopping every task" in out.getvalue()

    monkeypatch.setenv("DIE", "chief")  # a parameter-server chief killed by SIGKILL: the cluster lost a task
    out = io.StringIO()
    assert launch.launch(1, 1, ["-c", SLEEPING_TASK], out=out, program=[sys.executable]) == 4, out.getvalue()
    assert "launch    chief 0 was killed by SIGKILL: the cluster lost its chief" in out.getvalue()


LISTENING_TASK = """
import json, os, socket, sys, time
config = json.loads(os.environ["TF_CONFIG"])
port = int(config["cluster"]["worker"][config["task"]["index"]].rsplit(":", 1)[1])
server = socket.socket()
server.bind(("0.0.0.0", port))  # what TensorFlow's gRPC server does, whatever TF_CONFIG says
server.listen()
print("up", port, flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.05)
"""


def listening_ports(pid: str = "self") -> dict[int, str]:
    """port -> local address of the TCP sockets listening in the network namespace of process `pid`
    (what `ss -ltn` shows there), from /proc/<pid>/net/tcp."""
    ports = {}
    with open(f"/proc/{pid}/net/tcp") as f:
        for line in f.readlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A":  # LISTEN
                address, port = local.split(":")
                ports[int(port, 16)] = ".".join(str(int(address[i:i + 2], 16)) for i in (6, 4, 2, 0))
    return ports


def launch_listening_tasks(tmp_path, extra=()):
    """Two fake tasks that listen on 0.0.0.0 at their TF_CONFIG ports; returns (exit code, log, {pid: port}
    as seen inside each task's namespace, the ports listening in this process's namespace meanwhile)."""
    import threading

    done, out, seen = tmp_path / f"done-{len(extra)}", io.StringIO(), {}

    def look():
        deadline = time.time() + 60
        while out.getvalue().count("] up ") < 2 and time.time() < deadline:
            time.sleep(0.05)
        try:
            line = next(line for line in out.getvalue().splitlines() if line.startswith("launch    pids "))
            pids = [item.split("=")[1] for item in line[len("launch    pids "):].split(", ")]
            seen["inside"] = {pid: listening_ports(pid) for pid in pids}
            seen["outside"] = listening_ports()
        finally:
            done.touch()

    threading.Thread(target=look, daemon=True).start()
    code = launch.launch(2, 0, ["-c", LISTENING_TASK, str(done), *extra], out=out, program=[sys.executable])
    ports = [int(line.split()[-1]) for line in out.getvalue().splitlines() if "] up " in line]
    return code, out.getvalue(), ports, seen


@pytest.mark.slow
def test_a_local_cluster_listens_only_in_its_own_network_namespace(tmp_path):
    import shutil
    import subprocess

    if not (shutil.which("unshare") and shutil.which("nsenter")) or subprocess.run(
            ["unshare", "--net", *([] if os.geteuid() == 0 else ["--map-root-user"]), "true"]).returncode:
        pytest.skip("this system gives no network namespace (unshare --net fails)")
    code, log, ports, seen = launch_listening_tasks(tmp_path)
    assert code == 0, log
    assert len(ports) == 2 and len(seen["inside"]) == 2
    for pid, listening in seen["inside"].items():  # each task listens on 0.0.0.0 inside the namespace ...
        assert any(listening.get(port) == "0.0.0.0" for port in ports), (pid, listening, ports)
    assert not set(ports) & set(seen["outside"])  # ... and nothing listens on those ports in the host's network
    assert "launch    network: the tasks run in their own network namespace with only loopback" in log

    code, log, ports, seen = launch_listening_tasks(tmp_path, extra=["--run_dir=gs://bucket/run"])  # needs the network
    assert code == 0, log
    assert ("launch    warning: the cluster's ports are open to the network (the run reads or writes a remote "
            "location): TensorFlow's gRPC servers listen on 0.0.0.0 without authentication, and its distributed "
            "runtime requires a trusted network") in log
    assert all(seen["outside"].get(port) == "0.0.0.0" for port in ports), (ports, seen["outside"])


def test_launch_usage_errors(capsys):
    assert cli.main(["launch", "--workers", "2"]) == 2
    assert "needs the command to run after --" in capsys.readouterr().err
    assert cli.main(["launch", "--workers", "0", "--", "train"]) == 2
    assert "need at least 1 worker" in capsys.readouterr().err


@pytest.mark.slow
def test_strategies_benchmark_prints_its_table(tmp_path, capsys):
    from tpu_llm.tools import bench

    cfg = tiny_config(tmp_path)
    path = tmp_path / "bench.yaml"
    path.write_text(cfg.to_yaml())
    [row] = bench.strategies(steps=4, config=str(path), only="mirrored, 2")
    out = capsys.readouterr().out
    assert row["strategy"] == "mirrored" and row["replicas"] == 2 and row["step"] == 4
    assert "| mirrored, 2 logical CPUs" in out and "0 (sync)" in out
