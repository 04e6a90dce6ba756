"""`make tpu-up` and `make tpu-down` (for tpu_llm/cloud/driver.py): Terraform applies, the queued resource,
the wait for READY and for every worker's set-up, and the confirmation before buckets go. Standard library only."""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
import time

from tpu_llm.cloud.base import (DEFAULT_ZONE, Cloud, billing_note, lock_sha256, queued_name, read_tfvars,
                                 state_bucket)
from tpu_llm.cloud.shell import LaunchError, Outputs, explain_failure
from tpu_llm.cloud.ssh_agent import ensure_key_in_agent
from tpu_llm.cloud.worker_plan import SETUP_SCRIPT, STATE_DIR, flag


PLAN_FILE = ".tpu-up.tfplan"  # in infra/ (ignored by git), applied as planned, then removed


class Provision(Cloud):
    """`make tpu-up` and `make tpu-down`."""

    def up(self) -> None:
        settings = read_tfvars(self.tfvars)
        accel, spot = settings.get("accelerator_type", "v5litepod-8"), settings.get("spot", "true") == "true"
        if re.match(r"(v7|tpu7|ironwood)", accel.lower()):  # as infra/variables.tf, before anything runs
            raise LaunchError(f"accelerator_type = \"{accel}\" in {self.tfvars}: TPU7x (Ironwood) does not run "
                              "TensorFlow (tensorflow-tpu ends at 2.20.0), and the Cloud TPU API this uses does not "
                              "reach it; use v6e, v5p, v5litepod (v5e) or v4")
        print(f"tpu-up: this creates billable resources: a {accel} TPU ({'spot' if spot else 'on-demand'}), billed "
              "for every hour it exists, training or idle, plus a bucket, Cloud NAT and logs. Run `make tpu-down` "
              "when you are done.", flush=True)
        self.check_cloud(terraform=True)
        self.check_worker_image(settings)  # before anything is created: a missing tag fails in seconds
        self.init_backend(settings)
        prefix = settings.get("name_prefix", "tpu-llm")
        context = {"project": settings.get("project_id", "?"), "zone": settings.get("zone", DEFAULT_ZONE),
                   "accelerator": accel, "family": accel.split("-")[0], "tpu_name": f"{prefix}-tpu", "prefix": prefix}
        # The APIs first: the plan reads the zone's accelerator types and images from the TPU API
        # (infra/tpu.tf), which a new project has not enabled yet. A no-op once they are on.
        self.runner.stream(self.terraform("apply", *self.tf_var_args("-target=google_project_service.apis")), context)
        previous = self.outputs(required=False)
        replace, state = self.clear_the_way(previous, settings)
        self.apply_planned(previous or Outputs.preview(settings), state, replace, context)
        self.runner.fake_state = "READY"  # a dry run pretends the apply worked
        o = self.save_outputs()
        if o is None:
            print(f"tpu-up: (dry run without {self.outputs_path}: nothing more to show)")
            return
        if o.get("runtime_choice"):
            print(f"tpu-up: runtime image {o['runtime_choice']}", flush=True)
        if o.get("tf_worker_image"):
            print(f"tpu-up: pod set-up on every worker: tensorflow-tpu from the lock, and the TPU runtime serving "
                  f"TensorFlow from {o['tf_worker_image']} on port 8470", flush=True)
        if o["use_queued_resource"]:
            self.request_queued(o)
        else:
            self.billing = billing_note(o)  # the VM exists (or is being created) once the apply is done
            self.wait_ready(o)
        self.billing = billing_note(o)  # from here on, every failure says it
        self.hosts_from_api(o)
        ensure_key_in_agent(self.runner)  # before the first --worker=all command
        self.wait_setup(o)
        print(f"tpu-up: {o['tpu_name']} ({o['accelerator_type']}, {o['worker_count']} worker(s)) is READY in "
              f"{o['zone']}; bucket {o['bucket_url']}. Next: `make train` (or `make data-upload` first for a "
              "pod slice).", flush=True)

    def check_worker_image(self, settings: dict[str, str]) -> None:
        """A pod's hosts serve TensorFlow from the TF worker container the lock's tensorflow-tpu names: its tag is
        asked of the registry (`gcloud container images describe`) before anything is created. A tag the registry
        does not know stops here, named; a registry that cannot be asked (no permission, an old gcloud) is said,
        and the set-up on the TPU stops as soon as the pull fails (infra/startup.sh.tftpl)."""
        image = str(Outputs.preview(settings).get("tf_worker_image") or "")
        if not image:  # one host: no container
            return
        argv = ["gcloud", "container", "images", "describe", image, f"--project={settings.get('project_id', '?')}",
                "--format=value(image_summary.digest)"]
        status, out = self.runner.capture(argv, dry_result="sha256:<digest>")
        if status == 0:
            print(f"tpu-up: the pod's TF worker container {image} exists ({out.strip() or 'no digest shown'})",
                  flush=True)
            return
        said = next((line.strip() for line in reversed(out.splitlines()) if line.strip()), f"exit status {status}")
        if re.search(r"MANIFEST_UNKNOWN|manifest unknown|NOT_FOUND|not found|\b404\b", out, re.IGNORECASE):
            raise LaunchError(f"the pod's TF worker container {image} does not exist (the registry: {said[:200]}); "
                              f"every host of a {settings.get('accelerator_type')} pod serves TensorFlow from it, and "
                              "infra/worker-requirements.txt's tensorflow-tpu names that tag: nothing was created. "
                              "Pin a tensorflow-tpu whose tag exists (`gcloud container images list-tags "
                              f"{image.rsplit(':', 1)[0]}` lists them), or choose a single-host accelerator_type")
        print(f"tpu-up: could not ask the registry for {image} ({said[:200]}); the set-up on the TPU stops as soon as "
              "its pull fails, naming it", flush=True)

    def clear_the_way(self, previous: Outputs | None, settings: dict[str, str]) -> tuple[list[str], str]:
        """Before the apply: a queued resource no longer wanted, or a preempted TPU, goes. The -replace
        arguments that recreate a preempted TPU VM, and the TPU's state ("" if none)."""
        if previous and previous["use_queued_resource"] and settings.get("use_queued_resource") != "true":
            # its node carries the TPU's name, which the google_tpu_v2_vm about to be created needs: a running
            # one is replaced, so only with REPLACE=1
            # (REPLACE=1 asks worker 0 first; a TPU that is not running has no run to ask about)
            self.refuse_replacing(previous, self.tpu_state(previous) if previous["tpu_enabled"] else "",
                                  ["use_queued_resource: true -> false (a TPU VM replaces the queued resource's node)"])
            self.delete_queued(previous, "tpu-up: use_queued_resource is off now")
        if not previous or not previous["tpu_enabled"]:
            return [], ""
        state = self.tpu_state(previous)
        if state not in ("PREEMPTED", "TERMINATED"):
            return [], state
        print(f"tpu-up: TPU {previous['tpu_name']} is {state} (a spot TPU was reclaimed); recreating it. "
              "The bucket, its checkpoints and the network are kept; `make train` resumes the run.", flush=True)
        if previous["use_queued_resource"]:
            self.delete_queued(previous, "tpu-up")
            return [], ""
        return ["-replace=google_tpu_v2_vm.tpu[0]"], state

    def apply_planned(self, previous: Outputs, state: str, replace: list[str], context: dict) -> None:
        """Plan, read the plan, apply exactly it: a plan that would replace a running TPU (runtime_version,
        accelerator_type or zone changed: each forces a new node), or keep a queued resource's running node
        unlike the plan (gcloud made it, so the plan cannot show it: queued_drift), stops here unless REPLACE=1,
        which also lets go of the pinned image (infra/tpu.tf: terraform_data.runtime_pin) to take the current
        choice, and deletes such a queued resource before the apply (request_queued makes it anew)."""
        pin = ["-replace=terraform_data.runtime_pin[0]"] if flag("REPLACE") and state and not replace else []
        self.runner.stream(self.terraform("plan", *self.tf_var_args("-var=tpu_enabled=true", *replace, *pin,
                                                                    approve=False), f"-out={PLAN_FILE}"), context)
        argv = self.terraform("show", "-json", PLAN_FILE)
        status, text = self.runner.capture(argv)
        if status != 0:
            raise LaunchError(explain_failure(argv, status, text, context))
        changes = replaced_tpus(text) if not self.dry else []
        queued = bool(previous["use_queued_resource"]) and not self.dry and running(state)
        if queued:  # gcloud made its node, not Terraform: the plan replaces nothing, so compare the node itself
            changes += queued_drift(self.live_node(previous), previous, planned_outputs(text))
        if changes and not replace:  # -replace of a preempted TPU is asked for; anything else is checked
            if self.refuse_replacing(previous, state, changes) and queued:
                self.delete_queued(previous, "tpu-up REPLACE=1")  # request_queued makes it anew after the apply
        try:
            self.runner.stream(self.terraform("apply", "-input=false", PLAN_FILE), context)
        finally:
            if not self.dry and os.path.exists(os.path.join(self.tf_dir, PLAN_FILE)):
                os.remove(os.path.join(self.tf_dir, PLAN_FILE))

    def refuse_replacing(self, previous: Outputs, state: str, changes: list[str]) -> bool:
        """A change that replaces a running TPU, or keeps one that differs from the tfvars, stops here in one line
        unless REPLACE=1 (worker 0 is asked first whether a run lives). True when the TPU is to be replaced."""
        if not changes or not running(state):
            return False
        if not flag("REPLACE"):
            raise LaunchError(f"this apply would replace the running TPU {previous['tpu_name']} ({state}), or keep it "
                              f"unlike infra/terraform.tfvars: {'; '.join(changes)}; nothing was changed. A run on it "
                              "would be lost: `make tpu-up REPLACE=1` replaces it (after `make tpu-stop`), or undo "
                              "the change in infra/terraform.tfvars")
        self.refuse_if_run_alive(previous, "tpu-up REPLACE=1")
        print(f"tpu-up: REPLACE=1: replacing TPU {previous['tpu_name']} ({'; '.join(changes)})", flush=True)
        return True

    def live_node(self, o: Outputs) -> dict:
        """The TPU node as the API describes it (acceleratorType, runtimeVersion, ...), {} if it cannot be read."""
        argv = ["gcloud", "compute", "tpus", "tpu-vm", "describe", str(o["tpu_name"]), f"--zone={o['zone']}",
                f"--project={o['project_id']}", "--format=json"]
        status, out = self.runner.capture(argv, dry_result="{}")
        try:
            node = json.loads(out) if status == 0 and out.strip() else {}
        except ValueError:
            node = {}
        return node if isinstance(node, dict) else {}

    def request_queued(self, o: Outputs) -> None:
        """Create the queued resource unless one waits or is ACTIVE, and wait for its TPU. Ctrl-C or
        SIGTERM meanwhile withdraw the request: none is left to become a billed TPU unattended."""
        try:
            queued = self.queued_state(o)
            if queued in ("FAILED", "SUSPENDED"):
                print(f"tpu-up: queued resource {queued_name(o)} is {queued}{self.queued_reason(o)}", flush=True)
                self.delete_queued(o, f"tpu-up: queued resource {queued_name(o)} is {queued}")
                queued = ""
            if not queued:
                self.create_queued(o)
            self.wait_ready(o)
        except KeyboardInterrupt:
            self.withdraw_queued(o)

    def withdraw_queued(self, o: Outputs) -> None:
        """After an interruption: delete the waiting request, or end with the exact command that does."""
        argv = self.queued_args(o, "delete", "--force", "--quiet")
        if flag("KEEP_QUEUED"):
            raise LaunchError(f"interrupted; KEEP_QUEUED=1: queued resource {queued_name(o)} keeps waiting and may "
                              f"become a billed TPU; withdraw it with: {shlex.join(argv)}")
        print(f"\ntpu-up: interrupted: withdrawing queued resource {queued_name(o)} (interrupt again to leave it)",
              flush=True)
        try:
            self.runner.stream(argv, {**o.context(), "what": "queued resource"})
        except (LaunchError, KeyboardInterrupt) as e:
            if not re.search(r"NOT_FOUND|not found", str(e), re.IGNORECASE):
                why = str(e) or "interrupted again"
                raise LaunchError(f"interrupted, and queued resource {queued_name(o)} is not deleted ({why}); it may "
                                  f"still become a billed TPU: {shlex.join(argv)}") from None
        raise LaunchError(f"interrupted: queued resource {queued_name(o)} was deleted; nothing waits to become a TPU "
                          "(`make tpu-up` requests it again)")

    def wait_ready(self, o: Outputs) -> None:
        deadline, last = time.monotonic() + self.wait_minutes * 60, None
        while True:
            queued = self.queued_state(o) if o["use_queued_resource"] else ""
            if queued in ("FAILED", "SUSPENDED"):
                reason = self.queued_reason(o)  # e.g. its valid-until time passed before capacity came
                self.delete_queued(o, f"tpu-up: queued resource {queued_name(o)} is {queued}")
                raise LaunchError(f"queued resource {queued_name(o)} ended {queued}{reason}, and was deleted; `make "
                                  "tpu-up` requests it again (TPU_WAIT_MINUTES=N waits longer, KEEP_QUEUED=1 lets "
                                  "it wait KEEP_QUEUED_HOURS unattended)")
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
            if "could not pull the pod's TF worker container" in str(e):  # a retry would fail the same way
                raise
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
            if not self.dry:  # kept for make train / tpu-status, which read the saved outputs
                with open(self.outputs_path, encoding="utf-8") as f:
                    saved = json.load(f)
                saved["worker_count"] = {**saved.get("worker_count", {}), "value": len(endpoints)}
                with open(self.outputs_path, "w", encoding="utf-8") as f:
                    json.dump(saved, f)

    def down(self) -> None:
        self.check_cloud(terraform=True)
        destroy_bucket = flag("DESTROY_BUCKET")
        self.init_backend(read_tfvars(self.tfvars))
        try:
            o = self.save_outputs()
        except LaunchError:  # no state yet: nothing of ours to delete outside Terraform
            o = None
        self.refuse_if_run_alive(o, "tpu-down")
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
        state = f"gs://{state_bucket(read_tfvars(self.tfvars))}"
        print(f"tpu-down: everything infra/ created is deleted. Kept: the state bucket {state} (the now empty "
              f"Terraform state; `gcloud storage rm -r {state}` deletes it).", flush=True)

    def refuse_if_run_alive(self, o: Outputs | None, target: str) -> None:
        """This machine never deletes a TPU whose run is alive: worker 0 is asked first (FORCE=1: not asked)."""
        if flag("FORCE") or not o or not o["tpu_enabled"] or self.tpu_state(o) != "READY":
            return  # preempted, creating or gone: no run lives there
        try:
            run = self.run_state(o)
        except LaunchError as e:
            raise LaunchError(f"{e}; nothing was deleted, and TPU {o['tpu_name']} is billing: fix the connection, or "
                              f"`make {target} FORCE=1` deletes it without asking worker 0") from None
        if run.alive:
            raise LaunchError(f"a run is training on TPU {o['tpu_name']} (worker 0, pid {run.pid}); nothing was "
                              f"deleted: `make tpu-stop` stops it (it saves a checkpoint), then `make {target}`; "
                              f"`make {target} FORCE=1` deletes the TPU under the run")

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



def running(state: str) -> bool:
    """A TPU that exists and is not preempted: replacing it loses what runs there."""
    return state not in ("", "PREEMPTED", "TERMINATED")


# What a TPU node is made of, as the plan's outputs (infra/outputs.tf) name it and the TPU API's Node does
NODE_FIELDS = {"accelerator_type": "acceleratorType", "runtime_version": "runtimeVersion"}


def planned_outputs(plan_json: str) -> dict[str, object]:
    """The outputs the plan will leave (`terraform show -json`: output_changes.NAME.after); UNKNOWN for a value
    known only after the apply."""
    try:
        plan = json.loads(plan_json or "{}")
    except ValueError:
        return {}
    changes = plan.get("output_changes") if isinstance(plan, dict) else None
    out = {}
    for name, change in (changes if isinstance(changes, dict) else {}).items():
        if isinstance(change, dict):
            out[name] = UNKNOWN if change.get("after_unknown") is True else change.get("after")
    return out


UNKNOWN = "(known after apply)"


def queued_drift(node: dict, previous: Outputs, planned: dict[str, object]) -> list[str]:
    """How the running node of a queued resource differs from what the plan now asks for: "NAME: LIVE -> PLANNED"
    for its accelerator type and image (as the API describes the node, else as it was asked), zone and spot.
    gcloud, not Terraform, made that node, so the plan would silently keep it."""
    live = {"zone": previous.get("zone"), "spot": previous.get("spot")}
    live.update({name: node.get(api) or previous.get(name) for name, api in NODE_FIELDS.items()})
    drift = []
    for name, was in live.items():
        wanted = planned.get(name, was)
        if wanted != was:
            drift.append(f"{name}: {was!r} -> " + (UNKNOWN if wanted == UNKNOWN else repr(wanted)))
    return drift


def replaced_tpus(plan_json: str) -> list[str]:
    """What `terraform show -json PLAN` says would replace a TPU node: "ADDRESS (ATTRIBUTE: BEFORE -> AFTER, ...)"
    per replaced google_tpu_v2_vm, from its resource_changes (actions delete and create; replace_paths
    names the attributes that force it), or "ADDRESS (deleted: ...)" for one deleted alone (in `make tpu-up`,
    which keeps tpu_enabled on, that is use_queued_resource switched on: a queued resource's node takes its
    place). Anything else in the file is ignored."""
    try:
        plan = json.loads(plan_json or "{}")
    except ValueError:
        raise LaunchError("`terraform show -json` printed no plan; run `make tpu-up` again") from None
    found = []
    changes = plan.get("resource_changes") if isinstance(plan, dict) else None
    for change in changes if isinstance(changes, list) else []:
        body = change.get("change") if isinstance(change, dict) else None
        if not isinstance(body, dict) or change.get("type") != "google_tpu_v2_vm":
            continue
        actions = body.get("actions") if isinstance(body.get("actions"), list) else []
        if "delete" not in actions:  # delete and create: replaced; delete alone: a queued resource's node follows
            continue
        before, after, unknown = (body.get(k) if isinstance(body.get(k), dict) else {}
                                  for k in ("before", "after", "after_unknown"))
        paths = [p[0] for p in body.get("replace_paths") or [] if isinstance(p, list) and p and isinstance(p[0], str)]
        said = [f"{name}: {before.get(name)!r} -> "
                + ("(known after apply)" if unknown.get(name) else repr(after.get(name))) for name in paths]
        if "create" not in actions:
            said = [f"deleted: use_queued_resource is on now ({change.get('action_reason', 'no reason given')})"]
        found.append(f"{change.get('address', 'google_tpu_v2_vm')} ({', '.join(said) or change.get('action_reason')})")
    return found
