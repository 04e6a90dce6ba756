"""`make train` and `make data-upload` (for tpu_llm/cloud/driver.py): where the run goes (the TPU or this
machine), the source copied to and installed on every worker, the run started on worker 0. Standard library only."""

from __future__ import annotations

import json
import os
import shlex
import sys
import time

from tpu_llm.cloud.base import Cloud, billing_note, venv_tool
from tpu_llm.cloud.shell import LaunchError, Outputs
from tpu_llm.cloud.ssh_agent import ensure_key_in_agent
from tpu_llm.cloud.worker_plan import (BUSY, INSTALL, SOURCE_ARCHIVE, SSH_LOST, TEARDOWN_FAILED, TrainPlan, env, flag,
                                       pack_source, source_paths)


class Launch(Cloud):
    """`make train` (on the TPU or here) and `make data-upload`."""

    def record_run(self, plan: TrainPlan) -> None:
        with open(self.last_run_path, "w", encoding="utf-8") as f:
            json.dump({"run_dir": plan.run_dir, "config": plan.config,
                       "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, f)

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
            return self.train_here(local_command)
        plan = TrainPlan.from_env(o)
        self.check_cloud(terraform=False)
        state = self.tpu_state(o)
        if state == "PREEMPTED":
            raise LaunchError(f"TPU {o['tpu_name']} was preempted (spot): run `make tpu-up` to recreate it, then "
                              f"`make train` resumes from the last checkpoint in {plan.run_dir}")
        if state != "READY":
            raise LaunchError(f"TPU {o['tpu_name']} is {state or 'missing'}, not READY: run `make tpu-up`")
        self.billing = billing_note(o, owned=False)
        run = self.run_state(o)
        if run.alive and run.key != plan.run_key():
            raise LaunchError(f"a run is already training on worker 0 (pid {run.pid}) with other settings: follow "
                              "it with `make tpu-logs`, or stop it with `make tpu-stop` (it saves a checkpoint) and "
                              "run `make train` again")
        # whether worker 0 deletes the TPU at the run's end: this launch asks it (DOWN_AFTER, TTL_HOURS), or the
        # live run it attaches to was started so; what is said of the TPU's end follows this, never the flag alone
        owned = plan.down_after or (run.alive and run.teardown)
        if run.alive:
            print(f"train: a run with these settings is going on worker 0 (pid {run.pid}): attaching to it; nothing "
                  "is copied or installed", flush=True)
        else:
            self.copy_and_install(o, plan)
        launch = self.ssh(o, "0", plan.remote_script())
        self.runner.show(launch)
        print(f"train: {teardown_note(o, plan, run.alive and run.teardown)}", flush=True)
        if self.dry:
            return 0
        self.record_run(plan)
        return self.after_run(o, plan, _run_attached(launch), owned)

    def train_here(self, local_command: str) -> int:
        argv = shlex.split(local_command) + shlex.split(env("ARGS"))
        self.runner.show(argv)
        if self.dry:
            return 0
        sys.stdout.flush()
        os.execvp(argv[0], argv)
        return 0  # not reached

    def copy_and_install(self, o: Outputs, plan: TrainPlan) -> None:
        """The source (with the set-up script and the current lock) to every worker, installed there."""
        setup = self.write_setup_script(o)
        if self.dry:
            print(f"DRY_RUN: (would pack {', '.join(source_paths(plan.config))}, {setup} and the lock into "
                  f"{SOURCE_ARCHIVE})")
        else:
            pack_source(SOURCE_ARCHIVE, plan.config, setup)
        ensure_key_in_agent(self.runner)  # before the first --worker=all command
        context = o.context()
        self.runner.stream(self.scp(o, SOURCE_ARCHIVE, "tpu-llm-src.tar.gz", worker="all"), context)
        self.runner.stream(self.ssh(o, "all", INSTALL), context)

    def after_run(self, o: Outputs, plan: TrainPlan, status: int | None, owned: bool) -> int:
        """What the launch's exit status means; the TPU is never deleted from here (worker 0 owns it, and deletes
        it at the run's end when `owned`)."""
        if owned and status != BUSY:  # the owner started (or runs), and deletes the TPU at the run's end
            self.billing = billing_note(o, owned=True)
        if status is None:  # Ctrl-C: the terminal detached, the run goes on
            print(f"\ntrain: detached; the run goes on on worker 0 (`make tpu-logs` follows it, `make train` with "
                  f"the same settings attaches again); {self.billing}", flush=True)
            return 0
        if status == SSH_LOST:
            if owned:
                self.billing += "; if the run never started, `make tpu-down` deletes it"
            raise LaunchError("the connection to worker 0 dropped (ssh exit 255, after gcloud's own retries): a run it "
                              "started goes on there; `make tpu-logs` follows it, `make train` with the same settings "
                              "attaches to it (or starts it, if it never started), `make tpu-status` shows the TPU")
        if status == TEARDOWN_FAILED:
            self.billing = ""  # said here: worker 0's delete failed, so "worker 0 deletes it" is no longer true
            raise LaunchError(f"worker 0 could not delete TPU {o['tpu_name']} after the run (its reason is above and "
                              f"in the log: `make tpu-logs LOGS=gcs`); it is still up and billing: delete it by hand "
                              f"with `{shlex.join(self.delete_by_hand(o))}` (or `make tpu-down`); the run directory "
                              f"{plan.run_dir} keeps its checkpoints")
        if status == BUSY:
            raise LaunchError("a run with other settings started on worker 0 meanwhile: follow it with `make tpu-logs`, "
                              "or stop it with `make tpu-stop`")
        if status != 0:
            raise LaunchError(f"training on worker 0 stopped with exit status {status} (its output is above; `make "
                              f"tpu-logs` shows the log); the run directory {plan.run_dir} keeps its checkpoints, so "
                              "`make train` resumes once the cause is fixed")
        print(f"train: the run ended; {self.billing}", flush=True)
        self.billing = ""  # said: main() need not repeat it
        return 0

    def delete_by_hand(self, o: Outputs) -> list[str]:
        """The command that deletes the TPU from this machine: its queued resource with --force (which deletes
        the node too), else the node."""
        if o["use_queued_resource"]:
            return self.queued_args(o, "delete", "--force", "--quiet")
        return ["gcloud", "compute", "tpus", "tpu-vm", "delete", str(o["tpu_name"]), f"--zone={o['zone']}",
                f"--project={o['project_id']}", "--quiet"]

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
    (or SIGTERM) detached."""
    import subprocess

    try:
        return subprocess.call(argv)
    except FileNotFoundError:
        raise LaunchError(f"{argv[0]} not found on PATH") from None
    except KeyboardInterrupt:
        return None


def teardown_note(o: Outputs, plan: TrainPlan, attached_teardown: bool) -> str:
    """What becomes of the TPU when the run ends, as worker 0 will do it: this launch's DOWN_AFTER/TTL_HOURS, or
    the teardown the live run it attaches to was started with (`attached_teardown`), or none."""
    if plan.down_after:
        limit = f", or after TTL_HOURS={plan.ttl_hours:g} (it stops the run first)" if plan.ttl_hours > 0 else ""
        return (f"worker 0 deletes TPU {o['tpu_name']} when the run ends or fails{limit} (DOWN_AFTER=1), as its "
                f"service account: {shlex.join(plan.teardown_argv())}; this machine deletes nothing")
    if attached_teardown:
        return (f"the run attached to was started with DOWN_AFTER=1 or TTL_HOURS: worker 0 deletes TPU "
                f"{o['tpu_name']} when it ends or fails; this machine deletes nothing")
    return (f"worker 0 does not delete TPU {o['tpu_name']} when the run ends: it bills until `make tpu-down` "
            "(`make train DOWN_AFTER=1` with the same settings hands the teardown to worker 0)")
