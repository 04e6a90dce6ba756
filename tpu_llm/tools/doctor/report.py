"""What every doctor check returns (`Check`: one PASS / FAIL / SKIP line, its numbers for doctor.json) and
what to do when it failed (`FIX`, by check name, printed under a FAIL line unless the check says more)."""

from __future__ import annotations

import dataclasses

FIX = {
    "devices": "run `tpu-llm info`; on a TPU VM install tpu-llm[tpu] (tensorflow-tpu + libtpu) and set tpu=local; "
               "on a pod run on worker 0 with TPU_NAME set; see docs for the strategy options",
    "model parallel": "model parallelism failed on this machine; the data-parallel lines above hold without it: "
                      "train with parallel.pipeline_stages=1 parallel.tensor=1 here, run `tpu-llm doctor --stages 2 "
                      "--tensor 1` to tell pipeline stages from tensor groups, and report it with doctor.json",
    "replicas": "replicas diverged: the all-reduce or the variable sync is broken on this runtime; report it "
                "with doctor.json and do not train data-parallel here",
    "bfloat16": "bfloat16 loss is off: train with precision=float32 and report it with doctor.json",
    "checkpoint": "the run directory cannot hold checkpoints: check its permissions or bucket (gs:// on a TPU, "
                  "with the TPU's service account allowed to write), or choose another --run_dir",
    "input": "the input pipeline is slower than the step: pre-tokenize with `tpu-llm data prepare` and read "
             "TFRecords, use more files, or a larger model/batch per step",
    "run": "the tiny data-parallel run itself failed: read the error above and doctor.json; run `tpu-llm info` "
           "and a `tpu-llm train --config configs/tiny.yaml` to see the full traceback",
    "plan": "the step time is far from the planner's: check the devices line (a step on the host CPU?) and "
            "compare `tpu-llm plan --accelerator ...` with this machine's type",
    "profile": "TensorFlow's profiler cannot trace here: train without train.profile_steps, and report it with "
               "doctor.json",
    "hlo default": "the TPU's compiler put the pipeline stages' or tensor groups' matmuls on too few cores (the "
                   "numbers above): train with parallel.pipeline_stages=1 parallel.tensor=1 here and report it with "
                   "doctor.json and the HLO dump it names (issue 38)",
    "hlo mlir": "with the MLIR bridge the stages' or groups' matmuls land on too few cores, or the step does not "
                "compile: do not set TF_XLA_FLAGS=--tf_mlir_enable_mlir_bridge=true for model-parallel runs here; "
                "report it with doctor.json and the HLO dump it names",
    "shard state": "train with parallel.shard_optimizer=none here (each replica keeps the whole moments) and report "
                   "it with doctor.json",
    "shard grads": "train with parallel.shard_optimizer=state here (each replica keeps the whole gradients; the "
                   "moments stay divided if the shard state line passes) and report it with doctor.json",
    "memory": "train with train.loss_chunk=0 model.attention=dense if the results differ, and plan with a margin if "
              "the memory differs from the planner's; report it with doctor.json",
}


@dataclasses.dataclass
class Check:
    name: str
    status: str  # PASS, FAIL, WARN (worth knowing, not a failure) or SKIP
    numbers: str  # what was measured, one line
    values: dict = dataclasses.field(default_factory=dict)  # the same as numbers, for doctor.json
    fix: str = ""  # what to do when it failed, if more precise than FIX[name]

    def line(self) -> str:
        return f"{self.status:<5} {self.name:<14} {self.numbers}"


def status(ok: bool) -> str:
    return "PASS" if ok else "FAIL"
