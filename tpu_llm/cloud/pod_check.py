"""`tpu-llm doctor`'s `pod` line: on worker 0 of a multi-host slice, the TF servers the run needs.

A pod runs the way Google's TF release tests run one (GoogleCloudPlatform/ml-auto-solutions, its
TensorFlow configs): the family's base image, tensorflow-tpu from the lock on every worker, and the TPU
runtime service pointed at the TF worker container of that TensorFlow version
(`grpc_tpu_worker:tf-X.Y.Z-pjrt`), which serves TensorFlow on every host; the training process on worker
0 reaches those servers through the TPU's name (infra/startup.sh.tftpl does the set-up). Before the
doctor's strategy connects, this checks what a failed connection would not say:

  - this host's TPU runtime service names the TF worker container of the client's TensorFlow
    (/etc/systemd/system/tpu-runtime.service, its TF_DOCKER_URL)
  - every host of the slice accepts a connection on the TF server port, 8470 (the port the TPU API
    lists in the node's network endpoints); the hosts come from the VM's metadata server
    (`worker-network-endpoints`, one `a:b:IP` per host, worker 0 first: JAX's Cloud TPU cluster
    detection reads the same attribute)

Standard library only; not on a TPU VM, or on one host, it answers SKIP.
"""

from __future__ import annotations

import os
import re
import socket
import urllib.error
import urllib.request
from typing import Callable

TF_WORKER_REPOSITORY = "gcr.io/cloud-tpu-v2-images/grpc_tpu_worker"
RUNTIME_SERVICE = "/etc/systemd/system/tpu-runtime.service"
TF_SERVER_PORT = 8470
METADATA_URL = "http://metadata.google.internal/computeMetadata/v1/instance/attributes/"
SETUP_FIX = ("run `make tpu-up` again: it re-runs the worker set-up where it failed or is out of date, which points "
             "each host's TPU runtime at the TF worker container and restarts it (`make tpu-logs LOGS=setup` shows "
             "every host's set-up log)")


def tf_worker_image(tf_version: str) -> str:
    """The TF worker container of a TensorFlow release, by the tag scheme of Google's release tests."""
    return f"{TF_WORKER_REPOSITORY}:tf-{tf_version}-pjrt"


def service_image(unit_text: str) -> str:
    """The container a tpu-runtime.service unit runs (its TF_DOCKER_URL), or ""."""
    match = re.search(r"TF_DOCKER_URL=([^\"'\s]+)", unit_text)
    return match.group(1) if match else ""


def worker_hosts(endpoints: str) -> list[str]:
    """IP addresses from the metadata attribute worker-network-endpoints ("a:b:IP,a:b:IP,...")."""
    return [entry.split(":")[2] for entry in endpoints.strip().split(",") if entry.count(":") >= 2]


def metadata(key: str, timeout: float = 2.0) -> str | None:
    """An instance attribute from the metadata server, or None (not on a Google Cloud VM, or not set)."""
    request = urllib.request.Request(METADATA_URL + key, headers={"Metadata-Flavor": "Google"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:  # noqa: S310 - the metadata server
            return answer.read().decode()
    except (urllib.error.URLError, OSError, ValueError):
        return None


def reachable(host: str, port: int, timeout: float = 5.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def check(tf_version: str, service_path: str = RUNTIME_SERVICE, get: Callable[[str], str | None] = metadata,
          connect: Callable[[str, int], bool] = reachable) -> tuple[str, str, dict, str]:
    """(status, numbers, values, fix) of the pod line: PASS, FAIL or SKIP."""
    endpoints = get("worker-network-endpoints")
    if endpoints is None:
        return "SKIP", "not on a Cloud TPU VM (the metadata server lists no worker-network-endpoints)", {}, ""
    hosts = worker_hosts(endpoints)
    values: dict = {"hosts": hosts, "port": TF_SERVER_PORT, "want": tf_worker_image(tf_version)}
    if len(hosts) < 2:
        return "SKIP", f"{len(hosts)} host: no TF servers to reach (one host trains with tpu=local)", values, ""
    want = tf_worker_image(tf_version)
    text = ""
    if os.path.exists(service_path):
        with open(service_path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    values["runtime"] = have = service_image(text)
    problems = []
    if not text:
        problems.append(f"{service_path} not found: this image has no TPU runtime service to serve TensorFlow")
    elif have != want:
        problems.append(f"this host's TPU runtime runs {have or 'no TF_DOCKER_URL'}, not {want} (the client is "
                        f"TensorFlow {tf_version})")
    closed = [host for host in hosts if not connect(host, TF_SERVER_PORT)]
    values["closed"] = closed
    if closed:
        problems.append(f"no TF server answers on port {TF_SERVER_PORT} of {len(closed)} of {len(hosts)} hosts "
                        f"({', '.join(closed)})")
    if problems:
        return "FAIL", "; ".join(problems), values, SETUP_FIX
    return ("PASS", f"{len(hosts)} hosts answer on port {TF_SERVER_PORT}; this host's TPU runtime runs {want}",
            values, "")
