# A dedicated VPC: the TPU workers get no external IP (checkov CKV2_GCP_32), so the subnet has
# Private Google Access (Cloud Storage, the TPU API) and Cloud NAT gives them outbound internet for
# pip and apt. Inbound: ssh from Identity-Aware Proxy only, and all traffic between the workers of a
# multi-host slice (the TensorFlow servers of a pod talk over the VPC).

resource "google_compute_network" "vpc" {
  name                    = "${var.name_prefix}-vpc"
  project                 = var.project_id
  auto_create_subnetworks = false
  routing_mode            = "REGIONAL"

  depends_on = [google_project_service.apis]
}

resource "google_compute_subnetwork" "tpu" {
  name                     = "${var.name_prefix}-subnet"
  project                  = var.project_id
  region                   = local.region
  network                  = google_compute_network.vpc.id
  ip_cidr_range            = var.network_cidr
  private_ip_google_access = true

  # Flow logs (checkov CKV_GCP_26) at a tenth of the flows and without the optional metadata: a
  # pod's workers exchange a lot of traffic, and every logged flow is billed by Cloud Logging.
  log_config {
    aggregation_interval = "INTERVAL_10_MIN"
    flow_sampling        = 0.1
    metadata             = "EXCLUDE_ALL_METADATA"
  }

  lifecycle {
    precondition {
      condition     = startswith(var.zone, "${local.region}-")
      error_message = "zone ${var.zone} is not in region ${local.region}; leave region empty or pick a zone of that region."
    }
  }
}

resource "google_compute_router" "nat" {
  name    = "${var.name_prefix}-router"
  project = var.project_id
  region  = local.region
  network = google_compute_network.vpc.id
}

resource "google_compute_router_nat" "nat" {
  name                               = "${var.name_prefix}-nat"
  project                            = var.project_id
  region                             = local.region
  router                             = google_compute_router.nat.name
  nat_ip_allocate_option             = "AUTO_ONLY"
  source_subnetwork_ip_ranges_to_nat = "LIST_OF_SUBNETWORKS"

  subnetwork {
    name                    = google_compute_subnetwork.tpu.id
    source_ip_ranges_to_nat = ["ALL_IP_RANGES"]
  }

  log_config {
    enable = true
    filter = "ERRORS_ONLY"
  }
}

resource "google_compute_firewall" "ssh_from_iap" {
  name          = "${var.name_prefix}-ssh-from-iap"
  project       = var.project_id
  network       = google_compute_network.vpc.id
  direction     = "INGRESS"
  source_ranges = var.ssh_source_ranges

  allow {
    protocol = "tcp"
    ports    = ["22"]
  }

  log_config {
    metadata = "INCLUDE_ALL_METADATA"
  }
}

resource "google_compute_firewall" "internal" {
  name          = "${var.name_prefix}-internal"
  project       = var.project_id
  network       = google_compute_network.vpc.id
  direction     = "INGRESS"
  source_ranges = [var.network_cidr]

  allow {
    protocol = "tcp"
  }

  allow {
    protocol = "udp"
  }

  allow {
    protocol = "icmp"
  }

  log_config {
    metadata = "EXCLUDE_ALL_METADATA"
  }
}
