# One bucket for everything a run needs: data shards (shards/), run directories with checkpoints,
# TensorBoard logs and the training log (runs/NAME/). Uniform bucket-level access, public access
# prevention, versioning with lifecycle rules sized for checkpoints, and (usage_logs) access logs
# written to a second bucket.
#
# Checkpoints: the trainer rotates old ones out and TensorFlow's GCS writer re-uploads whole files,
# so every rotation and rewrite leaves noncurrent versions. With the default 7-day soft delete on
# top of versioning they were billed for about twice checkpoint_retention_days; soft delete is off
# here (retention 0; versioning already keeps deleted objects recoverable), noncurrent versions go
# after checkpoint_retention_days, and no object keeps more than 3 of them.

resource "google_storage_bucket" "logs" {
  # checkov:skip=CKV_GCP_62: this is the access-log sink of the data bucket; logging it into a third bucket (or itself) adds nothing
  count                       = var.usage_logs ? 1 : 0
  name                        = "${local.bucket_name}-logs"
  project                     = var.project_id
  location                    = local.bucket_location
  storage_class               = "STANDARD"
  uniform_bucket_level_access = true
  public_access_prevention    = "enforced"
  force_destroy               = var.bucket_force_destroy
  labels                      = local.labels

  versioning {
    enabled = true
  }

  soft_delete_policy {
    retention_duration_seconds = 0
  }

  lifecycle_rule {
    condition {
      age        = var.log_retention_days
      with_state = "ANY"
    }
    action {
      type = "Delete"
    }
  }

  depends_on = [google_project_service.apis]
}

# Cloud Storage writes usage and storage logs as this group (documented requirement for access
# logs). Refused under Domain Restricted Sharing: nothing depends on it, so only usage logs fail.
resource "google_storage_bucket_iam_member" "logs_writer" {
  count  = var.usage_logs ? 1 : 0
  bucket = google_storage_bucket.logs[0].name
  role   = "roles/storage.objectCreator"
  member = "group:cloud-storage-analytics@google.com"
}

resource "google_storage_bucket" "data" {
  name                        = local.bucket_name
  project                     = var.project_id
  location                    = local.bucket_location
  storage_class               = "STANDARD"
  uniform_bucket_level_access = true
  public_access_prevention    = "enforced"
  force_destroy               = var.bucket_force_destroy
  labels                      = local.labels

  versioning {
    enabled = true
  }

  soft_delete_policy {
    retention_duration_seconds = 0
  }

  dynamic "logging" {
    for_each = var.usage_logs ? [1] : []
    content {
      log_bucket = google_storage_bucket.logs[0].name
    }
  }

  # Old checkpoints: the trainer keeps the newest `checkpoint.keep` and deletes the rest; with
  # versioning they become noncurrent and are removed for good after checkpoint_retention_days.
  lifecycle_rule {
    condition {
      days_since_noncurrent_time = var.checkpoint_retention_days
      with_state                 = "ARCHIVED"
    }
    action {
      type = "Delete"
    }
  }

  # Files rewritten often (the checkpoint index, TensorBoard event files, the training log copied
  # up every 30 s) keep at most 3 old versions, whatever their age.
  lifecycle_rule {
    condition {
      num_newer_versions = 3
      with_state         = "ARCHIVED"
    }
    action {
      type = "Delete"
    }
  }

  # Half-finished uploads (an interrupted `make data-upload`) do not linger.
  lifecycle_rule {
    condition {
      age = 7
    }
    action {
      type = "AbortIncompleteMultipartUpload"
    }
  }

  dynamic "lifecycle_rule" {
    for_each = var.data_retention_days > 0 ? [var.data_retention_days] : []
    content {
      condition {
        age            = lifecycle_rule.value
        matches_prefix = ["shards/"]
        with_state     = "LIVE"
      }
      action {
        type = "Delete"
      }
    }
  }

  depends_on = [google_project_service.apis]
}
