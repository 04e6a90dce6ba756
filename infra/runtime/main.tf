# The runtime image rule, without providers so that tests/test_infra.py can run it with recorded
# `versions` lists (terraform apply on this module alone, offline). docs/cloud-tpu.md says why:
#
# - one host: Google's base image of the family ("TPU software versions": v2-alpha-tpuv6e,
#   v2-alpha-tpuv5, v2-alpha-tpuv5-lite, tpu-ubuntu2204-base). TensorFlow and libtpu come from the
#   venv (worker-requirements.txt: tensorflow-tpu with the libtpu it declares), so no image has to
#   carry TensorFlow 2.20, and the libtpu that runs is the pinned one (the set-up checks it).
# - a pod: the TF servers on every host come from a tpu-vm-tf-X.Y.Z-pod-pjrt[-SUFFIX] image, so X.Y.Z
#   must be the lock's TensorFlow. Suffixes that name this family (…-v5e-and-v6 for v5e and v6e) or
#   none are taken; a suffix naming only other families is not.

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
  base_image  = lookup(local.base_images, var.accelerator_family, "tpu-ubuntu2204-base")
  family_tags = { v5litepod = "v5e", v6e = "v6", v5p = "v5p", v4 = "v4", v3 = "v3", v2 = "v2" }
  family_tag  = lookup(local.family_tags, var.accelerator_family, var.accelerator_family)

  pod_prefix = "tpu-vm-tf-${var.tensorflow_version}-pod-pjrt"
  # the lock's TensorFlow as a pod image, with no suffix or one naming this family
  pod_images = sort([for v in var.versions : v if(
    v == local.pod_prefix || (substr(v, 0, min(length(v), length(local.pod_prefix) + 1)) == "${local.pod_prefix}-"
    && length(regexall(local.family_tag, substr(v, length(local.pod_prefix), -1))) > 0)
  )])
  # a family-specific image first (its suffix was made for this hardware), else the plain one
  pod_choice = length(local.pod_images) == 0 ? "" : (
    length([for v in local.pod_images : v if v != local.pod_prefix]) > 0
    ? [for v in local.pod_images : v if v != local.pod_prefix][0] : local.pod_prefix
  )
  tf_pod_images = [for v in var.versions : v if length(regexall("^tpu-vm-tf-[0-9.]+-pod", v)) > 0]

  chosen = var.override != "" ? var.override : (var.multi_host ? local.pod_choice : local.base_image)
  reason = (var.override != "" ? "runtime_version set in infra/terraform.tfvars" : (var.multi_host
    ? "pod slice: the image's TF servers run TensorFlow ${var.tensorflow_version}, the lock's tensorflow-tpu"
  : "single host: the ${var.accelerator_family} base image; TensorFlow ${var.tensorflow_version} and its pinned libtpu come from the venv (worker-requirements.txt)"))
  problem = (local.chosen == "" ? "no TensorFlow ${var.tensorflow_version} pod image (${local.pod_prefix}[-SUFFIX]) for ${var.accelerator_family} in this zone; its TensorFlow pod images: ${length(local.tf_pod_images) > 0 ? join(", ", local.tf_pod_images) : "none"}. Pin tensorflow-tpu to one of those versions in pyproject.toml and run `.venv/bin/python -m tpu_llm.cloud lock`, or set runtime_version, or use another zone" : (
    length(var.versions) > 0 && !contains(var.versions, local.chosen)
    ? "runtime image ${local.chosen} is not offered in this zone; offered there: ${join(", ", var.versions)}" : ""
  ))
}

output "runtime_version" {
  description = "The image to create the TPU with (empty when none fits: see problem)."
  value       = local.chosen
}

output "reason" {
  description = "Why that image: printed by the plan (runtime_choice) and by `make tpu-up`."
  value       = local.reason
}

output "problem" {
  description = "Empty, or why no image fits, with the fix (the plan stops on it)."
  value       = local.problem
}

output "libtpu_from" {
  description = "venv: the pinned libtpu wheel runs (single host); image: the pod image's TF servers load its own."
  value       = var.multi_host ? "image" : "venv"
}
