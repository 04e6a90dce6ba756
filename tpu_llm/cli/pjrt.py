"""Pointing TensorFlow at the TPU runtime and its libtpu before it is imported, on a TPU VM, as Google
documents it.

TensorFlow 2.20 reaches a TPU VM's chips through one of two runtimes. The PJRT plugin, which it loads at
import when NEXT_PLUGGABLE_DEVICE_USE_C_API=true and TF_PLUGGABLE_DEVICE_LIBRARY_PATH names libtpu, is
TensorFlow's TPU runtime on every generation in Google's TF images and release tests, v2 through v6e
(Colab's v2-8 and Kaggle's v3-8 included). Only a TPU VM whose generation cannot be told keeps
TensorFlow's non-PJRT runtime as it is: no PJRT variables, only TPU_LIBRARY_PATH, the variable that
runtime reads for its libtpu (else it asks the loader for `libtpu.so`); the table is
tpu_chips.runtime_variables, which `make train` uses too (cloud/worker_plan.py). `tpu-llm`
sets them at start-up (tpu_llm/cli/__init__.py `main`), before any command imports TensorFlow, when all of:

* this is a TPU VM: /dev/accel* (v2-v4, v5p chips) or /dev/vfio/<N> (v5e, v6e chips) exists, or the
  TPU was asked for as `local` (tpu=local, or TPU_NAME=local as TensorFlow's resolver reads it);
* the TPU is not one reached over the network (tpu=<name> or grpc://..., TPU_NAME=<name>): there the
  TF servers on the TPU's hosts hold the chips and run the ops, and this process must not load libtpu;
* TPU_LOAD_LIBRARY is not 0 (a pod's worker 0, where the pod's TF server already holds the chips);
* a libtpu is there (`library`): the one the user named (TPU_LIBRARY_PATH or
  TF_PLUGGABLE_DEVICE_LIBRARY_PATH); else the `libtpu` wheel's (found with importlib.util.find_spec,
  which does not import it) when its version is one the installed tensorflow-tpu declares
  (`libtpu~=0.0.14` for 2.20: newer ones abort `import tensorflow`); else the runtime image's
  /lib/libtpu.so (Cloud TPU VM images); else the wheel's anyway, said so.

The generation (`generation`) comes from the accelerator type GKE and Kaggle export, else the PCI ids of
the chips, else the GCE metadata server's `accelerator-type` attribute (a TPU VM's own, asked with a
short timeout only where device files show a TPU VM), else the device files: /dev/vfio only on v5e/v6e.

A variable the user already set is never changed. No TensorFlow here: this runs before it is imported.
`describe()` says, after start-up, which runtime and library this process was pointed at (doctor).
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.metadata
import importlib.util
import os
import urllib.request
from collections.abc import Callable, Mapping, MutableMapping

from tpu_llm.platform.tpu_chips import (C_API, LIBRARY, PLUGIN, accelerator_type, kind_of_type, pci_tpus,
                                        runtime_variables)

IMAGE_LIBTPU = "lib/libtpu.so"  # under root: what Cloud TPU VM images ship
METADATA = "http://metadata.google.internal/computeMetadata/v1/instance/attributes/accelerator-type"
METADATA_TIMEOUT = 0.5  # seconds: the metadata server answers at once on a TPU VM


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


def _libtpu_requirements() -> list:
    """What the installed tensorflow-tpu (`libtpu~=0.0.14`) and tpu-llm's own `tpu` extra (the version
    verified: `libtpu==0.0.14`) ask of libtpu, as packaging Requirements; [] without packaging."""
    try:
        from packaging.requirements import InvalidRequirement, Requirement  # tensorflow's own dependency
    except ImportError:
        return []
    found = []
    for dist in ("tensorflow-tpu", "tpu-llm"):
        try:
            lines = importlib.metadata.requires(dist) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for line in lines:
            try:
                requirement = Requirement(line)
            except InvalidRequirement:
                continue
            if requirement.name == "libtpu" and requirement.specifier:
                found.append((dist, requirement))
    return found


def wheel_check() -> tuple[bool, str]:
    """(whether the installed libtpu wheel's version is one tensorflow-tpu and tpu-llm ask for, in
    words). True when the wheel is not installed as a distribution or nothing asks a version."""
    try:
        have = importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        return True, "the libtpu wheel"
    asked = _libtpu_requirements()
    wrong = [f"{dist} asks {r.specifier}" for dist, r in asked if not r.specifier.contains(have, prereleases=True)]
    if wrong:
        return False, f"libtpu wheel {have}, but " + " and ".join(wrong)
    return True, f"libtpu wheel {have}" + (f", as {' and '.join(d for d, _ in asked)} ask" if asked else "")


def tpu_vm(root: str = "/") -> bool:
    """TPU chips attached to this machine, seen from their device files without touching them."""
    return bool(glob.glob(os.path.join(root, "dev/accel*")) or glob.glob(os.path.join(root, "dev/vfio/[0-9]*")))


def metadata_accelerator_type(url: str = METADATA, timeout: float = METADATA_TIMEOUT) -> str:
    """The TPU VM's accelerator type from the GCE metadata server, "" when it does not answer."""
    request = urllib.request.Request(url, headers={"Metadata-Flavor": "Google"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 - a fixed http URL
            return response.read().decode("utf-8", "replace").strip()
    except (OSError, ValueError):
        return ""


def generation(*, env: Mapping[str, str] | None = None, root: str = "/",
               metadata: Callable[[], str] = metadata_accelerator_type) -> tuple[str | None, str]:
    """(this TPU VM's device kind as tpu_chips spells it, or None; where that came from)."""
    env = os.environ if env is None else env
    if kind := kind_of_type(accelerator_type(env)):
        return kind, f"accelerator type {accelerator_type(env)}"
    if kind := pci_tpus(root)[1]:
        return kind, "the chips' PCI ids"
    if tpu_vm(root) and (kind := kind_of_type(found := metadata())):
        return kind, f"accelerator type {found} (GCE metadata)"
    if glob.glob(os.path.join(root, "dev/vfio/[0-9]*")):
        return "TPU v5 lite", "/dev/vfio (v5e and v6e chips)"
    return None, "not known"


@dataclasses.dataclass
class Runtime:
    """What `variables` decided: the runtime, the library and why, and the variables to add."""
    runtime: str  # "PJRT" | "TF's TPU runtime" | "" (none for this process)
    kind: str | None
    library: str | None
    why: str
    add: dict

    def describe(self) -> str:
        if not self.runtime:
            return f"TPU runtime: none set by tpu-llm ({self.why})"
        return f"TPU runtime: {self.runtime} for {self.kind or 'an unknown TPU'}; libtpu: {self.library} ({self.why})"


def _library(env: Mapping[str, str], root: str, libtpu: str | None) -> tuple[str | None, str]:
    named = env.get(LIBRARY) or env.get(PLUGIN)
    if named:
        return named, f"named by {LIBRARY if env.get(LIBRARY) else PLUGIN}"
    wheel = wheel_libtpu() if libtpu is None else libtpu
    image = os.path.join(root, IMAGE_LIBTPU)
    ok, said = wheel_check() if wheel else (True, "")
    if wheel and ok:
        return wheel, said
    if os.path.isfile(image):
        return image, "the runtime image's" + (f"; {said}" if wheel else "")
    return (wheel, said) if wheel else (None, "no libtpu found")


def decide(tpu: str = "", *, env: Mapping[str, str] | None = None, root: str = "/", libtpu: str | None = None,
           metadata: Callable[[], str] = metadata_accelerator_type) -> Runtime:
    """The runtime and library for this machine, and the variables to add to `env` (none the user set).

    `tpu`: the run's tpu= setting ('' when not given). `env`, `root` (holding dev/, sys/ and lib/),
    `libtpu` (the wheel's library; found and version-checked when None) and `metadata` are for tests.
    """
    env = os.environ if env is None else env
    elsewhere = not_here(tpu, env=env, root=root)
    if elsewhere:
        return Runtime("", None, None, elsewhere, {})
    kind, seen = generation(env=env, root=root, metadata=metadata)
    path, why = _library(env, root, libtpu)
    if not path:  # nothing to load: tpu-llm's TPU connection error says what to install
        return Runtime("", kind, None, why, {})
    # the generation's runtime (tpu_chips.runtime_variables); an unknown one asked for as tpu=local where no
    # device file shows (a container): PJRT, as before
    wanted = runtime_variables(kind, path, unknown_is_pjrt=not tpu_vm(root))
    runtime = "PJRT" if C_API in wanted else "TF's TPU runtime (the TPU's generation could not be told)"
    return Runtime(runtime, kind, path, f"{why}; generation from {seen}", {k: v for k, v in wanted.items()
                                                                            if not env.get(k)})


def not_here(tpu: str = "", *, env: Mapping[str, str] | None = None, root: str = "/") -> str:
    """Why this process does not run a TPU's programs itself ('' when it does: a TPU VM, or tpu=local)."""
    env = os.environ if env is None else env
    if env.get("TPU_LOAD_LIBRARY", "").strip() == "0":  # a pod's worker 0: its TF server holds the chips
        return "TPU_LOAD_LIBRARY=0"
    if _remote(tpu) or _remote(env.get("TPU_NAME", "").strip()):  # the TPU's own hosts run the ops
        return "a TPU reached over the network"
    if not (tpu_vm(root) or tpu == "local" or env.get("TPU_NAME", "").strip() == "local"):
        return "not a TPU VM"
    return ""


def _remote(tpu: str) -> bool:
    return bool(tpu) and tpu != "local"


def variables(tpu: str = "", *, env: Mapping[str, str] | None = None, root: str = "/", libtpu: str | None = None,
              metadata: Callable[[], str] = metadata_accelerator_type) -> dict[str, str]:
    """The variables to add to `env` for this machine: {} anywhere but a TPU VM, and none the user set."""
    return decide(tpu, env=env, root=root, libtpu=libtpu, metadata=metadata).add


def set_variables(tpu: str = "", *, env: MutableMapping[str, str] | None = None, root: str = "/",
                  libtpu: str | None = None, metadata: Callable[[], str] = metadata_accelerator_type) -> dict[str, str]:
    """Add `variables(...)` to `env` (os.environ); returns what was set. Call before TensorFlow is imported."""
    env = os.environ if env is None else env
    added = variables(tpu, env=env, root=root, libtpu=libtpu, metadata=metadata)
    env.update(added)
    return added


def describe(env: Mapping[str, str] | None = None) -> str:
    """Which runtime and libtpu this process was pointed at (after start-up: the variables as they are
    now, whoever set them), in one line for `tpu-llm doctor`."""
    env = os.environ if env is None else env
    library = env.get(PLUGIN) or env.get(LIBRARY)
    version = ""
    if library and library == wheel_libtpu():
        version = f" ({wheel_check()[1]})"
    if env.get(C_API, "").lower() == "true" and env.get(PLUGIN):
        return f"TPU runtime: PJRT plugin; libtpu: {env[PLUGIN]}{version}"
    if env.get(LIBRARY):
        return f"TPU runtime: TensorFlow's own (StreamExecutor); libtpu: {env[LIBRARY]}{version}"
    return "TPU runtime: TensorFlow's own (StreamExecutor); libtpu: `libtpu.so` from the loader's path"
