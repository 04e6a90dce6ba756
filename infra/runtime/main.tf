# The runtime image rule, without providers so that tests/test_infra.py can run it with recorded
# `versions` lists (terraform apply on this module alone, offline). docs/cloud-tpu.md says why.
#
# Every slice runs on a base image, and its TensorFlow is the lock's (worker-requirements.txt:
# tensorflow-tpu 2.20.0 and the libtpu it declares), installed on every worker by startup.sh.tftpl:
# - one host: the family's base image of Google's "TPU software versions" page (v2-alpha-tpuv6e,
#   v2-alpha-tpuv5, v2-alpha-tpuv5-lite, tpu-ubuntu2204-base); training runs in one process (PJRT,
#   the venv's pinned libtpu).
# - a pod: the base image Google's TF release tests run that family's pods on
#   (GoogleCloudPlatform/ml-auto-solutions, dags/solutions_team: v4-32 and v5p-32 on v2-alpha-tpuv5,
#   v5e-16 on v2-alpha-tpuv5-lite; v6e, which those tests do not cover, on its own base image). Its TF
#   servers are the TPU runtime's TF worker container of the lock's TensorFlow (tf_worker_image), which
#   the set-up points the runtime service at on every host, as those tests do. No TensorFlow image
#   (tpu-vm-tf-*) is needed, so the plan never waits for one that is not published.

variable "versions" {
  description = "Runtime versions the zone offers (google_tpu_v2_runtime_versions.versions); empty when not read."
  type        = list(string)
}

variable "tensorflow_version" {
  description = "TensorFlow of the lock (tensorflow-tpu==X.Y.Z in worker-requirements.txt)."
  type        = string
}

variable "accelerator_family" {
  description = "v2, v3, v4, v5litepod, v5p or v6e."
  type        = string
}

variable "multi_host" {
  description = "Whether the slice has more than one host."
  type        = bool
}

variable "override" {
  description = "runtime_version from terraform.tfvars; empty: automatic."
  type        = string
  default     = ""
}

locals {
  base_images = { v6e = "v2-alpha-tpuv6e", v5p = "v2-alpha-tpuv5", v5litepod = "v2-alpha-tpuv5-lite" }
  # v2, v3, v4: tpu-ubuntu2204-base on one host (the software versions page); a pod on v2-alpha-tpuv5, the
  # image Google's TF release tests run v2, v3 and v4 hosts and v4-32 pods on
  base_image = lookup(local.base_images, var.accelerator_family, var.multi_host ? "v2-alpha-tpuv5" : "tpu-ubuntu2204-base")

  # The TPU runtime's TF worker container, by the tag scheme of those tests' set_up_pjrt (tf-X.Y.Z-pjrt)
  tf_worker_repository = "gcr.io/cloud-tpu-v2-images/grpc_tpu_worker"
  tf_worker_image      = var.multi_host ? "${local.tf_worker_repository}:tf-${var.tensorflow_version}-pjrt" : ""

  # Google's TF release tests cover v2 to v5p; TensorFlow on v6e is unproven (public reports of 2.18/2.19)
  untested = var.accelerator_family == "v6e" ? "; v6e is outside Google's TF release tests, so TensorFlow on it is unproven" : ""

  chosen = var.override != "" ? var.override : local.base_image
  reason = (var.override != "" ? "runtime_version set in infra/terraform.tfvars" : (var.multi_host
    ? "pod slice: the base image Google's TF release tests run ${var.accelerator_family} pods on; tensorflow-tpu ${var.tensorflow_version} from the lock on every worker, whose TPU runtime serves TensorFlow from ${local.tf_worker_image}${local.untested}"
  : "single host: the ${var.accelerator_family} base image; TensorFlow ${var.tensorflow_version} and its pinned libtpu come from the venv (worker-requirements.txt)${local.untested}"))
  problem = (length(var.versions) > 0 && !contains(var.versions, local.chosen)
  ? "runtime image ${local.chosen} is not offered in this zone; offered there: ${join(", ", var.versions)}" : "")
}

output "runtime_version" {
  description = "The image to create the TPU with."
  value       = local.chosen
}

output "reason" {
  description = "Why that image: printed by the plan (runtime_choice) and by `make tpu-up`."
  value       = local.reason
}

output "problem" {
  description = "Empty, or why the image cannot be used, with the fix (the plan stops on it)."
  value       = local.problem
}

output "libtpu_from" {
  description = "venv: the pinned libtpu wheel runs in the training process (single host); container: the TF worker container's, on every host of a pod."
  value       = var.multi_host ? "container" : "venv"
}

output "tf_worker_repository" {
  description = "The TPU runtime's TF worker container repository (its tag is tf-X.Y.Z-pjrt)."
  value       = local.tf_worker_repository
}

output "tf_worker_image" {
  description = "A pod's TF worker container for the lock's TensorFlow; empty for one host."
  value       = local.tf_worker_image
}
