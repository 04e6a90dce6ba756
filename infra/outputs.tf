# What `make train`, `make tpu-ssh`, `make tpu-logs`, `make tensorboard` and `make data-upload`
# read (tpu_llm/cloud/driver.py, through `terraform output -json`).

output "project_id" {
  description = "Project of the TPU."
  value       = var.project_id
}

output "zone" {
  description = "Zone of the TPU."
  value       = var.zone
}

output "tpu_enabled" {
  description = "Whether the TPU exists (false after `make tpu-down`)."
  value       = var.tpu_enabled
}

output "tpu_name" {
  description = "Name of the TPU node (the node id of the queued resource when use_queued_resource)."
  value       = local.tpu_name
}

output "queued_resource_name" {
  description = "Name of the queued resource, or empty without one."
  value       = var.use_queued_resource ? local.queued_name : ""
}

output "accelerator_type" {
  description = "TPU slice type."
  value       = var.accelerator_type
}

output "runtime_version" {
  description = "TPU VM software image (chosen by infra/runtime when the TPU was created, pinned in the state since)."
  value       = local.runtime_version

  precondition {
    condition     = !var.tpu_enabled || module.runtime.problem == ""
    error_message = "runtime image: ${module.runtime.problem}."
  }
}

output "runtime_choice" {
  description = "The image and why it was chosen (`make tpu-up` prints it)."
  value = (local.runtime_version == module.runtime.runtime_version ? "${local.runtime_version}: ${module.runtime.reason}"
  : "${local.runtime_version}: pinned in the state when the TPU was created; infra/runtime now chooses ${module.runtime.runtime_version} (`make tpu-up REPLACE=1` takes it, replacing the TPU)")
}

output "libtpu" {
  description = "Which libtpu runs: the pinned wheel in the training process (venv, single host) or the TF worker container's on every host (container, a pod)."
  value       = module.runtime.libtpu_from
}

output "tf_worker_image" {
  description = "A pod's TF worker container, which the set-up points every host's TPU runtime at (empty for one host)."
  value       = module.runtime.tf_worker_image
}

output "worker_count" {
  description = "Hosts (TPU VM workers) in the slice: the TPU API's network endpoints once the VM exists, else the plan's estimate."
  value       = try(length(google_tpu_v2_vm.tpu[0].network_endpoints), local.worker_count)
}

output "multi_host" {
  description = "True for a multi-host (pod) slice: training runs on worker 0 against the pod's TF servers."
  value       = local.multi_host
}

output "spot" {
  description = "Whether the TPU is a spot TPU (can be preempted)."
  value       = var.spot
}

output "use_queued_resource" {
  description = "Whether the TPU comes from a queued resource (`make tpu-up` creates it with gcloud)."
  value       = var.use_queued_resource
}

output "reserved" {
  description = "Whether the TPU is created from a reservation."
  value       = var.reserved
}

output "network" {
  description = "VPC of the TPU workers (for the queued resource that `make tpu-up` creates)."
  value       = google_compute_network.vpc.name
}

output "subnetwork" {
  description = "Subnet of the TPU workers (for the queued resource that `make tpu-up` creates)."
  value       = google_compute_subnetwork.tpu.name
}

output "labels" {
  description = "Labels of the TPU."
  value       = local.labels
}

output "service_account_email" {
  description = "Service account of the workers (TPU VM and queued resource alike)."
  value       = google_service_account.tpu.email
}

output "bucket_name" {
  description = "Bucket for data, checkpoints and TensorBoard logs."
  value       = google_storage_bucket.data.name
}

output "bucket_url" {
  description = "gs:// URL of the bucket."
  value       = google_storage_bucket.data.url
}

output "data_url" {
  description = "Where `make data-upload` puts TFRecord shards."
  value       = "${google_storage_bucket.data.url}/shards"
}

output "runs_url" {
  description = "Parent of the run directories: `make train` uses RUNS_URL/RUN (RUN defaults to the config's name)."
  value       = "${google_storage_bucket.data.url}/runs"
}

output "run_dir" {
  description = "Run directory of `make train` with the default CONFIG (configs/tiny.yaml); RUN=NAME trains in RUNS_URL/NAME."
  value       = "${google_storage_bucket.data.url}/runs/tiny"
}

output "log_bucket_url" {
  description = "gs:// URL of the access-log bucket, or empty without usage_logs."
  value       = one(google_storage_bucket.logs[*].url) != null ? one(google_storage_bucket.logs[*].url) : ""
}

output "ssh_command" {
  description = "Ready-to-paste ssh to worker 0 (through Identity-Aware Proxy: the workers have no external IP)."
  value       = "gcloud alpha compute tpus tpu-vm ssh ${local.tpu_name} --zone=${var.zone} --project=${var.project_id} --worker=0 --tunnel-through-iap"
}

output "startup_script" {
  description = "The rendered worker set-up script (the queued resource's startup-script metadata, which `make tpu-up` passes to gcloud)."
  value       = local.startup_script
}
