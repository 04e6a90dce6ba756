# Inputs. Every variable is typed, described and, where it constrains input, validated, so a typo
# fails at `terraform plan` with a message naming the fix instead of half-way through an apply.

variable "project_id" {
  type        = string
  description = "Google Cloud project that holds the TPU, its network and the bucket (billing must be enabled)."

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{4,28}[a-z0-9]$", var.project_id)) && var.project_id != "my-project-id"
    error_message = "project_id must be your project's id (6-30 characters: lowercase letters, digits, hyphens), not the example's placeholder; `gcloud projects list` shows yours."
  }
}

variable "zone" {
  type        = string
  description = "Zone of the TPU. The accelerator type must be offered there (`gcloud compute tpus accelerator-types list --zone=ZONE`; the plan checks it). Default: us-central1-a, where v5e (v5litepod), v5p and v3 are offered (Cloud TPU \"TPU regions and zones\" page); v4 exists only in us-central2-b, which many projects cannot use without an allow-list."
  default     = "us-central1-a"

  validation {
    condition     = can(regex("^[a-z]+-[a-z]+[0-9]+-[a-z]$", var.zone))
    error_message = "zone must look like us-central1-a (region plus a zone letter)."
  }
}

variable "region" {
  type        = string
  description = "Region of the subnet, router/NAT and (by default) the bucket. Empty: the zone's region."
  default     = ""

  validation {
    condition     = var.region == "" || can(regex("^[a-z]+-[a-z]+[0-9]+$", var.region))
    error_message = "region must be empty (derived from zone) or look like us-central1."
  }
}

variable "name_prefix" {
  type        = string
  description = "Prefix of every resource name (TPU, VPC, service account, default bucket name)."
  default     = "tpu-llm"

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,20}[a-z0-9]$", var.name_prefix))
    error_message = "name_prefix must be 3-22 characters of lowercase letters, digits and hyphens, starting with a letter (the service account id adds \"-tpu\" and must stay within 30)."
  }
}

variable "accelerator_type" {
  type        = string
  description = "TPU slice: FAMILY-SIZE, e.g. v5litepod-8, v5p-8, v6e-8, v4-8. v5e (v5litepod) and v6e count chips, v2/v3/v4/v5p count TensorCores; more than 8 means several hosts (a pod slice). The plan checks that the zone offers it."
  default     = "v5litepod-8"

  # TPU7x (Ironwood) first, in its own words: the platform's edge, not a typo
  validation {
    condition     = !can(regex("^(v7|tpu7|ironwood)", lower(var.accelerator_type)))
    error_message = "accelerator_type: TPU7x (Ironwood) does not run TensorFlow (tensorflow-tpu ends at 2.20.0), and the Cloud TPU API this configuration uses (google_tpu_v2_vm) does not reach it; use v6e, v5p, v5litepod (v5e) or v4."
  }

  validation {
    condition     = can(regex("^(v2|v3|v4|v5litepod|v5p|v6e)-[1-9][0-9]*$", var.accelerator_type)) || can(regex("^(v7|tpu7|ironwood)", lower(var.accelerator_type)))
    error_message = "accelerator_type must be FAMILY-SIZE with FAMILY one of v2, v3, v4, v5litepod (v5e), v5p, v6e, e.g. v4-8, v4-32, v5litepod-8, v5p-8, v6e-8."
  }
}

variable "runtime_version" {
  type        = string
  description = "TPU VM software image. Empty: a base image chosen by infra/runtime (one host: the family's, e.g. v2-alpha-tpuv5-lite for v5e or tpu-ubuntu2204-base for v4; a pod: the one Google's TF release tests run that family's pods on), with TensorFlow from infra/worker-requirements.txt; the plan checks that the zone offers it (`gcloud compute tpus tpu-vm versions list --zone=ZONE` lists them). Pinned in the state while the TPU exists: a change replaces the TPU, which `make tpu-up` does only with REPLACE=1."
  default     = ""

  validation {
    condition     = var.runtime_version == "" || can(regex("^(tpu-vm-|v2-alpha|tpu-ubuntu)[a-z0-9.-]*$", var.runtime_version))
    error_message = "runtime_version must be empty (automatic) or a TPU VM image name such as v2-alpha-tpuv5-lite, v2-alpha-tpuv5 or tpu-ubuntu2204-base."
  }
}

variable "spot" {
  type        = bool
  description = "Spot TPU: much cheaper, can be preempted at any time (training resumes from the last checkpoint after `make tpu-up` recreates it)."
  default     = true
}

variable "reserved" {
  type        = bool
  description = "Create the TPU from a reservation of your project (scheduling_config.reserved). Excludes spot."
  default     = false
}

variable "use_queued_resource" {
  type        = bool
  description = "Request the TPU through a queued resource, which waits for capacity instead of failing on a stockout. `make tpu-up` creates it with gcloud (the provider's queued resource takes no service account, metadata or spot flag), with the service account, network and start-up script made here; `make tpu-down` deletes it with --force."
  default     = false
}

variable "tpu_enabled" {
  type        = bool
  description = "Whether the TPU exists. `make tpu-down` applies false: the TPU goes, the network, service account and bucket stay."
  default     = true
}

variable "network_cidr" {
  type        = string
  description = "Primary IPv4 range of the TPU subnet (one address per TPU worker)."
  default     = "10.8.0.0/20"

  validation {
    condition     = can(cidrhost(var.network_cidr, 0)) && tonumber(split("/", var.network_cidr)[1]) <= 28
    error_message = "network_cidr must be an IPv4 CIDR range of /28 or larger, e.g. 10.8.0.0/20."
  }
}

variable "ssh_source_ranges" {
  type        = list(string)
  description = "Source ranges allowed to reach the workers on TCP 22. The default is Identity-Aware Proxy's TCP-forwarding range, which `gcloud alpha compute tpus tpu-vm ssh --tunnel-through-iap` uses (the workers have no external IP)."
  default     = ["35.235.240.0/20"]

  validation {
    condition     = length(var.ssh_source_ranges) > 0 && alltrue([for r in var.ssh_source_ranges : can(cidrhost(r, 0)) && r != "0.0.0.0/0"])
    error_message = "ssh_source_ranges must be a non-empty list of CIDR ranges, and not 0.0.0.0/0."
  }
}

variable "bucket_name" {
  type        = string
  description = "Bucket for data shards, checkpoints and TensorBoard logs. Empty: PROJECT_ID-NAME_PREFIX. Access logs go to a second bucket named BUCKET-logs."
  default     = ""

  validation {
    condition     = var.bucket_name == "" || can(regex("^[a-z0-9][a-z0-9_-]{1,56}[a-z0-9]$", var.bucket_name))
    error_message = "bucket_name must be empty (automatic) or 3-58 characters of lowercase letters, digits, hyphens and underscores (the log bucket adds \"-logs\")."
  }
}

variable "bucket_location" {
  type        = string
  description = "Location of the buckets. Empty: the TPU's region (no cross-region traffic while training)."
  default     = ""

  validation {
    condition     = var.bucket_location == "" || can(regex("^[a-zA-Z0-9-]+$", var.bucket_location))
    error_message = "bucket_location must be empty (the region) or a location such as US-CENTRAL2, US or EU."
  }
}

variable "bucket_force_destroy" {
  type        = bool
  description = "Let `terraform destroy` delete the buckets with everything in them. Only `make tpu-down DESTROY_BUCKET=1` sets it."
  default     = false
}

variable "checkpoint_retention_days" {
  type        = number
  description = "Days a replaced or deleted object (an old checkpoint rotated out by the trainer, an overwritten shard) stays recoverable as a noncurrent version before it is deleted. Soft delete is off on the bucket (versioning already keeps them), so this is the whole time you pay for them."
  default     = 3

  validation {
    condition     = var.checkpoint_retention_days >= 1 && floor(var.checkpoint_retention_days) == var.checkpoint_retention_days
    error_message = "checkpoint_retention_days must be a whole number of days, at least 1."
  }
}

variable "data_retention_days" {
  type        = number
  description = "Delete uploaded data shards (objects under shards/) this many days after upload. 0 keeps them until you delete them."
  default     = 0

  validation {
    condition     = var.data_retention_days >= 0 && floor(var.data_retention_days) == var.data_retention_days
    error_message = "data_retention_days must be a whole number of days, 0 (keep) or more."
  }
}

variable "usage_logs" {
  type        = bool
  description = "Write the bucket's usage logs into a second bucket (BUCKET-logs). Needs a grant to cloud-storage-analytics@google.com, which an organisation policy restricting domains (Domain Restricted Sharing) refuses: set false there."
  default     = true
}

variable "log_retention_days" {
  type        = number
  description = "Days the bucket's access logs are kept in the log bucket."
  default     = 30

  validation {
    condition     = var.log_retention_days >= 1 && floor(var.log_retention_days) == var.log_retention_days
    error_message = "log_retention_days must be a whole number of days, at least 1."
  }
}

variable "labels" {
  type        = map(string)
  description = "Labels added to the TPU and the buckets (e.g. team, cost-center)."
  default     = {}

  validation {
    condition = alltrue([
      for k, v in var.labels : can(regex("^[a-z][a-z0-9_-]{0,62}$", k)) && can(regex("^[a-z0-9_-]{0,63}$", v))
    ])
    error_message = "labels keys must start with a lowercase letter; keys and values may hold lowercase letters, digits, _ and - (63 characters at most)."
  }
}
