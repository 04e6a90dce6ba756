"""Pointing TensorFlow at the TPU runtime (PJRT) before it is imported, on a TPU VM.

tensorflow-tpu 2.20 finds a TPU VM's chips only through the PJRT plugin, which it loads at import when
NEXT_PLUGGABLE_DEVICE_USE_C_API=true and TF_PLUGGABLE_DEVICE_LIBRARY_PATH names libtpu; TPU_LIBRARY_PATH
makes its own import-time load of libtpu take the same file. The Cloud TPU launcher
(tpu_llm/cloud/worker_plan.py, PJRT_ENV) and the notebook used to be the only places that set them, so
`pip install 'tpu-llm[tpu]'` then `tpu-llm train --tpu=local` found no TPU. `tpu-llm` now sets them
itself at start-up (tpu_llm/cli/__init__.py `main`), before any command imports TensorFlow, when all of:

* this is a TPU VM: /dev/accel* (v2-v4, v5p chips) or /dev/vfio/<N> (v5e, v6e chips) exists, or the
  TPU was asked for as `local` (tpu=local, or TPU_NAME=local as TensorFlow's resolver reads it);
* the TPU is not one reached over the network (tpu=<name> or grpc://..., TPU_NAME=<name>): there the
  TF servers on the TPU's hosts hold the chips and run the ops, and this process must not load libtpu;
* TPU_LOAD_LIBRARY is not 0 (a pod's worker 0, where the pod's TF server already holds the chips);
* a libtpu is there: the one the user named (TPU_LIBRARY_PATH or TF_PLUGGABLE_DEVICE_LIBRARY_PATH),
  else the runtime image's /lib/libtpu.so (Cloud TPU VM images), else the `libtpu` wheel's own
  libtpu/libtpu.so (Colab, Kaggle, a plain pip install), found with importlib.util.find_spec, which
  does not import it.

A variable the user already set is never changed. No TensorFlow here: this runs before it is imported.
"""

from __future__ import annotations

import glob
import importlib.util
import os
from collections.abc import Mapping, MutableMapping

C_API = "NEXT_PLUGGABLE_DEVICE_USE_C_API"
PLUGIN = "TF_PLUGGABLE_DEVICE_LIBRARY_PATH"
LIBRARY = "TPU_LIBRARY_PATH"
IMAGE_LIBTPU = "lib/libtpu.so"  # under root: what Cloud TPU VM images ship


def wheel_libtpu() -> str | None:
    """libtpu.so inside the installed `libtpu` wheel (libtpu/libtpu.so), without importing the package."""
    try:
        spec = importlib.util.find_spec("libtpu")
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(folder, "libtpu.so")  # the wheel also ships sdk.so: name the runtime itself
        if os.path.isfile(path):
            return path
    return None


def tpu_vm(root: str = "/") -> bool:
    """TPU chips attached to this machine, seen from their device files without touching them."""
    return bool(glob.glob(os.path.join(root, "dev/accel*")) or glob.glob(os.path.join(root, "dev/vfio/[0-9]*")))


def _remote(tpu: str) -> bool:
    return bool(tpu) and tpu != "local"


def variables(tpu: str = "", *, env: Mapping[str, str] | None = None, root: str = "/",
              libtpu: str | None = None) -> dict[str, str]:
    """The PJRT variables to add to `env` for this machine: {} anywhere but a TPU VM, and none the user set.

    `tpu`: the run's tpu= setting ('' when not given). `env`, `root` (holding dev/ and lib/) and `libtpu`
    (the wheel's library; found when None) are for tests.
    """
    env = os.environ if env is None else env
    if env.get("TPU_LOAD_LIBRARY", "").strip() == "0":  # a pod's worker 0: its TF server holds the chips
        return {}
    if _remote(tpu) or _remote(env.get("TPU_NAME", "").strip()):  # the TPU's own hosts run the ops
        return {}
    if not (tpu_vm(root) or tpu == "local" or env.get("TPU_NAME", "").strip() == "local"):
        return {}
    path = env.get(LIBRARY) or env.get(PLUGIN)
    if not path and os.path.isfile(os.path.join(root, IMAGE_LIBTPU)):
        path = os.path.join(root, IMAGE_LIBTPU)
    path = path or (wheel_libtpu() if libtpu is None else libtpu)
    if not path:  # nothing to load: tpu-llm's TPU connection error says what to install
        return {}
    wanted = {C_API: "true", PLUGIN: path, LIBRARY: path}
    return {k: v for k, v in wanted.items() if not env.get(k)}


def set_variables(tpu: str = "", *, env: MutableMapping[str, str] | None = None, root: str = "/",
                  libtpu: str | None = None) -> dict[str, str]:
    """Add `variables(...)` to `env` (os.environ); returns what was set. Call before TensorFlow is imported."""
    env = os.environ if env is None else env
    added = variables(tpu, env=env, root=root, libtpu=libtpu)
    env.update(added)
    return added
