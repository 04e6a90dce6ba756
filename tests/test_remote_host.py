"""A remote TPU host, simulated offline: the path `tpu=<name>`, `tpu=grpc://...` and pod slices take.

What runs as on a real remote TPU:
  * the host is another process serving a `worker` job with tf.distribute.Server, started without
    tensorflow-text (importing it raises ImportError there, as a TPU host's TF server lacks its ops);
  * `tpu-llm train --strategy=tpu --tpu=grpc://127.0.0.1:P` goes through tpu.py's connection code:
    TCP probe, `experimental_connect_to_cluster` with a resolver whose master is the worker, so the
    default device becomes /job:worker/replica:0/task:0; variables, steps and the input pipeline
    (byte tokenization included) run on the host;
  * checkpoints and summaries are written by the client (tpu.CLIENT_IO): in the host's mount
    namespace the run directories are an empty read-only tmpfs, so a write from the host fails, and a
    file the tests find there was written by the client;
  * the run is killed (SIGKILL between checkpoints) and resumes exactly: its final checkpoint equals,
    bit for bit, that of the same run made locally (MirroredStrategy over 2 logical CPUs of this
    process), weights, moments, dropout RNG state and data position included; then `generate` and
    `export` read the same run directory; a run directory or data outside the shared storage is
    refused in one line before anything connects.

What is simulated and not real: the host's devices are 2 CPUs (`device_count`), and the strategy is
MirroredStrategy over them where a TPU gets TPUStrategy over its cores (tpu.STANDIN_ENV, the one branch
that differs); TF's gs:// filesystem has no emulator endpoint, so "Cloud Storage" is a local directory
both processes reach (paths under it count as shared storage, every other local path as the client's
own). TPU compilation, the TPU system's initialization, topology and a pod's several hosts are not
covered (tests/test_tpu.py checks the topology arithmetic offline).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from helpers import free_port, write_corpus

from tpu_llm import cli
from tpu_llm.parallel import tpu

pytestmark = pytest.mark.slow  # a tf.distribute.Server process and the CLI in subprocesses

REPO = Path(__file__).resolve().parent.parent
TIMEOUT = 240  # seconds per client command
KILL_AT = 6  # the killed client dies when its third host call (steps 6-8) starts: ckpt-4 is the newest

SERVER = """
import sys
sys.modules["tensorflow_text"] = None  # a TPU host's TF server has no tensorflow-text ops
import tensorflow as tf
config = tf.compat.v1.ConfigProto(device_count={"CPU": 2})  # two devices in place of TPU cores
server = tf.distribute.Server(tf.train.ClusterSpec({"worker": [f"127.0.0.1:{sys.argv[1]}"]}), job_name="worker",
                              task_index=0, config=config, protocol="grpc", start=True)
print("serving", flush=True)
server.join()
"""

# The client: `tpu-llm` itself, plus two observations, and (KILL=N) a SIGKILL when a call starts at step N.
CLIENT = """
import os, signal, sys
from tpu_llm import cli
from tpu_llm.training import controller
from tpu_llm.training.trainer import Trainer
build_run, run = controller.build_run, Trainer.run

def observed_build_run(cfg, **kwargs):
    r = build_run(cfg, **kwargs)
    import tensorflow as tf
    print("default device", tf.constant(0).device, flush=True)
    print("variable devices", sorted({c.device for c in r.dist.strategy.experimental_local_results(r.model.weights[0].value)}),
          flush=True)
    return r

def killed_run(self, *args, **kwargs):
    if int(self.optimizer.iterations.numpy()) == int(os.environ.get("KILL", "-1")):
        os.kill(os.getpid(), signal.SIGKILL)
    return run(self, *args, **kwargs)

controller.build_run, Trainer.run = observed_build_run, killed_run
sys.exit(cli.main(sys.argv[1:]))
"""

FLAGS = ["--strategy=tpu", "--model.n_layer=2", "--model.n_head=2", "--model.n_embd=32", "--model.max_len=32",
         "--data.seq_len=16", "--data.shuffle_buffer=64", "--train.batch_size=4", "--train.steps=8",
         "--train.decay_steps=8", "--train.steps_per_loop=2", "--train.warmup_steps=1", "--train.eval_every=0",
         "--train.eval_steps=1", "--checkpoint.every_steps=4", "--sample.num_samples=0", "--model.dropout=0.1",
         "--execution=graph"]  # XLA-compiling the stand-in's step took ~15 s per client, and it is no TPU compile


def _isolation() -> list[str] | None:
    """A command prefix giving the host its own mount namespace (root, else an unprivileged user namespace)."""
    for prefix in (["unshare", "--mount", "--propagation", "private"],
                   ["unshare", "--user", "--map-root-user", "--mount", "--propagation", "private"]):
        if shutil.which("unshare") and subprocess.run([*prefix, "true"], capture_output=True).returncode == 0:
            return prefix
    return None


class Sim:
    def __init__(self, root: Path):
        self.shared = root / "shared"  # "Cloud Storage": both processes reach it
        self.runs = self.shared / "runs"  # the host's view of it: an empty read-only tmpfs
        self.runs.mkdir(parents=True)
        self.data = f"{self.shared / 'data'}/*.txt"
        write_corpus(self.shared / "data")
        self.port = free_port()
        self.tpu = f"grpc://127.0.0.1:{self.port}"
        self.env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": str(REPO),
                    tpu.STANDIN_ENV: str(self.shared)}
        (root / "server.py").write_text(SERVER)
        (root / "client.py").write_text(CLIENT)
        self.root, self.logs = root, root / "logs"
        self.logs.mkdir()
        isolation = _isolation()
        self.isolated = isolation is not None
        command = [sys.executable, str(root / "server.py"), str(self.port)]
        if isolation:
            command = [*isolation, "sh", "-c", f'mount -t tmpfs -o ro tmpfs "{self.runs}" && exec "$@"', "sh", *command]
        self.server_log = open(self.logs / "server.log", "w")
        self.server = subprocess.Popen(command, env=self.env, stdout=self.server_log, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 120
        while "serving" not in (self.logs / "server.log").read_text():
            assert self.server.poll() is None and time.monotonic() < deadline, (self.logs / "server.log").read_text()
            time.sleep(0.1)

    def client(self, name: str, run: str, kill: int = -1):
        """Start `tpu-llm train` against the host; returns a function that waits for (exit code, output)."""
        log = open(self.logs / f"{name}.log", "w")
        proc = subprocess.Popen([sys.executable, str(self.root / "client.py"), "train", f"--tpu={self.tpu}",
                                 f"--run_dir={self.runs / run}", f"--data.train={self.data}", *FLAGS],
                                cwd=self.root, env={**self.env, "KILL": str(kill)}, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

        def wait() -> tuple[int, str]:
            try:
                code = proc.wait(timeout=TIMEOUT)
            finally:
                if proc.poll() is None:
                    proc.kill()
                log.close()
            return code, (self.logs / f"{name}.log").read_text()
        return wait

    def close(self):
        os.killpg(self.server.pid, signal.SIGKILL)  # the server's own session: unshare, sh and python
        self.server.wait(timeout=30)
        self.server_log.close()


def local_reference(sim) -> int:
    """The same run without a TPU: MirroredStrategy over 2 of this process's logical CPUs, the TPU path's
    precision (mixed_bfloat16), in sim.root/local."""
    import keras

    policy = keras.mixed_precision.global_policy()
    try:
        return cli.main(["train", "--strategy=mirrored", "--cpu_devices=2", "--precision=mixed_bfloat16",
                         f"--run_dir={sim.root / 'local'}", f"--data.train={sim.data}",
                         *[f for f in FLAGS if f != "--strategy=tpu"]])
    finally:
        keras.mixed_precision.set_global_policy(policy)


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    s = Sim(tmp_path_factory.mktemp("remote"))
    try:
        killed = s.client("killed", "resumed", kill=KILL_AT)
        s.local = local_reference(s)  # meanwhile, in this process
        s.killed = killed()
        s.resumed = s.client("resumed", "resumed")()
        yield s
    finally:
        s.close()


def test_training_runs_on_the_remote_host(sim):
    code, log = sim.resumed
    assert code == 0, log
    assert f"remote CPU host stand-in via tpu='{sim.tpu}'" in log and "2 replicas" in log
    assert "default device /job:worker/replica:0/task:0/device:CPU:0" in log
    assert "variable devices ['/job:worker/replica:0/task:0/device:CPU:0', " \
           "'/job:worker/replica:0/task:0/device:CPU:1']" in log
    assert "tokenizer byte" in log and "precision mixed_bfloat16" in log
    assert "done      step 8" in log  # the data was tokenized on a host without tensorflow-text


def test_checkpoints_and_summaries_are_written_by_the_client(sim):
    if not sim.isolated:
        pytest.skip("no mount namespace here (unshare): the host sees the run directories, so who wrote them "
                    "cannot be told")
    run = sim.runs / "resumed"  # ckpt-4 by the killed client, ckpt-8 by the resumed one
    assert {p.name for p in (run / "checkpoints").glob("*.index")} == {"ckpt-4.index", "ckpt-8.index"}
    assert list((run / "logs" / "train").glob("events.out.tfevents.*"))
    assert list((run / "logs" / "validation").glob("events.out.tfevents.*"))


def test_killed_run_resumes_exactly(sim):
    code, log = sim.killed
    assert code == -signal.SIGKILL, log
    assert "step 6/8" in log and "step 8/8" not in log  # killed in steps 6-8
    assert not any(line.startswith("done ") for line in log.splitlines())
    code, log = sim.resumed
    assert code == 0, log
    assert f"resumed   from {sim.runs / 'resumed' / 'checkpoints' / 'ckpt-4'} at step 4 (data position restored)" in log
    assert sim.local == 0
    local = tf.train.load_checkpoint(str(sim.root / "local" / "checkpoints" / "ckpt-8"))
    resumed = tf.train.load_checkpoint(str(sim.runs / "resumed" / "checkpoints" / "ckpt-8"))
    # every variable (not the object graph: it records the Python objects' names, which differ between the
    # test process and a subprocess)
    names = sorted(n for n in local.get_variable_to_shape_map()
                   if not n.startswith("save_counter") and n != "_CHECKPOINTABLE_OBJECT_GRAPH")
    assert set(names) < set(resumed.get_variable_to_shape_map()) and len(names) > 20
    assert any(n.startswith("rng/") for n in names) and any(n.startswith("data_position") for n in names)
    for name in names:  # weights, both moments, the step, dropout RNG state, data position: bit for bit
        np.testing.assert_array_equal(local.get_tensor(name), resumed.get_tensor(name), err_msg=name)


def test_generate_and_export_read_the_same_run(sim, capsys):
    run = str(sim.runs / "resumed")
    assert cli.main(["generate", "--run_dir", run, "--prompt", "The ", "--max_new_tokens", "8",
                     "--temperature", "0"]) == 0
    assert cli.main(["export", "--run_dir", run]) == 0
    out = capsys.readouterr().out
    assert "--- sample 1" in out and f"exported  {run} at step 8 to {run}/export" in out
    served = tf.saved_model.load(f"{run}/export")
    ids = served.signatures["generate"](
        tokens=tf.constant([[84, 104, 101, 32]], tf.int32), max_new_tokens=tf.constant(8),
        temperature=tf.constant(0.0), top_k=tf.constant(0), top_p=tf.constant(1.0), seed=tf.constant(0, tf.int64))
    assert ids["ids"].shape == (1, 8)


def test_local_run_dir_and_data_are_refused_in_one_line_before_connecting(tmp_path, monkeypatch, capsys):
    shared, local = tmp_path / "shared", tmp_path / "local-run"
    write_corpus(shared / "data")
    monkeypatch.setenv(tpu.STANDIN_ENV, str(shared))
    target = f"grpc://127.0.0.1:{free_port()}"  # nothing listens: a connection attempt would fail otherwise
    base = ["train", "--strategy=tpu", f"--tpu={target}"]
    assert cli.main([*base, f"--run_dir={local}", f"--data.train={shared}/data/*.txt"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: run_dir '{local}' is on this machine, but tpu='{target}' is a TPU reached over the network, "
        "whose hosts run the input pipeline and cannot read this machine's files; put the run on Cloud Storage: "
        "--run_dir=gs://BUCKET/runs/NAME")
    assert cli.main([*base, f"--run_dir={shared}/run", f"--data.train={tmp_path}/*.txt"]) == 2
    assert capsys.readouterr().err.strip().startswith(f"error: data.train '{tmp_path}/*.txt' is on this machine")
    assert cli.main([*base, f"--run_dir={shared}/run", "--data.train="]) == 2
    assert "embedded corpus" in capsys.readouterr().err
    assert not local.exists() and not (shared / "run").exists()  # nothing written
    monkeypatch.delenv(tpu.STANDIN_ENV)  # without the stand-in, only storage such as gs:// is shared
    assert cli.main([*base, f"--run_dir={shared}/run", f"--data.train={shared}/data/*.txt"]) == 2
    assert capsys.readouterr().err.strip().startswith(f"error: run_dir '{shared}/run' is on this machine")


def test_sentencepiece_text_is_refused_for_a_remote_tpu(tmp_path):
    from tpu_llm.config import load_config
    from tpu_llm.data.sources import Source
    from tpu_llm.errors import UserError

    cfg = load_config(None, {"tpu": "grpc://10.0.0.2:8470", "data.tokenizer": "sentencepiece",
                             "data.tokenizer_model": str(tmp_path / "sp.model")})
    with pytest.raises(UserError) as error:
        tpu.check_remote_data(cfg, (Source(["gs://b/a.txt"], "text"), Source(["gs://b/b.txt"], "text")))
    assert str(error.value).startswith("data.tokenizer=sentencepiece tokenizes text with tensorflow-text's ops, "
                                       "which the TF servers on the hosts of tpu='grpc://10.0.0.2:8470' do not have")
    # the command it names reads the run's own model file (issue 50: a hint works as printed)
    assert f"`tpu-llm data prepare --tokenizer sentencepiece --tokenizer_model {tmp_path / 'sp.model'} --output " \
        "gs://BUCKET/shards`" in str(error.value)
    tpu.check_remote_data(cfg, (Source(["gs://b/a.tfrecord"], "tfrecord"),) * 2)  # shards: tokenized already
    for kind in ("byte", "char"):
        cfg.data.tokenizer = kind
        tpu.check_remote_data(cfg, (Source(["gs://b/a.txt"], "text"),) * 2)


@pytest.mark.parametrize("tpu_setting,env,remote", [("local", {}, False), ("my-tpu", {}, True),
                                                   ("grpc://10.0.0.2:8470", {}, True), ("", {"TPU_NAME": "pod"}, True),
                                                   ("", {"TPU_NAME": "local"}, False)])
def test_which_tpus_are_remote(tmp_path, tpu_setting, env, remote, monkeypatch):
    monkeypatch.setattr(tpu, "_local_evidence", lambda root, env: "a TPU VM")
    assert tpu.is_remote(tpu_setting, env=env, root=str(tmp_path)) is remote


def test_shared_storage_is_what_both_sides_reach(tmp_path):
    standin = {tpu.STANDIN_ENV: str(tmp_path / "shared")}
    for path, shared in (("gs://bucket/runs/x", True), ("s3://b/x", True), ("ram://x", False), ("file:///x", False),
                         ("runs/x", False), (str(tmp_path / "shared" / "x"), False)):
        assert tpu.shared_storage(path, {}) is shared, path
    assert tpu.shared_storage(str(tmp_path / "shared" / "runs" / "x"), standin)
    assert not tpu.shared_storage(str(tmp_path / "shared-not"), standin)  # a prefix of the name is not inside
    assert tpu.shared_storage("gs://bucket/x", standin)



def test_a_stand_in_host_that_does_not_answer_is_the_tpu_paths_one_line_error(tmp_path):
    target = f"grpc://127.0.0.1:{free_port()}"
    with pytest.raises(tpu.UserError) as error:  # refused before TensorFlow connects: this process stays local
        tpu.tpu_strategy(target, env={tpu.STANDIN_ENV: str(tmp_path)}, root=str(tmp_path))
    assert str(error.value).startswith(f"no TPU reachable via tpu='{target}': ConnectionRefusedError")
    assert "\n" not in str(error.value)
