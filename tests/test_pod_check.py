"""`tpu-llm doctor`'s pod line (tpu_llm/cloud/pod_check.py): the TPU runtime unit and the metadata server's
worker endpoints read as a pod's worker 0 sees them, the TF server port of every host tried for real."""

from __future__ import annotations

import socket

from hypothesis import given
from hypothesis import strategies as st

from tpu_llm.cloud import pod_check

WANT = "gcr.io/cloud-tpu-v2-images/grpc_tpu_worker:tf-2.20.0-pjrt"
UNIT = ('[Service]\nEnvironment="TF_DOCKER_URL={url}"\nExecStart=/usr/bin/docker run --net=host ${{TF_DOCKER_URL}}\n')


def test_the_tag_scheme_and_the_unit_file():
    assert pod_check.tf_worker_image("2.20.0") == WANT
    assert pod_check.service_image(UNIT.format(url=WANT)) == WANT
    assert pod_check.service_image("[Service]\nExecStart=/bin/true\n") == ""


ips = st.tuples(*[st.integers(0, 255)] * 4).map(lambda t: ".".join(map(str, t)))


@given(st.lists(ips, min_size=1, max_size=64), st.text("abcdefghijklmnopqrstuvwxyz0123456789-", max_size=12))
def test_worker_endpoints_parse_in_worker_order(hosts, name):
    # the attribute as JAX's Cloud TPU cluster detection reads it: one "a:b:IP" per worker, comma-separated
    text = ",".join(f"{name or 'x'}:{i}:{ip}" for i, ip in enumerate(hosts))
    assert pod_check.worker_hosts(text) == hosts
    assert pod_check.worker_hosts(text + "\n") == hosts


@given(st.text())
def test_any_metadata_text_parses_without_error(text):
    assert all(isinstance(h, str) for h in pod_check.worker_hosts(text))


def check(tmp_path, endpoints, unit: str | None, open_hosts=()):
    path = tmp_path / "tpu-runtime.service"
    if unit is not None:
        path.write_text(unit)
    tried = []

    def connect(host, port):
        tried.append((host, port))
        return host in open_hosts

    result = pod_check.check("2.20.0", service_path=str(path), get=lambda key: endpoints, connect=connect)
    return result, tried


def test_skip_off_a_tpu_vm_and_on_one_host(tmp_path):
    (status, numbers, _, _), tried = check(tmp_path, None, None)
    assert status == "SKIP" and "not on a Cloud TPU VM" in numbers and not tried
    (status, numbers, _, _), tried = check(tmp_path, "a:b:10.0.0.2", UNIT.format(url=WANT))
    assert status == "SKIP" and "1 host" in numbers and not tried


def test_pass_when_the_runtime_runs_the_client_s_container_and_every_host_answers(tmp_path):
    hosts = ["10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.5"]
    (status, numbers, values, fix), tried = check(tmp_path, ",".join(f"a:b:{h}" for h in hosts), UNIT.format(url=WANT),
                                                  open_hosts=hosts)
    assert status == "PASS" and numbers == f"4 hosts answer on port 8470; this host's TPU runtime runs {WANT}"
    assert tried == [(h, 8470) for h in hosts] and values["closed"] == [] and fix == ""


def test_fail_names_the_wrong_container_and_the_silent_hosts(tmp_path):
    endpoints = "a:b:10.0.0.2,a:b:10.0.0.3,a:b:10.0.0.4"
    other = "gcr.io/cloud-tpu-v2-images/grpc_tpu_worker:nightly"
    (status, numbers, values, fix), _ = check(tmp_path, endpoints, UNIT.format(url=other), open_hosts=["10.0.0.2"])
    assert status == "FAIL"
    assert f"this host's TPU runtime runs {other}, not {WANT} (the client is TensorFlow 2.20.0)" in numbers
    assert "no TF server answers on port 8470 of 2 of 3 hosts (10.0.0.3, 10.0.0.4)" in numbers
    assert "make tpu-up" in fix and values["closed"] == ["10.0.0.3", "10.0.0.4"]
    (status, numbers, _, _), _ = check(tmp_path / "none", endpoints, None, open_hosts=["10.0.0.2", "10.0.0.3",
                                                                                       "10.0.0.4"])
    assert status == "FAIL" and "tpu-runtime.service not found" in numbers


def test_reachable_tries_a_real_port():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    assert pod_check.reachable("127.0.0.1", port, timeout=2)
    listener.close()
    assert not pod_check.reachable("127.0.0.1", port, timeout=2)


def test_the_metadata_server_out_of_reach_is_none(monkeypatch):
    monkeypatch.setattr(pod_check, "METADATA_URL", "http://127.0.0.1:9/computeMetadata/v1/instance/attributes/")
    assert pod_check.metadata("worker-network-endpoints", timeout=1) is None
