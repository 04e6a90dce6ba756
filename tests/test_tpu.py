"""TPU discovery, the one-line "no TPU" errors, and replica-to-core layout on hand-built slice topologies.

Everything runs offline on CPU: `tf.tpu.experimental.Topology(mesh_shape=..., device_coordinates=...)`
and `DeviceAssignment.build` are plain Python and need no TPU.

Slice layouts (mesh = [x, y, z, cores per chip]; hosts tile the mesh in boxes). Host boxes follow
the TPU_HOST_BOUNDS / TPU_CHIPS_PER_HOST_BOUNDS that TPU runtimes export per slice type (as on GKE):
v4-8 one host of 2x2x1 chips; v4-16 two hosts of 2x2x1 stacked in z (host bounds 1,1,2);
v5litepod-8 one host of 2x4 chips; v5litepod-16 four hosts of 2x2 chips (host bounds 2,2,1). v4 runs
its two TensorCores as one megacore, so TF sees one core per chip; v3 shows two. ASSUMPTION: the order
of TF device ordinals inside a host is not documented; we number core first, then x, y, z, and a
separate test shuffles it to show the layout does not depend on it.
"""

import itertools
import socket
import sys
import time

import numpy as np
import pytest
import tensorflow as tf
from helpers import make_topology, offline_tpu
from hypothesis import given, settings
from hypothesis import strategies as st

from tpu_llm.errors import UserError
from tpu_llm.parallel import tpu
from tpu_llm.platform import perf

SLICES = {  # name: (mesh, host box)
    "v4-8": ([2, 2, 1, 1], [2, 2, 1, 1]),
    "v3-8": ([2, 2, 1, 2], [2, 2, 1, 2]),
    "v5litepod-8": ([2, 4, 1, 1], [2, 4, 1, 1]),
    "v4-16": ([2, 2, 2, 1], [2, 2, 1, 1]),
    "v5litepod-16": ([4, 4, 1, 1], [2, 2, 1, 1]),
    "two-8-chip-hosts": ([4, 4, 1, 1], [2, 4, 1, 1]),  # hypothetical: 16 chips on two 2x4 hosts
}
SHAPES = {  # (slice, cores_per_replica): expected computation shape
    ("v4-8", 2): [2, 1, 1, 1], ("v4-8", 4): [2, 2, 1, 1],
    ("v3-8", 2): [1, 1, 1, 2], ("v3-8", 4): [2, 1, 1, 2], ("v3-8", 8): [2, 2, 1, 2],
    ("v5litepod-8", 4): [2, 2, 1, 1], ("v5litepod-8", 8): [2, 4, 1, 1],
    ("v4-16", 4): [2, 2, 1, 1], ("v4-16", 8): [2, 2, 2, 1],
    ("v5litepod-16", 4): [2, 2, 1, 1], ("v5litepod-16", 8): [4, 2, 1, 1], ("v5litepod-16", 16): [4, 4, 1, 1],
    ("two-8-chip-hosts", 8): [2, 4, 1, 1],
}
CASES = [(name, n) for name, (mesh, _) in SLICES.items() for n in (1, 2, 4, 8, 16) if n <= np.prod(mesh)]


def check_layout(topo, n, da):
    cores_per_host = topo.num_tpus_per_task
    total = topo.num_tasks * cores_per_host
    assert da.num_replicas == total // n and da.num_cores_per_replica == n
    used = [tuple(c) for c in da.core_assignment.reshape(-1, 4).tolist()]
    assert sorted(used) == sorted(tuple(c) for c in topo.device_coordinates.reshape(-1, 4).tolist())
    shape = tpu.computation_shape(topo, n)
    for r in range(da.num_replicas):
        coords = np.array([da.coordinates(r, c) for c in range(n)])
        low = coords.min(axis=0)
        box = {tuple(low + np.array(o)) for o in itertools.product(*map(range, shape))}
        assert {tuple(c) for c in coords} == box  # a contiguous block of the computation shape
        for a, b in zip(coords, coords[1:]):  # pipeline stage i -> i+1: same chip or one ICI hop
            assert np.abs(a[:3] - b[:3]).sum() <= 1
        hosts = {da.host_device(r, c) for c in range(n)}
        assert len(hosts) == max(1, n // cores_per_host)  # one host if it fits, else whole hosts
    if n <= cores_per_host:
        for task in range(topo.num_tasks):
            for core in range(n):
                assert len(da.lookup_replicas(task, core)) == cores_per_host // n


@pytest.mark.parametrize("name,n", CASES)
def test_device_assignment_uses_every_core_once_in_neighbour_blocks(name, n):
    topo = make_topology(*SLICES[name])
    da = tpu.device_assignment(topo, n)
    if n == 1:
        assert da is None and tpu.computation_shape(topo, 1) == [1, 1, 1, 1]
        return
    if (name, n) in SHAPES:
        assert tpu.computation_shape(topo, n) == SHAPES[name, n]
    check_layout(topo, n, da)


@pytest.mark.parametrize("name", ["v4-16", "v5litepod-16", "v3-8"])
def test_layout_does_not_depend_on_device_order_within_a_host(name):
    topo = make_topology(*SLICES[name], shuffle=True)
    for n in (2, 4, 8):
        check_layout(topo, n, tpu.device_assignment(topo, n))


@pytest.mark.parametrize("name,n,valid", [("v5litepod-8", 3, "1, 2, 4, 8"), ("v4-8", 8, "1, 2, 4"),
                                          ("v4-16", 0, "1, 2, 4, 8"), ("v3-8", 6, "1, 2, 4, 8")])
def test_impossible_cores_per_replica_names_the_slice_and_valid_values(name, n, valid):
    topo = make_topology(*SLICES[name])
    mesh = "x".join(map(str, SLICES[name][0]))
    for call in (tpu.computation_shape, tpu.device_assignment):
        with pytest.raises(UserError) as err:
            call(topo, n)
        msg = str(err.value)
        assert f"cores_per_replica={n}" in msg and f"mesh {mesh}" in msg and f"valid values: {valid}" in msg
        assert "\n" not in msg


# the "no TPU" tests hold on machines where TensorFlow lists no TPU device (CI, laptops)
no_tpu_here = pytest.mark.skipif(bool(tf.config.list_physical_devices("TPU")), reason="this machine has a TPU")


@no_tpu_here
def test_find_tpu_sees_nothing_on_an_empty_machine(tmp_path):
    assert tpu.find_tpu("", env={}, root=str(tmp_path)) is None


def test_find_tpu_evidence(tmp_path):
    assert tpu.find_tpu("local", env={}, root=str(tmp_path)) == "tpu='local' set"
    assert tpu.find_tpu("", env={"TPU_NAME": "foo"}, root=str(tmp_path)) == "TPU_NAME=foo in the environment"
    assert tpu.find_tpu("", env={"COLAB_TPU_ADDR": "10.0.0.2:8470"}, root=str(tmp_path)) == "COLAB_TPU_ADDR set (Colab)"
    accel = tmp_path / "accel"
    (accel / "dev").mkdir(parents=True)
    (accel / "dev" / "accel0").touch()
    assert tpu.find_tpu("", env={}, root=str(accel)) == "/dev/accel0 present (TPU VM)"
    vfio = tmp_path / "vfio"
    (vfio / "dev" / "vfio").mkdir(parents=True)
    (vfio / "dev" / "vfio" / "0").touch()
    (vfio / "dev" / "vfio" / "vfio").touch()
    (vfio / "lib").mkdir()
    (vfio / "lib" / "libtpu.so").touch()
    assert tpu.find_tpu("", env={}, root=str(vfio)) == "/dev/vfio present and libtpu installed (TPU VM)"


def fake_pci(root, vendor, device):
    slot = root / "sys" / "bus" / "pci" / "devices" / "0000:00:05.0"
    slot.mkdir(parents=True)
    (slot / "vendor").write_text(vendor + "\n")
    (slot / "device").write_text(device + "\n")


@no_tpu_here
def test_find_tpu_reads_the_pci_bus_and_names_the_kind(tmp_path):
    fake_pci(tmp_path / "tpu", "0x1ae0", "0x0063")
    assert tpu.find_tpu("", env={}, root=str(tmp_path / "tpu")) == "1 TPU v5 lite chip(s) on the PCI bus (TPU VM)"
    assert tpu.tpu_kind(env={}, root=str(tmp_path / "tpu")) == "TPU v5 lite"
    fake_pci(tmp_path / "nic", "0x8086", "0x0063")
    assert tpu.find_tpu("", env={}, root=str(tmp_path / "nic")) is None
    assert tpu.tpu_kind(env={}, root=str(tmp_path / "nic")) == "TPU"


@pytest.mark.parametrize("accelerator,kind,tflops", [("v4-8", "TPU v4", 275), ("v5litepod-16", "TPU v5 lite", 197),
                                                     ("v5p-8", "TPU v5p", 459), ("v6e-8", "TPU v6 lite", 918)])
def test_tpu_kind_is_one_perf_knows(tmp_path, accelerator, kind, tflops):
    assert tpu.tpu_kind(env={"TPU_ACCELERATOR_TYPE": accelerator}, root=str(tmp_path)) == kind
    assert perf.tpu_peak_flops(kind) == tflops * 1e12


def assert_one_line(err, *parts):
    msg = str(err.value)
    assert "\n" not in msg and "strategy=auto / mirrored / default" in msg and "tpu=local" in msg
    for part in parts:
        assert part in msg


@no_tpu_here
@pytest.mark.parametrize("fn", [tpu.connect, tpu.tpu_strategy])
def test_no_tpu_gives_one_line_error(tmp_path, fn):
    with pytest.raises(UserError) as err:
        fn("", env={}, root=str(tmp_path))
    assert_one_line(err, "tpu=''", "TPU_NAME", "COLAB_TPU_ADDR", "/dev/accel*", "PCI bus")
    with pytest.raises(UserError) as err:
        fn("local", env={}, root=str(tmp_path))
    assert_one_line(err, "tpu='local'", "no TPU is attached", "/dev/vfio")
    with pytest.raises(UserError) as err:
        fn("my-tpu", env={}, root=str(tmp_path), timeout=5)
    assert_one_line(err, "tpu='my-tpu'")


def test_tpu_name_in_the_environment_is_what_tpu_empty_connects_to(tmp_path):
    with pytest.raises(UserError) as err:
        tpu.connect("", env={"TPU_NAME": "pod-7"}, root=str(tmp_path), timeout=5)
    assert_one_line(err, "tpu='' with TPU_NAME=pod-7")


@pytest.mark.parametrize("name,kind", [("v4-8", "TPU v4"), ("v3-8", "TPU v3"), ("v5litepod-8", "TPU v5 lite"),
                                       ("v4-16", "TPU v4"), ("v5litepod-16", "TPU v5 lite")])
def test_slice_name_for_the_description(name, kind):
    assert tpu._slice_name(kind, make_topology(*SLICES[name]), {}) == name
    assert tpu._slice_name(kind, make_topology(*SLICES[name]), {"TPU_ACCELERATOR_TYPE": "v9-1"}) == "v9-1"


def test_colab_address_that_nobody_answers_fails_before_tensorflow_connects(tmp_path):
    with socket.socket() as s:  # a local port with nothing listening: refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(UserError) as err:
        tpu.connect("", env={"COLAB_TPU_ADDR": f"127.0.0.1:{port}"}, root=str(tmp_path))
    assert_one_line(err, f"COLAB_TPU_ADDR=127.0.0.1:{port}", "ConnectionRefusedError")


def test_a_resolver_lookup_that_hangs_is_cut_off(tmp_path, monkeypatch):
    monkeypatch.setattr(tpu, "_resolve", lambda target: time.sleep(3))
    start = time.perf_counter()
    with pytest.raises(UserError) as err:
        tpu.connect("grpc://10.0.0.9:8470", env={}, root=str(tmp_path), timeout=0.2)
    assert time.perf_counter() - start < 5
    assert_one_line(err, "tpu='grpc://10.0.0.9:8470'", "TimeoutError")


def test_a_second_strategy_on_the_same_tpu_reuses_its_connection(monkeypatch):
    # tpu-llm doctor builds a data-parallel, then a model-parallel TPUStrategy in one process: a second
    # initialize_tpu_system would wipe the TPU's memory, so the second strategy reuses the first connection
    initialized = offline_tpu(monkeypatch, make_topology(*SLICES["v5litepod-8"]))
    first = tpu.tpu_strategy("local", 1)[0]
    second, _, description, chips = tpu.tpu_strategy("local", 4)
    assert len(initialized) == 1 and first.num_replicas_in_sync == 8 and second.num_replicas_in_sync == 2
    assert "8 cores, 1 host(s), 2 replicas x 4 core(s)" in description and chips == 8


# ---- the PJRT variables tpu-llm sets at start-up on a TPU VM (tpu_llm/cli/pjrt.py) ---------------------

PJRT = ("NEXT_PLUGGABLE_DEVICE_USE_C_API", "TF_PLUGGABLE_DEVICE_LIBRARY_PATH", "TPU_LIBRARY_PATH")


def fake_machine(root, *devices, image_libtpu=False, pci=None):
    for d in devices:  # e.g. "dev/accel0", "dev/vfio/0"
        (root / d).parent.mkdir(parents=True, exist_ok=True)
        (root / d).touch()
    if image_libtpu:
        (root / "lib").mkdir(parents=True, exist_ok=True)
        (root / "lib" / "libtpu.so").touch()
    if pci:  # a Google TPU chip's PCI device id, as sysfs shows it
        chip = root / "sys/bus/pci/devices/0000:00:05.0"
        chip.mkdir(parents=True)
        (chip / "vendor").write_text("0x1ae0\n")
        (chip / "device").write_text(pci + "\n")
    return str(root)


def no_metadata():
    raise AssertionError("the metadata server was asked although the machine showed its generation")


WHEEL = "/site-packages/libtpu/libtpu.so"


@pytest.mark.parametrize("device,shows,env,metadata,pjrt", [
    ("dev/vfio/0", None, {"TPU_ACCELERATOR_TYPE": "v5litepod-8"}, no_metadata, True),  # v5e on GKE
    ("dev/accel0", "0x0062", {}, no_metadata, True),  # v5p, by its chips' PCI id
    ("dev/vfio/0", None, {}, lambda: "v6e-8", True),  # v6e: the TPU VM's metadata
    ("dev/vfio/0", None, {}, lambda: "", True),  # /dev/vfio: only v5e and v6e chips
    ("dev/accel0", "0x005e", {}, no_metadata, True),  # v4
    ("dev/accel0", None, {"ACCELERATOR_TYPE": "v3-8"}, no_metadata, True),  # Kaggle's v3-8
    ("dev/accel0", "0x0027", {}, no_metadata, True),  # v2 or v3 (one PCI id)
    ("dev/accel0", None, {}, lambda: "v2-8", True),  # Colab's v2-8
    ("dev/accel0", None, {}, lambda: "", False),  # an unknown generation with /dev/accel: left alone
], ids=["v5e-env", "v5p-pci", "v6e-metadata", "vfio", "v4-pci", "kaggle-v3", "v2-v3-pci", "colab-v2", "accel"])
def test_pjrt_only_where_google_documents_tensorflows_pjrt_runtime(tmp_path, device, shows, env, metadata, pjrt):
    """Every generation from v2 to v6e: the PJRT plugin (Google's TF images and release tests, issue 50); a
    TPU whose generation cannot be told: TensorFlow's non-PJRT runtime, left as it is, with only the library
    it reads (TPU_LIBRARY_PATH) named."""
    from tpu_llm.cli import pjrt as module

    root = fake_machine(tmp_path, device, pci=shows)
    added = module.variables(env=env, root=root, libtpu=WHEEL, metadata=metadata)
    assert added == (dict(zip(PJRT, ("true", WHEEL, WHEEL))) if pjrt else {"TPU_LIBRARY_PATH": WHEEL})
    decided = module.decide(env=env, root=root, libtpu=WHEEL, metadata=metadata)
    assert decided.runtime.startswith("PJRT" if pjrt else "TF's TPU runtime") and WHEEL in decided.describe()


def test_one_table_of_the_runtime_per_generation():
    """tpu_chips.runtime_variables, which cli/pjrt.decide and cloud/worker_plan both use: PJRT on every
    generation from v2 to v6e (as Google's TF images `tpu-vm-tf-2.18.0-pjrt-v5p-and-below` and its TF release
    harness run v2-8, v3-8 and v4-8); TensorFlow's non-PJRT runtime (only its library named) on a TPU whose
    generation is unknown, and on TPU7x, which runs no TensorFlow."""
    from tpu_llm.platform import tpu_chips

    for prefix, kind, _ in tpu_chips.TYPES:
        assert tpu_chips.runtime_variables(kind, WHEEL) == dict(zip(PJRT, ("true", WHEEL, WHEEL))), prefix
    for kind in set(tpu_chips.PCI_KINDS.values()) - {"TPU7x"}:
        assert tpu_chips.runtime_variables(kind, WHEEL) == dict(zip(PJRT, ("true", WHEEL, WHEEL))), kind
    assert tpu_chips.runtime_variables("TPU7x", WHEEL) == {"TPU_LIBRARY_PATH": WHEEL}
    assert tpu_chips.runtime_variables(None, WHEEL) == {"TPU_LIBRARY_PATH": WHEEL}
    assert tpu_chips.runtime_variables(None, WHEEL, unknown_is_pjrt=True) == dict(zip(PJRT, ("true", WHEEL, WHEEL)))


def test_pjrt_variables_only_on_a_tpu_vm_and_never_over_the_users(tmp_path):
    from tpu_llm.cli import pjrt

    # asked for with tpu=local or TPU_NAME=local, device files not visible (a container): PJRT as before
    bare = fake_machine(tmp_path / "bare")
    assert pjrt.variables("local", env={}, root=bare, libtpu=WHEEL, metadata=no_metadata) == \
        dict(zip(PJRT, ("true", WHEEL, WHEEL)))
    assert pjrt.variables(env={"TPU_NAME": "local"}, root=bare, libtpu=WHEEL)["TPU_LIBRARY_PATH"] == WHEEL
    # nothing elsewhere: no TPU, no libtpu, a pod's worker 0, a TPU reached over the network
    vm = fake_machine(tmp_path / "vm", "dev/vfio/0")
    assert pjrt.variables(env={}, root=bare, libtpu=WHEEL) == {}
    assert pjrt.variables(env={}, root=vm, libtpu="", metadata=lambda: "") == {}
    for env in ({"TPU_NAME": "my-pod", "TPU_LOAD_LIBRARY": "0"}, {"TPU_LOAD_LIBRARY": "0"}, {"TPU_NAME": "my-pod"}):
        assert pjrt.variables(env=env, root=vm, libtpu=WHEEL, metadata=no_metadata) == {}
    assert pjrt.variables("grpc://10.0.0.2:8470", env={}, root=vm, libtpu=WHEEL, metadata=no_metadata) == {}
    # what the user set stays, and names the library for the rest
    env = {"TPU_LIBRARY_PATH": "/mine/libtpu.so", "NEXT_PLUGGABLE_DEVICE_USE_C_API": "false"}
    assert pjrt.variables(env=env, root=vm, libtpu=WHEEL, metadata=lambda: "") == \
        {"TF_PLUGGABLE_DEVICE_LIBRARY_PATH": "/mine/libtpu.so"}
    assert pjrt.set_variables(env=env, root=vm, libtpu=WHEEL, metadata=lambda: "")
    assert env["NEXT_PLUGGABLE_DEVICE_USE_C_API"] == "false"
    assert pjrt.variables(env=env, root=vm, libtpu=WHEEL, metadata=lambda: "") == {}


def test_the_pinned_libtpu_wheel_before_the_images_unless_its_version_is_not_the_one_asked(tmp_path, monkeypatch):
    from tpu_llm.cli import pjrt

    image = fake_machine(tmp_path / "image", "dev/vfio/0", image_libtpu=True)
    monkeypatch.setattr(pjrt, "wheel_check", lambda: (True, "libtpu wheel 0.0.14, as tensorflow-tpu and tpu-llm ask"))
    assert pjrt.variables(env={}, root=image, libtpu=WHEEL, metadata=lambda: "")["TPU_LIBRARY_PATH"] == WHEEL
    monkeypatch.setattr(pjrt, "wheel_check", lambda: (False, "libtpu wheel 0.0.52, but tpu-llm asks ==0.0.14"))
    decided = pjrt.decide(env={}, root=image, libtpu=WHEEL, metadata=lambda: "")
    assert decided.add["TPU_LIBRARY_PATH"] == f"{image}/lib/libtpu.so" and "0.0.52" in decided.describe()
    # no image library: the wheel's all the same, and the line says why it may not load
    vm = fake_machine(tmp_path / "vm", "dev/vfio/0")
    decided = pjrt.decide(env={}, root=vm, libtpu=WHEEL, metadata=lambda: "")
    assert decided.add["TPU_LIBRARY_PATH"] == WHEEL and "tpu-llm asks ==0.0.14" in decided.describe()


@pytest.mark.parametrize("have,ok,says", [("0.0.14", True, "as tensorflow-tpu and tpu-llm ask"),
                                          ("0.0.52", False, "tpu-llm asks ==0.0.14"),
                                          ("0.0.13", False, "tensorflow-tpu asks ~=0.0.14 and tpu-llm asks ==0.0.14")])
def test_the_libtpu_version_check_reads_what_tensorflow_tpu_and_tpu_llm_declare(monkeypatch, have, ok, says):
    import importlib.metadata

    from tpu_llm.cli import pjrt

    declared = {"tensorflow-tpu": ["absl-py>=1.0.0", "libtpu~=0.0.14", "numpy>=1.26.0"],
                "tpu-llm": ["keras<3.16,>=3.10", 'libtpu==0.0.14; extra == "tpu"']}
    monkeypatch.setattr(importlib.metadata, "version", lambda name: {"libtpu": have}[name])
    monkeypatch.setattr(importlib.metadata, "requires", lambda name: declared[name])
    found, said = pjrt.wheel_check()
    assert found is ok and says in said and have in said


def test_the_generation_from_the_metadata_server_of_a_tpu_vm():
    """A real HTTP server standing in for the GCE metadata server: the header it requires is sent, the
    answer read; no server (or a slow one) is an empty answer within the timeout, not a hang."""
    import http.server
    import threading
    import time

    from tpu_llm.cli import pjrt

    class Metadata(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            ok = self.headers.get("Metadata-Flavor") == "Google" and self.path.endswith("/accelerator-type")
            self.send_response(200 if ok else 403)
            self.end_headers()
            self.wfile.write(b"v6e-8\n" if ok else b"")

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Metadata)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/computeMetadata/v1/instance/attributes/accelerator-type"
        assert pjrt.metadata_accelerator_type(url) == "v6e-8"
    finally:
        server.shutdown()
        server.server_close()
    start = time.monotonic()
    assert pjrt.metadata_accelerator_type(url, timeout=0.2) == ""  # the server is gone
    assert time.monotonic() - start < 5


@settings(max_examples=200, deadline=None)
@given(answer=st.text(), exported=st.text())
def test_any_accelerator_type_answer_gives_a_known_generation_or_none(tmp_path_factory, answer, exported):
    """What the metadata server or the environment says is outside input: any text gives a known kind
    or none, never an error (and a runtime decision all the same)."""
    from tpu_llm.cli import pjrt
    from tpu_llm.platform import tpu_chips

    kinds = {kind for _, kind, _ in tpu_chips.TYPES}
    assert tpu_chips.kind_of_type(answer) in kinds | {None}
    root = tmp_path_factory.mktemp("vm")
    (root / "dev").mkdir()
    (root / "dev" / "accel0").touch()
    kind, _ = pjrt.generation(env={"TPU_ACCELERATOR_TYPE": exported}, root=str(root), metadata=lambda: answer)
    assert kind in kinds | {None}
    assert pjrt.decide(env={"TPU_ACCELERATOR_TYPE": exported}, root=str(root), libtpu=WHEEL,
                       metadata=lambda: answer).add


def test_describe_says_which_runtime_and_library_this_process_was_pointed_at(monkeypatch):
    from tpu_llm.cli import pjrt

    monkeypatch.setattr(pjrt, "wheel_libtpu", lambda: WHEEL)
    monkeypatch.setattr(pjrt, "wheel_check", lambda: (True, "libtpu wheel 0.0.14, as tensorflow-tpu asks"))
    assert pjrt.describe(dict(zip(PJRT, ("true", WHEEL, WHEEL)))) == \
        f"TPU runtime: PJRT plugin; libtpu: {WHEEL} (libtpu wheel 0.0.14, as tensorflow-tpu asks)"
    assert pjrt.describe({"TPU_LIBRARY_PATH": "/lib/libtpu.so"}) == \
        "TPU runtime: TensorFlow's own (StreamExecutor); libtpu: /lib/libtpu.so"
    assert "loader's path" in pjrt.describe({})


def test_the_libtpu_wheel_is_found_without_importing_it(tmp_path, monkeypatch):
    from tpu_llm.cli import pjrt

    package = tmp_path / "site" / "libtpu"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise RuntimeError('imported')\n")
    for name in ("sdk.so", "libtpu.so"):  # the wheel ships both: the runtime is libtpu.so
        (package / name).touch()
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert pjrt.wheel_libtpu() == str(package / "libtpu.so") and "libtpu" not in sys.modules


def test_tpu_llm_sets_the_pjrt_variables_before_a_command_runs(tmp_path, monkeypatch):
    import os

    from tpu_llm import cli
    from tpu_llm.cli import pjrt

    environ = {k: v for k, v in os.environ.items() if k not in PJRT + ("TPU_NAME", "TPU_LOAD_LIBRARY")}
    monkeypatch.setattr(os, "environ", environ)  # a copy: this process's own environment stays as it is
    monkeypatch.setattr(pjrt, "wheel_libtpu", lambda: "/site-packages/libtpu/libtpu.so")
    seen = {}
    monkeypatch.setattr(cli.COMMANDS["doctor"], "run", lambda **kw: seen.update({k: os.environ.get(k) for k in PJRT}))
    assert cli.main(["doctor", "--tpu", "local", "--run_dir", str(tmp_path)]) == 0
    assert seen == dict(zip(PJRT, ("true",) + ("/site-packages/libtpu/libtpu.so",) * 2))
