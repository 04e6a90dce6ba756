# One bucket for everything a run needs: data shards (shards/), run directories with checkpoints and
# TensorBoard logs (runs/NAME/). Uniform bucket-level access, public access prevention, versioning
# with a lifecycle that deletes replaced checkpoints after checkpoint_retention_days, and access logs
# written to a second bucket.

resource "google_storage_bucket" "logs" {
  # checkov:skip=CKV_GCP_62: this is the access-log sink of the data bucket; logging it into a third bucket (or itself) adds nothing
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

# Cloud Storage writes usage and storage logs as this group (documented requirement for access logs).
resource "google_storage_bucket_iam_member" "logs_writer" {
  bucket = google_storage_bucket.logs.name
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

  logging {
    log_bucket = google_storage_bucket.logs.name
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

  depends_on = [google_storage_bucket_iam_member.logs_writer]
}
