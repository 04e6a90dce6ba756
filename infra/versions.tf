# Terraform and provider versions.
#
# google_tpu_v2_vm and google_tpu_v2_queued_resource exist only in the google-beta provider, and
# scheduling_config.spot on google_tpu_v2_vm needs google-beta >= 6.25. The argument names used here
# were checked against the provider documentation of the 6.x series (6.27 to 6.50); nothing here has
# been applied against a real project from this repository's CI (no cloud account), see docs/cloud-tpu.md.

terraform {
  required_version = ">= 1.5.0"

  required_providers {
    google = {
      source  = "hashicorp/google"
      version = ">= 6.27.0, < 7.0.0"
    }
    google-beta = {
      source  = "hashicorp/google-beta"
      version = ">= 6.27.0, < 7.0.0"
    }
  }
}

provider "google" {
  project = var.project_id
  region  = local.region
  zone    = var.zone
}

provider "google-beta" {
  project = var.project_id
  region  = local.region
  zone    = var.zone
}
