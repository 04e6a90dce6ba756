#!/usr/bin/env python3
"""Cloud TPU glue behind the Makefile: tpu-up, train, tpu-down, tpu-ssh, tpu-logs, tensorboard, data-upload.

    python scripts/tpu.py up | down | train --local-command CMD | ssh | logs | tensorboard | data-upload

Terraform (infra/) makes the TPU, network, bucket and service account; this script reads what it
made from `terraform output -json` (saved to infra/.outputs.json by `up`) and drives the workers
with `gcloud compute tpus tpu-vm ssh/scp --worker=...`. Standard library only.

How training is launched (as Google's own TF-on-TPU test harness does it):
  single-host slice  on the VM, `--strategy=tpu --tpu=local`, with PJRT:
                     NEXT_PLUGGABLE_DEVICE_USE_C_API=true TF_PLUGGABLE_DEVICE_LIBRARY_PATH=/lib/libtpu.so
                     (plus TPU_LIBRARY_PATH=/lib/libtpu.so: scripts/tpu_plan.py says why)
  multi-host slice   (a -pod runtime image) on worker 0 only, `--strategy=tpu --tpu=NAME`, with
                     TPU_NAME=NAME TPU_LOAD_LIBRARY=0: the resolver reaches the TF servers that the pod
                     runtime starts on every host. Their input pipeline cannot run tensorflow-text's
                     ops, so pods read pre-tokenized TFRecord shards (`make data-upload`).
The code is copied to every worker and installed there first; the run directory is on the bucket.

Settings come from the environment (the Makefile passes its variables through):
  DRY_RUN=1          print every terraform/gcloud command instead of running it
  CONFIG, RUN, RUN_DIR, DATA, TOKENIZER, TOKENIZER_MODEL, ARGS   what to train (see the Makefile)
  INPUT, SHARDS, OVERWRITE                                       data-upload
  TRAIN_ON=auto|tpu|local, WORKER, LOGS=train|setup, PORT, DESTROY_BUCKET=1, TPU_WAIT_MINUTES
  TPU_SSH=iap|internal   ssh through Identity-Aware Proxy (default; needs gcloud's alpha component)
                         or to internal IPs (from a VM inside the VPC)
  TF_DIR, TFVARS, TF_OUTPUTS   where the Terraform files, variables and saved outputs are
  DRY_RUN_TPU_STATE      the TPU state a dry run pretends `gcloud ... describe` answered (tests)
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tpu_plan import (INSTALL, SOURCE_ARCHIVE, STATE_DIR, TRAIN_LOG, TrainPlan, env, flag,  # noqa: E402
                      pack_source, source_paths)
from tpu_shell import (EXIT_ERROR, LaunchError, Outputs, Runner, check_application_default,  # noqa: E402
                       check_gcloud_auth, check_tool, explain_failure, tfvars_project)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POLL_SECONDS = 20


class Launcher:
    def __init__(self):
        self.runner = Runner(flag("DRY_RUN"), fake_state=env("DRY_RUN_TPU_STATE", "READY"))
        self.dry = self.runner.dry_run
        self.tf_dir = env("TF_DIR", "infra")
        self.tfvars = env("TFVARS", os.path.join(self.tf_dir, "terraform.tfvars"))
        self.outputs_path = env("TF_OUTPUTS", os.path.join(self.tf_dir, ".outputs.json"))
        self.iap = env("TPU_SSH", "iap") != "internal"
        self.wait_minutes = float(env("TPU_WAIT_MINUTES", "30"))

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
            if required:
                raise LaunchError(f"no Cloud TPU outputs ({self.outputs_path} not found): run `make tpu-up` first")
            return None
        return Outputs.load(self.outputs_path)

    def save_outputs(self) -> Outputs | None:
        status, text = self.runner.capture(self.terraform("output", "-json"))
        if self.dry:
            return self.outputs(required=False)
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

    def queued_state(self, o: Outputs) -> str:
        argv = ["gcloud", "compute", "tpus", "queued-resources", "describe", str(o["queued_resource_name"]),
                f"--zone={o['zone']}", f"--project={o['project_id']}", "--format=value(state.state)"]
        status, out = self.runner.capture(argv, dry_result="ACTIVE")
        if status != 0:
            raise LaunchError(explain_failure(argv, status, out, {**o.context(), "what": "queued resource"}))
        return out.strip()

    def check_cloud(self, terraform: bool) -> None:
        if self.dry:
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
        accel, spot = settings.get("accelerator_type", "v4-8"), settings.get("spot", "true") == "true"
        print(f"tpu-up: this creates billable resources: a {accel} TPU ({'spot' if spot else 'on-demand'}), billed "
              "for every hour it exists, training or idle, plus a bucket, Cloud NAT and logs. Run `make tpu-down` "
              "when you are done.", flush=True)
        self.check_cloud(terraform=True)
        self.runner.stream(self.terraform("init", "-input=false"))
        replace = []
        previous = self.outputs(required=False)
        if previous and previous["tpu_enabled"]:
            state = self.tpu_state(previous)
            if state in ("PREEMPTED", "TERMINATED"):
                kind = "google_tpu_v2_queued_resource" if previous["use_queued_resource"] else "google_tpu_v2_vm"
                replace = [f"-replace={kind}.tpu[0]"]
                print(f"tpu-up: TPU {previous['tpu_name']} is {state} (a spot TPU was reclaimed); recreating it. "
                      "The bucket, its checkpoints and the network are kept; `make train` resumes the run.", flush=True)
        context = {"project": settings.get("project_id", "?"), "zone": settings.get("zone", "us-central2-b"),
                   "accelerator": accel, "family": accel.split("-")[0], "tpu_name": "the TPU",
                   "prefix": settings.get("name_prefix", "tpu-llm")}
        self.runner.stream(self.terraform("apply", *self.tf_var_args("-var=tpu_enabled=true", *replace)), context)
        self.runner.fake_state = "READY"  # a dry run pretends the apply worked
        o = self.save_outputs()
        if o is None:
            print(f"tpu-up: (dry run without {self.outputs_path}: nothing more to show)")
            return
        self.wait_ready(o)
        if o["use_queued_resource"]:  # a queued resource's node spec takes no startup-script metadata
            script = os.path.join("build", "tpu-llm-setup.sh")
            if not self.dry:
                os.makedirs("build", exist_ok=True)
                with open(script, "w", encoding="utf-8") as f:
                    f.write(o["startup_script"])
            self.runner.stream(self.scp(o, script, "tpu-llm-setup.sh", worker="all"), o.context())
            self.runner.stream(self.ssh(o, "all", "sudo bash tpu-llm-setup.sh"), o.context())
        self.wait_setup(o)
        print(f"tpu-up: {o['tpu_name']} ({o['accelerator_type']}, {o['worker_count']} worker(s)) is READY in "
              f"{o['zone']}; bucket {o['bucket_url']}. Next: `make train` (or `make data-upload` first for a "
              "pod slice).", flush=True)

    def wait_ready(self, o: Outputs) -> None:
        deadline, last = time.monotonic() + self.wait_minutes * 60, None
        while True:
            queued = self.queued_state(o) if o["use_queued_resource"] else ""
            if queued in ("FAILED", "SUSPENDED"):
                raise LaunchError(f"queued resource {o['queued_resource_name']} is {queued}: `gcloud compute tpus "
                                  f"queued-resources describe {o['queued_resource_name']} --zone={o['zone']}` says "
                                  "why; `make tpu-down` then `make tpu-up` requests it again")
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
                raise LaunchError(f"TPU {o['tpu_name']} is still {shown} after {self.wait_minutes:g} minutes; "
                                  "run `make tpu-up` again to keep waiting (a queued resource waits for "
                                  "capacity), or `make tpu-down` to give up")
            time.sleep(POLL_SECONDS)

    def wait_setup(self, o: Outputs) -> None:
        rounds = max(1, int(self.wait_minutes * 6))
        command = (f"for i in $(seq {rounds}); do "
                   f"if [ -f {STATE_DIR}/ready ]; then exit 0; fi; "
                   f"if [ -f {STATE_DIR}/failed ]; then echo \"set-up failed on $(hostname); running it again\"; "
                   f"sudo {STATE_DIR}/setup.sh && exit 0; tail -n 20 /var/log/tpu-llm-setup.log; exit 1; fi; "
                   f"sleep 10; done; echo \"set-up still running on $(hostname)\"; exit 1")
        print(f"tpu-up: waiting for the set-up script on {o['worker_count']} worker(s)", flush=True)
        try:
            self.runner.stream(self.ssh(o, "all", command), o.context())
        except LaunchError as e:
            raise LaunchError(f"the worker set-up did not finish ({e}); `make tpu-logs LOGS=setup` shows its "
                              "log, and `make tpu-up` retries it") from None

    def down(self) -> None:
        self.check_cloud(terraform=True)
        destroy_bucket = flag("DESTROY_BUCKET")
        self.runner.stream(self.terraform("init", "-input=false"))
        if not destroy_bucket:
            self.runner.stream(self.terraform("apply", *self.tf_var_args("-var=tpu_enabled=false")))
            o = self.save_outputs()
            bucket = o["bucket_url"] if o else "the bucket"
            print(f"tpu-down: the TPU is deleted. Kept: {bucket} (data, checkpoints, TensorBoard logs), the "
                  "network and the service account (Cloud NAT bills a little per hour; `make tpu-down "
                  "DESTROY_BUCKET=1` removes everything).", flush=True)
            return
        print("tpu-down: DESTROY_BUCKET=1: deleting everything, including the bucket with all data, "
              "checkpoints and logs.", flush=True)
        self.runner.stream(self.terraform("apply", *self.tf_var_args("-var=tpu_enabled=false",
                                                                     "-var=bucket_force_destroy=true")))
        self.runner.stream(self.terraform("destroy", *self.tf_var_args("-var=bucket_force_destroy=true")))
        if not self.dry and os.path.exists(self.outputs_path):
            os.remove(self.outputs_path)
        print("tpu-down: everything infra/ created is deleted.", flush=True)

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
        if self.dry:
            print(f"DRY_RUN: (would pack {', '.join(source_paths(plan.config))} into {SOURCE_ARCHIVE})")
        else:
            pack_source(SOURCE_ARCHIVE, plan.config)
        context = o.context()
        self.runner.stream(self.scp(o, SOURCE_ARCHIVE, "tpu-llm-src.tar.gz", worker="all"), context)
        self.runner.stream(self.ssh(o, "all", INSTALL), context)
        launch = self.ssh(o, "0", plan.remote_script())
        self.runner.show(launch)
        if self.dry:
            return 0
        status = _run_attached(launch)
        if status != 0:
            raise LaunchError(f"training on worker 0 stopped with exit status {status} (its output is above; "
                              f"`make tpu-logs` shows the log); the run directory {plan.run_dir} keeps its "
                              "checkpoints, so `make train` resumes once the cause is fixed")
        return 0

    # ---------------------------------------------------------------------------------------------
    # tpu-ssh / tpu-logs / tensorboard / data-upload

    def ssh_session(self) -> int:
        o = self.outputs()
        self.check_cloud(terraform=False)
        return self.runner.interactive(self.gcloud_tpu(o, "ssh", str(o["tpu_name"]), worker=env("WORKER", "0")))

    def logs(self) -> int:
        o = self.outputs()
        self.check_cloud(terraform=False)
        if env("LOGS", "train") == "setup":
            return self.runner.interactive(self.ssh(o, "all", "tail -n 50 /var/log/tpu-llm-setup.log"))
        return self.runner.interactive(self.ssh(o, env("WORKER", "0"), f"tail -n 200 -F {TRAIN_LOG}"))

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


def _run_attached(argv: list[str]) -> int:
    """Run the launch ssh (already shown) with the terminal attached; its exit status. Ctrl-C detaches."""
    import subprocess

    try:
        return subprocess.call(argv)
    except FileNotFoundError:
        raise LaunchError(f"{argv[0]} not found on PATH") from None
    except KeyboardInterrupt:
        print("\ntrain: detached; training goes on on worker 0 (`make tpu-logs` follows it)", flush=True)
        return 0


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
    parser = argparse.ArgumentParser(description="Cloud TPU glue (see the Makefile's tpu-* targets)")
    parser.add_argument("command", choices=["up", "down", "train", "ssh", "logs", "tensorboard", "data-upload"])
    parser.add_argument("--local-command", default="", help="train: the command for a local run (ARGS is appended)")
    args = parser.parse_args(argv)
    os.chdir(ROOT)
    launcher = Launcher()
    actions = {"up": launcher.up, "down": launcher.down, "ssh": launcher.ssh_session, "logs": launcher.logs,
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
