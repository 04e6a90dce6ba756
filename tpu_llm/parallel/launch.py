"""`tpu-llm launch`: a local cluster of tpu-llm processes on 127.0.0.1, one TF_CONFIG each.

    tpu-llm launch --workers 2 -- train --config configs/tiny.yaml           # multi_worker (MWMS)
    tpu-llm launch --workers 2 --ps 1 -- train --config configs/tiny.yaml    # parameter_server

Every process runs the same command; only its TF_CONFIG differs, exactly as on a real cluster, where
each machine gets its own TF_CONFIG and `strategy=auto` picks the strategy from it. This is for
trying multi-worker training on one box and for the tests; it is not a cluster manager.

Output lines are prefixed with the task (`[worker 0] ...`). The launcher fails fast: under
multi_worker, one process exiting with an error stops all of them (the others would wait forever
in their next all-reduce), except a worker that saved and stopped on a signal (exit 130/143: the
others save at the same step and stop too). Under parameter_server the chief decides: a worker that
dies is reported and the chief's coordinator carries on with the rest; a ps task dying, or the last
worker, makes the chief stop with a message (exit 4), then the launcher stops the rest.
`launch    pids ...` names every task's process, to stop or kill one as a preemption would.

Network: TensorFlow's gRPC server listens on 0.0.0.0:<port> with insecure credentials, whatever
address TF_CONFIG names, so any host that reaches the port can run graphs in the task. So the
launcher runs the tasks in a network namespace of their own with only loopback (`unshare --net`,
as root or through a user namespace, and `nsenter` for each task), where no other host can reach
them. A run that needs the network (a gs:// path, the storage emulator) or a system without
namespaces runs in the host's network: the launcher says so in one line at start
(`--network open` asks for that).

Exit status: the job's (tpu_llm/training/fault.py lists the codes); 4 when a task was killed by a signal it
could not handle (SIGKILL: the cluster lost it); 128 + the signal number when the launcher itself is
stopped by SIGINT or SIGTERM (130, 143), after every task saved and stopped.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

from tpu_llm.errors import UserError
from tpu_llm.platform import tether

STOP_GRACE_SECONDS = 30  # a task stopped by SIGTERM saves a checkpoint first (tpu_llm/training/fault.py)
NO_WORKER_GRACE_SECONDS = 120  # parameter_server: the chief's own wait for a worker (60 s by default), then this
SAVED_AND_STOPPED = (130, 143)  # exit codes of a task that saved a checkpoint and stopped on a signal
EXIT_CLUSTER = 4  # as tpu_llm.training.fault.EXIT_CLUSTER (not imported: that module loads TensorFlow)


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on 127.0.0.1 (held open together so they differ)."""
    sockets = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def cluster_spec(workers: int, ps: int = 0) -> dict[str, list[str]]:
    """TF_CONFIG's cluster: workers only (multi_worker), or chief + workers + ps (parameter_server)."""
    if workers < 1 or ps < 0:
        raise UserError(f"--workers={workers} --ps={ps}: need at least 1 worker and 0 or more ps tasks")
    counts = {"chief": 1, "worker": workers, "ps": ps} if ps else {"worker": workers}
    ports = iter(free_ports(sum(counts.values())))
    return {kind: [f"127.0.0.1:{next(ports)}" for _ in range(n)] for kind, n in counts.items()}


def tf_config(cluster: dict, kind: str, index: int) -> str:
    return json.dumps({"cluster": cluster, "task": {"type": kind, "index": index}})


class _Task:
    def __init__(self, kind: str, index: int, command: list[str], cluster: dict, out, lock, enter: list[str]):
        self.name = f"{kind} {index}"
        env = {**os.environ, "TF_CONFIG": tf_config(cluster, kind, index), "PYTHONUNBUFFERED": "1"}
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        # tethered: a task gets SIGTERM (and saves) when the launcher dies, even by SIGKILL (tpu_llm/platform/tether.py)
        self.proc = tether.Popen(command, enter=enter, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, errors="replace", bufsize=1)
        self.reader = threading.Thread(target=self._copy, args=(out, lock), daemon=True)
        self.reader.start()

    def _copy(self, out, lock) -> None:
        for line in self.proc.stdout:
            with lock:
                out.write(f"[{self.name}] {line.rstrip()}\n")
                out.flush()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()


def launch(workers: int, ps: int, args: list[str], out=None, program: list[str] | None = None,
           network: str = "auto") -> int:
    """Start the cluster running `tpu-llm <args>` (or `program + args`), stream its output, and return
    the exit status of the job. `network`: auto (a loopback-only namespace when the run needs no
    network and the system allows it) or open (the host's network)."""
    if not args:
        raise UserError("tpu-llm launch needs the command to run after --, e.g. "
                        "`tpu-llm launch --workers 2 -- train --config configs/tiny.yaml`")
    out = out or sys.stdout
    cluster = cluster_spec(workers, ps)
    lock = threading.Lock()
    mode = f"parameter_server: chief + {workers} workers + {ps} ps" if ps else f"multi_worker: {workers} workers"
    out.write(f"launch    {mode} on 127.0.0.1 ({json.dumps(cluster)}): tpu-llm {' '.join(args)}\n")
    out.flush()
    namespace, why_open = (None, "--network open") if network == "open" else _isolate(args)
    if namespace:
        _say(out, lock, "launch    network: the tasks run in their own network namespace with only loopback; no other "
                        "host can reach their ports")
    else:
        _say(out, lock, f"launch    warning: the cluster's ports are open to the network ({why_open}): TensorFlow's "
                        "gRPC servers listen on 0.0.0.0 without authentication, and its distributed runtime "
                        "requires a trusted network")
    command = (program or [sys.executable, "-m", "tpu_llm"]) + list(args)
    try:
        tasks = [_Task(kind, i, command, cluster, out, lock, namespace.enter if namespace else [])
                 for kind, addresses in cluster.items() for i in range(len(addresses))]
        return _run(tasks, ps, out, lock)
    finally:
        if namespace:
            namespace.close()


def _run(tasks: list[_Task], ps: int, out, lock) -> int:
    # the pids let a user (or a test) stop or kill one task of the cluster, as a preemption would
    _say(out, lock, "launch    pids " + ", ".join(f"{t.name}={t.proc.pid}" for t in tasks))
    received = []  # the signal that stops the launcher: it exits with 128 + its number, as a shell reports

    def stop(signum, _frame):
        received.append(signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        return _supervise(tasks, ps > 0, out, lock)
    except KeyboardInterrupt:  # SIGINT (Python's own KeyboardInterrupt) or SIGTERM (`stop`)
        signum = received[0] if received else signal.SIGINT
        _say(out, lock, f"launch    {signal.Signals(signum).name}: stopping every task (each saves a checkpoint first)")
        _stop_all(tasks)
        return 128 + signum
    finally:
        signal.signal(signal.SIGTERM, previous)


def _supervise(tasks: list[_Task], parameter_server: bool, out, lock) -> int:
    reported, result, ps_lost, grace = set(), 0, None, STOP_GRACE_SECONDS
    while True:
        for task in tasks:
            code = task.proc.poll()
            if code is None or task.name in reported:
                continue
            reported.add(task.name)
            if parameter_server and task.name == "chief 0":
                _stop_all(tasks)  # workers and ps serve forever: the job ends with the chief
                if code < 0:  # killed by a signal it could not handle (SIGKILL, a crash): the task is lost
                    _say(out, lock, f"launch    chief 0 was killed by {_signal_name(code)}: the cluster lost its chief")
                    return EXIT_CLUSTER
                return code
            if parameter_server and task.name.startswith("ps"):  # the chief notices, says so and stops
                _say(out, lock, f"launch    {task.name} exited with status {code}: training cannot go on without "
                                "the variables it held; waiting for the chief to stop")
                ps_lost, grace = time.time(), STOP_GRACE_SECONDS
                continue
            if parameter_server and task.name.startswith("worker"):
                if any(t.name.startswith("worker") and t.proc.poll() is None for t in tasks):
                    _say(out, lock, f"launch    {task.name} exited with status {code}; the chief's coordinator "
                                    "goes on with the other workers")
                else:  # nothing restarts a local worker: the chief notices (distribute.Distribution._join)
                    _say(out, lock, f"launch    {task.name} exited with status {code}: no worker is left; the chief "
                                    "stops (exit 4) once none has answered for cluster.timeout_seconds (0: 60 s)")
                    ps_lost = time.time()
                    grace = NO_WORKER_GRACE_SECONDS
                continue
            if code in SAVED_AND_STOPPED and not parameter_server:  # the others save at the same step
                _say(out, lock, f"launch    {task.name} saved a checkpoint and stopped on a signal (status "
                                f"{code}); the other workers do the same")
                result = result or code
                continue
            if code != 0 or parameter_server:  # any multi_worker error, or a ps task gone
                _say(out, lock, f"launch    {task.name} exited with status {code}: stopping every task")
                _stop_all(tasks)
                return code if code > 0 else EXIT_CLUSTER  # killed by a signal: the cluster lost a task
        if ps_lost and time.time() - ps_lost > grace:
            _say(out, lock, "launch    the chief did not stop: stopping every task")
            _stop_all(tasks)
            return EXIT_CLUSTER
        if all(t.proc.poll() is not None for t in tasks):
            _drain(tasks)
            return result
        time.sleep(0.2)


NETWORK_HINTS = ("gs://", "http://", "https://")  # a run reading or writing these needs the host's network

# Runs in the new namespace: brings its loopback interface up (it starts down), says so, and keeps
# the namespace alive until the launcher closes its stdin (also when the launcher dies).
_HOLDER = r"""
import fcntl, socket, struct, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
flags = struct.unpack("16sH22x", fcntl.ioctl(s, 0x8913, struct.pack("16sH22x", b"lo", 0)))[1]  # SIOCGIFFLAGS
fcntl.ioctl(s, 0x8914, struct.pack("16sH22x", b"lo", flags | 1))  # SIOCSIFFLAGS: IFF_UP
print("ready", flush=True)
sys.stdin.read()
"""


class _Namespace:
    """A network namespace with only loopback, held open by a small process; `enter` is the command
    prefix that runs a program inside it."""

    def __init__(self, as_root: bool):
        user = [] if as_root else ["--map-root-user"]  # an unprivileged user needs a user namespace too
        self.holder = subprocess.Popen(["unshare", "--net", *user, sys.executable, "-c", _HOLDER],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True)
        ready = self.holder.stdout.readline().strip() == "ready"
        if not ready:
            self.close()
            raise OSError(self.holder.stderr.read().strip().splitlines()[-1:] or "no namespace")
        ns = f"/proc/{self.holder.pid}/ns"
        self.enter = ["nsenter", f"--net={ns}/net"] if as_root else \
            ["nsenter", "--preserve-credentials", f"--user={ns}/user", f"--net={ns}/net"]

    def close(self) -> None:
        if self.holder.poll() is None:
            self.holder.stdin.close()
            try:
                self.holder.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.holder.kill()
                self.holder.wait()


def _isolate(args: list[str]) -> tuple[_Namespace | None, str]:
    """(a loopback-only network namespace for the tasks, None) or (None, why the network stays open)."""
    texts = list(args)
    for i, arg in enumerate(args):  # the config file may name gs:// paths too
        path = arg.split("=", 1)[1] if arg.startswith("--config=") else \
            (args[i + 1] if arg == "--config" and i + 1 < len(args) else None)
        if path and os.path.isfile(path):
            with open(path, errors="replace") as f:
                texts.append(f.read())
    if any(hint in text for text in texts for hint in NETWORK_HINTS):
        return None, "the run reads or writes a remote location"
    if os.environ.get("STORAGE_EMULATOR_HOST"):
        return None, "STORAGE_EMULATOR_HOST is set"
    if not sys.platform.startswith("linux") or not (shutil.which("unshare") and shutil.which("nsenter")):
        return None, "no unshare/nsenter here to give the tasks a network namespace of their own"
    try:
        return _Namespace(as_root=os.geteuid() == 0), ""
    except OSError as e:
        return None, f"this system does not allow a network namespace: {str(e)[:120]}"


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def _stop_all(tasks: list[_Task]) -> None:
    for task in tasks:
        task.stop()
    deadline = time.time() + STOP_GRACE_SECONDS
    for task in tasks:
        try:
            task.proc.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            task.proc.kill()
            task.proc.wait()
    _drain(tasks)


def _drain(tasks: list[_Task]) -> None:
    for task in tasks:
        task.reader.join(timeout=5)


def _say(out, lock, text: str) -> None:
    with lock:
        out.write(text + "\n")
        out.flush()
