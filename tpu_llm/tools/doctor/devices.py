"""The devices line: the strategy and devices found, and how (distribute.look_around, tpu.find_tpu); when it
fails, what to do, from what TensorFlow itself sees."""

from __future__ import annotations

import os

import tensorflow as tf

from tpu_llm.parallel import distribute
from tpu_llm.tools.doctor.report import FIX, Check, status


def check_devices(found: distribute.Found, name: str, reason: str, dist) -> Check:
    logical = tf.config.list_logical_devices()
    kinds = {}
    for d in logical:
        kinds[d.device_type] = kinds.get(d.device_type, 0) + 1
    listed = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
    # what was seen must be what runs: a TPU or GPUs left unused are the classic first-contact failure
    ok = not (found.tpu and name != "tpu") and not (found.gpus and dist.device_kind != "GPU" and name != "tpu")
    return Check("devices", status(ok), f"{name} ({reason}); {dist.num_replicas} replica(s) x "
                 f"{dist.placement.mesh.per_replica} device(s); TF lists {listed}",
                 {"strategy": name, "reason": reason, "replicas": dist.num_replicas, "device_kind": dist.device_kind,
                  "logical_devices": [d.name for d in logical], "tpu_evidence": found.tpu, "gpus": found.gpus},
                 fix="" if ok else devices_fix(found, name))


def _tensorflow_tpus() -> int:
    try:  # physical devices: listing them does not start the TPU runtime
        return len(tf.config.list_physical_devices("TPU"))
    except Exception:  # noqa: BLE001 - a broken plugin lists nothing
        return 0


def devices_fix(found: distribute.Found, name: str = "", remote: bool = False) -> str:
    """What to do when the devices line failed, from what TensorFlow itself sees: the install advice
    only when it sees no TPU where one was found."""
    tpus = _tensorflow_tpus()
    if found.tpu and name and name != "tpu":
        return (f"a TPU is attached ({found.tpu}) but strategy={name} runs without it: use strategy=auto or tpu")
    if found.gpus and name and name != "tpu":
        return (f"TensorFlow lists {found.gpus} GPU(s) but the run used the CPU: use strategy=auto or mirrored, "
                "and check `tpu-llm info`")
    if found.tpu and tpus:
        return (f"TensorFlow sees this TPU ({tpus} TPU device(s)), so its install is right: the error above is the "
                "cause (another process holding the TPU? a TPU accepts one process at a time: stop it, or restart "
                "the notebook's runtime)")
    if found.tpu and remote:
        return ("the TPU named is reached over the network: check its name, zone and this machine's credentials "
                "(`gcloud compute tpus tpu-vm list`); on a pod run on worker 0 with TPU_NAME and TPU_LOAD_LIBRARY=0")
    if found.tpu:
        pjrt = os.environ.get("TF_PLUGGABLE_DEVICE_LIBRARY_PATH")
        return ("TensorFlow lists no TPU device: install the TPU build (pip install 'tpu-llm[tpu]': "
                "tensorflow-tpu 2.20.0 with libtpu 0.0.14, in place of the `tensorflow` wheel) and start tpu-llm "
                "afresh (a notebook: restart its runtime), which points TensorFlow at libtpu before it starts ("
                + (f"TF_PLUGGABLE_DEVICE_LIBRARY_PATH={pjrt} now" if pjrt else "no libtpu was found to point at")
                + "); see docs/colab-kaggle.md")
    return FIX["devices"]
