# The workers' identity: a dedicated service account with object access to the one bucket, log and
# metric writing, read access to TPU metadata (a pod's TPUClusterResolver looks the TPU up by name
# through the TPU API), and the right to delete a TPU node, which worker 0 uses to delete its own TPU
# when a run started with DOWN_AFTER=1 or TTL_HOURS ends (tpu_llm/cloud/run_owner.py). No primitive
# role (owner/editor/viewer) anywhere. The TPU VM and the
# queued resource (created by `make tpu-up` with gcloud --service-account) both run as it, never as
# the Compute Engine default service account (which lacks tpu.nodes.get where
# iam.automaticIamGrantsForDefaultServiceAccounts is enforced, and holds roles/editor elsewhere).

resource "google_service_account" "tpu" {
  account_id   = "${var.name_prefix}-tpu"
  project      = var.project_id
  display_name = "tpu-llm TPU workers"
  description  = "Runs tpu-llm training on the TPU workers; reads and writes only ${local.bucket_name}."

  depends_on = [google_project_service.apis]
}

locals {
  # tpu.viewer only for a pod: its worker 0 resolves the TPU by name through the TPU API; a single
  # host trains with tpu=local and never asks.
  project_roles = concat(["roles/logging.logWriter", "roles/monitoring.metricWriter"],
  local.multi_host ? ["roles/tpu.viewer"] : [])
  bucket_roles = [
    "roles/storage.objectUser",         # read data, write checkpoints and logs, delete old checkpoints (no IAM on objects)
    "roles/storage.legacyBucketReader", # bucket metadata: the pre-flight "bucket exists" check
  ]
}

# The least role that lets worker 0 delete its TPU: no predefined TPU role is that narrow (roles/tpu.admin
# and roles/tpu.editor also create, update and reimage nodes), so a custom role with the two permissions
# `gcloud compute tpus tpu-vm delete --async` needs. Granted on the project: Cloud TPU has no IAM policy on a
# single node, so it reaches the project's other TPU nodes too (deleting them is all it allows). A queued
# resource is not deleted by worker 0: once its node is gone it is SUSPENDED, bills nothing, and the next
# `make tpu-up` or `make tpu-down` deletes it.
#
# Its ID is never reused. IAM soft-deletes a custom role: `make tpu-down DESTROY_BUCKET=1` deletes it with
# everything else, the provider can undelete it for 7 days (it does, on create), and after that the ID stays
# unusable for up to 30 more days, so a fixed ID made the next `make tpu-up` fail for weeks (the provider's
# documentation of google_project_iam_custom_role says both). The ID ends with the deployment's creation time
# (time_static, made on the first apply and kept until the destroy, `make tpu-down` without DESTROY_BUCKET
# included): a deployment made after a destroy gets a new ID.
resource "time_static" "deployment" {}

resource "google_project_iam_custom_role" "tpu_self_delete" {
  project     = var.project_id
  role_id     = "${replace(var.name_prefix, "-", "_")}_tpu_self_delete_${time_static.deployment.unix}"
  title       = "tpu-llm: delete a TPU node"
  description = "Lets the TPU workers of ${var.name_prefix} delete their TPU node when a run that owns it ends."
  permissions = ["tpu.nodes.delete", "tpu.nodes.get"]

  depends_on = [google_project_service.apis]
}

resource "google_project_iam_member" "tpu_self_delete" {
  project = var.project_id
  role    = google_project_iam_custom_role.tpu_self_delete.name
  member  = "serviceAccount:${google_service_account.tpu.email}"
}

resource "google_project_iam_member" "tpu" {
  for_each = toset(local.project_roles)

  project = var.project_id
  role    = each.value
  member  = "serviceAccount:${google_service_account.tpu.email}"
}

resource "google_storage_bucket_iam_member" "workers" {
  # Keys as before the Compute Engine default account was dropped ("tpu ROLE"): a changed key would
  # destroy and re-create the same binding, and the destroy could remove the new one.
  for_each = { for role in local.bucket_roles : "tpu ${role}" => role }

  bucket = google_storage_bucket.data.name
  role   = each.value
  member = "serviceAccount:${google_service_account.tpu.email}"
}

# A new service account and its grants take a while to reach every Google service (IAM is
# eventually consistent); a TPU created at once may fail to start as it or be refused. The
# provider's own TPU VM example waits the same way.
resource "time_sleep" "service_account" {
  create_duration = "60s"

  depends_on = [
    google_service_account.tpu,
    google_project_iam_member.tpu,
    google_project_iam_member.tpu_self_delete,
    google_storage_bucket_iam_member.workers,
  ]
}
