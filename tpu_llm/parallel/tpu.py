"""Finding, connecting to and laying out a Cloud TPU: the TPU half of `distribute.py`.

* `strategy=auto` and `tpu-llm info` run on every laptop, so `find_tpu` only reads cheap local evidence
  (the `tpu` setting, environment variables, device files, the PCI bus) and never connects: for a TPU
  *name*, TensorFlow's resolver asks the GCE metadata server (urllib, no timeout), then the Cloud TPU
  API; `initialize_tpu_system` claims the chips.
* `connect` turns every way of not having a TPU into one `UserError` line naming what was looked for
  and what to do instead. It decides before TensorFlow is asked where it can (`tpu=""` with no evidence,
  `tpu=local` with no chips attached, a name without the API client), bounds the name lookup with a
  timeout, and checks that gRPC workers accept a TCP connection before TF's gRPC retries start.
* `tpu=""` means "what this machine shows": `TPU_NAME` (pod slices, as Google's TF harness runs them),
  `COLAB_TPU_ADDR` (legacy Colab TPU nodes), else the chips of a TPU VM. Colab's and Kaggle's TPUs are
  TPU VMs today, where TF's own `tpu=""` fails with "Please provide a TPU Name".
* A TPU reached over the network (`tpu=<name>`, `grpc://`, a pod's TPU_NAME: everything but `local`) runs
  its ops in TF servers on the TPU hosts: `experimental_connect_to_cluster` makes
  /job:worker/replica:0/task:0 the default device, input pipelines run there, and so would checkpoint
  and summary writes (`CLIENT_IO` keeps those on this process). Those servers see neither this
  machine's files nor tensorflow-text's ops: `check_remote_paths` and `check_remote_data` refuse such a
  run in one line before it starts.
* `STANDIN_ENV` (tests only) makes a `grpc://` TPU a "remote CPU host stand-in": a tf.distribute.Server
  on this machine serving CPU devices, reached through the same connection code, with
  MirroredStrategy over its CPUs where a TPU would get TPUStrategy (the one difference: the device type).
* `device_assignment` gives each replica's logical cores (later: pipeline stages x tensor-parallel
  ways) physical cores that are ICI neighbours and share a host when they fit in one. It is topology
  arithmetic only, unit-tested offline on hand-built `tf.tpu.experimental.Topology` objects.
"""

from __future__ import annotations

import glob
import importlib.util
import math
import os
import shlex
import socket
import threading
from collections.abc import Mapping

import numpy as np
import tensorflow as tf

from tpu_llm.errors import UserError
from tpu_llm.platform.tpu_chips import TYPES as _TYPES  # (tools/plan.py and doctor read tpu._TYPES)
from tpu_llm.platform.tpu_chips import accelerator_type, kind_of_type, pci_tpus
from tpu_llm.tokenizers import REMOTE_OK

ALTERNATIVES = ("use tpu=local on a TPU VM, tpu=<name> or tpu=grpc://<ip>:8470 for a TPU reached over the "
                "network, or strategy=auto / mirrored / default to run without one")
LOOKED_FOR = "/dev/accel*, /dev/vfio with libtpu, a Google TPU on the PCI bus, TPU devices listed by TensorFlow"
RESOLVE_TIMEOUT = 30.0  # seconds for TF's name lookup (metadata server + Cloud TPU API); instant on GCE
PROBE_TIMEOUT = 5.0  # seconds for a TCP connect to each TPU worker
# Checkpoints and summaries of a remote TPU run are written by this process (the client), not by the
# TPU hosts that own the variables: see `CLIENT_IO`.
CLIENT_IO = "/job:localhost"
# Tests only: a grpc:// TPU is a tf.distribute.Server on this machine serving CPUs. The value is a
# directory standing in for Cloud Storage: both sides reach paths under it, as both reach gs:// on a
# real TPU; every other local path counts as this machine's own, as it does with a real remote TPU.
STANDIN_ENV = "TPU_LLM_REMOTE_CPU_STANDIN"
# URL schemes of storage that a TPU host and this process both reach (TF's own filesystems); file://
# and ram:// are this machine's, or this process's, alone
SHARED_SCHEMES = ("gs://", "s3://", "hdfs://", "viewfs://")


def _local_evidence(root: str, env: Mapping[str, str]) -> str | None:
    """Evidence of TPU chips attached to this machine (a TPU VM), without touching them."""
    accel = sorted(glob.glob(os.path.join(root, "dev/accel*")))
    if accel:  # v2-v4 (and v5p) chips are /dev/accel<N>
        return f"/{os.path.relpath(accel[0], root)} present (TPU VM)"
    # v5e/v6e chips are VFIO groups /dev/vfio/<N>; VFIO alone is common, so libtpu must be there too
    libtpu = [os.path.join(root, "lib/libtpu.so")]
    libtpu += [env[v] for v in ("TPU_LIBRARY_PATH", "TF_PLUGGABLE_DEVICE_LIBRARY_PATH") if env.get(v)]
    if glob.glob(os.path.join(root, "dev/vfio/[0-9]*")) and (
            importlib.util.find_spec("libtpu") or any(map(os.path.exists, libtpu))):
        return "/dev/vfio present and libtpu installed (TPU VM)"
    chips, kind = pci_tpus(root)
    if chips:
        return f"{chips} {kind} chip(s) on the PCI bus (TPU VM)"
    try:  # physical devices only: listing logical devices would start the runtime
        if tf.config.list_physical_devices("TPU"):
            return "TPU devices listed by TensorFlow (tf.config.list_physical_devices)"
    except Exception:  # noqa: BLE001 - a broken plugin is no evidence of a TPU
        pass
    return None


def _env_tpu(env: Mapping[str, str]) -> tuple[str, str] | None:
    """(resolver target, variable) from the variables TF's resolver reads, or Colab's legacy address."""
    for var in ("TPU_NAME", "KUBE_GOOGLE_CLOUD_TPU_ENDPOINTS"):
        if env.get(var):
            return env[var], var
    return ("grpc://" + env["COLAB_TPU_ADDR"], "COLAB_TPU_ADDR") if env.get("COLAB_TPU_ADDR") else None


def find_tpu(tpu: str, *, env: Mapping[str, str] | None = None, root: str = "/") -> str | None:
    """Short evidence that a TPU is reachable (for strategy=auto and `tpu-llm info`), or None.

    Never connects, never starts the TPU runtime. `env` and `root` (holding dev/ and sys/) are for tests.
    """
    env = os.environ if env is None else env
    if tpu:
        return f"tpu={tpu!r} set"
    if found := _env_tpu(env):
        var = found[1]
        return "COLAB_TPU_ADDR set (Colab)" if var == "COLAB_TPU_ADDR" else f"{var}={env[var]} in the environment"
    return _local_evidence(root, env)


def tpu_kind(*, env: Mapping[str, str] | None = None, root: str = "/") -> str:
    """The generation as perf.tpu_peak_flops spells it ("TPU v4", "TPU v5 lite", ...), else "TPU".

    TensorFlow's TPU devices do not carry the chip version, so this reads the accelerator type that GKE
    and Kaggle export, or the PCI device id of this host's chips (a pod's worker 0 is a host too).
    """
    env = os.environ if env is None else env
    return kind_of_type(accelerator_type(env)) or pci_tpus(root)[1] or "TPU"


def _slice_name(kind: str, topology, env: Mapping[str, str]) -> str:
    """`v4-8`, `v5litepod-16`, ...; TF shows v4/v5p chips as one (megacore) device, v2/v3 as two."""
    if accelerator_type(env):
        return accelerator_type(env)
    chips = topology.num_tasks * topology.num_tpus_per_task // int(topology.mesh_shape[3])
    return next((f"{prefix}-{chips * per_chip}" for prefix, known, per_chip in _TYPES if known == kind), "")


def _target(tpu: str, env: Mapping[str, str], root: str) -> tuple[str, str]:
    """(what to hand TPUClusterResolver, how it was chosen); a UserError when it cannot work."""
    if tpu == "local" and not _local_evidence(root, env):
        raise UserError(f"tpu='local', but no TPU is attached to this machine (looked for {LOOKED_FOR}); "
                        + ALTERNATIVES)
    if tpu:
        return tpu, f"tpu={tpu!r}"
    if found := _env_tpu(env):  # passed on explicitly: TF reads os.environ (and takes TPU_NAME=local for
        return found[0], f"tpu='' with {found[1]}={env[found[1]]}"  # a name), and never COLAB_TPU_ADDR
    if evidence := _local_evidence(root, env):
        return "local", f"tpu='' on this machine ({evidence})"
    raise UserError(f"tpu='' found no TPU: no TPU_NAME or COLAB_TPU_ADDR in the environment and none of "
                    f"{LOOKED_FOR}; " + ALTERNATIVES)


def is_remote(tpu: str, *, env: Mapping[str, str] | None = None, root: str = "/") -> bool:
    """Whether `tpu` names a TPU whose hosts are other processes (a name, grpc://, a pod's TPU_NAME), not the
    chips of this TPU VM (`local`). Decided from the setting and the environment, without connecting."""
    env = os.environ if env is None else env
    return _target(tpu, env, root)[0] != "local"


def shared_storage(path: str, env: Mapping[str, str] | None = None) -> bool:
    """`path` is on storage the TPU hosts reach too (gs://, ...; with the stand-in, its shared directory)."""
    env = os.environ if env is None else env
    if path.startswith(SHARED_SCHEMES):
        return True
    shared = env.get(STANDIN_ENV, "")
    return bool(shared) and "://" not in path and os.path.abspath(path).startswith(os.path.abspath(shared) + os.sep)


def check_remote_paths(cfg, *, env: Mapping[str, str] | None = None) -> None:
    """Before connecting to a remote TPU: its run directory and data must be on storage its hosts share."""
    where = (f"tpu={cfg.tpu!r} is a TPU reached over the network, whose hosts run the input pipeline and cannot "
             "read this machine's files")
    if not shared_storage(cfg.run_dir, env):
        raise UserError(f"run_dir {cfg.run_dir!r} is on this machine, but {where}; put the run on Cloud Storage: "
                        "--run_dir=gs://BUCKET/runs/NAME")
    if not cfg.data.train:
        raise UserError(f"data.train is empty (the embedded corpus: this machine's Python sources), but {where}; "
                        "write shards to Cloud Storage with `tpu-llm data prepare --output gs://BUCKET/shards` and set "
                        "--data.train='gs://BUCKET/shards/*.tfrecord'")
    for key in ("train", "validation"):
        for pattern in (p.strip() for p in getattr(cfg.data, key).split(",") if p.strip()):
            if not shared_storage(pattern, env):
                raise UserError(f"data.{key} {pattern!r} is on this machine, but {where}; upload it (`tpu-llm data "
                                "prepare --output gs://BUCKET/shards`, or gsutil cp for text) and set "
                                f"--data.{key}=gs://...")


def check_remote_data(cfg, sources) -> None:
    """After the data is resolved: text tokenized on the TPU hosts must need core TF ops only."""
    text = [s for s in sources if s.format == "text"]
    if text and cfg.data.tokenizer not in REMOTE_OK:  # the command names the run's own text and model file
        given = "".join(f" --{flag} {shlex.quote(value)}" for flag, value in
                        (("input", cfg.data.train), ("tokenizer_model", cfg.data.tokenizer_model)) if value)
        raise UserError(f"data.tokenizer={cfg.data.tokenizer} tokenizes text with tensorflow-text's ops, which the TF "
                        f"servers on the hosts of tpu={cfg.tpu!r} do not have; pre-tokenize it with `tpu-llm data prepare "
                        f"--tokenizer {cfg.data.tokenizer}{given} --output gs://BUCKET/shards` and train on the shards, "
                        f"or use data.tokenizer={' or '.join(REMOTE_OK)}")


def _bounded(fn, seconds: float):
    """fn() in a daemon thread, so a lookup without a timeout cannot hold the run (or its exit)."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = e

    thread = threading.Thread(target=run, name="tpu-resolve", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive() or "error" in box:
        raise box.get("error") or TimeoutError(f"no answer within {seconds:g}s")
    return box["value"]


def _resolve(target: str):
    resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=target)
    return resolver, ([] if target == "local" else resolver.cluster_spec().job_tasks(resolver.task_type))


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 160 else text[:157] + "..."


def _standin_resolver(target: str):
    """The stand-in's resolver: one worker task serving CPUs; with `master` set, connecting makes it the
    default device, as TPUClusterResolver's master does for a TPU."""
    spec = tf.train.ClusterSpec({"worker": [target[len("grpc://"):]]})
    return tf.distribute.cluster_resolver.SimpleClusterResolver(spec, master=target), spec.job_tasks("worker")


# target -> (resolver, topology) of each TPU this process has initialized. A second strategy on the same
# TPU (tpu-llm doctor's data-parallel run, then its model-parallel run) reuses the connection:
# initialize_tpu_system again would wipe the TPU's memory, the first strategy's variables with it
# (TF 2.20 tpu_strategy_util warns "Reinitializing the TPU can cause previously created variables on
# TPU to be lost").
_CONNECTED: dict = {}


def _connect(tpu: str, env: Mapping[str, str], root: str, timeout: float):
    target, how = _target(tpu, env, root)
    if target in _CONNECTED:
        return (*_CONNECTED[target], target)
    standin = bool(env.get(STANDIN_ENV)) and target.startswith("grpc://")  # tests: no TPU system to initialize
    named = target != "local" and not target.startswith("grpc://")
    # TF's own resolver client (tensorflow/python/tpu/client) needs both, or it cannot look names up
    if named and not all(importlib.util.find_spec(m) for m in ("googleapiclient", "oauth2client")):
        raise UserError(f"no TPU reachable via {how}: TensorFlow looks TPU names up through the Cloud TPU API, "
                        "whose client is not installed (pip install 'tpu-llm[tpu]'); " + ALTERNATIVES)
    try:
        resolver, workers = _bounded(lambda: _standin_resolver(target) if standin else _resolve(target), timeout)
        for address in workers:  # an unreachable worker would otherwise sit in gRPC retries for minutes
            host, _, port = address.rpartition(":")
            socket.create_connection((host, int(port)), timeout=PROBE_TIMEOUT).close()
        tf.config.experimental_connect_to_cluster(resolver)  # as TF's docs do; a no-op for 'local'
        topology = None if standin else tf.tpu.experimental.initialize_tpu_system(resolver)
    except Exception as e:  # noqa: BLE001 - every failure here means "no usable TPU"
        hint = (" (a TPU name needs the GCE metadata server, the Cloud TPU API and credentials)" if named else
                " (a TPU VM needs the tensorflow-tpu build and libtpu: pip install 'tpu-llm[tpu]')"
                if target == "local" else "")
        raise UserError(f"no TPU reachable via {how}{hint}: {type(e).__name__}: {_one_line(e)}; "
                        + ALTERNATIVES) from e
    if topology is not None:
        _CONNECTED[target] = (resolver, topology)
    return resolver, topology, target


def connect(tpu: str, *, env: Mapping[str, str] | None = None, root: str = "/", timeout: float = RESOLVE_TIMEOUT):
    """Connect to and initialize the TPU system: (TPUClusterResolver, tf.tpu.experimental.Topology).

    `tpu`: "local" on a TPU VM, "" for what this machine shows, a TPU name or a grpc:// address.
    Raises a one-line UserError when there is no usable TPU.
    """
    resolver, topology, _ = _connect(tpu, os.environ if env is None else env, root, timeout)
    return resolver, topology


def _host_shape(topology) -> list[int]:
    """Extent of one host's cores along (x, y, z, core); the whole mesh if hosts are not aligned boxes."""
    coords = np.asarray(topology.device_coordinates)
    shape = (coords[0].max(axis=0) - coords[0].min(axis=0) + 1).tolist()
    for task in coords:
        low = task.min(axis=0)
        if (task.max(axis=0) - low + 1).tolist() != shape or any(low % shape) or math.prod(shape) != len(task):
            return [int(v) for v in topology.mesh_shape]
    return shape


def _fill(n: int, host: list[int], mesh: list[int]) -> list[int] | None:
    """Greedy block of n cores: the chip's cores first, then x, y, z; within a host, then across hosts.

    Every factor divides the host's extent (or the host count along that axis), so the blocks tile the
    mesh and a replica crosses a host boundary only when it needs more cores than one host has.
    """
    shape, rest = [1, 1, 1, 1], n
    for limits in (host, [m // h for m, h in zip(mesh, host)]):
        for axis in (3, 0, 1, 2):
            factor = math.gcd(limits[axis], rest)
            shape[axis], rest = shape[axis] * factor, rest // factor
    return shape if rest == 1 else None


def _no_fit(topology, n, why: str = "") -> UserError:
    cores = topology.num_tasks * topology.num_tpus_per_task
    host, mesh = _host_shape(topology), [int(v) for v in topology.mesh_shape]
    valid = [str(k) for k in range(1, cores + 1) if cores % k == 0 and _fill(k, host, mesh)]
    return UserError(f"cores_per_replica={n} does not fit this TPU slice (mesh {'x'.join(map(str, mesh))} "
                     f"(x,y,z,core), {cores} cores on {topology.num_tasks} host(s) of {topology.num_tpus_per_task})"
                     f"{why}; valid values: {', '.join(valid)}")


def computation_shape(topology, cores_per_replica: int) -> list[int]:
    """The [x, y, z, core] block of physical cores one replica occupies (its product is cores_per_replica)."""
    n, cores = cores_per_replica, topology.num_tasks * topology.num_tpus_per_task
    shape = None
    if isinstance(n, int) and n >= 1 and cores % n == 0:
        shape = _fill(n, _host_shape(topology), [int(v) for v in topology.mesh_shape])
    if shape is None:
        raise _no_fit(topology, n)
    return shape


def device_assignment(topology, cores_per_replica: int):
    """A DeviceAssignment giving each replica a block of neighbouring cores; None for 1 core per replica
    (TPUStrategy's default: plain data parallel, one replica per core)."""
    shape = computation_shape(topology, cores_per_replica)
    if cores_per_replica == 1:
        return None
    cores = topology.num_tasks * topology.num_tpus_per_task
    try:
        da = tf.tpu.experimental.DeviceAssignment.build(topology, computation_shape=shape,
                                                        num_replicas=cores // cores_per_replica)
    except ValueError as e:
        raise _no_fit(topology, cores_per_replica, f": TensorFlow cannot place block {shape}: {_one_line(e)}") from e
    if len({tuple(c) for c in da.core_assignment.reshape(-1, 4).tolist()}) != cores:  # slices with missing chips
        raise _no_fit(topology, cores_per_replica, ": TensorFlow's assignment reuses cores (missing chips?)")
    return da


def tpu_strategy(tpu: str, cores_per_replica: int = 1, *, env: Mapping[str, str] | None = None,
                 root: str = "/", timeout: float = RESOLVE_TIMEOUT):
    """(tf.distribute.TPUStrategy, device kind for perf.tpu_peak_flops, one-line description, chips).

    Chips, not replicas, scale the published per-chip peak: v2/v3 chips hold two cores, and a replica
    may span several cores."""
    env = os.environ if env is None else env
    resolver, topology, target = _connect(tpu, env, root, timeout)
    if topology is None:  # the remote CPU host stand-in (STANDIN_ENV): its CPUs in place of TPU cores
        return _standin_strategy(target, cores_per_replica)
    strategy = tf.distribute.TPUStrategy(
        resolver, experimental_device_assignment=device_assignment(topology, cores_per_replica))
    kind = tpu_kind(env=env, root=root)
    name = _slice_name(kind, topology, env)
    description = (f"{'TPU ' + name if name else kind} via tpu={target!r}: "
                   f"{topology.num_tasks * topology.num_tpus_per_task} cores, {topology.num_tasks} host(s), "
                   f"{strategy.num_replicas_in_sync} replicas x {cores_per_replica} core(s)")
    chips = topology.num_tasks * topology.num_tpus_per_task // int(topology.mesh_shape[3])
    return strategy, kind, description, chips


def _standin_strategy(target: str, cores_per_replica: int):
    """MirroredStrategy over the remote host's CPU devices, where a TPU gets TPUStrategy over its cores."""
    if cores_per_replica != 1:
        raise UserError(f"{STANDIN_ENV}: the remote CPU host stand-in has no logical cores for {cores_per_replica} "
                        "pipeline stages / tensor groups per replica; set parallel.pipeline_stages=1 and "
                        "parallel.tensor=1")
    devices = [d.name for d in tf.config.list_logical_devices("CPU") if d.name.startswith("/job:worker/")]
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=tf.distribute.ReductionToOneDevice())
    return (strategy, "CPU", f"remote CPU host stand-in via tpu={target!r} ({STANDIN_ENV}): {len(devices)} CPU "
                             f"devices of /job:worker, {strategy.num_replicas_in_sync} replicas", 0)

