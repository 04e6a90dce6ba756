"""The Cloud TPU driver's common ground (for tpu_llm/cloud/driver.py): its settings, the terraform and gcloud
command lines, the Terraform outputs, the TPU's and the queued resource's state. Standard library only.

The commands themselves live by concern: provision.py (tpu-up, tpu-down), launch.py (train, data-upload),
watch.py (tpu-status, tpu-logs, tpu-ssh, tpu-stop, tensorboard); driver.py puts them together.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shlex
import sys

from tpu_llm.cloud.shell import (LaunchError, Outputs, Runner, check_application_default, check_gcloud_auth,
                                 check_tool, explain_failure, tfvars_project)
from tpu_llm.cloud.worker_plan import LOCK_PATH, RUN_STATE, SETUP_SCRIPT, env, flag

DEFAULT_ZONE = "us-central1-a"  # infra/variables.tf


@dataclasses.dataclass
class RunState:
    """What worker 0 says of its run (worker_plan.RUN_STATE)."""
    alive: bool
    key: str = ""  # the settings the live run was started with (TrainPlan.run_key)
    pid: str = ""
    teardown: bool = False  # worker 0 deletes the TPU when the live run ends (its teardown file is set)


class Cloud:
    """Settings from the environment and the building blocks every command uses."""

    def __init__(self):
        self.runner = Runner(flag("DRY_RUN"), fake_state=env("DRY_RUN_TPU_STATE", "READY"))
        self.dry = self.runner.dry_run
        self.tf_dir = env("TF_DIR", "infra")
        self.tfvars = env("TFVARS", os.path.join(self.tf_dir, "terraform.tfvars"))
        self.outputs_path = env("TF_OUTPUTS", os.path.join(self.tf_dir, ".outputs.json"))
        self.iap = env("TPU_SSH", "iap") != "internal"
        self.wait_minutes = float(env("TPU_WAIT_MINUTES", "30"))
        self.fake_queued = os.environ.get("DRY_RUN_QUEUED_STATE", "ACTIVE").strip()
        self.poll_seconds = float(env("TPU_POLL_SECONDS", "20"))
        self.last_run_path = env("TF_LAST_RUN", os.path.join(self.tf_dir, ".last-run.json"))
        # Once a TPU exists: that it bills and how it stops, said last by every failure (driver.main)
        self.billing = ""

    # ---------------------------------------------------------------------------------------------
    # Building blocks

    def terraform(self, *args: str) -> list[str]:
        return ["terraform", f"-chdir={self.tf_dir}", *args]

    def tf_var_args(self, *extra: str, approve: bool = True) -> list[str]:
        rel = os.path.relpath(self.tfvars, self.tf_dir)  # -var-file is read from TF_DIR (-chdir)
        var_file = os.path.abspath(self.tfvars) if rel.startswith("..") else rel
        return ["-input=false", *(["-auto-approve"] if approve else []), f"-var-file={var_file}", *extra]

    def gcloud_tpu(self, o: Outputs, verb: str, *args: str, worker: str) -> list[str]:
        base = ["gcloud", "alpha"] if self.iap else ["gcloud"]  # --tunnel-through-iap is alpha-only
        route = "--tunnel-through-iap" if self.iap else "--internal-ip"
        return [*base, "compute", "tpus", "tpu-vm", verb, *args, f"--zone={o['zone']}", f"--project={o['project_id']}",
                f"--worker={worker}", route]

    def ssh(self, o: Outputs, worker: str, command: str) -> list[str]:
        return self.gcloud_tpu(o, "ssh", str(o["tpu_name"]), worker=worker) + [f"--command={command}"]

    def scp(self, o: Outputs, local: str, remote: str, worker: str) -> list[str]:
        return self.gcloud_tpu(o, "scp", local, f"{o['tpu_name']}:{remote}", worker=worker)

    def outputs(self, required: bool = True) -> Outputs | None:
        if not os.path.exists(self.outputs_path):
            if self.dry and required:
                print(f"DRY_RUN: (no {self.outputs_path}: names from {self.tfvars}, <...> for what only exists after "
                      "`make tpu-up`)", flush=True)
                return Outputs.preview(read_tfvars(self.tfvars))
            if required:
                raise LaunchError(f"no Cloud TPU outputs ({self.outputs_path} not found): run `make tpu-up` first")
            return None
        return Outputs.load(self.outputs_path)

    def save_outputs(self) -> Outputs | None:
        status, text = self.runner.capture(self.terraform("output", "-json"))
        if self.dry:
            return self.outputs(required=True)  # a preview from terraform.tfvars when nothing was applied yet
        if status != 0:
            raise LaunchError(explain_failure(["terraform"], status, text, {}))
        with open(self.outputs_path, "w", encoding="utf-8") as f:
            f.write(text)
        return Outputs.load(self.outputs_path)

    def tpu_state(self, o: Outputs) -> str:
        """READY, CREATING, PREEMPTED, ... or "" when the TPU does not exist."""
        argv = ["gcloud", "compute", "tpus", "tpu-vm", "describe", str(o["tpu_name"]), f"--zone={o['zone']}",
                f"--project={o['project_id']}", "--format=value(state)"]
        status, out = self.runner.capture(argv, dry_result=self.runner.fake_state)
        if status != 0:
            if re.search(r"NOT_FOUND|not found", out, re.IGNORECASE):
                return ""
            raise LaunchError(explain_failure(argv, status, out, o.context()))
        return out.strip().splitlines()[-1] if out.strip() else ""

    def run_state(self, o: Outputs) -> RunState:
        """Whether a run lives on worker 0 (its owner process, or a trainer of an older launch), asked over ssh;
        LaunchError when worker 0 cannot be asked. A dry run pretends DRY_RUN_RUN_STATE (default: idle)."""
        argv = self.ssh(o, "0", RUN_STATE)
        status, out = self.runner.capture(argv, dry_result=os.environ.get("DRY_RUN_RUN_STATE", "tpu-llm-run: idle"))
        line = next((line for line in out.splitlines() if line.startswith("tpu-llm-run: ")), "")
        if status != 0 or not line:
            raise LaunchError("cannot tell whether a run is training on worker 0: "
                              + explain_failure(argv, status, out, o.context()))
        words = line.split()[1:] + ["", "", ""]
        return RunState(words[0] == "alive", words[1], words[2], words[3] == "teardown")

    def queued_args(self, o: Outputs, verb: str, *args: str) -> list[str]:
        return ["gcloud", "compute", "tpus", "queued-resources", verb, queued_name(o), *args, f"--zone={o['zone']}",
                f"--project={o['project_id']}"]

    def queued_state(self, o: Outputs) -> str:
        """ACCEPTED, WAITING_FOR_RESOURCES, ACTIVE, FAILED, SUSPENDED, ... or "" when it does not exist."""
        argv = self.queued_args(o, "describe", "--format=value(state.state)")
        status, out = self.runner.capture(argv, dry_result=self.fake_queued)
        if status != 0:
            if re.search(r"NOT_FOUND|not found", out, re.IGNORECASE):
                return ""
            raise LaunchError(explain_failure(argv, status, out, {**o.context(), "what": "queued resource"}))
        return out.strip().splitlines()[-1] if out.strip() else ""

    def queued_reason(self, o: Outputs) -> str:
        """Why a queued resource is FAILED, as the API says it (QueuedResourceState.failedData.error): " (...)"
        or ""."""
        status, out = self.runner.capture(self.queued_args(o, "describe", "--format=json(state)"), dry_result="{}")
        try:
            state = json.loads(out).get("state") or {} if status == 0 else {}
        except ValueError:
            state = {}
        message = ((state.get("failedData") or {}).get("error") or {}).get("message", "")
        return f" ({message.strip()[:200]})" if message.strip() else ""

    def delete_queued(self, o: Outputs, why: str) -> None:
        """Delete the queued resource and its TPU, ACTIVE or not (the API deletes an ACTIVE queued
        resource only with force=true: its nodes go first). Nothing to do if it does not exist."""
        state = self.queued_state(o)
        if not state:
            return
        print(f"{why}: deleting queued resource {queued_name(o)} ({state}) and its TPU with --force", flush=True)
        self.runner.stream(self.queued_args(o, "delete", "--force", "--quiet"), {**o.context(), "what": "queued resource"})

    def create_queued(self, o: Outputs) -> None:
        """The queued resource, with gcloud's GA flags: the project's service account (not the Compute
        Engine default one), spot or reserved, no external IP, the start-up script as metadata."""
        if o["spot"] and o.get("reserved"):
            raise LaunchError("spot and reserved exclude each other; set one of them to false in infra/terraform.tfvars")
        script = self.write_setup_script(o)
        labels = ",".join(f"{k}={v}" for k, v in sorted(dict(o.get("labels") or {}).items()))
        argv = self.queued_args(
            o, "create", f"--node-id={o['tpu_name']}", f"--accelerator-type={o['accelerator_type']}",
            f"--runtime-version={o['runtime_version']}", f"--network={o['network']}",
            f"--subnetwork={o['subnetwork']}", "--internal-ips", f"--service-account={o['service_account_email']}",
            "--scopes=https://www.googleapis.com/auth/cloud-platform", f"--metadata-from-file=startup-script={script}",
            f"--tags={o['tpu_name']}", *([f"--labels={labels}"] if labels else []),
            *(["--spot"] if o["spot"] else []), *(["--reserved"] if o.get("reserved") else []),
            # the request ends with the wait: never a TPU hours later that nobody waits for, unless asked
            f"--valid-until-duration={self.queued_seconds()}s")
        print(f"tpu-up: requesting {o['accelerator_type']} through queued resource {queued_name(o)}; it waits for "
              "capacity", flush=True)
        self.runner.stream(argv, {**o.context(), "what": "queued resource"})

    def queued_seconds(self) -> int:
        """How long a new queued resource may wait: the wait itself, or KEEP_QUEUED_HOURS (24) with KEEP_QUEUED=1."""
        if not flag("KEEP_QUEUED"):
            return max(60, int(self.wait_minutes * 60))
        try:
            hours = float(env("KEEP_QUEUED_HOURS", "24"))
        except ValueError:
            hours = 0.0
        if not 0 < hours <= 24 * 30:
            raise LaunchError(f"KEEP_QUEUED_HOURS={env('KEEP_QUEUED_HOURS')}: give the hours a queued resource may "
                              "wait for capacity unattended, e.g. KEEP_QUEUED_HOURS=12")
        return max(60, int(self.wait_minutes * 60), int(hours * 3600))

    def init_backend(self, settings: dict[str, str]) -> None:
        """`terraform init` on the remote state in the deployment's state bucket, which is created first when
        missing (Terraform cannot keep its state in a bucket it manages itself: destroying it would take the
        state along). A local state from before is copied into it (-migrate-state), then set aside."""
        bucket = state_bucket(settings)
        project = settings.get("project_id", "<project_id>")
        url = f"gs://{bucket}"
        context = {"project": project, "zone": settings.get("zone", DEFAULT_ZONE), "what": f"state bucket {url}"}
        status, out = self.runner.capture(["gcloud", "storage", "buckets", "describe", url, f"--project={project}",
                                           "--format=value(name)"])
        create = ["gcloud", "storage", "buckets", "create", url, f"--project={project}",
                  f"--location={bucket_location(settings)}", "--uniform-bucket-level-access", "--public-access-prevention"]
        versioning = ["gcloud", "storage", "buckets", "update", url, "--versioning"]
        if self.dry:
            print(f"DRY_RUN: (when {url} does not exist yet: {shlex.join(create)}; {shlex.join(versioning)})", flush=True)
        elif status != 0:
            if not re.search(r"NOT_FOUND|not found|\b404\b", out, re.IGNORECASE):
                raise LaunchError(explain_failure(["gcloud"], status, out, context))
            print(f"terraform state: creating {url} (versioned, private)", flush=True)
            self.runner.stream(create, context)
            self.runner.stream(versioning, context)
        local = os.path.join(self.tf_dir, "terraform.tfstate")
        migrate = ["-migrate-state", "-force-copy"] if os.path.exists(local) else []
        self.runner.stream(self.terraform("init", "-input=false", f"-backend-config=bucket={bucket}",
                                          f"-backend-config=prefix={STATE_PREFIX}", *migrate))
        if migrate and not self.dry:
            os.replace(local, f"{local}.migrated")
            print(f"terraform state: the local state is now in {url}/{STATE_PREFIX}; the old file is "
                  f"{local}.migrated", flush=True)

    def check_cloud(self, terraform: bool) -> None:
        if self.dry:
            if terraform and not os.path.exists(self.tfvars):
                print(f"DRY_RUN: {self.tfvars} not found: a real run stops here (no project set; `cp "
                      f"{os.path.join(self.tf_dir, 'terraform.tfvars.example')} {self.tfvars}` and set project_id); "
                      "the commands below are what it would run with one", flush=True)
            return
        if terraform:
            tfvars_project(self.tfvars)
        check_tool("gcloud")
        check_gcloud_auth(self.runner)
        if terraform:
            check_tool("terraform")
            check_application_default(self.runner)

    def write_setup_script(self, o: Outputs) -> str:
        """The current start-up script (Terraform's rendering of the lock) as build/tpu-llm-setup.sh."""
        script = os.path.join("build", SETUP_SCRIPT)
        if not self.dry:
            os.makedirs("build", exist_ok=True)
            with open(script, "w", encoding="utf-8") as f:
                f.write(o["startup_script"])
        return script


def lock_sha256(tf_dir: str) -> str:
    """sha256 of worker-requirements.txt, as Terraform's sha256() puts it in the workers' ready marker."""
    path = os.path.join(tf_dir, "worker-requirements.txt")
    with open(path if os.path.exists(path) else LOCK_PATH, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def billing_note(o: Outputs, owned: bool = False) -> str:
    """The last word of a failure once a TPU exists: it bills, and how it stops."""
    if owned:
        return f"worker 0 deletes TPU {o['tpu_name']} when the run ends (DOWN_AFTER=1); `make tpu-status` shows it"
    return f"TPU {o['tpu_name']} is still up and billing: `make tpu-down` deletes it"


STATE_PREFIX = "terraform/state"  # the state's folder in the state bucket (default.tfstate in it)


def state_bucket(settings: dict[str, str]) -> str:
    """The deployment's state bucket: TF_STATE_BUCKET, else the data bucket's name + "-tf" (within 63 characters)."""
    if env("TF_STATE_BUCKET"):
        return env("TF_STATE_BUCKET").removeprefix("gs://")
    prefix = settings.get("name_prefix") or "tpu-llm"
    return (settings.get("bucket_name") or f"{settings.get('project_id', '<project_id>')}-{prefix}") + "-tf"


def bucket_location(settings: dict[str, str]) -> str:
    """Where infra/ puts its buckets (main.tf: bucket_location, else the region of the zone)."""
    if settings.get("bucket_location"):
        return settings["bucket_location"].upper()
    region = settings.get("region") or "-".join(settings.get("zone", DEFAULT_ZONE).split("-")[:2])
    return region.upper()


def queued_name(o: Outputs) -> str:
    return str(o["queued_resource_name"] or f"{o['tpu_name']}-queued")


def read_tfvars(path: str) -> dict[str, str]:
    """Simple `key = "value"` / `key = true` lines of terraform.tfvars (for messages only)."""
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        pairs = re.findall(r'^\s*([a-z_]+)\s*=\s*"?([^"\n#]*?)"?\s*(?:#.*)?$', f.read(), re.MULTILINE)
    return dict(pairs)


def venv_tool(name: str) -> str:
    """A tool of the Python running this script (the project's .venv under make), relative if possible."""
    path = os.path.join(os.path.dirname(sys.executable), name)
    rel = os.path.relpath(path)
    return rel if not rel.startswith("..") else path

