"""The model-parallel line, the least proven path: the same model in P pipeline stages x T tensor groups per
replica (`layout`), its placement (`check_placement`), replicas and mean loss against the data-parallel run's."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from tpu_llm.errors import UserError
from tpu_llm.parallel import distribute
from tpu_llm.tools.doctor.data_parallel import check_replicas, replica_copies
from tpu_llm.tools.doctor.report import Check, status
from tpu_llm.training import build

MODEL_PARALLEL_TOLERANCE = 0.01  # |model-parallel - data-parallel| / data-parallel mean loss, same weights and
# batches: float32 sums in another order (a TPU's float32 matmuls run bfloat16 passes), far below the
# effect of a stage or tensor group that computes or updates the wrong thing
KINDS = {"tpu": "TPU core", "GPU": "GPU", "CPU": "logical CPU"}  # what one replica of the data-parallel run holds


def _devices_of(v) -> list[str]:
    return [c.device for c in replica_copies(v)]


def check_placement(run) -> Check:
    """Each stage's variables (and AdamW moments) on one device per replica, distinct per stage, adding
    up to the planner's parameters for that stage."""
    pipe, replicas = run.trainer.pipeline, run.dist.num_replicas
    moments = [v for v in run.optimizer.variables if v.path.endswith(("_momentum", "_velocity"))]
    moment_params = {}  # device -> AdamW m and v held there
    for m in moments:
        for device in _devices_of(m):
            moment_params[device] = moment_params.get(device, 0) + int(np.prod(m.shape))
    problems, per_device = [], {}
    seen = set()
    for stage in pipe.stages:
        own = [v for v in pipe.stage_variables(stage.index) if id(v) not in seen]  # the tied table: stage 0
        seen.update(id(v) for v in own)
        for r in range(replicas):
            devices = {_devices_of(v)[r] for v in own}
            count = sum(int(np.prod(v.shape)) for v in own)
            if len(devices) != 1:
                problems.append(f"stage {stage.index} of replica {r} spans {', '.join(sorted(devices))}")
                continue
            device = devices.pop()
            per_device[device] = per_device.get(device, 0) + count
            if count != stage.params:
                problems.append(f"stage {stage.index}: {count:,} parameters, the planner counts {stage.params:,}")
    for device, count in per_device.items():  # AdamW's moments beside their variables
        if moment_params.get(device, 0) != 2 * count:
            problems.append(f"{device.split('device:')[-1]} holds {count:,} parameters but "
                            f"{moment_params.get(device, 0):,} AdamW moment values (expected {2 * count:,})")
    stages = len(pipe.stages)
    if len(per_device) != stages * replicas:  # two stages of one replica share a device
        problems.append(f"{stages} stages x {replicas} replicas on {len(per_device)} devices")
    memory = {}
    for device in per_device:
        if "CPU" in device:  # logical CPUs share one allocator: its figure says nothing per device
            continue
        try:
            memory[device] = tf.config.experimental.get_memory_info(device)["current"]
        except (ValueError, tf.errors.OpError):  # not reported for this device type
            pass
    short = {d: d.split("device:")[-1] for d in per_device}
    shown = "; ".join(f"{short[d]} {n:,} params" + (f" {memory[d] / 2**20:.1f} MiB" if d in memory else "")
                      for d, n in per_device.items())
    layout = pipe.placement.describe()
    return Check("placement", status(not problems), (problems[0] if problems else f"{layout}: {shown}"),
                 {"layout": layout, "params_per_device": per_device, "bytes_in_use": memory, "problems": problems,
                  "planned_params_per_stage": [s.params for s in pipe.stages]})


def layout(devices: int, stages: int = 0, tensor: int = 0) -> tuple[int, int]:
    """(pipeline stages, tensor groups) per replica of the model-parallel run on `devices` devices (TPU
    cores, GPUs or logical CPUs): what was asked, else

      4, 8, 16, ... (4 divides it)  2 x 2: both kinds of split in every replica (one replica on 4,
                                    two on 8: v5e-4/v4-8 and v5e-8/v6e-8/v3-8 alike), all cores used
      2                             2 x 1: the only split two cores allow (v5litepod-2)
      1, or any other number        1 x 1: nothing to split (v5e-1, v6e-1: Colab and Kaggle); the
                                    model-parallel line is a SKIP

    On 4 cores 2 x 2 (one replica) rather than 2 x 1 (two): the data-parallel run has already checked
    replicas over all 4 cores, so the model-parallel run spends them on what is unproven, stages and
    tensor groups together. A TPU slice's cores come in 1, 2, 4, 8, ...; a number 4 does not divide
    (3 or 6 GPUs) gets no default split, as a layout that leaves devices idle would say little.
    """
    if stages and tensor:
        return stages, tensor
    default = (2, 2) if devices % 4 == 0 else (2, 1) if devices == 2 else (1, 1)
    return stages or default[0], tensor or default[1]


def device_count(dist) -> int:
    """Devices a replica of the model-parallel run may span: the data-parallel run has one replica per TPU
    core, GPU or logical CPU. Multi-worker and parameter-server strategies keep one device per replica."""
    return dist.num_replicas if dist.name in ("tpu", "mirrored", "default") else 1


def _kind(dist) -> str:
    return KINDS["tpu"] if dist.name == "tpu" else KINDS.get(dist.device_kind, "device")


def fit_fix(devices: int, kind: str, stages: int, tensor: int, refused: bool = False) -> str:
    """What to do when P x T per replica does not fit the machine's devices (or, `refused`, its topology)."""
    k = stages * tensor
    where = "this TPU" if kind == KINDS["tpu"] else "this machine"
    if refused:
        return (f"{where} has {devices} {kind}(s), but its topology cannot be cut into blocks of {k} neighbouring "
                f"cores ({stages} x {tensor}; the line above lists the valid sizes): pass --stages/--tensor whose "
                "product is one of them, or leave them at 0 for the layout doctor picks")
    fits = [f"{p} x {t}" for p, t in ((2, 1), (2, 2), (4, 1), (4, 2)) if devices % (p * t) == 0]
    return (f"{where} has {devices} {kind}(s); {stages} x {tensor} = {k} {kind}(s) per replica needs a multiple of "
            f"{k}: pass --stages/--tensor whose product divides {devices}"
            + (f" ({', '.join(fits)})" if fits else " (none: model parallelism needs 2 or more)")
            + ", or leave them at 0 for the layout doctor picks")


def check_model_parallel(make_cfg, found: distribute.Found, dist, stages: int, tensor: int, steps: int,
                         reference_loss: float) -> Check:
    """The same model in `stages` x `tensor` per replica, trained `steps` steps on the same batches as the
    data-parallel run (`make_cfg(stages, tensor)` gives its config): placement, replicas, and the mean
    loss against `reference_loss`, the data-parallel run's."""
    devices, kind = device_count(dist), _kind(dist)
    layout_text = f"{stages} stage(s) x {tensor} tensor group(s)"
    if stages * tensor == 1:
        why = (f"{devices} {kind}(s): nothing to split" if dist.name in ("tpu", "mirrored", "default") else
               f"strategy {dist.name} runs one device per replica")
        return Check("model parallel", "SKIP", f"{why} (pipeline stages and tensor groups need 2+ per replica; "
                     "--stages/--tensor choose them)", {"devices": devices, "stages": stages, "tensor": tensor})
    values = {"devices": devices, "kind": kind, "stages": stages, "tensor": tensor}
    if devices % (stages * tensor):
        return Check("model parallel", "FAIL", f"{layout_text} per replica do not fit {devices} {kind}(s)", values,
                     fix=fit_fix(devices, kind, stages, tensor))
    cfg = make_cfg(stages, tensor)
    try:
        mp_dist = distribute.get_strategy(cfg, found)
    except UserError as e:  # e.g. tpu.device_assignment: the block does not fit this slice's topology
        return Check("model parallel", "FAIL", f"{layout_text}: {e}", values,
                     fix=fit_fix(devices, kind, stages, tensor, refused=True))
    try:
        run = build.build_run(cfg, mp_dist)
        loss = run_model_parallel(run, steps)
        placement, replicas = check_placement(run), check_replicas(run)
    except Exception as e:  # noqa: BLE001 - what broke on this machine is the finding
        first = (str(e).strip().splitlines() or [""])[0][:300]
        return Check("model parallel", "FAIL", f"{layout_text} stopped: {type(e).__name__}: {first}", values)
    rel = abs(loss - reference_loss) / abs(reference_loss) if reference_loss else float("inf")
    values.update(loss=loss, data_parallel_loss=reference_loss, relative=rel, replicas=mp_dist.num_replicas,
                  placement=placement.values, replicas_check=replicas.values)
    problems = [c.numbers for c in (placement, replicas) if c.status == "FAIL"]
    if not (np.isfinite(loss) and rel <= MODEL_PARALLEL_TOLERANCE):
        problems.append(f"mean loss {loss:.4f} vs data-parallel {reference_loss:.4f} ({100 * rel:.2f}% apart, "
                        f"tolerance {100 * MODEL_PARALLEL_TOLERANCE:g}%)")
    if problems:
        return Check("model parallel", "FAIL", f"{layout_text} x {mp_dist.num_replicas} replica(s): {problems[0]}",
                     values)
    return Check("model parallel", "PASS", f"{mp_dist.num_replicas} replica(s) on {devices} {kind}(s), "
                 f"{placement.numbers}; {'replicas bit-identical' if replicas.status == 'PASS' else 'one replica'}; "
                 f"mean loss {loss:.4f} vs data-parallel {reference_loss:.4f} ({100 * rel:.3f}%)", values)


def run_model_parallel(run, steps: int) -> float:
    """The model-parallel run's mean loss over `steps` steps (a seam for tests)."""
    return run.trainer.run(run.train_iterator, steps, run.cfg.train.steps_per_loop)["loss"]
