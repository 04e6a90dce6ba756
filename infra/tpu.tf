# The TPU. Terraform validates the zone, accelerator type and runtime image against the TPU API
# at plan time, and makes a google_tpu_v2_vm. With use_queued_resource = true, `make tpu-up`
# (tpu_llm/cloud/driver.py) creates a queued resource with gcloud instead, on the network, service account
# and start-up script made here: the provider's google_tpu_v2_queued_resource node spec takes no
# service account, metadata or spot flag (its schema: tpu.node_spec.node.{accelerator_type,
# description, network_config, runtime_version} only), and its delete has no `force`, so an
# ACTIVE queued resource could not be deleted by `terraform destroy`. gcloud's GA command takes
# --service-account, --spot, --internal-ips and --metadata-from-file, and `queued-resources delete
# --force` deletes its nodes first (Cloud TPU API, queuedResources.delete: without force an ACTIVE
# queued resource is not deleted).
#
# Workers have no external IP; they reach the internet through Cloud NAT and Google APIs through
# Private Google Access. Every worker runs startup.sh.tftpl at boot, which installs exactly the
# versions of worker-requirements.txt, and on a pod points the TPU runtime at the TF worker container.

locals {
  startup_script = templatefile("${path.module}/startup.sh.tftpl", {
    state_dir            = "/opt/tpu-llm"
    venv                 = "/opt/tpu-llm/venv"
    requirements         = local.worker_requirements
    lock_sha256          = sha256(local.worker_requirements)
    tpu_name             = local.tpu_name
    multi_host           = local.multi_host ? "true" : "false"
    bucket_url           = "gs://${local.bucket_name}"
    tf_worker_repository = module.runtime.tf_worker_repository
  })

  tpu_description = "tpu-llm training slice (${var.accelerator_type}, ${local.runtime_version})"
}

# Plan-time checks against the TPU API (data sources read before anything is created; a zone that
# does not exist fails here with the API's "Location ... is not found or access is unauthorized").
# Both list what the zone offers to this project (sources: google-beta
# services/tpuv2/data_source_tpu_v2_{accelerator_types,runtime_versions}.go: `types`, `versions`).
data "google_tpu_v2_accelerator_types" "available" {
  provider = google-beta
  count    = var.tpu_enabled ? 1 : 0
  project  = var.project_id
  zone     = var.zone

  # Read at plan time once the TPU API is on (`make tpu-up` enables the APIs first).
  depends_on = [google_project_service.apis]

  lifecycle {
    postcondition {
      condition     = contains(self.types, var.accelerator_type)
      error_message = "accelerator_type ${var.accelerator_type} is not offered in zone ${var.zone}; offered there: ${join(", ", self.types)}. Set accelerator_type (or zone) in infra/terraform.tfvars."
    }
  }
}

data "google_tpu_v2_runtime_versions" "available" {
  provider = google-beta
  count    = var.tpu_enabled ? 1 : 0
  project  = var.project_id
  zone     = var.zone

  depends_on = [google_project_service.apis]

  lifecycle {
    # The image checks live in ./runtime (a postcondition here that read the choice would be a cycle).
  }
}

module "runtime" {
  source             = "./runtime"
  versions           = try(data.google_tpu_v2_runtime_versions.available[0].versions, [])
  tensorflow_version = local.tensorflow_version
  accelerator_family = local.accelerator_family
  multi_host         = local.multi_host
  override           = var.runtime_version
}

# The image the TPU was created with, pinned in the state while the TPU exists: runtime_version is
# ForceNew, so a new choice of ./runtime (another image list in the zone, a new rule in a later version
# of this configuration) would otherwise replace a running TPU on the next apply. A deliberate change
# (runtime_version set in terraform.tfvars, another accelerator type or zone) replaces the pin, and with
# it the TPU: `make tpu-up` refuses a plan that replaces a running TPU unless REPLACE=1. `make tpu-down`
# deletes the pin with the TPU, so the next TPU takes the current choice.
resource "terraform_data" "runtime_pin" {
  count            = var.tpu_enabled ? 1 : 0
  input            = module.runtime.runtime_version
  triggers_replace = [var.runtime_version, var.accelerator_type, var.zone]

  lifecycle {
    ignore_changes = [input]
  }
}

resource "google_tpu_v2_vm" "tpu" {
  provider = google-beta
  count    = var.tpu_enabled && !var.use_queued_resource ? 1 : 0

  name             = local.tpu_name
  project          = var.project_id
  zone             = var.zone
  description      = local.tpu_description
  accelerator_type = var.accelerator_type
  runtime_version  = local.runtime_version
  labels           = local.labels
  tags             = [local.tpu_name]

  network_config {
    network             = google_compute_network.vpc.id
    subnetwork          = google_compute_subnetwork.tpu.id
    enable_external_ips = false
    can_ip_forward      = false
  }

  service_account {
    email = google_service_account.tpu.email
    scope = ["https://www.googleapis.com/auth/cloud-platform"]
  }

  scheduling_config {
    spot     = var.spot
    reserved = var.reserved
  }

  metadata = {
    startup-script = local.startup_script
  }

  lifecycle {
    # `gcloud compute tpus tpu-vm ssh/scp` adds the user's key to the node's ssh-keys metadata
    # (googlecloudsdk command_lib/compute/tpus/tpu_vm/ssh_utils.AddSSHKeyIfNeeded, called whether
    # or not the node has enable-oslogin, unless the key is in project metadata), and metadata is
    # an in-place update here. Without this, every `make tpu-up` stripped the keys and the next
    # ssh re-added them. OS Login alone would not stop gcloud from writing the key.
    ignore_changes = [metadata["ssh-keys"]]

    precondition {
      condition     = module.runtime.problem == ""
      error_message = "runtime image: ${module.runtime.problem}."
    }
    precondition {
      condition     = !(var.spot && var.reserved)
      error_message = "spot and reserved exclude each other; set one of them to false."
    }
  }

  # The start-up script needs NAT (pip) and the bucket roles from its first minute, and the new
  # service account must be usable (time_sleep.service_account in iam.tf). The checks come first
  # even when their reading is deferred to the apply (a first apply without `make tpu-up`).
  depends_on = [
    data.google_tpu_v2_accelerator_types.available,
    data.google_tpu_v2_runtime_versions.available,
    google_compute_router_nat.nat,
    google_project_iam_member.tpu,
    google_storage_bucket_iam_member.workers,
    time_sleep.service_account,
  ]
}
