# Names and values derived once from the variables; every other file reads them from here.

locals {
  region = var.region != "" ? var.region : join("-", slice(split("-", var.zone), 0, 2))

  # The TPU family and size, from accelerator_type ("v4-32" -> "v4", 32). v5e/v6e count chips and
  # v2/v3/v4/v5p count TensorCores; a slice of more than 8 is multi-host (a pod). worker_count
  # is only the plan's estimate (8 per host; v6e's multi-host slices may have 4-chip hosts): the
  # count that is used comes from the TPU API (the node's network endpoints, outputs.tf and driver).
  accelerator_family = split("-", var.accelerator_type)[0]
  accelerator_size   = tonumber(split("-", var.accelerator_type)[1])
  worker_count       = max(1, ceil(local.accelerator_size / 8))
  multi_host         = local.worker_count > 1

  # What the workers install: worker-requirements.txt, generated from pyproject.toml (its
  # dependencies and `tpu` extra) by `python -m tpu_llm.cloud lock`, exact versions with hashes. Its
  # tensorflow-tpu pin names a pod's TF worker container too (./runtime): the TF servers on every host
  # and the client on worker 0 must be the same TensorFlow.
  worker_requirements = file("${path.module}/worker-requirements.txt")
  tensorflow_version  = regex("(?m)^tensorflow-tpu==([0-9][0-9.]*)", local.worker_requirements)[0]

  # Runtime image: chosen by ./runtime (a base image for every slice), and why; docs/cloud-tpu.md. The
  # TPU takes the one pinned in the state when it was created (terraform_data.runtime_pin, tpu.tf).
  runtime_version = try(terraform_data.runtime_pin[0].output, module.runtime.runtime_version)

  tpu_name        = "${var.name_prefix}-tpu"
  queued_name     = "${local.tpu_name}-queued"
  bucket_name     = var.bucket_name != "" ? var.bucket_name : "${var.project_id}-${var.name_prefix}"
  bucket_location = upper(var.bucket_location != "" ? var.bucket_location : local.region)

  labels = merge(var.labels, { managed-by = "terraform", app = "tpu-llm" })
}
