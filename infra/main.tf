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

  # What the workers install: worker-requirements.txt, generated from pyproject.toml (its
  # dependencies and `tpu` extra) by `python -m tpu_llm.cloud lock`, exact versions with hashes. Its
  # tensorflow-tpu pin is the TensorFlow of the runtime image below too: on a pod the image's
  # TensorFlow servers and the client on worker 0 must be the same version.
  worker_requirements = file("${path.module}/worker-requirements.txt")
  tensorflow_version  = regex("(?m)^tensorflow-tpu==([0-9][0-9.]*)", local.worker_requirements)[0]

  # Runtime image: Cloud TPU's TensorFlow naming, tpu-vm-tf-x.y.z[-pod][-pjrt] ("TPU software
  # versions", cloud.google.com/tpu/docs/runtimes: v5e, v5p and v6e take TF >= 2.15 as
  # tpu-vm-tf-x.y.z[-pod]-pjrt; v4 with TF >= 2.10.1 and v2/v3 take the same names, -pjrt or -se).
  # No tpu-vm-tf-2.20.0* name is published in that table (it stops before 2.20), so the plan checks
  # the name against google_tpu_v2_runtime_versions for the zone (tpu.tf) and says what exists.
  runtime_version = (
    var.runtime_version != ""
    ? var.runtime_version
    : "tpu-vm-tf-${local.tensorflow_version}${local.multi_host ? "-pod" : ""}-pjrt"
  )
  # The TensorFlow version a tpu-vm-tf-* image carries ("" for other images).
  runtime_tensorflow = try(regex("^tpu-vm-tf-([0-9]+\\.[0-9]+\\.[0-9]+)", local.runtime_version)[0], "")

  tpu_name        = "${var.name_prefix}-tpu"
  queued_name     = "${local.tpu_name}-queued"
  bucket_name     = var.bucket_name != "" ? var.bucket_name : "${var.project_id}-${var.name_prefix}"
  bucket_location = upper(var.bucket_location != "" ? var.bucket_location : local.region)

  labels = merge(var.labels, { managed-by = "terraform", app = "tpu-llm" })
}
