"""Which TPU generation this machine has, from what it shows without TensorFlow: the accelerator type
that GKE and Kaggle export, and the PCI device ids of its chips; and which TPU runtime TensorFlow is
pointed at on each generation (`runtime_variables`, the one table cli/pjrt.py and cloud/worker_plan.py
use). No TensorFlow here: cli/pjrt.py reads it before TensorFlow is imported (parallel/tpu.py too, after)."""

from __future__ import annotations

import glob
import os
from collections.abc import Mapping

# Google's PCI vendor and TPU device ids, as JAX's hardware detection reads them; the kinds are spelled
# as perf.TPU_PEAK_TFLOPS (and JAX's device_kind) spell them
GOOGLE_VENDOR = "0x1ae0"
PCI_KINDS = {"0x0027": "TPU v2/v3", "0x005e": "TPU v4", "0x0062": "TPU v5p", "0x0063": "TPU v5 lite",
             "0x006f": "TPU v6 lite", "0x0076": "TPU7x"}
# accelerator-type prefix, device kind, and whether the type counts TensorCores (2 per chip) or chips
TYPES = (("v5litepod", "TPU v5 lite", 1), ("v5e", "TPU v5 lite", 1), ("v6e", "TPU v6 lite", 1),
         ("v5p", "TPU v5p", 2), ("v4", "TPU v4", 2), ("v3", "TPU v3", 2), ("v2", "TPU v2", 2))


def pci_tpus(root: str = "/") -> tuple[int, str | None]:
    """(TPU chips on this machine's PCI bus, the first one's kind); `root` holds sys/ (tests)."""
    chips, kind = 0, None
    for vendor in sorted(glob.glob(os.path.join(root, "sys/bus/pci/devices/*/vendor"))):
        try:
            with open(vendor) as v, open(os.path.join(os.path.dirname(vendor), "device")) as d:
                found = PCI_KINDS.get(d.read().strip()) if v.read().strip() == GOOGLE_VENDOR else None
        except OSError:
            continue
        chips, kind = chips + bool(found), kind or found
    return chips, kind


def accelerator_type(env: Mapping[str, str]) -> str:
    """The accelerator type GKE (TPU_ACCELERATOR_TYPE) or Kaggle (ACCELERATOR_TYPE) exports, or ""."""
    return (env.get("TPU_ACCELERATOR_TYPE") or env.get("ACCELERATOR_TYPE") or "").strip()


def kind_of_type(accelerator: str) -> str | None:
    """The device kind of an accelerator type (`v5litepod-8` -> "TPU v5 lite"), None if unknown."""
    accelerator = accelerator.lower()
    return next((kind for prefix, kind, _ in TYPES if accelerator.startswith(prefix)), None)


# ---- the TPU runtime per generation --------------------------------------------------------------------
C_API = "NEXT_PLUGGABLE_DEVICE_USE_C_API"
PLUGIN = "TF_PLUGGABLE_DEVICE_LIBRARY_PATH"
LIBRARY = "TPU_LIBRARY_PATH"
# TensorFlow's TPU runtime is PJRT on every generation TensorFlow supports: from TF 2.17/2.18 Google's TF
# runtime images carry PJRT for all of them (`tpu-vm-tf-2.18.0-pjrt-v5p-and-below` for v2 through v5p,
# `...-pjrt-v5e-and-v6` for v5e and v6e), and Google's TF release harness (GoogleCloudPlatform/
# ml-auto-solutions: dags/solutions_team/solutionsteam_tf_release_supported.py runs v2-8, v3-8 and v4-8
# with is_pjrt left at its default True; configs/tensorflow/common.py export_env_variables then sets
# NEXT_PLUGGABLE_DEVICE_USE_C_API=true and TF_PLUGGABLE_DEVICE_LIBRARY_PATH=.../libtpu/libtpu.so on a single
# host) runs them on PJRT too. TPU7x runs no TensorFlow at all and gets nothing.
PJRT_KINDS = ("TPU v2", "TPU v3", "TPU v2/v3", "TPU v4", "TPU v5 lite", "TPU v5p", "TPU v6 lite")


def runtime_variables(kind: str | None, library: str, *, unknown_is_pjrt: bool = False) -> dict[str, str]:
    """The variables that point TensorFlow 2.20 at `library` (a libtpu.so) on a TPU of device `kind`:
    the PJRT plugin (NEXT_PLUGGABLE_DEVICE_USE_C_API=true, TF_PLUGGABLE_DEVICE_LIBRARY_PATH, and
    TPU_LIBRARY_PATH for TensorFlow's own import-time load) on every generation TensorFlow runs on, v2
    through v6e (PJRT_KINDS: Google's images and TF release tests). A TPU whose generation cannot be told
    (None) gets only TPU_LIBRARY_PATH, the library TensorFlow's non-PJRT runtime loads, left as it is, or
    the PJRT variables with `unknown_is_pjrt`."""
    if kind in PJRT_KINDS or (kind is None and unknown_is_pjrt):
        return {C_API: "true", PLUGIN: library, LIBRARY: library}
    return {LIBRARY: library}
