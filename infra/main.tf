# Names and values derived once from the variables; every other file reads them from here.

locals {
  region = var.region != "" ? var.region : join("-", slice(split("-", var.zone), 0, 2))

  # The TPU family and size, from accelerator_type ("v4-32" -> "v4", 32). v5e/v6e count chips and
  # v2/v3/v4/v5p count TensorCores; either way a host carries 8 of them, so a slice of more than 8
  # is multi-host and needs the "-pod" runtime image.
  accelerator_family = split("-", var.accelerator_type)[0]
  accelerator_size   = tonumber(split("-", var.accelerator_type)[1])
  worker_count       = max(1, ceil(local.accelerator_size / 8))
  multi_host         = local.worker_count > 1

  # TensorFlow 2.20 everywhere (tensorflow-tpu stops at 2.20.0; pyproject.toml pins the same).
  tensorflow_version = "2.20.0"
  runtime_suffix     = contains(["v5litepod", "v6e"], local.accelerator_family) ? "-v5e-and-v6" : ""
  runtime_version = (
    var.runtime_version != ""
    ? var.runtime_version
    : "tpu-vm-tf-${local.tensorflow_version}${local.multi_host ? "-pod" : ""}-pjrt${local.runtime_suffix}"
  )

  tpu_name        = "${var.name_prefix}-tpu"
  bucket_name     = var.bucket_name != "" ? var.bucket_name : "${var.project_id}-${var.name_prefix}"
  bucket_location = upper(var.bucket_location != "" ? var.bucket_location : local.region)

  labels = merge(var.labels, { managed-by = "terraform", app = "tpu-llm" })
}
