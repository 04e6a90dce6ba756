"""Processes that end with the process that started them (tpu_llm/platform/tether.py): the tasks of a killed
`tpu-llm launch` stop, saving a checkpoint, in both cluster modes and with either mechanism (the
kernel's parent-death signal on Linux, the pipe elsewhere); the parent's death is one SIGTERM however
often the kernel signals it; a child whose parent died before it was tied exits; output to a reader
that is gone is dropped instead of raised."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import TINY_FLAGS, write_corpus

from tpu_llm.platform import tether

REPO = Path(__file__).resolve().parent.parent
GONE_WITHIN = 30  # seconds after the launcher's SIGKILL by which no task may be left

# the launcher under another mechanism than this platform's (tpu_llm.platform.tether.MODE), as on macOS
LAUNCH_WITH = """
import sys
from tpu_llm.platform import tether
tether.MODE = sys.argv[1]
from tpu_llm.cli import main
sys.exit(main(sys.argv[2:]))
"""


def tasks_of(cluster: str) -> dict[int, str]:
    """{pid: command line} of every live process whose TF_CONFIG holds this cluster (its ports)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:  # a zombie's environ reads empty: it counts as gone
            if cluster.encode() in (entry / "environ").read_bytes():
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
        except OSError:
            continue
    return found


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the tasks in /proc")
@pytest.mark.parametrize("ps, mode", [(0, "pdeathsig"), (1, "pdeathsig"), (1, "pipe")],
                         ids=["multi_worker", "parameter_server", "parameter_server-pipe"])
def test_the_tasks_of_a_killed_launcher_save_and_stop(tmp_path, ps, mode):
    """SIGKILL of `tpu-llm launch` once every task trains or serves: within 30 s no task is left (before,
    parameter-server workers and ps tasks served on forever under PID 1), and the cluster saved a
    checkpoint on its way out (before, multi-worker tasks died of a broken pipe at their next line)."""
    if mode == "pdeathsig" and tether.MODE != "pdeathsig":
        pytest.skip("the parent-death signal is Linux's")
    write_corpus(tmp_path / "corpus")
    run_dir = tmp_path / "run"
    args = ["launch", "--workers", "2", "--ps", str(ps), "--", "train", f"--run_dir={run_dir}",
            f"--data.train={tmp_path / 'corpus' / '*.txt'}", *TINY_FLAGS, "--train.steps=100000",
            "--train.eval_every=0", "--checkpoint.every_steps=0", "--execution=graph", "--cluster.timeout_seconds=10"]
    log = tmp_path / "launch.log"
    with open(log, "w") as out:  # its own session: nothing else of this test's process is in its group
        launcher = subprocess.Popen([sys.executable, "-c", LAUNCH_WITH, mode, *args], cwd=REPO, stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                    env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    cluster = ""
    try:
        training = "[chief 0] step " if ps else "[worker 0] step "
        deadline = time.time() + 300
        while training not in log.read_text() and time.time() < deadline:
            assert launcher.poll() is None, log.read_text()[-3000:]
            time.sleep(0.2)
        text = log.read_text()
        assert training in text, text[-3000:]
        cluster = json.dumps(json.loads(text.splitlines()[0].split(" on 127.0.0.1 (", 1)[1].rsplit("): ", 1)[0]))
        assert len(tasks_of(cluster)) == 2 + 2 * bool(ps), (tasks_of(cluster), text[-2000:])
        launcher.kill()
        launcher.wait()
        killed = time.time()
        while tasks_of(cluster) and time.time() - killed < GONE_WITHIN:
            time.sleep(0.2)
        left = tasks_of(cluster)
        assert not left, f"{len(left)} task(s) still running {GONE_WITHIN} s after the launcher's SIGKILL: {left}"
        saved = sorted(p.name for p in (run_dir / "checkpoints").glob("ckpt-*.index"))
        assert saved, f"no checkpoint saved on the way out: {sorted(os.listdir(run_dir))}"
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for pid in tasks_of(cluster) if cluster else ():  # this test's tasks only (their TF_CONFIG names its ports)
            os.kill(pid, signal.SIGKILL)


# A tpu-llm child whose parent dies: the kernel may send the death signal once per parent it is handed
# to (a killed parent's threads, then PID 1); here three arrive at once, and the run sees one SIGTERM.
THREE_DEATH_SIGNALS = """
import os, signal, sys, time
from tpu_llm.platform import tether
got = []
signal.signal(signal.SIGTERM, lambda *_: got.append(1))
assert tether.as_child()
for _ in range(3):
    os.kill(os.getpid(), tether.PARENT_GONE)
    time.sleep(0.3)
print(len(got), os.environ.get("TPU_LLM_TETHER"))
"""


@pytest.mark.slow
@pytest.mark.skipif(tether.MODE != "pdeathsig", reason="the parent-death signal is Linux's")
def test_the_death_signal_is_one_sigterm_however_often_it_comes():
    env = {**os.environ, tether.ENV: f"pdeathsig:{os.getpid()}"}
    done = subprocess.run([sys.executable, "-c", THREE_DEATH_SIGNALS], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "None"]  # one SIGTERM; the variable is not passed on to its children


@pytest.mark.slow
@pytest.mark.skipif(tether.MODE != "pdeathsig", reason="the parent-death signal is Linux's")
def test_a_child_whose_parent_died_before_it_was_tied_exits_at_once(tmp_path):
    """The prelude runs after the fork: a parent that died in between would never send the signal."""
    ran = tmp_path / "ran"
    args, kwargs = tether.tie([sys.executable, "-c", f"open({str(ran)!r}, 'w')"], {})
    args[args.index(str(os.getpid()))] = "1"  # as if the parent had died and PID 1 had adopted the child
    done = subprocess.run(args, **kwargs, timeout=60)
    assert done.returncode == 128 + signal.SIGTERM and not ran.exists()
    args, kwargs = tether.tie([sys.executable, "-c", f"open({str(ran)!r}, 'w')"], {})
    done = subprocess.run(args, **kwargs, timeout=60)
    assert done.returncode == 0 and ran.exists()  # the same, tied by its living parent, runs


def test_output_whose_reader_is_gone_goes_to_devnull():
    read, write = os.pipe()
    stream = tether.OutlivesReader(io.TextIOWrapper(io.FileIO(write, "w"), line_buffering=True))
    stream.write("heard\n")
    assert os.read(read, 100) == b"heard\n"
    os.close(read)  # the parent is gone
    stream.write("unheard\n")  # would raise BrokenPipeError
    stream.write("x" * 100_000)
    stream.flush()
    assert os.path.samestat(os.fstat(stream.fileno()), os.stat(os.devnull))
    stream.close()
