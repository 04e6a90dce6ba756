"""Issue 50 (Cloud 3): a Cloud run that reports only the truth.

Offline, with the fakes of tests/tpu_worker.py (issue 39's tests use them too): the launch script `make train`
sends to worker 0, run with bash in a scratch HOME (fake trainer, fake gcloud), and the driver against fake
gcloud/terraform.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import NAME, PROJECT, ZONE, clean_env, fake_cloud, make, one_error_line, outputs_json, write_outputs
from tpu_worker import DELETE, Worker0, launch_script, ready_tpu, single_host

pytestmark = pytest.mark.slow  # bash and the driver in subprocesses

ROOT = Path(__file__).resolve().parent.parent
FAST_TEARDOWN = "--copy-seconds=30 --attempts=1 --retry-seconds=0"  # one delete attempt, no pause


def failing_delete(worker: Worker0, error: str = "ERROR: (gcloud.compute.tpus.tpu-vm.delete) PERMISSION_DENIED: "
                   "Permission 'tpu.nodes.delete' denied") -> None:
    """Worker 0's gcloud refuses the delete (an API error, a missing permission); everything else works."""
    (worker.bin / "gcloud").write_text(f'#!/bin/sh\necho "gcloud $*" >> {worker.calls}\n'
                                       f'case "$*" in *delete*) echo "{error}" >&2; exit 1 ;; esac\n')
    worker.script = worker.script.replace("--copy-seconds=30", FAST_TEARDOWN)


# --------------------------------------------------------------------------------------------------
# 11. A failed self-delete is a failure, with the command that deletes by hand


def test_a_failed_self_delete_makes_the_launch_fail_and_says_why(tmp_path):
    worker = Worker0(tmp_path, launch_script(tmp_path, DOWN_AFTER="1"))
    failing_delete(worker)
    done = subprocess.run(["bash", "-c", worker.script], capture_output=True, text=True, timeout=120, env=worker.env())
    assert done.returncode == 76, done.stdout + done.stderr  # worker_plan.TEARDOWN_FAILED, not the run's 0
    assert worker.deletes() == [DELETE]
    assert ("error: the run ended (exit status 0), but worker 0 could not delete this TPU: ERROR: "
            "(gcloud.compute.tpus.tpu-vm.delete) PERMISSION_DENIED") in done.stderr
    hand = DELETE.replace(" --async", "")
    assert f"could not delete this TPU; it is billing: delete it by hand with `{hand}`" in worker.log()


def test_make_train_reports_a_failed_self_delete_as_a_failure_with_the_command(tmp_path):
    _, _, env = ready_tpu(tmp_path, ("*--command=set -e*", 76, "error: the run ended (exit status 0), but worker 0 "
                                     "could not delete this TPU: PERMISSION_DENIED"))
    done = subprocess.run([sys.executable, "-m", "tpu_llm.cloud", "train"], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env=clean_env(DOWN_AFTER=1, **env))
    line = one_error_line(done)  # exit status 2, one line
    assert f"worker 0 could not delete TPU {NAME} after the run" in line and "still up and billing" in line
    assert f"`gcloud compute tpus tpu-vm delete {NAME} --zone={ZONE} --project={PROJECT} --quiet`" in line
    assert "worker 0 deletes" not in line and "the run ended;" not in done.stdout


# --------------------------------------------------------------------------------------------------
# 17. What make train says of the TPU's end is what worker 0 will do


def attach_key(tmp_path: Path) -> str:
    """The run key a `make train` with no settings gives (the live run it attaches to was started with it)."""
    return next(ln for ln in launch_script(tmp_path).splitlines() if ln.startswith("key="))[4:]


@pytest.mark.parametrize("teardown", [False, True], ids=["run-keeps-its-tpu", "run-deletes-its-tpu"])
def test_attaching_without_down_after_says_what_worker_0_will_do(tmp_path, teardown):
    single, tfvars = single_host(tmp_path)
    state = f"tpu-llm-run: alive {attach_key(tmp_path)} 4242 {'teardown' if teardown else 'keep'}"
    done = make("train", TF_OUTPUTS=single, TFVARS=tfvars, DRY_RUN_RUN_STATE=state)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "attaching to it" in done.stdout
    said = [ln for ln in done.stdout.splitlines() if f"TPU {NAME} when" in ln]
    if teardown:  # started with DOWN_AFTER=1: worker 0 still deletes it, whatever this launch's flags
        assert said == [f"train: the run attached to was started with DOWN_AFTER=1 or TTL_HOURS: worker 0 deletes TPU "
                        f"{NAME} when it ends or fails; this machine deletes nothing"], done.stdout
    else:  # no teardown is announced that will not happen
        assert said == [f"train: worker 0 does not delete TPU {NAME} when the run ends: it bills until `make tpu-down` "
                        "(`make train DOWN_AFTER=1` with the same settings hands the teardown to worker 0)"], done.stdout


def test_after_an_attached_run_ends_the_tpu_s_fate_is_worker_0_s(tmp_path):
    (tmp_path / "k").mkdir()
    key = attach_key(tmp_path / "k")
    for word, fate in (("teardown", f"worker 0 deletes TPU {NAME} when the run ends"),
                       ("keep", f"TPU {NAME} is still up and billing: `make tpu-down` deletes it")):
        run = tmp_path / word
        run.mkdir()
        _, _, env = ready_tpu(run, ("*echo tpu-llm-run:*", 0, f"tpu-llm-run: alive {key} 4242 {word}"))
        done = subprocess.run([sys.executable, "-m", "tpu_llm.cloud", "train"], capture_output=True, text=True,
                              timeout=120, cwd=ROOT, env=clean_env(**env))
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"train: the run ended; {fate}" in done.stdout, done.stdout


@pytest.mark.parametrize("teardown", [False, True], ids=["keep", "teardown"])
def test_worker_0_says_whether_its_live_run_deletes_the_tpu(tmp_path, teardown):
    from tpu_llm.cloud.worker_plan import RUN_STATE

    (tmp_path / "tpu-llm-run.key").write_text("0123456789ab\n")
    if teardown:
        (tmp_path / "tpu-llm-run.teardown").write_text(DELETE + "\n")
    owner = subprocess.Popen(["sleep", "30"])
    try:
        (tmp_path / "tpu-llm-owner.pid").write_text(f"{owner.pid}\n")
        done = subprocess.run(["bash", "-c", RUN_STATE], capture_output=True, text=True, timeout=30,
                              env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"})
    finally:
        owner.kill()
        owner.wait()
    assert done.stdout.strip() == f"tpu-llm-run: alive 0123456789ab {owner.pid} {'teardown' if teardown else 'keep'}"


# --------------------------------------------------------------------------------------------------
# 12. TTL_HOURS applies to the run a make train attaches to


def test_ttl_hours_given_when_attaching_stops_the_live_run_and_deletes_the_tpu(tmp_path):
    worker = Worker0(tmp_path, launch_script(tmp_path))  # started without a time limit
    first = worker.start(FAKE_RELEASE=tmp_path / "never")
    try:
        worker.wait_for("fake trainer started")
        attach = Worker0(tmp_path / "again", launch_script(tmp_path, TTL_HOURS="0.0003")).script  # about a second
        attach = attach.replace(str(tmp_path / "again"), str(tmp_path))
        done = subprocess.run(["bash", "-c", attach], capture_output=True, text=True, timeout=40,
                              env=worker.env(FAKE_RELEASE=tmp_path / "never"))
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
    assert "attaching to the run with these settings" in done.stdout, done.stdout + done.stderr
    assert done.returncode == 143, done.stdout + done.stderr  # the live run got SIGTERM at the new limit
    log = worker.log()
    assert "time limit TTL_HOURS=0.0003: the run stops at" in log and "TTL_HOURS=0.0003 reached: SIGTERM" in log
    assert "fake trainer: SIGTERM, checkpoint saved" in log and log.count("fake trainer started") == 1
    assert worker.deletes() == [DELETE]  # a time limit bounds the TPU's life too


# --------------------------------------------------------------------------------------------------
# 13. No running TPU is replaced, or kept unlike the tfvars, without REPLACE=1: queued resources too

PIN_REPLACED = {"format_version": "1.2", "resource_changes": [
    {"address": "terraform_data.runtime_pin[0]", "type": "terraform_data", "name": "runtime_pin",
     "change": {"actions": ["delete", "create"], "before": {}, "after": {}}}],
    "output_changes": {
        "runtime_version": {"actions": ["update"], "before": "tpu-ubuntu2204-base", "after": None, "after_unknown": True},
        "accelerator_type": {"actions": ["no-op"], "before": "v4-8", "after": "v4-8", "after_unknown": False}}}
VM_DELETED = {"format_version": "1.2", "resource_changes": [
    {"address": "google_tpu_v2_vm.tpu[0]", "type": "google_tpu_v2_vm", "name": "tpu", "index": 0,
     "change": {"actions": ["delete"], "before": {}, "after": None}, "action_reason": "delete_because_count_index"}]}
LIVE_NODE = {"name": f"projects/{PROJECT}/locations/{ZONE}/nodes/{NAME}", "state": "READY", "acceleratorType": "v4-8",
             "runtimeVersion": "tpu-ubuntu2204-base"}


def tpu_up(tmp_path: Path, was_queued: bool, tfvars: str, plan: dict, **extra) -> tuple[subprocess.CompletedProcess, list]:
    """make tpu-up over a READY TPU (a queued resource's node when `was_queued`) with fake gcloud/terraform."""
    tmp_path.mkdir(exist_ok=True)
    previous = write_outputs(tmp_path / "o.json", "v4-8", 1, use_queued_resource=was_queued,
                             queued_resource_name=f"{NAME}-queued" if was_queued else "",
                             runtime_version="tpu-ubuntu2204-base")
    (tmp_path / "terraform.tfvars").write_text(f'project_id = "{PROJECT}"\nzone = "{ZONE}"\n{tfvars}')
    bin_dir, log = fake_cloud(tmp_path, gcloud=[
        ("compute tpus tpu-vm describe*--format=json", 0, json.dumps(LIVE_NODE)),
        ("compute tpus tpu-vm describe*", 0, "READY"), ("compute tpus queued-resources describe*", 0, "ACTIVE")],
        terraform=[("*show -json*", 0, json.dumps(plan)), ("*output -json*", 0, outputs_json(previous))])
    done = subprocess.run([sys.executable, "-m", "tpu_llm.cloud", "up"], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env=clean_env(PATH=bin_dir, TFVARS=tmp_path / "terraform.tfvars", TF_OUTPUTS=previous,
                                                  SSH_AUTH_SOCK="", **extra))
    return done, log.read_text().splitlines()


APPLY = "terraform -chdir=infra apply -input=false .tpu-up.tfplan"
QUEUED_DELETE = f"gcloud compute tpus queued-resources delete {NAME}-queued --force --quiet"


@pytest.mark.parametrize("was_queued, tfvars, plan, said", [
    (True, 'use_queued_resource = true\nruntime_version = "v2-alpha-tpuv5"\n', PIN_REPLACED,
     "runtime_version: 'tpu-ubuntu2204-base' -> (known after apply)"),
    (False, "use_queued_resource = true\n", VM_DELETED, "google_tpu_v2_vm.tpu[0] (deleted: use_queued_resource is on"),
    (True, "", {}, "use_queued_resource: true -> false")], ids=["queued-new-image", "vm-to-queued", "queued-to-vm"])
def test_a_change_to_a_running_tpu_is_refused_before_anything_unless_replace(tmp_path, was_queued, tfvars, plan, said):
    done, calls = tpu_up(tmp_path / "refused", was_queued, tfvars, plan)
    line = one_error_line(done)
    assert f"would replace the running TPU {NAME} (READY)" in line and said in line and "REPLACE=1" in line, line
    assert APPLY not in calls and not [c for c in calls if " delete " in c], calls  # nothing changed
    done, calls = tpu_up(tmp_path / "replaced", was_queued, tfvars, plan, REPLACE=1)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"tpu-up: REPLACE=1: replacing TPU {NAME}" in done.stdout
    if was_queued:  # gcloud's queued resource goes first (with its node), then the apply; tpu-up requests it anew
        deleted = next(i for i, c in enumerate(calls) if c.startswith(QUEUED_DELETE))
        assert APPLY in calls and deleted < calls.index(APPLY), calls


def test_an_unchanged_queued_tpu_is_kept_without_asking(tmp_path):
    same = {**PIN_REPLACED, "resource_changes": [], "output_changes": {
        "runtime_version": {"actions": ["no-op"], "before": "tpu-ubuntu2204-base", "after": "tpu-ubuntu2204-base"}}}
    done, calls = tpu_up(tmp_path, True, "use_queued_resource = true\n", same)
    assert done.returncode == 0, done.stdout + done.stderr
    assert APPLY in calls and not [c for c in calls if c.startswith(QUEUED_DELETE)]


# --------------------------------------------------------------------------------------------------
# 14. A deleted custom role's ID is never asked for again


def role_id(tmp_path: Path, name_prefix: str, created: int) -> str:
    """The worker role's ID as infra/iam.tf computes it for a deployment made at `created` (unix seconds), by the
    Terraform binary: the role_id expression with time_static's value given (the time provider is not here)."""
    import hcl2
    from helpers import terraform

    with open(ROOT / "infra" / "iam.tf", encoding="utf-8") as f:
        iam = hcl2.load(f)
    role = next(block['"google_project_iam_custom_role"']['"tpu_self_delete"'] for block in iam["resource"]
                if '"google_project_iam_custom_role"' in block)  # python-hcl2 keeps the labels' quotes
    expression = role["role_id"].replace("time_static.deployment.unix", "var.created")
    module = tmp_path / f"role-{created}"
    module.mkdir()
    (module / "main.tf").write_text('variable "name_prefix" { type = string }\nvariable "created" { type = number }\n')
    done = subprocess.run([terraform(), "console", f"-var=name_prefix={name_prefix}", f"-var=created={created}"],
                          input=f"{expression}\n", capture_output=True, text=True, cwd=module,
                          env={**os.environ, "CHECKPOINT_DISABLE": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip())


def test_a_deployment_after_destroy_bucket_never_reuses_the_deleted_role_id(tmp_path):
    """up, then `make tpu-down DESTROY_BUCKET=1` (IAM keeps the deleted role's ID reserved for up to 37 days), then
    up again a day later: the second deployment's role must have another ID, or its create fails for weeks."""
    reserved = set()
    first = role_id(tmp_path, "tpu-llm", 1_796_000_000)
    reserved.add(first)  # destroyed: soft-deleted, its ID unusable until purged
    second = role_id(tmp_path, "tpu-llm", 1_796_000_000 + 86_400)
    assert second not in reserved, f"the new deployment asks for the reserved role ID {second}"
    longest = "a" + "-" * 20 + "z"  # name_prefix allows 22 characters
    for rid in (first, second, role_id(tmp_path, longest, 4_102_444_800)):  # ... up to the year 2100
        assert re.fullmatch(r"[a-zA-Z0-9_.]{3,64}", rid), rid  # IAM's rule for a custom role's ID
    text = (ROOT / "infra" / "iam.tf").read_text()
    assert 'resource "time_static" "deployment" {}' in text  # no count: kept while the TPU comes and goes


# --------------------------------------------------------------------------------------------------
# 15. A missing right to create the custom role is named, with the role that grants it

# The provider's error when the account lacks iam.roles.create (its shape as googleapi prints a 403)
ROLE_DENIED = ("│ Error: Error creating the custom project role projects/my-proj/roles/tpu_llm_tpu_self_delete_1796000000: "
               "googleapi: Error 403: Permission 'iam.roles.create' denied on resource (or it may not exist)., forbidden")


def test_a_denied_custom_role_names_role_admin_and_the_grant():
    from tpu_llm.cloud.shell import explain_failure

    line = explain_failure(["terraform"], 1, ROLE_DENIED, {"project": PROJECT, "zone": ZONE})
    assert "iam.roles" in line and "roles/iam.roleAdmin" in line, line
    assert (f"`gcloud projects add-iam-policy-binding {PROJECT} --member=user:YOUR_EMAIL --role=roles/iam.roleAdmin`"
            in line) and "nothing was destroyed" in line
    generic = explain_failure(["gcloud"], 1, "ERROR: PERMISSION_DENIED: tpu.nodes.create", {"project": PROJECT})
    assert "roles/iam.roleAdmin" in generic and "docs/cloud-tpu.md" in generic  # the owner-less set is complete


# --------------------------------------------------------------------------------------------------
# 16. A pod's TF worker container is asked of its registry before anything is created

IMAGE = "gcr.io/cloud-tpu-v2-images/grpc_tpu_worker:tf-2.20.0-pjrt"


@pytest.mark.parametrize("answer", ["missing", "exists", "cannot-ask"])
def test_a_missing_worker_container_tag_stops_tpu_up_before_anything_is_created(tmp_path, answer):
    recorded = {"missing": (1, f"ERROR: (gcloud.container.images.describe) NOT_FOUND: manifest unknown: {IMAGE}"),
                "exists": (0, "sha256:0123abcd"),
                "cannot-ask": (1, "ERROR: (gcloud.container.images.describe) PERMISSION_DENIED: artifactregistry."
                                  "repositories.downloadArtifacts")}[answer]
    tfvars = tmp_path / "terraform.tfvars"
    tfvars.write_text(f'project_id = "{PROJECT}"\nzone = "us-east5-a"\naccelerator_type = "v5p-16"\n')
    pod = write_outputs(tmp_path / "pod.json", "v5p-16", 2)
    bin_dir, log = fake_cloud(tmp_path, gcloud=[("container images describe*", *recorded),
                                                ("compute tpus tpu-vm describe*", 0, "READY")],
                              terraform=[("*output -json*", 0, outputs_json(pod))])
    done = subprocess.run([sys.executable, "-m", "tpu_llm.cloud", "up"], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env=clean_env(PATH=bin_dir, TFVARS=tfvars, TF_OUTPUTS=tmp_path / "saved.json",
                                                  SSH_AUTH_SOCK=""))
    calls = [c for c in log.read_text().splitlines() if " auth " not in c]
    assert calls[0] == (f"gcloud container images describe {IMAGE} --project={PROJECT} "
                        "--format=value(image_summary.digest)")  # first: before the state bucket or terraform
    if answer == "missing":
        line = one_error_line(done)
        assert f"the pod's TF worker container {IMAGE} does not exist" in line and "nothing was created" in line
        assert "gcloud container images list-tags gcr.io/cloud-tpu-v2-images/grpc_tpu_worker" in line
        assert calls == calls[:1]  # nothing else ran
    else:
        assert done.returncode == 0, done.stdout + done.stderr
        said = "exists (sha256:0123abcd)" if answer == "exists" else "could not ask the registry"
        assert said in done.stdout and any(c.startswith("terraform") for c in calls)


def test_a_worker_that_cannot_pull_the_container_is_one_line_naming_tag_and_tpu_down(tmp_path):
    setup_log = (f"docker: Error response from daemon: manifest for {IMAGE} not found: manifest unknown\n"
                 f"tpu-llm setup failed on t1v-n-0-w-1: the TF worker container {IMAGE} cannot be pulled (the tag "
                 "tensorflow-tpu 2.20.0 names is not in the registry; the runtime's journal is above)")
    pod = write_outputs(tmp_path / "pod.json", "v5p-16", 2)
    tfvars = tmp_path / "terraform.tfvars"
    tfvars.write_text(f'project_id = "{PROJECT}"\naccelerator_type = "v5p-16"\n')
    bin_dir, _ = fake_cloud(tmp_path, gcloud=[("*--worker=all*/opt/tpu-llm/ready*", 1, setup_log),
                                              ("compute tpus tpu-vm describe*", 0, "READY")],
                            terraform=[("*output -json*", 0, outputs_json(pod))])
    done = subprocess.run([sys.executable, "-m", "tpu_llm.cloud", "up"], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env=clean_env(PATH=bin_dir, TFVARS=tfvars, TF_OUTPUTS=tmp_path / "s.json",
                                                  SSH_AUTH_SOCK=""))
    line = one_error_line(done)
    assert line.startswith(f"error: a worker could not pull the pod's TF worker container (") and IMAGE in line
    assert "`make tpu-down` deletes the TPU" in line and "retries it" not in line, line


def detached(seconds: float) -> int:
    """The pid of a `sleep` that is no child of this process (as the trainer and its owner are not the launch's
    children on worker 0): when it ends, init reaps it, so `kill -0` stops seeing it."""
    done = subprocess.run(["bash", "-c", f"sleep {seconds} > /dev/null 2>&1 & echo $!"], capture_output=True, text=True)
    return int(done.stdout)


def test_tpu_stop_waits_for_the_teardown_and_reports_a_failed_one(tmp_path):
    from tpu_llm.cloud.watch import STOP

    home = tmp_path / "home"
    home.mkdir()
    trainer, owner = detached(30), detached(1)
    try:
        (home / "tpu-llm-train.pid").write_text(f"{trainer}\n")
        (home / "tpu-llm-owner.pid").write_text(f"{owner}\n")
        (home / "tpu-llm-run.teardown").write_text(DELETE + "\n")
        (home / "tpu-llm-run.teardown-failed").write_text("ERROR: PERMISSION_DENIED: tpu.nodes.delete\n")
        done = subprocess.run(["bash", "-c", STOP], capture_output=True, text=True, timeout=60,
                              env={**os.environ, "HOME": str(home)})
    finally:
        for pid in (trainer, owner):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert "tpu-stop: the run stopped" in done.stdout, done.stdout + done.stderr
    assert done.returncode == 76 and "error: worker 0 could not delete this TPU: ERROR: PERMISSION_DENIED" in done.stderr


def test_make_tpu_stop_says_a_failed_teardown_in_one_line_with_the_command(tmp_path):
    _, _, env = ready_tpu(tmp_path, ("*tpu-stop: SIGTERM*", 76, "tpu-stop: the run stopped\nerror: worker 0 could not "
                                     "delete this TPU: ERROR: PERMISSION_DENIED: tpu.nodes.delete"))
    done = subprocess.run([sys.executable, "-m", "tpu_llm.cloud", "stop"], capture_output=True, text=True, timeout=60,
                          cwd=ROOT, env=clean_env(**env))
    line = one_error_line(done)
    assert f"worker 0 could not delete TPU {NAME}" in line and "still up and billing" in line
    assert f"`gcloud compute tpus tpu-vm delete {NAME} --zone={ZONE} --project={PROJECT} --quiet`" in line
