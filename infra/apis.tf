# The Google APIs this configuration uses. They stay enabled on destroy (other work in the project
# may use them), and a first apply may need a minute after enabling before the TPU API answers.

locals {
  services = [
    "cloudresourcemanager.googleapis.com", # the project IAM bindings (iam.tf) go through it
    "compute.googleapis.com",              # VPC, subnet, router, NAT, firewall
    "iam.googleapis.com",                  # the workers' service account
    "iap.googleapis.com",                  # ssh to workers without external IPs (--tunnel-through-iap)
    "logging.googleapis.com",              # worker logs, VPC flow logs, NAT logs
    "monitoring.googleapis.com",           # worker metrics
    "storage.googleapis.com",              # the bucket
    "tpu.googleapis.com",                  # the TPU VM or queued resource, and the plan-time zone checks
  ]
}

resource "google_project_service" "apis" {
  for_each = toset(local.services)

  project            = var.project_id
  service            = each.value
  disable_on_destroy = false
}
