"""The MFU denominator on CPUs and GPUs: one peak per machine, measured once, cached, and shared by the
processes of a run on that machine.

Each process used to measure its own matmul at start-up. Two workers launched together on one 2-core
machine measured at the same moment, each got about half the cores, and each divided the run's whole
throughput by that half: MFU 94%. Now the first process to need the peak measures it while holding a
file lock (the other processes of the run wait instead of measuring at the same time), writes it to
the cache ($XDG_CACHE_HOME/tpu-llm/peak.json, else ~/.cache/tpu-llm/peak.json), and every later process
and run on the machine reads it. The run's peak is the machine's times the machines that run its steps
(the processes on one machine share its peak; other machines are assumed alike). A peak measured while
the machine was busy is too low, and runs would show an MFU above 100%: a run that reaches more than
the cached peak raises it to what it reached (`raise_peak`). Delete the file to measure again.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import platform
from typing import Callable

from tpu_llm.platform.files import write_atomically

CACHE_FILE = "peak.json"
LOOPBACK = {"localhost", "127.0.0.1", "::1", "[::1]", "0.0.0.0"}


def cache_path() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tpu-llm", CACHE_FILE)


def machine_key(device: str) -> str:
    """What the measured number depends on: the device, the machine and its CPU, TensorFlow's version."""
    import tensorflow as tf

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{device} on {platform.node()}: {cpu}, {os.cpu_count()} CPUs, TensorFlow {tf.__version__}"


def machine_peak(device: str, measure: Callable[[], float], on_measure: Callable[[], None] | None = None,
                 path: str | None = None) -> tuple[float, str]:
    """(FLOP/s of `device` on this machine, how it was obtained): from the cache, or measured now by
    `measure()` (after `on_measure()`, which says so) and cached for the other processes and runs."""
    path = path or cache_path()
    key = machine_key(device)
    shown = path.replace(os.path.expanduser("~"), "~", 1)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        lock = open(path + ".lock", "a")
    except OSError as e:
        if on_measure:
            on_measure()
        return measure(), f"measured by this process: the cache {shown} cannot be written ({e.strerror or e})"
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process of the run measuring: wait for its number
        entries = _read(path)
        cached = _flops(entries.get(key))
        if cached:
            return cached, f"measured once on this machine {entries[key].get('measured', '')}, cached in {shown}"
        if on_measure:
            on_measure()
        flops = measure()
        entries[key] = {"flops": flops, "measured": _now()}
        with contextlib.suppress(OSError):
            write_atomically(path, json.dumps(entries, indent=1))
        return flops, f"measured now, once per machine, cached in {shown}"


def raise_peak(device: str, reached: float, path: str | None = None) -> float | None:
    """A run on `device` reached `reached` FLOP/s per machine: above the cached peak, the cache holds
    it from now on (the old peak was measured on a busy machine). The old peak when raised, else None."""
    path = path or cache_path()
    key = machine_key(device)
    try:
        with open(path + ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            entries = _read(path)
            cached = _flops(entries.get(key))
            if not cached or cached >= reached:
                return None
            entries[key] = {"flops": reached,
                            "measured": f"{_now()} (reached by a run; measured {entries[key].get('measured', '')})"}
            write_atomically(path, json.dumps(entries, indent=1))
            return cached
    except OSError:
        return None


def _flops(entry) -> float | None:
    """A cache entry's FLOP/s, if it holds a usable one."""
    if isinstance(entry, dict) and isinstance(entry.get("flops"), (int, float)) and entry["flops"] > 0:
        return float(entry["flops"])
    return None


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def _read(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            entries = json.load(f)
        return entries if isinstance(entries, dict) else {}
    except (OSError, ValueError):
        return {}


def sharing(cluster: dict, task: tuple[str, int] | None) -> tuple[int, int]:
    """(processes of the cluster on this machine, machines that run its steps) from TF_CONFIG's cluster
    and this process's task. Steps run on the workers, and on the chief unless there are ps tasks (a
    parameter-server chief only schedules). A task shares this machine when its host is this task's
    host or a loopback name."""
    if not cluster or not task:
        return 1, 1
    mine = _host(cluster[task[0]][task[1]])
    here = LOOPBACK | {mine}
    local = sum(_host(address) in here for addresses in cluster.values() for address in addresses)
    jobs = ["worker"] + ([] if "ps" in cluster else ["chief"])
    hosts = {"here" if _host(a) in here else _host(a) for job in jobs for a in cluster.get(job, [])}
    return max(local, 1), max(len(hosts), 1)


def _host(address: str) -> str:
    return str(address).rpartition(":")[0] or str(address)
