#!/usr/bin/env python3
"""Cloud TPU glue behind the Makefile: tpu-up, train, tpu-down, tpu-status, tpu-ssh, tpu-logs, tensorboard, data-upload.

    python -m tpu_llm.cloud up | down | status | train --local-command CMD | ssh | logs | tensorboard | data-upload

Terraform (infra/) makes the TPU, network, bucket and service account; this script reads what it
made from `terraform output -json` (saved to infra/.outputs.json by `up`) and drives the workers
with `gcloud compute tpus tpu-vm ssh/scp --worker=...`. With use_queued_resource, this script
creates the queued resource with gcloud (on Terraform's network, service account and start-up
script) and deletes it with `--force` before any destroy or re-creation: the provider's queued
resource can neither take a service account nor delete an ACTIVE queued resource. Standard
library only.

How training is launched (as Google's own TF-on-TPU test harness does it):
  single-host slice  on the VM, `--strategy=tpu --tpu=local`, with PJRT:
                     NEXT_PLUGGABLE_DEVICE_USE_C_API=true TF_PLUGGABLE_DEVICE_LIBRARY_PATH=/lib/libtpu.so
                     (plus TPU_LIBRARY_PATH=/lib/libtpu.so: tpu_llm/cloud/worker_plan.py says why)
  multi-host slice   (a -pod runtime image) on worker 0 only, `--strategy=tpu --tpu=NAME`, with
                     TPU_NAME=NAME TPU_LOAD_LIBRARY=0: the resolver reaches the TF servers that the pod
                     runtime starts on every host. Their input pipeline cannot run tensorflow-text's
                     ops, so pods read pre-tokenized TFRecord shards (`make data-upload`).
The code is copied to every worker and installed there first; the run directory is on the bucket.

Settings come from the environment (the Makefile passes its variables through):
  DRY_RUN=1          print every terraform/gcloud command instead of running it
  CONFIG, RUN, RUN_DIR, DATA, TOKENIZER, TOKENIZER_MODEL, ARGS   what to train (see the Makefile)
  INPUT, SHARDS, OVERWRITE                                       data-upload
  TRAIN_ON=auto|tpu|local, WORKER, LOGS=train|gcs|setup, PORT, TPU_WAIT_MINUTES
  DESTROY_BUCKET=1 [YES=1]   tpu-down deletes everything, buckets included, after showing what and
                             asking (YES=1: without asking)
  TPU_SSH=iap|internal   ssh through Identity-Aware Proxy (default; needs gcloud's alpha component)
                         or to internal IPs (from a VM inside the VPC)
  TF_DIR, TFVARS, TF_OUTPUTS   where the Terraform files, variables and saved outputs are
  DRY_RUN_TPU_STATE      the TPU state a dry run pretends `gcloud ... describe` answered (tests)
  DRY_RUN_QUEUED_STATE   the same for the queued resource (default ACTIVE; "" = it does not exist)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import sys
import time

from tpu_llm.cloud.shell import (EXIT_ERROR, LaunchError, Outputs, Runner, check_application_default, check_gcloud_auth,
                                 check_tool, explain_failure, tfvars_project)
from tpu_llm.cloud.ssh_agent import ensure_key_in_agent
from tpu_llm.cloud.worker_plan import (INSTALL, LOG_DIR, PID_FILE, SETUP_SCRIPT, SOURCE_ARCHIVE, STATE_DIR, TRAIN_LOG,
                                       TrainPlan, default_run_dir, env, flag, pack_source, source_paths)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
LOCK = os.path.join("infra", "worker-requirements.txt")


class Launcher:
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

    # ---------------------------------------------------------------------------------------------
    # Building blocks

    def terraform(self, *args: str) -> list[str]:
        return ["terraform", f"-chdir={self.tf_dir}", *args]

    def tf_var_args(self, *extra: str) -> list[str]:
        rel = os.path.relpath(self.tfvars, self.tf_dir)  # -var-file is read from TF_DIR (-chdir)
        var_file = os.path.abspath(self.tfvars) if rel.startswith("..") else rel
        return ["-input=false", "-auto-approve", f"-var-file={var_file}", *extra]

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
            # the request ends with the wait: never a TPU hours later that nobody waits for
            f"--valid-until-duration={max(60, int(self.wait_minutes * 60))}s")
        print(f"tpu-up: requesting {o['accelerator_type']} through queued resource {queued_name(o)}; it waits for "
              "capacity", flush=True)
        self.runner.stream(argv, {**o.context(), "what": "queued resource"})

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

    # ---------------------------------------------------------------------------------------------
    # tpu-up / tpu-down

    def up(self) -> None:
        settings = read_tfvars(self.tfvars)
        accel, spot = settings.get("accelerator_type", "v5litepod-8"), settings.get("spot", "true") == "true"
        print(f"tpu-up: this creates billable resources: a {accel} TPU ({'spot' if spot else 'on-demand'}), billed "
              "for every hour it exists, training or idle, plus a bucket, Cloud NAT and logs. Run `make tpu-down` "
              "when you are done.", flush=True)
        self.check_cloud(terraform=True)
        self.runner.stream(self.terraform("init", "-input=false"))
        prefix = settings.get("name_prefix", "tpu-llm")
        context = {"project": settings.get("project_id", "?"), "zone": settings.get("zone", DEFAULT_ZONE),
                   "accelerator": accel, "family": accel.split("-")[0], "tpu_name": f"{prefix}-tpu", "prefix": prefix}
        # The APIs first: the plan reads the zone's accelerator types and images from the TPU API
        # (infra/tpu.tf), which a new project has not enabled yet. A no-op once they are on.
        self.runner.stream(self.terraform("apply", *self.tf_var_args("-target=google_project_service.apis")), context)
        replace = []
        previous = self.outputs(required=False)
        if previous and previous["use_queued_resource"] and settings.get("use_queued_resource") != "true":
            # its node carries the TPU's name, which the google_tpu_v2_vm about to be created needs
            self.delete_queued(previous, "tpu-up: use_queued_resource is off now")
        if previous and previous["tpu_enabled"]:
            state = self.tpu_state(previous)
            if state in ("PREEMPTED", "TERMINATED"):
                print(f"tpu-up: TPU {previous['tpu_name']} is {state} (a spot TPU was reclaimed); recreating it. "
                      "The bucket, its checkpoints and the network are kept; `make train` resumes the run.", flush=True)
                if previous["use_queued_resource"]:
                    self.delete_queued(previous, "tpu-up")
                else:
                    replace = ["-replace=google_tpu_v2_vm.tpu[0]"]
        self.runner.stream(self.terraform("apply", *self.tf_var_args("-var=tpu_enabled=true", *replace)), context)
        self.runner.fake_state = "READY"  # a dry run pretends the apply worked
        o = self.save_outputs()
        if o is None:
            print(f"tpu-up: (dry run without {self.outputs_path}: nothing more to show)")
            return
        if o["use_queued_resource"]:
            queued = self.queued_state(o)
            if queued in ("FAILED", "SUSPENDED"):
                self.delete_queued(o, f"tpu-up: queued resource {queued_name(o)} is {queued}")
                queued = ""
            if not queued:
                self.create_queued(o)
        if o.get("runtime_choice"):
            print(f"tpu-up: runtime image {o['runtime_choice']}", flush=True)
        self.wait_ready(o)
        self.hosts_from_api(o)
        ensure_key_in_agent(self.runner)  # before the first --worker=all command
        self.wait_setup(o)
        print(f"tpu-up: {o['tpu_name']} ({o['accelerator_type']}, {o['worker_count']} worker(s)) is READY in "
              f"{o['zone']}; bucket {o['bucket_url']}. Next: `make train` (or `make data-upload` first for a "
              "pod slice).", flush=True)

    def wait_ready(self, o: Outputs) -> None:
        deadline, last = time.monotonic() + self.wait_minutes * 60, None
        while True:
            queued = self.queued_state(o) if o["use_queued_resource"] else ""
            if queued in ("FAILED", "SUSPENDED"):
                raise LaunchError(f"queued resource {queued_name(o)} is {queued}: `gcloud compute tpus "
                                  f"queued-resources describe {queued_name(o)} --zone={o['zone']}` says "
                                  "why; `make tpu-up` deletes it and requests it again")
            state = self.tpu_state(o)
            if state == "READY":
                return
            if state in ("PREEMPTED", "TERMINATED"):
                raise LaunchError(f"TPU {o['tpu_name']} became {state} while starting; run `make tpu-up` again "
                                  "to recreate it")
            shown = f"{state or 'not created yet'}" + (f" (queued resource: {queued})" if queued else "")
            if shown != last:
                print(f"tpu-up: TPU {o['tpu_name']} is {shown}; waiting for READY", flush=True)
                last = shown
            if time.monotonic() > deadline:
                waited = f"TPU {o['tpu_name']} is still {shown} after {self.wait_minutes:g} minutes"
                if o["use_queued_resource"] and not flag("KEEP_QUEUED"):
                    self.delete_queued(o, "tpu-up: gave up waiting")
                    raise LaunchError(f"{waited}; the queued resource was deleted, so no TPU comes up unattended "
                                      "later (KEEP_QUEUED=1 keeps it waiting until its valid-until time); `make "
                                      "tpu-up` requests it again, TPU_WAIT_MINUTES=N waits longer")
                if o["use_queued_resource"]:
                    raise LaunchError(f"{waited}; KEEP_QUEUED=1: the queued resource keeps waiting until its "
                                      "valid-until time and may become a billed TPU: `make tpu-status` shows it, "
                                      "`make tpu-down` deletes it")
                raise LaunchError(f"{waited}; run `make tpu-up` again to keep waiting, or `make tpu-down` to give up")
            time.sleep(self.poll_seconds)

    def write_setup_script(self, o: Outputs) -> str:
        """The current start-up script (Terraform's rendering of the lock) as build/tpu-llm-setup.sh."""
        script = os.path.join("build", SETUP_SCRIPT)
        if not self.dry:
            os.makedirs("build", exist_ok=True)
            with open(script, "w", encoding="utf-8") as f:
                f.write(o["startup_script"])
        return script

    def wait_setup(self, o: Outputs) -> None:
        """Wait for the boot-time set-up on every worker; a worker set up for another lock (metadata is
        updated in place and never re-runs) or a failed one runs the current script, copied first."""
        rounds = max(1, int(self.wait_minutes * 6))
        lock = lock_sha256(self.tf_dir)
        self.runner.stream(self.scp(o, self.write_setup_script(o), SETUP_SCRIPT, worker="all"), o.context())
        command = (f"for i in $(seq {rounds}); do "
                   f"if [ -f {STATE_DIR}/ready ] || [ -f {STATE_DIR}/failed ]; then break; fi; sleep 10; done; "
                   f"if grep -qx 'lock={lock}' {STATE_DIR}/ready 2>/dev/null; then exit 0; fi; "
                   f"if [ ! -f {STATE_DIR}/ready ] && [ ! -f {STATE_DIR}/failed ]; then "
                   f"echo \"set-up still running on $(hostname)\"; exit 1; fi; "
                   f"echo \"set-up on $(hostname) failed or is for another lock; running the current one\"; "
                   f"sudo bash ~/{SETUP_SCRIPT} && exit 0; tail -n 20 /var/log/tpu-llm-setup.log; exit 1")
        print(f"tpu-up: waiting for the set-up script (lock {lock[:12]}) on {o['worker_count']} worker(s)", flush=True)
        try:
            self.runner.stream(self.ssh(o, "all", command), o.context())
        except LaunchError as e:
            raise LaunchError(f"the worker set-up did not finish ({e}); `make tpu-logs LOGS=setup` shows its "
                              "log, and `make tpu-up` retries it") from None

    def hosts_from_api(self, o: Outputs) -> None:
        """The host count from the node's network endpoints (one per worker), not the plan's estimate."""
        argv = ["gcloud", "compute", "tpus", "tpu-vm", "describe", str(o["tpu_name"]), f"--zone={o['zone']}",
                f"--project={o['project_id']}", "--format=json(networkEndpoints)"]
        status, out = self.runner.capture(argv, dry_result="{}")
        try:
            endpoints = json.loads(out).get("networkEndpoints") or [] if status == 0 and out.strip() else []
        except ValueError:
            endpoints = []
        if endpoints and len(endpoints) != o["worker_count"]:
            print(f"tpu-up: the TPU API lists {len(endpoints)} hosts ({o['worker_count']} estimated); using "
                  f"{len(endpoints)}", flush=True)
            o["worker_count"] = len(endpoints)

    def down(self) -> None:
        self.check_cloud(terraform=True)
        destroy_bucket = flag("DESTROY_BUCKET")
        self.runner.stream(self.terraform("init", "-input=false"))
        try:
            o = self.save_outputs()
        except LaunchError:  # no state yet: nothing of ours to delete outside Terraform
            o = None
        if destroy_bucket:  # asked before anything is deleted
            self.confirm_destroy(o)
        if o and o["use_queued_resource"]:  # before Terraform: its queued-resource delete has no force
            self.delete_queued(o, "tpu-down")
        if not destroy_bucket:
            self.runner.stream(self.terraform("apply", *self.tf_var_args("-var=tpu_enabled=false")))
            o = self.save_outputs()
            bucket = o["bucket_url"] if o else "the bucket"
            print(f"tpu-down: the TPU is deleted. Kept: {bucket} (data, checkpoints, TensorBoard logs), the "
                  "network and the service account (Cloud NAT bills a little per hour; `make tpu-down "
                  "DESTROY_BUCKET=1` removes everything).", flush=True)
            return
        self.runner.stream(self.terraform("apply", *self.tf_var_args("-var=tpu_enabled=false",
                                                                     "-var=bucket_force_destroy=true")))
        self.runner.stream(self.terraform("destroy", *self.tf_var_args("-var=bucket_force_destroy=true")))
        if not self.dry and os.path.exists(self.outputs_path):
            os.remove(self.outputs_path)
        print("tpu-down: everything infra/ created is deleted.", flush=True)

    def confirm_destroy(self, o: Outputs | None) -> None:
        """Show the buckets DESTROY_BUCKET=1 deletes with how many objects (all versions) they hold,
        and ask for the data bucket's name, unless YES=1."""
        buckets = [str(u) for u in ((o or {}).get("bucket_url"), (o or {}).get("log_bucket_url")) if u]
        if not buckets and self.dry:
            print(f"DRY_RUN: (no {self.outputs_path}: a real run lists the buckets from `terraform output` with "
                  "their object counts and asks before deleting; YES=1 skips the question)", flush=True)
            return
        if not buckets:
            raise LaunchError("DESTROY_BUCKET=1: cannot tell which buckets would be deleted (no Terraform outputs); "
                              "`make tpu-up` first, or delete them by hand after `gcloud storage ls`")
        print("tpu-down: DESTROY_BUCKET=1 deletes everything infra/ created, and these buckets with every object "
              "in them (all versions):", flush=True)
        for url in buckets:
            argv = ["gcloud", "storage", "ls", "--all-versions", f"{url}/**", f"--project={o['project_id']}"]
            status, out = self.runner.capture(argv)
            if status != 0 and not re.search(r"matched no objects|One or more URLs matched no", out):
                raise LaunchError(explain_failure(argv, status, out, {**o.context(), "what": f"bucket {url}"}))
            count = sum(1 for line in out.splitlines() if line.startswith("gs://")) if status == 0 else 0
            print(f"  {url}: {'?' if self.dry else count} object(s)", flush=True)
        name = buckets[0].removeprefix("gs://")
        if flag("YES"):
            print("tpu-down: YES=1: not asking", flush=True)
            return
        if self.dry:
            print(f"DRY_RUN: (a real run asks for the bucket name {name} here; YES=1 skips the question)", flush=True)
            return
        if not sys.stdin.isatty():
            raise LaunchError(f"DESTROY_BUCKET=1 deletes {', '.join(buckets)} with everything in them; nothing was "
                              "deleted: run it in a terminal to confirm, or add YES=1")
        answer = input(f"Type the bucket name {name} to delete it all: ").strip()
        if answer != name:
            raise LaunchError(f"not confirmed ({answer!r} is not {name}); nothing was deleted")

    # ---------------------------------------------------------------------------------------------
    # tpu-status

    def status(self) -> int:
        """The TPU (or queued resource): state, health, workers; the run's log tail from Cloud Storage."""
        o = self.outputs()
        self.check_cloud(terraform=False)
        print(f"tpu-status: {o['tpu_name']} ({o['accelerator_type']}, {o['worker_count']} worker(s), "
              f"{'spot' if o['spot'] else 'on-demand'}) in {o['zone']}, project {o['project_id']}", flush=True)
        if not o["tpu_enabled"]:
            print("  TPU: deleted by `make tpu-down` (`make tpu-up` brings it back)")
        else:
            if o["use_queued_resource"]:
                print(f"  queued resource {queued_name(o)}: {self.queued_state(o) or 'does not exist'}")
            argv = ["gcloud", "compute", "tpus", "tpu-vm", "describe", str(o["tpu_name"]), f"--zone={o['zone']}",
                    f"--project={o['project_id']}", "--format=json"]
            status, out = self.runner.capture(argv, dry_result="{}")
            if status != 0 and not re.search(r"NOT_FOUND|not found", out, re.IGNORECASE):
                raise LaunchError(explain_failure(argv, status, out, o.context()))
            for line in describe_node(json.loads(out) if status == 0 and out.strip() else None):
                print(f"  {line}")
        self.print_log_tail(o, lines=int(env("LOG_LINES", "20")))
        return 0

    def newest_log(self, o: Outputs, run_dir: str) -> str:
        """gs:// URL of the run's newest training log, or ""."""
        argv = ["gcloud", "storage", "ls", f"{run_dir}/{LOG_DIR}/train-*.log", f"--project={o['project_id']}"]
        status, out = self.runner.capture(argv)
        logs = sorted(line.strip() for line in out.splitlines() if line.strip().startswith("gs://")) if status == 0 else []
        return logs[-1] if logs else ""

    def watched_run_dir(self, o: Outputs) -> str:
        """RUN_DIR / RUN / CONFIG when given, else the run `make train` last started, else the default."""
        if any(env(k) for k in ("RUN_DIR", "RUN", "CONFIG")) or not os.path.exists(self.last_run_path):
            return default_run_dir(o)
        try:
            with open(self.last_run_path, encoding="utf-8") as f:
                return str(json.load(f)["run_dir"])
        except (OSError, ValueError, KeyError):
            return default_run_dir(o)

    def record_run(self, plan: TrainPlan) -> None:
        with open(self.last_run_path, "w", encoding="utf-8") as f:
            json.dump({"run_dir": plan.run_dir, "config": plan.config,
                       "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, f)

    def print_log_tail(self, o: Outputs, lines: int, url: str | None = None) -> None:
        run_dir = self.watched_run_dir(o)
        url = self.newest_log(o, run_dir) if url is None else url
        if not url:
            if not self.dry:
                print(f"  training log: none in {run_dir}/{LOG_DIR}/ (RUN=NAME or RUN_DIR=gs://... picks another run)")
            return
        argv = ["gcloud", "storage", "cat", url, f"--project={o['project_id']}"]
        status, out = self.runner.capture(argv)
        if status != 0:
            raise LaunchError(explain_failure(argv, status, out, {**o.context(), "what": f"log {url}"}))
        print(f"  training log {url} (last {lines} lines):")
        for line in out.splitlines()[-lines:]:
            print(f"    {line}")

    # ---------------------------------------------------------------------------------------------
    # train

    def decide(self) -> tuple[Outputs | None, str]:
        """(outputs, reason): outputs when training goes to the TPU, None for a local run."""
        where = env("TRAIN_ON", "auto")
        if where not in ("auto", "tpu", "local"):
            raise LaunchError(f"TRAIN_ON={where!r}: use auto, tpu or local")
        if where == "local":
            return None, "locally on this machine: TRAIN_ON=local"
        o = self.outputs(required=where == "tpu")
        if o is None:
            return None, (f"locally on this machine: no Cloud TPU outputs ({self.outputs_path} not found; "
                          "`make tpu-up` creates a TPU and them)")
        if not o["tpu_enabled"]:
            if where == "tpu":
                raise LaunchError("TRAIN_ON=tpu, but the TPU was deleted by `make tpu-down`; run `make tpu-up`")
            return None, (f"locally on this machine: {self.outputs_path} says the TPU was deleted by `make tpu-down` "
                          "(`make tpu-up` brings it back)")
        return o, (f"on Cloud TPU {o['tpu_name']} ({o['accelerator_type']}, {o['worker_count']} worker(s), "
                   f"{o['zone']}): {self.outputs_path} from `make tpu-up` says it exists (TRAIN_ON=local trains "
                   "here instead)")

    def train(self, local_command: str) -> int:
        o, reason = self.decide()
        print(f"train: {reason}", flush=True)
        if o is None:
            argv = shlex.split(local_command) + shlex.split(env("ARGS"))
            self.runner.show(argv)
            if self.dry:
                return 0
            sys.stdout.flush()
            os.execvp(argv[0], argv)
        plan = TrainPlan.from_env(o)
        self.check_cloud(terraform=False)
        state = self.tpu_state(o)
        if state == "PREEMPTED":
            raise LaunchError(f"TPU {o['tpu_name']} was preempted (spot): run `make tpu-up` to recreate it, then "
                              f"`make train` resumes from the last checkpoint in {plan.run_dir}")
        if state != "READY":
            raise LaunchError(f"TPU {o['tpu_name']} is {state or 'missing'}, not READY: run `make tpu-up`")
        setup = self.write_setup_script(o)
        if self.dry:
            print(f"DRY_RUN: (would pack {', '.join(source_paths(plan.config))} and {setup} into {SOURCE_ARCHIVE})")
        else:
            pack_source(SOURCE_ARCHIVE, plan.config, setup)
        ensure_key_in_agent(self.runner)  # before the first --worker=all command
        context = o.context()
        self.runner.stream(self.scp(o, SOURCE_ARCHIVE, "tpu-llm-src.tar.gz", worker="all"), context)
        self.runner.stream(self.ssh(o, "all", INSTALL), context)
        launch = self.ssh(o, "0", plan.remote_script())
        self.runner.show(launch)
        if not self.dry:
            self.record_run(plan)
        down_after = flag("DOWN_AFTER")
        if self.dry:
            if down_after:
                print("DRY_RUN: (DOWN_AFTER=1: when the run ends, `make tpu-down` follows:)", flush=True)
                self.down()
            return 0
        status = _run_attached(launch)
        if status is None:  # detached: the run goes on
            if down_after:
                print("train: DOWN_AFTER=1 is not honoured after a detach: the run goes on and the TPU bills; "
                      "`make tpu-down` when it ends", flush=True)
            return 0
        if down_after:
            print(f"train: the run ended (exit status {status}); DOWN_AFTER=1: deleting the TPU", flush=True)
            self.down()
        if status != 0:
            raise LaunchError(f"training on worker 0 stopped with exit status {status} (its output is above; "
                              f"`make tpu-logs` shows the log); the run directory {plan.run_dir} keeps its "
                              "checkpoints, so `make train` resumes once the cause is fixed")
        return 0

    # ---------------------------------------------------------------------------------------------
    # tpu-ssh / tpu-logs / tensorboard / data-upload

    def stop(self) -> int:
        """Stop the training run on worker 0 with SIGTERM (it saves a checkpoint at the next step, then
        exits; tpu_llm/training/fault.py) and wait for it; every host's TF servers stay up."""
        o = self.outputs()
        self.check_cloud(terraform=False)
        command = (f"if [ -f {PID_FILE} ] && kill -0 \"$(cat {PID_FILE})\" 2>/dev/null; then pid=$(cat {PID_FILE}); "
                   "kill -TERM \"$pid\"; echo \"tpu-stop: SIGTERM sent to $pid; waiting for its checkpoint\"; "
                   "for i in $(seq 600); do kill -0 \"$pid\" 2>/dev/null || { echo 'tpu-stop: the run stopped'; "
                   "exit 0; }; sleep 1; done; echo 'tpu-stop: still running after 10 minutes' >&2; exit 1; "
                   "else echo 'tpu-stop: no run is training on worker 0'; fi")
        self.runner.stream(self.ssh(o, "0", command), o.context())
        print("tpu-stop: the TPU still exists and bills: `make tpu-down` deletes it", flush=True)
        return 0

    def ssh_session(self) -> int:
        o = self.outputs()
        self.check_cloud(terraform=False)
        return self.runner.interactive(self.gcloud_tpu(o, "ssh", str(o["tpu_name"]), worker=env("WORKER", "0")))

    def logs(self) -> int:
        """Follow the training log on worker 0 while the TPU is READY; otherwise (preempted, deleted)
        or with LOGS=gcs, print the copy in the run directory on Cloud Storage."""
        o = self.outputs()
        self.check_cloud(terraform=False)
        which = env("LOGS", "train")
        if which not in ("train", "gcs", "setup"):
            raise LaunchError(f"LOGS={which!r}: use train (live from worker 0, else Cloud Storage), gcs or setup")
        if which == "setup":
            return self.runner.interactive(self.ssh(o, "all", "tail -n 50 /var/log/tpu-llm-setup.log"))
        if which == "train":
            state = self.tpu_state(o) if o["tpu_enabled"] else ""
            if state == "READY":
                return self.runner.interactive(self.ssh(o, env("WORKER", "0"), f"tail -n 200 -F {TRAIN_LOG}"))
            print(f"tpu-logs: TPU {o['tpu_name']} is {state or 'gone'}; the training log from Cloud Storage:", flush=True)
        run_dir = self.watched_run_dir(o)
        url = self.newest_log(o, run_dir)
        if not url and not self.dry:
            raise LaunchError(f"no training log in {run_dir}/{LOG_DIR}/: `make train` writes one there; RUN=NAME or "
                              "RUN_DIR=gs://... picks another run")
        self.print_log_tail(o, lines=int(env("LOG_LINES", "200")), url=url)
        return 0

    def tensorboard(self) -> int:
        o = self.outputs()
        port = env("PORT", "6006")
        print(f"tensorboard: reading {o['runs_url']} (needs `gcloud auth application-default login`); open "
              f"http://localhost:{port}", flush=True)
        return self.runner.interactive([venv_tool("tensorboard"), "--logdir", str(o["runs_url"]), "--port", port])

    def data_upload(self) -> int:
        o = self.outputs()
        source = env("INPUT")
        if not source:
            raise LaunchError("make data-upload needs INPUT='corpus/*.txt' (UTF-8 text files or globs, "
                              "comma-separated)")
        local = os.path.join("build", "shards")
        prepare = [venv_tool("tpu-llm"), "data", "prepare", "--input", source, "--output", local,
                   "--tokenizer", env("TOKENIZER", "byte"), "--shards", env("SHARDS", "32"), "--overwrite"]
        if env("TOKENIZER_MODEL"):
            prepare += ["--tokenizer_model", env("TOKENIZER_MODEL")]
        upload = [venv_tool("python"), "-m", "tpu_llm.cloud", "upload", local, str(o["data_url"])]
        if flag("OVERWRITE"):
            upload.append("--overwrite")
        self.runner.stream(prepare)
        self.runner.stream(upload)
        print(f"data-upload: shards are in {o['data_url']}; `make train` reads {o['data_url']}/*.tfrecord on a pod "
              f"slice (pass DATA='{o['data_url']}/*.tfrecord' TOKENIZER={env('TOKENIZER', 'byte')} on a single "
              "host)", flush=True)
        return 0


def _run_attached(argv: list[str]) -> int | None:
    """Run the launch ssh (already shown) with the terminal attached; its exit status, None when Ctrl-C
    detached."""
    import subprocess

    try:
        return subprocess.call(argv)
    except FileNotFoundError:
        raise LaunchError(f"{argv[0]} not found on PATH") from None
    except KeyboardInterrupt:
        print("\ntrain: detached; training goes on on worker 0 (`make tpu-logs` follows it)", flush=True)
        return None


DEFAULT_ZONE = "us-central1-a"  # infra/variables.tf


def lock_sha256(tf_dir: str) -> str:
    """sha256 of worker-requirements.txt, as Terraform's sha256() puts it in the workers' ready marker."""
    path = os.path.join(tf_dir, "worker-requirements.txt")
    with open(path if os.path.exists(path) else LOCK, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def queued_name(o: Outputs) -> str:
    return str(o["queued_resource_name"] or f"{o['tpu_name']}-queued")


def describe_node(node: dict | None) -> list[str]:
    """`gcloud compute tpus tpu-vm describe --format=json` as status lines: a Cloud TPU API v2 Node
    (state, health, healthDescription, runtimeVersion, symptoms[].{symptomType, workerId, details},
    networkEndpoints[].ipAddress, one per worker)."""
    if node is None:
        return ["TPU: does not exist (`make tpu-up` creates it)"]
    if not node:
        return []  # dry run
    lines = [f"TPU: {node.get('state', '?')}" + (f", health {node['health']}" if node.get("health") else "")
             + (f" ({node['healthDescription']})" if node.get("healthDescription") else "")
             + f", image {node.get('runtimeVersion', '?')}"]
    for symptom in node.get("symptoms") or []:
        lines.append(f"symptom: {symptom.get('symptomType', '?')} on worker {symptom.get('workerId', '?')}: "
                     f"{symptom.get('details', '')}")
    endpoints = node.get("networkEndpoints") or []
    lines.append(f"workers: {len(endpoints)}" + (": " + ", ".join(
        f"{i}={e.get('ipAddress', '?')}" for i, e in enumerate(endpoints)) if endpoints else ""))
    return lines


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tpu_llm.cloud",
                                     description="Cloud TPU glue (see the Makefile's tpu-* targets)")
    parser.add_argument("command", choices=["up", "down", "status", "train", "ssh", "logs", "tensorboard",
                                            "data-upload", "stop"])
    parser.add_argument("--local-command", default="", help="train: the command for a local run (ARGS is appended)")
    args = parser.parse_args(argv)
    os.chdir(ROOT)
    launcher = Launcher()
    actions = {"up": launcher.up, "down": launcher.down, "status": launcher.status, "ssh": launcher.ssh_session, "stop": launcher.stop,
               "logs": launcher.logs,
               "tensorboard": launcher.tensorboard, "data-upload": launcher.data_upload,
               "train": lambda: launcher.train(args.local_command)}
    try:
        return actions[args.command]() or 0
    except LaunchError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
