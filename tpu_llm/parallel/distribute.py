"""How the job is distributed: the one place that chooses a tf.distribute strategy.

The trainer, data and controller ask this module for a `Distribution` and never branch on the
strategy themselves; what differs between strategies is handed to them here (how datasets are
distributed, how a loop of steps is run, who writes the run directory, and the `Placement` of
pipeline stages on devices or TPU cores).

  tpu               TPUStrategy (tpu_llm/parallel/tpu.py): synchronous data parallel over the TPU cores
  mirrored          synchronous data parallel over the GPUs of one machine, or over the CPU split
                    into `cpu_devices` logical devices
  multi_worker      MultiWorkerMirroredStrategy: synchronous, one process per machine, TF_CONFIG
  parameter_server  ParameterServerStrategy + ClusterCoordinator: ASYNCHRONOUS updates, a chief
                    schedules loops of steps to whichever worker is free; variables live on ps tasks
  default           one device

`choose` is pure (what was found -> which strategy and why), so `tpu-llm info` can explain the
choice without building anything, and tests can cover every branch offline.

Splitting a 2-core CPU into 2 logical devices is not only for testing multi-device code: XLA:CPU
spends much of a small model's step in per-kernel overhead, and two replicas running side by side
overlap it (`make bench`: 13.4k-15.4k vs 10.0k tokens/s for the same global batch).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import threading
import time
from typing import Callable

import tensorflow as tf

from tpu_llm.config import Config
from tpu_llm.errors import UserError
from tpu_llm.parallel import tpu
from tpu_llm.parallel.mesh import Mesh, Placement
from tpu_llm.platform import peak, perf

RUN_HERE = "strategy=auto, mirrored (cpu_devices=N) or default"
# parameter_server: how long the chief waits for a worker to answer again once none does
# (cluster.timeout_seconds when set), and how often it looks
NO_WORKER_SECONDS = 60
WORKER_PROBE_SECONDS = 1.0


@dataclasses.dataclass
class Found:
    """What this process can see, gathered without starting TensorFlow's runtime."""

    gpus: int = 0
    tpu: str | None = None  # evidence of a TPU (tpu_llm.parallel.tpu.find_tpu), or None
    cluster: dict = dataclasses.field(default_factory=dict)  # TF_CONFIG["cluster"]: task type -> addresses
    task: tuple[str, int] | None = None  # TF_CONFIG["task"]: this process's (type, index)

    @property
    def cluster_size(self) -> int:
        return sum(len(v) for v in self.cluster.values())

    def describe(self) -> list[str]:
        tasks = ", ".join(f"{len(v)} {k}" for k, v in self.cluster.items())
        return [f"GPUs      {self.gpus}",
                f"TPU       {self.tpu or 'none found (no tpu=, TPU_NAME, COLAB_TPU_ADDR or TPU device files)'}",
                f"TF_CONFIG {f'{tasks}; this process is {self.task[0]} {self.task[1]}' if self.cluster else 'not set'}"]


def look_around(cfg: Config) -> Found:
    cluster, task = read_tf_config()
    return Found(gpus=len(tf.config.list_physical_devices("GPU")), tpu=tpu.find_tpu(cfg.tpu),
                 cluster=cluster, task=task)


def read_tf_config() -> tuple[dict, tuple[str, int] | None]:
    text = os.environ.get("TF_CONFIG", "").strip()
    if not text:
        return {}, None
    try:
        spec = json.loads(text)
        cluster = {k: list(v) for k, v in spec.get("cluster", {}).items()}
        task = spec.get("task") or {}
        return cluster, ((str(task["type"]), int(task.get("index", 0))) if task else None)
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise UserError(f"TF_CONFIG is not valid ({e}); expected JSON like "
                        '{"cluster": {"worker": ["host1:2222", "host2:2222"]}, "task": {"type": "worker", '
                        '"index": 0}}') from None


def choose(cfg: Config, found: Found) -> tuple[str, str]:
    """(strategy name, why) for `cfg.strategy` given what was found; a request that cannot run here
    is a UserError naming what was looked for and the alternatives."""
    want, ps = cfg.strategy, "ps" in found.cluster
    if want == "tpu":
        if found.tpu or cfg.tpu:
            return "tpu", f"strategy=tpu: {found.tpu or f'tpu={cfg.tpu!r}'}"
        raise UserError("strategy=tpu found no TPU (looked for tpu=..., TPU_NAME, COLAB_TPU_ADDR and TPU device "
                        f"files); set tpu=local on a TPU VM or tpu=<name>, or use {RUN_HERE}")
    if want in ("multi_worker", "parameter_server"):
        if want == "parameter_server" and not (ps and found.cluster.get("worker")):
            raise UserError("strategy=parameter_server needs TF_CONFIG with chief, worker and ps tasks; start a "
                            "local cluster with `tpu-llm launch --workers 2 --ps 1 -- train ...`")
        if want == "multi_worker" and (ps or not found.cluster):
            raise UserError("strategy=multi_worker needs TF_CONFIG listing the workers (and no ps tasks); start "
                            "local workers with `tpu-llm launch --workers 2 -- train ...`")
        return want, f"strategy={want}: TF_CONFIG with {found.cluster_size} tasks"
    per_replica = cfg.parallel.pipeline_stages * cfg.parallel.tensor  # devices one replica's stages/groups take
    replicas = cfg.cpu_devices // per_replica
    if want == "mirrored":
        if found.gpus // per_replica > 1:
            return "mirrored", f"strategy=mirrored: {found.gpus} GPUs"
        if replicas > 1:
            return "mirrored", f"strategy=mirrored: cpu_devices={cfg.cpu_devices} logical CPU devices"
        raise UserError("strategy=mirrored found one device (no second GPU); set cpu_devices=N to mirror over N "
                        "logical CPU devices, or use strategy=auto / default")
    if want == "default":
        return "default", "strategy=default"
    # auto
    if found.tpu:
        return "tpu", f"strategy=auto: a TPU ({found.tpu})"
    if ps:
        return "parameter_server", f"strategy=auto: TF_CONFIG has ps tasks ({found.cluster_size} tasks)"
    if found.cluster_size > 1:  # before local GPUs: each worker mirrors over its own GPUs
        return "multi_worker", f"strategy=auto: TF_CONFIG with {found.cluster_size} tasks"
    if found.gpus // per_replica > 1:
        return "mirrored", f"strategy=auto: {found.gpus} GPUs"
    if replicas > 1:
        return "mirrored", f"strategy=auto: cpu_devices={cfg.cpu_devices} logical CPU devices"
    if per_replica > 1:
        return "default", (f"strategy=auto: one replica whose {_layout(cfg)} take "
                           f"{'the GPUs' if found.gpus else f'cpu_devices={cfg.cpu_devices} logical CPUs'}")
    return "default", f"strategy=auto: one {'GPU' if found.gpus else 'CPU'} device, no TPU, no TF_CONFIG"


@dataclasses.dataclass
class Distribution:
    strategy: tf.distribute.Strategy
    name: str  # what was chosen
    reason: str  # why, in words, for `tpu-llm info` and the training log
    device_kind: str  # "CPU", "GPU" or the TPU's device kind, for the MFU peak
    jit_compile: bool = True  # wrap the per-replica forward/backward in tf.function(jit_compile=True)
    xla: str = "per-replica step compiled with XLA"  # how XLA is used, for the log
    coordinator: object = None  # parameter_server: the ClusterCoordinator that schedules steps
    is_chief: bool = True  # writes the run directory (config, checkpoints, logs); prints progress
    task: str = ""  # this process's place in a cluster, e.g. "worker 1 of 2"
    chips: int = 0  # TPU chips in the slice (the published peak is per chip)
    placement: Placement = dataclasses.field(default_factory=Placement)  # the mesh's coordinates -> devices
    workers: tuple = ()  # parameter_server: the workers' host:port, watched while steps run
    worker_timeout: float = NO_WORKER_SECONDS  # parameter_server: no worker answers this long -> stop
    # a TPU reached over the network: ops run in its hosts' TF servers by default; checkpoints and
    # summaries are written on this device instead (tpu.CLIENT_IO), "" = wherever TF puts them
    io_device: str = ""

    @property
    def num_replicas(self) -> int:
        return self.strategy.num_replicas_in_sync

    @property
    def asynchronous(self) -> bool:
        """Steps run concurrently on several workers against shared variables (parameter_server)."""
        return self.coordinator is not None

    @property
    def num_workers(self) -> int:
        return len(self.workers) if self.coordinator else 1  # (TF keeps its count private)

    def distribute_dataset(self, dataset_fn: Callable):
        """A dataset for `strategy.run` (sync) or one per worker (parameter_server); iterate it with iter()."""
        if self.coordinator:
            return self.coordinator.create_per_worker_dataset(
                lambda: self.strategy.distribute_datasets_from_function(dataset_fn))
        return self.strategy.distribute_datasets_from_function(dataset_fn)

    def loops_per_call(self) -> int:
        """How many loops of `steps_per_loop` one controller call should ask for: parameter_server queues
        two per worker so that a free worker always finds one (the load balancing), sync strategies one."""
        return 2 * self.num_workers if self.coordinator else 1

    def run_loops(self, loop: Callable, iterator, num_steps: int, chunk: int) -> list[tuple[int, dict]]:
        """Run `loop(iterator, n)` for `num_steps` steps in all: [(n, result), ...].

        Synchronous strategies make one call. parameter_server cuts the steps into loops of at most
        `chunk` steps and schedules each to whichever worker is free, then waits for all of them.
        """
        if not self.coordinator:
            return [(num_steps, loop(iterator, tf.constant(num_steps)))]
        sizes = [min(chunk, num_steps - start) for start in range(0, num_steps, chunk)]
        pending = [(n, self.coordinator.schedule(loop, args=(iterator, tf.constant(n)))) for n in sizes]
        self._join()
        return [(n, remote.fetch()) for n, remote in pending]

    def _join(self) -> None:
        """`coordinator.join()`, except when no worker is left. TF's coordinator puts a dead worker's
        steps back in its queue and waits, up to an hour per attempt, for a worker to come back; a
        local worker never does, and the chief would wait in join() for ever, unable even to stop on
        a signal. So the chief polls `done()` (which raises a step's error, as join() does) and checks
        that some worker still accepts connections on its port: when none has for `worker_timeout`
        seconds, the call fails as a lost task (fault.cluster_failure: exit 4)."""
        silent_since, next_probe = None, time.monotonic() + WORKER_PROBE_SECONDS
        while not self.coordinator.done():
            time.sleep(0.02)
            now = time.monotonic()
            if not self.workers or now < next_probe:
                continue
            next_probe = now + WORKER_PROBE_SECONDS
            if any(map(_accepts_connections, self.workers)):
                silent_since = None
            elif silent_since is None:
                silent_since = now
            elif now - silent_since >= self.worker_timeout:
                tasks = ", ".join(f"/job:worker/replica:0/task:{i}" for i in range(len(self.workers)))
                raise tf.errors.UnavailableError(None, None, f"no worker is left: {tasks} accepted no connection "
                                                             f"for {self.worker_timeout:.0f} s")

    def peak_flops(self, on_measure: Callable | None = None) -> tuple[float, str]:
        """(peak FLOP/s of all replicas together, how it was obtained). CPUs and GPUs: the machine's
        measured peak, cached once per machine (tpu_llm/platform/peak.py); `on_measure()` runs before a measurement."""
        tpu = perf.tpu_peak_flops(self.device_kind) if self.device_kind.startswith("TPU") else None
        if tpu:
            chips = self.chips or self.num_replicas
            return tpu * chips, f"{self.device_kind} bf16 peak (published) x {chips} chips"
        if self.device_kind == "GPU":
            flops, how = peak.machine_peak("/GPU:0", lambda: perf.measured_matmul_flops("/GPU:0", repeats=MACHINE_PEAK_REPEATS), on_measure)
            return flops * self.num_replicas, f"float32 matmul of one GPU, {how}; x {self.num_replicas} GPUs"
        # logical CPU devices and the local processes of a cluster share the same cores: one machine peak
        flops, how = peak.machine_peak("/CPU:0", lambda: perf.measured_matmul_flops("/CPU:0", repeats=MACHINE_PEAK_REPEATS), on_measure)
        local, hosts = peak.sharing(*read_tf_config())
        shared = f"; its {local} processes of this run share it" if local > 1 else ""
        machines = f"; x {hosts} machines (assumed alike)" if hosts > 1 else ""
        return flops * hosts, f"this machine's CPU float32 matmul, {how}{shared}{machines}"

    def raise_peak(self, reached: float) -> float | None:
        """The run reached `reached` FLOP/s over all its replicas, more than `peak_flops` said: on CPUs and
        GPUs, the cached machine peak was measured low (a busy machine) and is raised (tpu_llm/platform/peak.py).
        The old peak of all replicas when raised, else None."""
        if self.device_kind.startswith("TPU"):
            return None  # a published figure
        if self.device_kind == "GPU":
            old = peak.raise_peak("/GPU:0", reached / self.num_replicas)
            return None if old is None else old * self.num_replicas
        hosts = peak.sharing(*read_tf_config())[1]
        old = peak.raise_peak("/CPU:0", reached / hosts)
        return None if old is None else old * hosts


# best of this many matmuls (~3 s on 2 cores): measured once per machine, so a longer window is
# affordable and more likely to catch the machine free of other work
MACHINE_PEAK_REPEATS = 16


def _accepts_connections(address: str, timeout: float = 2) -> bool:
    """Whether a TCP connection to host:port succeeds (a TF server is there to answer)."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
        return True
    except (OSError, ValueError):
        return False


def split_cpu(n: int) -> list[str]:
    """Names of `n` logical CPU devices, splitting the physical CPU if TensorFlow has not started yet."""
    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        if len(tf.config.get_logical_device_configuration(cpu) or []) < n:
            tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * n)
    except RuntimeError:  # the runtime is up: the split is fixed for this process
        pass
    have = tf.config.list_logical_devices("CPU")
    if len(have) < n:
        raise UserError(f"cpu_devices={n}, but TensorFlow already started in this process with {len(have)} "
                        "CPU device(s); set cpu_devices in the config or on the command line of a new run")
    return [d.name for d in have[:n]]


def get_strategy(cfg: Config, found: Found | None = None) -> Distribution:
    """The distribution for this run (call before any other TensorFlow work: it may split the CPU or
    configure collectives)."""
    found = found or look_around(cfg)
    name, reason = choose(cfg, found)
    kind = "GPU" if found.gpus else "CPU"
    stages, ways = cfg.parallel.pipeline_stages, cfg.parallel.tensor
    per_replica = stages * ways
    if name == "tpu":
        # No quiet fallback to the CPU when a TPU was seen but cannot be reached: a half-made
        # connection may already have changed TF's default devices, and a user on a TPU VM wants
        # the TPU. The error says how to run without it.
        remote = tpu.is_remote(cfg.tpu)
        if remote:  # before connecting: a run its hosts cannot read is refused at once
            tpu.check_remote_paths(cfg)
        strategy, kind, described, chips = tpu.tpu_strategy(cfg.tpu, per_replica)
        io = {"io_device": tpu.CLIENT_IO} if remote else {}
        if kind == "CPU":  # the remote CPU host stand-in (tests): Mirrored over its CPUs, the step XLA-compiled
            return Distribution(strategy, "tpu", f"{reason}; {described}", kind, **io)
        # TPUStrategy compiles the whole replica function for the TPU: no nested jit_compile needed
        return Distribution(strategy, "tpu", f"{reason}; {described}", kind, jit_compile=False,
                            xla="whole replica step compiled for the TPU", chips=chips,
                            placement=Placement(Mesh(strategy.num_replicas_in_sync, stages, ways), tpu_strategy=strategy),
                            **io)
    if per_replica > 1 and name in ("multi_worker", "parameter_server"):
        raise UserError(f"{_layout(cfg)} run under strategy tpu, mirrored or default, not {name}; set "
                        "parallel.pipeline_stages=1 and parallel.tensor=1")
    if name == "multi_worker":
        return _multi_worker(cfg, reason, kind, found)
    if name == "parameter_server":
        return _parameter_server(reason, kind, found, cfg.cluster.timeout_seconds or NO_WORKER_SECONDS)
    if found.gpus and (name == "mirrored" or per_replica > 1):
        if found.gpus < per_replica:
            raise UserError(f"{_layout(cfg)} need a GPU each; this machine has {found.gpus}; lower "
                            "parallel.pipeline_stages or parallel.tensor")
        devices = [f"/device:GPU:{i}" for i in range(found.gpus)]  # a remainder of < P x T GPUs stays idle
    elif cfg.cpu_devices > 1 or per_replica > 1:
        devices = split_cpu(_check_stage_devices(cfg, "cpu_devices", cfg.cpu_devices))
    else:
        return Distribution(tf.distribute.get_strategy(), "default", reason, kind)
    devices = devices[:len(devices) // per_replica * per_replica]
    groups = [tuple(devices[r * per_replica:(r + 1) * per_replica]) for r in range(len(devices) // per_replica)]
    placement = Placement(Mesh(len(groups), stages, ways), groups if per_replica > 1 else ())
    # stages or groups on several devices cannot be one XLA program: the step runs as a graph (pipeline.py)
    xla = {"jit_compile": False, "xla": f"off ({_layout(cfg)} on several devices run as a TF graph)"} \
        if per_replica > 1 else {}
    if len(groups) == 1:  # one replica of P stages: no data parallelism to mirror
        return Distribution(tf.distribute.get_strategy(), "default", reason, kind, placement=placement, **xla)
    # logical CPUs share one memory: reduce on the first of them. (The default, collective
    # all-reduce, also breaks when a process builds a second strategy of another size.)
    reduce = {} if kind == "GPU" else {"cross_device_ops": tf.distribute.ReductionToOneDevice()}
    strategy = tf.distribute.MirroredStrategy([g[0] for g in groups], **reduce)
    return Distribution(strategy, "mirrored", f"{reason}, synchronous data parallel", kind, placement=placement,
                        **xla)


def _layout(cfg: Config) -> str:
    """'4 pipeline stages', '2 tensor groups' or '2 pipeline stages x 2 tensor groups', for messages."""
    p, t = cfg.parallel.pipeline_stages, cfg.parallel.tensor
    parts = [f"{p} pipeline stages"] * (p > 1) + [f"{t} tensor groups"] * (t > 1)
    return " x ".join(parts) or "1 stage"


def _check_stage_devices(cfg: Config, what: str, count: int) -> int:
    k = cfg.parallel.pipeline_stages * cfg.parallel.tensor
    if count % k or count < k:
        name = "parallel.pipeline_stages x parallel.tensor" if cfg.parallel.tensor > 1 else "parallel.pipeline_stages"
        raise UserError(f"{what}={count} must be a multiple of {name}={k} (one device per stage and tensor "
                        f"group, per replica); set {what}={k} for one replica or {2 * k} for two")
    return count


def _is_chief(found: Found) -> bool:
    task_type, index = found.task or ("worker", 0)
    return task_type == "chief" or (task_type == "worker" and index == 0 and "chief" not in found.cluster)


def _multi_worker(cfg: Config, reason: str, kind: str, found: Found) -> Distribution:
    if not found.task:
        raise UserError('TF_CONFIG has no "task" entry; give each process {"type": "worker", "index": i}')
    impl = tf.distribute.experimental.CommunicationImplementation
    options = tf.distribute.experimental.CommunicationOptions(
        implementation={"auto": impl.AUTO, "ring": impl.RING, "nccl": impl.NCCL}[cfg.cluster.communication],
        timeout_seconds=cfg.cluster.timeout_seconds or None)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    workers = len(found.cluster.get("worker", [])) + len(found.cluster.get("chief", []))
    return Distribution(strategy, "multi_worker",
                        f"{reason}, synchronous data parallel, {cfg.cluster.communication} all-reduce", kind,
                        is_chief=_is_chief(found), task=f"{found.task[0]} {found.task[1]} of {workers} workers")


def _parameter_server(reason: str, kind: str, found: Found, worker_timeout: float) -> Distribution:
    if not found.task or found.task[0] != "chief":
        raise UserError("this process is a parameter-server cluster's worker or ps task: start it with "
                        "`tpu-llm train` (it serves) or use `tpu-llm launch --workers N --ps M -- train ...`")
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    # A step reads variables that live on another task; XLA cannot compile such a step (it would need
    # the variables on the worker's device), so the workers run it as a TF graph.
    return Distribution(strategy, "parameter_server", f"{reason}, ASYNCHRONOUS updates", kind,
                        jit_compile=False, xla="off (variables live on the ps tasks)", coordinator=coordinator,
                        workers=tuple(found.cluster["worker"]), worker_timeout=worker_timeout,
                        task=f"{found.task[0]} {found.task[1]} of {len(found.cluster['worker'])} workers and "
                             f"{len(found.cluster['ps'])} ps")


def serve_if_cluster_server(cfg: Config) -> bool:
    """In a parameter-server cluster every task runs the same command; worker and ps tasks start a
    TF server here and block (the chief drives them). Returns False for every other process."""
    if cfg.strategy not in ("auto", "parameter_server"):
        return False
    cluster, task = read_tf_config()
    if "ps" not in cluster or not task or task[0] not in ("worker", "ps"):
        return False
    try:  # the chief may ship input pipelines that tokenize with its ops (SentencePiece)
        import tensorflow_text  # noqa: F401
    except ImportError:  # an optional extra: byte and char tokenize with core ops
        pass

    config = tf.compat.v1.ConfigProto()
    if task[0] == "worker":  # closures from the chief run concurrently with the worker's own ops
        config.inter_op_parallelism_threads = 4
    server = tf.distribute.Server(tf.train.ClusterSpec(cluster), job_name=task[0], task_index=task[1],
                                  config=config, protocol="grpc", start=True)
    print(f"serving   {task[0]} {task[1]} of a parameter-server cluster at {cluster[task[0]][task[1]]}; "
          "the chief drives training", flush=True)
    _stop_after_the_chief(cluster["chief"][0])
    server.join()
    return True


SERVE_AFTER_SIGNAL_SECONDS = 20  # how long a worker or ps task, asked to stop, serves on for the chief


def _stop_after_the_chief(chief: str) -> None:
    """From now on SIGTERM or SIGINT ends this worker or ps task only once the chief has stopped (its
    address no longer takes connections), or after SERVE_AFTER_SIGNAL_SECONDS. A job is stopped by
    signalling every task at once (`tpu-llm launch` on SIGTERM or Ctrl-C, or when the launcher dies,
    tpu_llm/platform/tether.py): the chief then finishes the round of steps in flight on the workers and saves
    the variables the ps tasks hold; a task that died at once would leave it nothing to save from.
    A second signal of the same kind ends the task at once. The main thread is blocked in the
    server's join(), where Python handlers never run: the C-level handler wakes a thread through
    `signal.set_wakeup_fd`."""
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)  # (a Python handler, or the wake-up byte is never written)

    def wait() -> None:
        first = os.read(read, 1)[0]
        deadline = time.time() + SERVE_AFTER_SIGNAL_SECONDS
        os.set_blocking(read, False)
        while time.time() < deadline and _accepts_connections(chief, timeout=1):
            try:
                if first in os.read(read, 64):
                    break  # asked twice: now
            except BlockingIOError:
                pass
            time.sleep(0.2)
        os._exit(128 + first)  # 143 / 130, as a task stopped by that signal

    threading.Thread(target=wait, name="stop-after-the-chief", daemon=True).start()
