"""`make tpu-status`, `tpu-logs`, `tpu-ssh`, `tpu-stop` and `tensorboard` (for tpu_llm/cloud/driver.py): the
TPU's state and health, the training log live from worker 0 or from Cloud Storage. Standard library only."""

from __future__ import annotations

import datetime
import json
import os
import re

from tpu_llm.cloud.base import Cloud, queued_name, venv_tool
from tpu_llm.cloud.shell import LaunchError, Outputs, explain_failure
from tpu_llm.cloud.ssh_agent import ensure_key_in_agent
from tpu_llm.cloud.worker_plan import (LOG_DIR, OWNER_PID_FILE, PID_FILE, RUN_FILES, TEARDOWN_FAILED, TRAIN_LOG,
                                       default_run_dir, env)


# On worker 0: SIGTERM to the training, wait for it; when the run owns its TPU, wait for the owner's teardown
# too and report a failed one (exit 76 with its reason, run_owner.TEARDOWN_FAILED_FILE), never a clean end.
STOP = (f"if [ -f {PID_FILE} ] && kill -0 \"$(cat {PID_FILE})\" 2>/dev/null; then pid=$(cat {PID_FILE}); "
        "kill -TERM \"$pid\"; echo \"tpu-stop: SIGTERM sent to $pid; waiting for its checkpoint\"; "
        "for i in $(seq 600); do kill -0 \"$pid\" 2>/dev/null || break; sleep 1; done; "
        "if kill -0 \"$pid\" 2>/dev/null; then echo 'tpu-stop: still running after 10 minutes' >&2; exit 1; fi; "
        "echo 'tpu-stop: the run stopped'; "
        f"if [ -s {RUN_FILES['teardown']} ]; then "
        "echo 'tpu-stop: it was started with DOWN_AFTER=1 or TTL_HOURS: worker 0 deletes the TPU now'; "
        f"for i in $(seq 900); do [ -f {OWNER_PID_FILE} ] && kill -0 \"$(cat {OWNER_PID_FILE})\" 2>/dev/null || break; "
        "sleep 1; done; "
        f"if [ -f {RUN_FILES['teardown-failed']} ]; then echo \"error: worker 0 could not delete this TPU: "
        f"$(cat {RUN_FILES['teardown-failed']})\" >&2; exit {TEARDOWN_FAILED}; fi; "
        "echo 'tpu-stop: worker 0 asked for the deletion of the TPU'; fi; exit 0; "
        "else echo 'tpu-stop: no run is training on worker 0'; fi")


class Watch(Cloud):
    """`make tpu-status`, `tpu-logs`, `tpu-ssh`, `tpu-stop`, `tensorboard`."""

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
        self.print_deployment(o)
        return 0

    def print_deployment(self, o: Outputs) -> None:
        """Every TPU and queued resource of this deployment in its zone (names starting with its prefix), with
        state and age: what bills or may bill, whatever the saved outputs say (a request left waiting, a
        node whose worker-0 teardown failed, a TPU made by hand under the prefix)."""
        prefix = str(o["tpu_name"]).removesuffix("-tpu") + "-"
        found = []
        for what, kind in (("TPU", "tpu-vm"), ("queued resource", "queued-resources")):
            argv = ["gcloud", "compute", "tpus", kind, "list", f"--zone={o['zone']}", f"--project={o['project_id']}",
                    "--format=json"]
            status, out = self.runner.capture(argv, dry_result="[]")
            if status != 0:
                raise LaunchError(explain_failure(argv, status, out, {**o.context(), "what": f"{what} list"}))
            found += [(what, item) for item in json.loads(out or "[]")
                      if str(item.get("name", "")).rsplit("/", 1)[-1].startswith(prefix)]
        print(f"  everything of {prefix.rstrip('-')} in {o['zone']} (what bills, or may):"
              + ("" if found else " nothing"))
        for what, item in found:
            state = item.get("state")
            state = state.get("state", "?") if isinstance(state, dict) else state or "?"  # a queued resource's nests
            print(f"    {what} {str(item['name']).rsplit('/', 1)[-1]}: {state}, {age(item.get('createTime', ''))}")

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

    def stop(self) -> int:
        """Stop the training run on worker 0 with SIGTERM (it saves a checkpoint at the next step, then
        exits; tpu_llm/training/fault.py) and wait for it; every host's TF servers stay up."""
        o = self.outputs()
        self.check_cloud(terraform=False)
        self.runner.stream(self.ssh(o, "0", STOP), o.context())
        print("tpu-stop: unless worker 0 said above that it deletes it, the TPU still exists and bills: `make tpu-down` "
              "deletes it", flush=True)
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
            ensure_key_in_agent(self.runner)  # gcloud needs it for --worker=all on a pod
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




def age(created: str, now: datetime.datetime | None = None) -> str:
    """'3 h 12 min old' from an API createTime (RFC 3339, UTC, up to nanoseconds), or 'age unknown'."""
    match = re.match(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)", created or "")
    if not match:
        return "age unknown"
    start = datetime.datetime.fromisoformat(match.group(1)).replace(tzinfo=datetime.timezone.utc)
    minutes = max(0, int(((now or datetime.datetime.now(datetime.timezone.utc)) - start).total_seconds() // 60))
    days, hours = divmod(minutes // 60, 24)
    return (f"{days} d " if days else "") + (f"{hours} h " if days or hours else "") + f"{minutes % 60} min old"
