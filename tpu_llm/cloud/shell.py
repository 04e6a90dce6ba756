"""Running terraform and gcloud for tpu_llm/cloud/driver.py: dry runs, prerequisites, one-line failures.

Standard library only (the Makefile may run it with any Python >= 3.10, before .venv exists).

  Runner           runs a command (echoed as `+ CMD`), or with DRY_RUN=1 prints `DRY_RUN: CMD` and
                   runs nothing; streams output while keeping its tail to explain a failure
  explain_failure  the API's message (stockout, quota, credentials, ...) -> one line with the fix
  Outputs          `terraform output -json`, as saved by `make tpu-up`
  check_*          terraform / gcloud present, authenticated, a project set in terraform.tfvars
"""

from __future__ import annotations

import collections
import json
import os
import re
import shlex
import shutil
import subprocess
import sys

from tpu_llm.cloud.pod_check import tf_worker_image

EXIT_ERROR = 2

# Zones that Cloud TPU's "TPU regions and zones" page (cloud.google.com/tpu/docs/regions-zones)
# lists for each family, US and Europe (a project may see fewer; the fix line also gives the
# command that tells for sure, and the plan checks the zone against the TPU API).
ZONES = {
    "v2": "us-central1-b, us-central1-c, europe-west4-a",
    "v3": "us-central1-a, us-central1-b, europe-west4-a",
    "v4": "us-central2-b",
    "v5litepod": "us-central1-a, us-south1-a, us-west1-c, us-west4-a, europe-west4-b",
    "v5p": "us-central1-a, us-east5-a, europe-west4-b",
    "v6e": "us-central1-b, us-east1-d, us-east5-a, us-east5-b, europe-west4-a",
}


class LaunchError(Exception):
    """A failure with a one-line message naming the culprit and the fix (printed as `error: ...`)."""


class Runner:
    def __init__(self, dry_run: bool, fake_state: str = "READY"):
        self.dry_run = dry_run
        self.fake_state = fake_state  # what `gcloud ... describe` answers in a dry run

    def show(self, argv: list[str]) -> None:
        print(f"{'DRY_RUN:' if self.dry_run else '+'} {shlex.join(argv)}", flush=True)

    def capture(self, argv: list[str], dry_result: str = "") -> tuple[int, str]:
        """Run quietly and return (exit status, stdout+stderr); in a dry run print it and return dry_result."""
        if self.dry_run:
            self.show(argv)
            return 0, dry_result
        try:
            done = subprocess.run(argv, capture_output=True, text=True, check=False)
        except FileNotFoundError:
            raise LaunchError(f"{argv[0]} not found on PATH; {INSTALL_HINT.get(argv[0], 'install it')}") from None
        return done.returncode, (done.stdout or "") + (done.stderr or "")

    def stream(self, argv: list[str], context: dict | None = None) -> str:
        """Run showing the output as it comes; on failure raise LaunchError with explain_failure's line."""
        self.show(argv)
        if self.dry_run:
            return ""
        tail: collections.deque[str] = collections.deque(maxlen=400)
        try:
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        except FileNotFoundError:
            raise LaunchError(f"{argv[0]} not found on PATH; {INSTALL_HINT.get(argv[0], 'install it')}") from None
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                sys.stdout.write(line)
                sys.stdout.flush()
                tail.append(line)
            status = proc.wait()
        except KeyboardInterrupt:
            proc.terminate()
            proc.wait()
            raise
        output = "".join(tail)
        if status != 0:
            raise LaunchError(explain_failure(argv, status, output, context or {}))
        return output

    def interactive(self, argv: list[str]) -> int:
        """Hand the terminal to the command (ssh sessions, tail -F, tensorboard)."""
        self.show(argv)
        if self.dry_run:
            return 0
        try:
            return subprocess.call(argv)
        except FileNotFoundError:
            raise LaunchError(f"{argv[0]} not found on PATH; {INSTALL_HINT.get(argv[0], 'install it')}") from None
        except KeyboardInterrupt:
            return 130


INSTALL_HINT = {
    "terraform": "install Terraform >= 1.5 (HashiCorp's install page), then run the target again",
    "gcloud": "install the Google Cloud CLI (cloud.google.com/sdk), run `gcloud init`, then the target again",
}

# (pattern, message[, tools]) in order; the first match (for that tool) wins. {zone}, {accelerator},
# ... come from the context.
FAILURES = [
    # worker 0's owner tried to delete its TPU (DOWN_AFTER=1, TTL_HOURS) and could not (`make tpu-stop`)
    (r"worker 0 could not delete this TPU",
     "worker 0 could not delete TPU {tpu_name} ({detail}); it is still up and billing: delete it by hand with "
     "`gcloud compute tpus tpu-vm delete {tpu_name} --zone={zone} --project={project} --quiet` (or `make tpu-down`)"),
    # infra/startup.sh.tftpl on a pod's host whose runtime could not pull the TF worker container
    (r"the TF worker container \S+ cannot be pulled",
     "a worker could not pull the pod's TF worker container ({detail}); `make tpu-down` deletes the TPU, which "
     "bills meanwhile; then pin in infra/worker-requirements.txt a tensorflow-tpu whose tag exists"),
    (r"a run is already training on worker 0",
     "a run is already training on worker 0: follow it with `make tpu-logs`, or stop it first (`make tpu-ssh`, "
     "then `kill $(cat ~/tpu-llm-train.pid)`)"),
    (r"no more capacity|ZONE_RESOURCE_POOL_EXHAUSTED|resource pool exhausted|insufficient capacity|"
     r"does not have enough resources available",
     "no capacity for {accelerator} in {zone} (a stockout): set use_queued_resource = true in "
     "infra/terraform.tfvars to wait for capacity, or try a zone that offers {family} ({zones}; check with "
     "`gcloud compute tpus accelerator-types list --zone=ZONE`); nothing was destroyed"),
    # The TPU API's answer for a zone that does not exist or is closed to the project (a 403, not a
    # missing role): `googleapi: Error 403: Location us-centrl1-a is not found or access is unauthorized.`
    (r"Location \S+ is not found or access is unauthorized|Unknown zone|Invalid value for field '?zone",
     "zone {zone} is not a Cloud TPU location open to project {project} ({detail}): fix zone in "
     "infra/terraform.tfvars (`gcloud compute tpus locations list --project={project}` lists them; {family} is "
     "offered in {zones}); nothing was created"),
    (r"iam\.allowedPolicyMemberDomains|belong to a permitted customer|Domain Restricted Sharing",
     "an organisation policy (Domain Restricted Sharing) refuses the grant to cloud-storage-analytics@google.com "
     "that the bucket's usage logs need: set usage_logs = false in infra/terraform.tfvars and run the target again"),
    (r"quota|RESOURCE_EXHAUSTED|limit exceeded",
     "TPU quota exceeded for {accelerator} in {zone} ({detail}): request more quota for the TPU API in the "
     "Cloud console (IAM & Admin > Quotas) or choose a smaller accelerator_type; nothing was destroyed"),
    (r"could not find default credentials|application default credentials|oauth2: cannot fetch token|"
     r"invalid_grant|reauthentication|google: could not find",
     "not authenticated: run `gcloud auth login` and `gcloud auth application-default login` (Terraform uses "
     "the application-default credentials), then run the target again"),
    (r"You do not currently have an active account|gcloud auth login",
     "gcloud has no active account: run `gcloud auth login`, then the target again"),
    (r"billing",
     "billing is not enabled on project {project}: link a billing account (`gcloud billing projects link "
     "{project} --billing-account=ACCOUNT_ID`), then run the target again"),
    (r"SERVICE_DISABLED|has not been used in project|API has not been used|is disabled",
     "an API of project {project} is not enabled yet ({detail}): `make tpu-up` enables them (infra/apis.tf); "
     "wait a minute after the first apply and run the target again"),
    (r"Invalid choice: 'alpha'|alpha component|components install alpha",
     "gcloud's alpha component is missing (needed for --tunnel-through-iap): run `gcloud components install "
     "alpha`, or set TPU_SSH=internal when running from a VM inside the TPU's VPC"),
    (r"failed to connect to backend|Error while connecting \[40\d\d|IAP tunnel|iap\.tunnelInstances",
     "ssh through Identity-Aware Proxy failed ({detail}): the firewall rule {prefix}-ssh-from-iap must exist "
     "(make tpu-up) and your account needs roles/iap.tunnelResourceAccessor; then run the target again"),
    # The workers' custom role (infra/iam.tf): creating one needs iam.roles.create, which roles/editor lacks
    (r"iam\.roles\.(create|update|delete|undelete)",
     "permission denied in project {project} ({detail}): the workers' custom role needs iam.roles.* on the "
     "project: an owner grants your account roles/iam.roleAdmin (`gcloud projects add-iam-policy-binding "
     "{project} --member=user:YOUR_EMAIL --role=roles/iam.roleAdmin`), then run the target again; nothing was "
     "destroyed"),
    (r"PERMISSION_DENIED|Permission denied|does not have .*permission|\b403\b",
     "permission denied in project {project} ({detail}): your account needs roles/owner, or roles/editor plus "
     "roles/resourcemanager.projectIamAdmin and roles/iam.roleAdmin, on the project (docs/cloud-tpu.md lists "
     "the roles each target needs)"),
    # During `make tpu-up` a 404 is something the configuration names (an image, a type, a network):
    # recreating would fail the same way.
    (r"NOT_FOUND|was not found|\b404\b",
     "not found while applying infra/ ({detail}): check zone, accelerator_type and runtime_version in "
     "infra/terraform.tfvars (`gcloud compute tpus tpu-vm versions list --zone={zone}` lists the images); "
     "nothing was destroyed", ("terraform",)),
    (r"NOT_FOUND|was not found|\b404\b",
     "{what} not found ({detail}): it was deleted, or a spot TPU was reclaimed; `make tpu-status` shows what "
     "exists and `make tpu-up` creates it again"),
]


def error_text(output: str) -> str:
    """The part of a command's output that reports the failure: from the first `Error:`/`ERROR:` line
    on (terraform prints its plan before the errors, and resource names there must not be taken for
    an error), else the last 20 lines."""
    lines = output.splitlines()
    for i, line in enumerate(lines):
        if re.search(r"\b(Error|ERROR):", line):
            return "\n".join(lines[i:])
    return "\n".join(lines[-20:])


def explain_failure(argv: list[str], status: int, output: str, context: dict) -> str:
    """One line naming what failed and the fix, from the command's output."""
    tool = os.path.basename(argv[0])
    output = error_text(output)
    condition = terraform_condition(output)
    if condition:
        return f"infra/terraform.tfvars: {condition}"
    for pattern, message, *tools in FAILURES:
        if tools and tool not in tools[0]:
            continue
        match = re.search(pattern, output, re.IGNORECASE)
        if match:
            detail = _detail_line(output, match)
            values = collections.defaultdict(lambda: "?", context, detail=detail,
                                             what=context.get("what", f"TPU {context.get('tpu_name', '?')}"),
                                             zones=_other_zones(context))
            return message.format_map(values)
    last = next((line.strip() for line in reversed(output.splitlines()) if line.strip()), "no output")
    return f"{tool} failed (exit {status}): {last[:200]}; see its output above"


def terraform_condition(output: str) -> str:
    """The error message of a failed variable validation or pre/postcondition (infra/*.tf wrote it
    to name the fix), or "". Terraform prints it last in the error box, after the code excerpt:

      │ Error: Resource postcondition failed
      │   on tpu.tf line 44, in data "google_tpu_v2_accelerator_types" "available":
      │   44:       condition     = contains(self.types, var.accelerator_type)
      │     ├────────────────
      │     │ var.accelerator_type is "v4-7"
      │ accelerator_type v4-7 is not offered in zone us-central1-a; offered there: ...
    """
    lines = output.splitlines()
    start = next((i for i, line in enumerate(lines)
                  if re.search(r"Error: (Resource (pre|post)condition failed|Module output value precondition failed|"
                            r"Invalid value for variable)", line)), None)
    if start is None:
        return ""
    paragraphs, current = [], []  # Terraform wraps the message at the terminal width: join its lines
    for line in lines[start + 1:]:
        if re.search(r"\bError:|^╵", line):
            break
        text = re.sub(r"^│ ?", "", line.rstrip())
        if text and not text[0].isspace():
            current.append(text.strip())
        elif current:
            paragraphs.append(" ".join(current))
            current = []
    if current:
        paragraphs.append(" ".join(current))
    messages = [p for p in paragraphs if not p.startswith(("on ", "This was checked"))]
    return messages[-1][:400] if messages else ""


def _other_zones(context: dict) -> str:
    zones = [z for z in ZONES.get(context.get("family", ""), "").split(", ") if z and z != context.get("zone")]
    return ", ".join(zones) or "see the Cloud TPU regions and zones page"


def _detail_line(output: str, match: re.Match) -> str:
    start = output.rfind("\n", 0, match.start()) + 1
    end = output.find("\n", match.end())
    line = output[start:end if end >= 0 else None].strip()
    line = re.sub(r"^(│\s*)?(Error:\s*)?", "", line)
    return line[:160]


# --------------------------------------------------------------------------------------------------
# Terraform outputs

REQUIRED_OUTPUTS = ("project_id", "zone", "tpu_enabled", "tpu_name", "accelerator_type", "worker_count",
                    "multi_host", "use_queued_resource", "queued_resource_name", "bucket_url", "data_url",
                    "runs_url", "startup_script")


class Outputs(dict):
    """The values of `terraform output -json` (name -> value), checked for what the launcher reads."""

    @classmethod
    def load(cls, path: str) -> "Outputs":
        try:
            with open(path, encoding="utf-8") as f:
                raw = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise LaunchError(f"{path}: cannot read Terraform outputs ({e}); run `make tpu-up` to refresh "
                              "it, or delete it to train locally") from None
        values = cls({k: v["value"] if isinstance(v, dict) and "value" in v else v for k, v in raw.items()})
        missing = [k for k in REQUIRED_OUTPUTS if k not in values]
        if missing:
            raise LaunchError(f"{path} lacks the output(s) {', '.join(missing)}; run `make tpu-up` to refresh "
                              "it from infra/")
        return values

    @classmethod
    def preview(cls, tfvars: dict[str, str]) -> "Outputs":
        """What `make tpu-up` would write, from terraform.tfvars alone (DRY_RUN before any apply): names
        that follow from the variables, <placeholders> for what only the cloud decides."""
        project, prefix = tfvars.get("project_id", "<project_id>"), tfvars.get("name_prefix", "tpu-llm")
        accelerator = tfvars.get("accelerator_type", "v5litepod-8")
        workers = max(1, -(-int(accelerator.split("-")[1]) // 8)) if accelerator.split("-")[-1].isdigit() else 1
        bucket = "gs://" + (tfvars.get("bucket_name") or f"{project}-{prefix}")
        queued = tfvars.get("use_queued_resource") == "true"
        return cls({"project_id": project, "zone": tfvars.get("zone", "us-central1-a"), "tpu_enabled": True,
                    "tpu_name": f"{prefix}-tpu", "queued_resource_name": f"{prefix}-tpu-queued" if queued else "",
                    "accelerator_type": accelerator, "worker_count": workers, "multi_host": workers > 1,
                    "use_queued_resource": queued, "spot": tfvars.get("spot", "true") == "true",
                    "reserved": tfvars.get("reserved") == "true", "bucket_url": bucket, "data_url": f"{bucket}/shards",
                    "runs_url": f"{bucket}/runs", "log_bucket_url": "", "runtime_version": "<chosen by the plan>",
                    "runtime_choice": "", "network": f"{prefix}-vpc", "subnetwork": f"{prefix}-subnet",
                    "service_account_email": f"{prefix}-tpu@{project}.iam.gserviceaccount.com", "labels": {},
                    "startup_script": "#!/bin/bash\n# <rendered by terraform from infra/startup.sh.tftpl>\n",
                    "tf_worker_image": tf_worker_image(lock_tensorflow()) if workers > 1 else ""})

    @property
    def family(self) -> str:
        return str(self["accelerator_type"]).split("-")[0]

    def context(self) -> dict:
        return {"project": self["project_id"], "zone": self["zone"], "tpu_name": self["tpu_name"],
                "accelerator": self["accelerator_type"], "family": self.family,
                "prefix": str(self["tpu_name"]).removesuffix("-tpu")}


def lock_tensorflow(path: str = os.path.join("infra", "worker-requirements.txt")) -> str:
    """The tensorflow-tpu version the lock pins (as infra/main.tf reads it), or "?"."""
    try:
        with open(path, encoding="utf-8") as f:
            match = re.search(r"^tensorflow-tpu==([0-9][0-9.]*)", f.read(), re.MULTILINE)
    except OSError:
        return "?"
    return match.group(1) if match else "?"


# --------------------------------------------------------------------------------------------------
# Prerequisites (skipped in dry runs)


def check_tool(name: str) -> None:
    if shutil.which(name) is None:
        raise LaunchError(f"{name} not found on PATH; {INSTALL_HINT[name]}")


def check_gcloud_auth(runner: Runner) -> None:
    status, out = runner.capture(["gcloud", "auth", "list", "--filter=status:ACTIVE", "--format=value(account)"])
    if status != 0 or not out.strip():
        raise LaunchError("gcloud has no active account: run `gcloud auth login`, then the target again")


def check_application_default(runner: Runner) -> None:
    status, _ = runner.capture(["gcloud", "auth", "application-default", "print-access-token"])
    if status != 0:
        raise LaunchError("Terraform has no application-default credentials: run `gcloud auth "
                          "application-default login`, then the target again")


def tfvars_project(path: str) -> str:
    """project_id from terraform.tfvars, or LaunchError naming the fix."""
    example = os.path.join(os.path.dirname(path), "terraform.tfvars.example")
    if not os.path.exists(path):
        raise LaunchError(f"no project set: {path} not found; run `cp {example} {path}` and set project_id "
                          "(`gcloud projects list` shows yours)")
    with open(path, encoding="utf-8") as f:
        match = re.search(r'^\s*project_id\s*=\s*"([^"]*)"', f.read(), re.MULTILINE)
    if not match or not match.group(1):
        raise LaunchError(f"no project set: {path} has no project_id = \"...\" line; add your project's id")
    if match.group(1) == "my-project-id":
        raise LaunchError(f"no project set: {path} still has the example's project_id = \"my-project-id\"; "
                          "put your project's id there (`gcloud projects list`)")
    return match.group(1)
