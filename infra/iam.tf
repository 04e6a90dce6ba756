# The workers' identity: a dedicated service account with object access to the one bucket, log and
# metric writing, and read access to TPU metadata (a pod's TPUClusterResolver looks the TPU up by
# name through the TPU API). No primitive role (owner/editor/viewer) anywhere.

resource "google_service_account" "tpu" {
  account_id   = "${var.name_prefix}-tpu"
  project      = var.project_id
  display_name = "tpu-llm TPU workers"
  description  = "Runs tpu-llm training on the TPU workers; reads and writes only ${local.bucket_name}."

  depends_on = [google_project_service.apis]
}

locals {
  project_roles = [
    "roles/logging.logWriter",
    "roles/monitoring.metricWriter",
    "roles/tpu.viewer",
  ]
  bucket_roles = [
    "roles/storage.objectAdmin",        # read data, write checkpoints and logs, rotate old checkpoints
    "roles/storage.legacyBucketReader", # bucket metadata: the pre-flight "bucket exists" check
  ]

  # A queued resource's node spec has no service account: its workers run as the Compute Engine
  # default service account, which then gets the same bucket roles (and nothing project-wide).
  # Keys are static (known at plan time); the members may only be known after apply.
  worker_members = {
    for key, member in {
      tpu             = "serviceAccount:${google_service_account.tpu.email}"
      compute-default = var.use_queued_resource ? "serviceAccount:${one(data.google_compute_default_service_account.default[*].email)}" : ""
    } : key => member if key == "tpu" || var.use_queued_resource
  }
}

data "google_compute_default_service_account" "default" {
  count   = var.use_queued_resource ? 1 : 0
  project = var.project_id

  depends_on = [google_project_service.apis]
}

resource "google_project_iam_member" "tpu" {
  for_each = toset(local.project_roles)

  project = var.project_id
  role    = each.value
  member  = "serviceAccount:${google_service_account.tpu.email}"
}

resource "google_storage_bucket_iam_member" "workers" {
  for_each = {
    for pair in setproduct(keys(local.worker_members), local.bucket_roles) :
    "${pair[0]} ${pair[1]}" => { member = local.worker_members[pair[0]], role = pair[1] }
  }

  bucket = google_storage_bucket.data.name
  role   = each.value.role
  member = each.value.member
}
