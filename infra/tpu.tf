# The TPU: a google_tpu_v2_vm (default), or a google_tpu_v2_queued_resource that waits for capacity
# (use_queued_resource = true). Both exist only in the google-beta provider. Workers have no
# external IP; they reach the internet through Cloud NAT and Google APIs through Private Google
# Access. Every worker runs startup.sh.tftpl, which installs tpu-llm's dependencies and TPU extra.

locals {
  # tpu-llm's dependencies on a worker: pyproject.toml's `dependencies`, its `tpu` extra and its
  # build requirement, in the same words (tests/test_infra.py checks they match).
  python_requirements = [
    "keras>=3.10",
    "fire>=0.6",
    "pyyaml>=6",
    "google-cloud-storage>=2.10",
    "sentencepiece>=0.2",
    "tensorflow-tpu==2.20.0",
    "libtpu==0.0.14",
    "google-api-python-client>=2",
    "oauth2client>=4.1",
    "setuptools>=77",
  ]

  startup_script = templatefile("${path.module}/startup.sh.tftpl", {
    state_dir      = "/opt/tpu-llm"
    venv           = "/opt/tpu-llm/venv"
    requirements   = join(" ", [for r in local.python_requirements : "'${r}'"])
    tensorflow_tpu = "tensorflow-tpu==${local.tensorflow_version}"
    tpu_name       = local.tpu_name
    multi_host     = local.multi_host ? "true" : "false"
    bucket_url     = "gs://${local.bucket_name}"
  })

  tpu_description = "tpu-llm training slice (${var.accelerator_type}, ${local.runtime_version})"
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
    precondition {
      condition     = !(var.spot && var.reserved)
      error_message = "spot and reserved exclude each other; set one of them to false."
    }
  }

  # The startup script needs NAT (pip) and the bucket roles from its first minute.
  depends_on = [
    google_compute_router_nat.nat,
    google_project_iam_member.tpu,
    google_storage_bucket_iam_member.workers,
  ]
}

resource "google_tpu_v2_queued_resource" "tpu" {
  provider = google-beta
  count    = var.tpu_enabled && var.use_queued_resource ? 1 : 0

  name    = "${local.tpu_name}-queued"
  project = var.project_id
  zone    = var.zone

  tpu {
    node_spec {
      parent  = "projects/${var.project_id}/locations/${var.zone}"
      node_id = local.tpu_name

      node {
        runtime_version  = local.runtime_version
        accelerator_type = var.accelerator_type
        description      = local.tpu_description

        network_config {
          network             = google_compute_network.vpc.id
          subnetwork          = google_compute_subnetwork.tpu.id
          enable_external_ips = false
          can_ip_forward      = false
        }
      }
    }
  }

  lifecycle {
    precondition {
      condition     = !var.spot && !var.reserved
      error_message = "use_queued_resource = true requests on-demand capacity: set spot = false and reserved = false (the queued resource of the pinned provider range has no spot or reservation option)."
    }
  }

  depends_on = [
    google_compute_router_nat.nat,
    google_storage_bucket_iam_member.workers,
  ]
}
