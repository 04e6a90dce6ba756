# Terraform and provider versions.
#
# google_tpu_v2_vm and the data sources google_tpu_v2_accelerator_types / google_tpu_v2_runtime_versions
# exist only in the google-beta provider, and scheduling_config.spot on google_tpu_v2_vm needs
# google-beta >= 6.25. The argument names used here were checked against the provider's sources
# (hashicorp/terraform-provider-google-beta, google-beta/services/tpuv2/); nothing here has been
# applied against a real project from this repository's CI (no cloud account), see docs/cloud-tpu.md.
# `time` gives time_sleep: a new service account takes a moment before other services accept it.
#
# Every provider is pinned to a range from an exact minor release (tests/test_infra.py checks it).
# The exact versions are pinned on first use: `terraform -chdir=infra init` writes
# .terraform.lock.hcl; commit it, and `terraform -chdir=infra providers lock -platform=linux_amd64
# -platform=darwin_arm64 -platform=darwin_amd64` adds the hashes of your team's other platforms.

terraform {
  required_version = ">= 1.5.0"

  # The state lives in the deployment's state bucket (PROJECT_ID-NAME_PREFIX-tf unless TF_STATE_BUCKET),
  # so `make tpu-down` works from a fresh clone. Partial configuration: `make tpu-up`/`tpu-down` create
  # the bucket first when missing (gcloud: versioned, uniform access, public access prevented) and pass
  # -backend-config=bucket=... -backend-config=prefix=terraform/state to `terraform init`. By hand:
  # `terraform -chdir=infra init -backend-config=bucket=BUCKET -backend-config=prefix=terraform/state`.
  backend "gcs" {}

  required_providers {
    google = {
      source  = "hashicorp/google"
      version = ">= 6.27.0, < 7.0.0"
    }
    google-beta = {
      source  = "hashicorp/google-beta"
      version = ">= 6.27.0, < 7.0.0"
    }
    time = {
      source  = "hashicorp/time"
      version = ">= 0.12.0, < 0.14.0"
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
