"""`make tpu-up / train / tpu-down` (tpu_llm/cloud/driver.py) against a fake `terraform output -json` file.

With DRY_RUN=1 every terraform and gcloud command is printed (`DRY_RUN: CMD`) instead of run; the
tests parse those lines back into argv lists and assert them exactly, for a single-host (v4-8) and
a multi-host (v4-32) slice. Without DRY_RUN, fake `terraform` and `gcloud` executables on PATH check
the one-line failures (tool missing, not authenticated, no project, stockout, quota) and that a
failed `tpu-up` destroys nothing.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import (BUCKET, IAP, NAME, PROJECT, SCP, TF, ZONE, clean_env, commands, fake_cloud, make, one_error_line,
                     outputs_json, remote, tpu_py, write_outputs)

pytestmark = pytest.mark.slow  # the driver and fake terraform/gcloud in subprocesses

ROOT = Path(__file__).resolve().parent.parent
SSH = ["gcloud", "alpha", "compute", "tpus", "tpu-vm", "ssh", NAME, *IAP]
DESCRIBE = ["gcloud", "compute", "tpus", "tpu-vm", "describe", NAME, *IAP, "--format=value(state)"]
# the state in the deployment's state bucket, created first when missing
STATE_BUCKET = ["gcloud", "storage", "buckets", "describe", "gs://my-proj-tpu-llm-tf", "--project=my-proj",
                "--format=value(name)"]
INIT = [*TF, "init", "-input=false", "-backend-config=bucket=my-proj-tpu-llm-tf", "-backend-config=prefix=terraform/state"]


@pytest.fixture
def single(tmp_path) -> Path:
    return write_outputs(tmp_path / "single.json", "v4-8", 1)


@pytest.fixture
def pod(tmp_path) -> Path:
    return write_outputs(tmp_path / "pod.json", "v4-32", 4)


@pytest.fixture
def tfvars(tmp_path) -> Path:
    path = tmp_path / "terraform.tfvars"
    path.write_text('project_id = "my-proj"\nzone = "us-central2-b"\naccelerator_type = "v4-32"\n')
    return path


# --------------------------------------------------------------------------------------------------
# make train


RUN_STATE = [*SSH, "--worker=0", "--tunnel-through-iap",
             '--command=for f in ~/tpu-llm-owner.pid ~/tpu-llm-train.pid; do if [ -f $f ] && kill -0 "$(cat $f)" '
             '2>/dev/null; then echo "tpu-llm-run: alive $(cat ~/tpu-llm-run.key 2>/dev/null || echo -) $(cat $f) '
             '$([ -s ~/tpu-llm-run.teardown ] && echo teardown || echo keep)"; exit 0; fi; done; echo tpu-llm-run: idle']
BUSY = ('for f in ~/tpu-llm-owner.pid ~/tpu-llm-train.pid; do if [ -f $f ] && kill -0 "$(cat $f)" 2>/dev/null; then '
        'echo "error: a run is already training on worker 0 (pid $(cat $f))" >&2; exit 75; fi; done')


def owner_line(script: list[str]) -> tuple[list[str], list[str]]:
    """The owner's own arguments and the training command after `--` (the nohup line of the launch)."""
    (line,) = [ln for ln in script if ln.strip().startswith("nohup ")]
    words = shlex.split(line)
    assert words[:5] == ["nohup", "/opt/tpu-llm/venv/bin/python", "-m", "tpu_llm.cloud", "own"], words
    assert words[-6:] == [">", "/dev/null", "2>&1", "<", "/dev/null", "&"], words  # detached from the ssh
    own = words[5:words.index("--")]
    return own, words[words.index("--") + 1:-6]


def test_train_single_host_on_the_vm_with_the_generations_runtime(single):
    done = make("train", TF_OUTPUTS=single)
    assert done.returncode == 0, done.stderr
    assert f"train: on Cloud TPU {NAME} (v4-8, 1 worker(s), {ZONE})" in done.stdout
    describe, state, scp, install, launch = commands(done.stdout)
    assert describe == DESCRIBE
    assert state == RUN_STATE  # is a run going on worker 0? (idle: copy, install, start)
    assert scp == [*SCP, "build/tpu-llm-src.tar.gz", f"{NAME}:tpu-llm-src.tar.gz", *IAP, "--worker=all",
                   "--tunnel-through-iap"]
    assert install == [*SSH, "--worker=all", "--tunnel-through-iap",
                       f"--command={BUSY}; rm -rf ~/tpu-llm && mkdir -p ~/tpu-llm && tar -xzf ~/tpu-llm-src.tar.gz "
                       "-C ~/tpu-llm && sudo bash ~/tpu-llm/tpu-llm-setup.sh ~/tpu-llm"]
    assert launch[:-1] == [*SSH, "--worker=0", "--tunnel-through-iap"]
    script = remote(launch)
    assert script[:2] == ["set -e", "cd ~/tpu-llm"]
    assert re.fullmatch(r"launch=[0-9a-f]{12}", script[2]) and re.fullmatch(r"key=[0-9a-f]{12}", script[3])
    assert f"  {BUSY}" in script  # a run of an older launch is checked for right before the start
    assert f"  log_url={BUCKET}/runs/tiny/logs/train-$(date -u +%Y%m%dT%H%M%SZ).log" in script
    own, train = owner_line(script)
    assert own == ["--log=~/tpu-llm-train.log", "--log-url=$log_url", "--copy-seconds=30",
                   f"--preflight=/opt/tpu-llm/venv/bin/python -m tpu_llm.cloud preflight --run_dir={BUCKET}/runs/tiny"]
    # a v4: PJRT, as on every generation, with the venv's libtpu (tpu_chips.runtime_variables)
    assert train == ["env", "NEXT_PLUGGABLE_DEVICE_USE_C_API=true",
                     "TF_PLUGGABLE_DEVICE_LIBRARY_PATH=/opt/tpu-llm/libtpu.so", "TPU_LIBRARY_PATH=/opt/tpu-llm/libtpu.so",
                     "/opt/tpu-llm/venv/bin/tpu-llm", "train", "--config", "configs/tiny.yaml", "--strategy=tpu",
                     "--tpu=local", f"--run_dir={BUCKET}/runs/tiny"]
    writes = "\n".join(script).replace("rm -f ~/tpu-llm-run.status ~/tpu-llm-run.teardown", "")
    assert "tpu-llm-run.teardown " not in writes and "> ~/tpu-llm-run.teardown" not in writes
    assert script[-9:] == ['tail -n "$from" -f --pid="$(cat ~/tpu-llm-owner.pid)" ~/tpu-llm-train.log',
                           "for _ in $(seq 60); do if [ -f ~/tpu-llm-run.status ]; then break; fi; sleep 1; done",
                           "if [ -f ~/tpu-llm-run.teardown-failed ]; then",
                           '  echo "error: the run ended (exit status $(cat ~/tpu-llm-run.status 2>/dev/null || echo '
                           'unknown)), but worker 0 could not delete this TPU: $(cat ~/tpu-llm-run.teardown-failed)" >&2',
                           "  exit 76", "fi",
                           'if [ -f ~/tpu-llm-run.status ]; then exit "$(cat ~/tpu-llm-run.status)"; fi',
                           'echo "error: worker 0 recorded no exit status for the run (~/tpu-llm-train.log says why)" >&2',
                           "exit 1"]
    syntax = subprocess.run(["bash", "-n"], input="\n".join(script), capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr


@pytest.mark.parametrize("accelerator,pjrt", [("v5litepod-8", True), ("v5p-8", True), ("v6e-8", True),
                                               ("v4-8", True), ("v3-8", True), ("v2-8", True)])
def test_a_single_host_gets_pjrt_only_where_google_documents_it_for_tensorflow(tmp_path, accelerator, pjrt):
    done = make("train", TF_OUTPUTS=write_outputs(tmp_path / "o.json", accelerator, 1))
    assert done.returncode == 0, done.stderr
    _, train = owner_line(remote(commands(done.stdout)[-1]))
    env = train[1:train.index("/opt/tpu-llm/venv/bin/tpu-llm")]
    libtpu = "/opt/tpu-llm/libtpu.so"
    assert env == (["NEXT_PLUGGABLE_DEVICE_USE_C_API=true", f"TF_PLUGGABLE_DEVICE_LIBRARY_PATH={libtpu}"] * pjrt
                   + [f"TPU_LIBRARY_PATH={libtpu}"]), env


def test_train_pod_on_worker_0_against_the_pod_servers(pod):
    done = make("train", TF_OUTPUTS=pod, CONFIG="configs/gpt2_125m.yaml", ARGS="--train.steps=100")
    assert done.returncode == 0, done.stderr
    assert f"train: on Cloud TPU {NAME} (v4-32, 4 worker(s), {ZONE})" in done.stdout
    describe, state, scp, install, launch = commands(done.stdout)
    assert describe == DESCRIBE and state == RUN_STATE
    assert "--worker=all" in scp and "--worker=all" in install  # code and install go to every host
    assert launch[:-1] == [*SSH, "--worker=0", "--tunnel-through-iap"]  # training starts on worker 0 only
    own, train = owner_line(remote(launch))
    shards = f"{BUCKET}/shards/*.tfrecord"
    assert own[-1] == ("--preflight=/opt/tpu-llm/venv/bin/python -m tpu_llm.cloud preflight "
                       f"--run_dir={BUCKET}/runs/gpt2_125m '--data={shards}' --require_tfrecord")
    assert train == ["env", "TPU_NAME=tpu-llm-tpu", "TPU_LOAD_LIBRARY=0", "/opt/tpu-llm/venv/bin/tpu-llm", "train",
                     "--config", "configs/gpt2_125m.yaml", "--strategy=tpu", f"--tpu={NAME}",
                     f"--run_dir={BUCKET}/runs/gpt2_125m", f"--data.train={shards}", "--data.format=tfrecord",
                     "--train.steps=100"]
    assert "NEXT_PLUGGABLE_DEVICE_USE_C_API" not in launch[-1] and "TPU_LIBRARY_PATH" not in launch[-1]


def test_a_live_run_with_the_same_settings_is_attached_to_without_copying(single):
    done = make("train", TF_OUTPUTS=single, DRY_RUN_RUN_STATE="tpu-llm-run: alive - 4242")
    assert done.returncode != 0 and "a run is already training on worker 0 (pid 4242) with other settings" in done.stderr
    key = next(ln for ln in remote(commands(make("train", TF_OUTPUTS=single).stdout)[-1]) if ln.startswith("key="))
    done = make("train", TF_OUTPUTS=single, DRY_RUN_RUN_STATE=f"tpu-llm-run: alive {key[4:]} 4242")
    assert done.returncode == 0, done.stderr
    assert "a run with these settings is going on worker 0 (pid 4242): attaching to it" in done.stdout
    describe, state, launch = commands(done.stdout)  # nothing copied, nothing reinstalled under the run
    assert launch[-1].startswith("--command=set -e")


@pytest.mark.parametrize("data", [f"{BUCKET}/text/*.txt", "corpus/*.tfrecord"])
def test_pod_refuses_raw_text_or_local_data(pod, data):
    done = make("train", TF_OUTPUTS=pod, DATA=data)
    assert done.returncode != 0
    assert not commands(done.stdout)  # nothing was sent to the TPU
    (line,) = [ln for ln in done.stderr.splitlines() if ln.startswith("error:")]
    assert "reads pre-tokenized TFRecord shards" in line and "make data-upload" in line


def test_train_run_dir_and_tokenizer_overrides(single):
    done = make("train", TF_OUTPUTS=single, RUN="exp1", DATA=f"{BUCKET}/shards/*.tfrecord", TOKENIZER="byte")
    assert done.returncode == 0, done.stderr
    script = "\n".join(remote(commands(done.stdout)[-1]))
    assert (f"--run_dir={BUCKET}/runs/exp1 '--data.train={BUCKET}/shards/*.tfrecord' --data.tokenizer=byte" in script)
    done = make("train", TF_OUTPUTS=single, ARGS="--run_dir=runs/local")
    assert done.returncode != 0 and "is not on Cloud Storage" in done.stderr


def test_train_without_outputs_runs_locally(tmp_path):
    done = make("train", TF_OUTPUTS=tmp_path / "absent.json")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("train: locally on this machine: no Cloud TPU outputs")
    assert lines[1] == "DRY_RUN: .venv/bin/tpu-llm train --config configs/tiny.yaml"  # the foundation's command


def test_train_after_tpu_down_runs_locally(tmp_path):
    outputs = write_outputs(tmp_path / "down.json", "v4-8", 1, tpu_enabled=False)
    done = make("train", TF_OUTPUTS=outputs)
    assert "train: locally on this machine" in done.stdout and "deleted by `make tpu-down`" in done.stdout
    assert commands(done.stdout) == [[".venv/bin/tpu-llm", "train", "--config", "configs/tiny.yaml"]]
    done = make("train", TF_OUTPUTS=write_outputs(tmp_path / "up.json", "v4-8", 1), TRAIN_ON="local")
    assert "train: locally on this machine: TRAIN_ON=local" in done.stdout


def test_train_refuses_a_preempted_tpu(single):
    done = make("train", TF_OUTPUTS=single, DRY_RUN_TPU_STATE="PREEMPTED")
    assert done.returncode != 0 and "was preempted" in done.stderr and "make tpu-up" in done.stderr
    assert commands(done.stdout) == [DESCRIBE]


# --------------------------------------------------------------------------------------------------
# make tpu-up / tpu-down


@pytest.mark.parametrize("slice_", ["single", "pod"])
def test_tpu_up_applies_then_waits_for_every_worker(request, tfvars, slice_):
    outputs = request.getfixturevalue(slice_)
    done = make("tpu-up", TF_OUTPUTS=outputs, TFVARS=tfvars)
    assert done.returncode == 0, done.stderr
    assert "creates billable resources" in done.stdout and "make tpu-down" in done.stdout
    registry, state, init, apis, describe, plan, show, apply, output, describe2, hosts, copy, wait = \
        commands(done.stdout)
    # tfvars asks for a v4-32 pod: its TF worker container is asked of the registry before anything is made
    assert registry == ["gcloud", "container", "images", "describe",
                        "gcr.io/cloud-tpu-v2-images/grpc_tpu_worker:tf-2.20.0-pjrt", "--project=my-proj",
                        "--format=value(image_summary.digest)"]
    assert (state, init) == (STATE_BUCKET, INIT)
    # the APIs first: the plan reads the zone's accelerator types and images from the TPU API
    assert apis == [*TF, "apply", "-input=false", "-auto-approve", f"-var-file={tfvars}",
                    "-target=google_project_service.apis"]
    assert describe == describe2 == DESCRIBE
    # planned, the plan read (a running TPU is never replaced unasked), then exactly that plan applied
    assert plan == [*TF, "plan", "-input=false", f"-var-file={tfvars}", "-var=tpu_enabled=true", "-out=.tpu-up.tfplan"]
    assert show == [*TF, "show", "-json", ".tpu-up.tfplan"]
    assert apply == [*TF, "apply", "-input=false", ".tpu-up.tfplan"]
    assert output == [*TF, "output", "-json"]
    assert hosts == [*DESCRIBE[:-1], "--format=json(networkEndpoints)"]  # hosts from the API
    assert copy == [*SCP, "build/tpu-llm-setup.sh", f"{NAME}:tpu-llm-setup.sh", *IAP, "--worker=all",
                    "--tunnel-through-iap"]  # the current set-up script, for a worker set up for an older lock
    assert wait[:-1] == [*SSH, "--worker=all", "--tunnel-through-iap"]
    assert "/opt/tpu-llm/ready" in wait[-1] and "/opt/tpu-llm/failed" in wait[-1]
    assert "is READY" in done.stdout


def test_tpu_up_recreates_a_preempted_spot_tpu(single, tfvars):
    done = make("tpu-up", TF_OUTPUTS=single, TFVARS=tfvars, DRY_RUN_TPU_STATE="PREEMPTED")
    assert done.returncode == 0, done.stderr
    assert "is PREEMPTED" in done.stdout and "recreating it" in done.stdout
    plan = [c for c in commands(done.stdout) if c[:3] == [*TF, "plan"]]
    assert plan == [[*TF, "plan", "-input=false", f"-var-file={tfvars}", "-var=tpu_enabled=true",
                     "-replace=google_tpu_v2_vm.tpu[0]", "-out=.tpu-up.tfplan"]]


QUEUED = ["gcloud", "compute", "tpus", "queued-resources"]
QUEUED_DESCRIBE = [*QUEUED, "describe", f"{NAME}-queued", "--format=value(state.state)", *IAP]
QUEUED_DELETE = [*QUEUED, "delete", f"{NAME}-queued", "--force", "--quiet", *IAP]
QUEUED_CREATE = [*QUEUED, "create", f"{NAME}-queued", f"--node-id={NAME}", "--accelerator-type=v4-8",
                 "--runtime-version=tpu-vm-tf-2.20.0-pjrt", "--network=tpu-llm-vpc", "--subnetwork=tpu-llm-subnet",
                 "--internal-ips", "--service-account=sa@my-proj.iam.gserviceaccount.com",
                 "--scopes=https://www.googleapis.com/auth/cloud-platform",
                 "--metadata-from-file=startup-script=build/tpu-llm-setup.sh", f"--tags={NAME}",
                 "--labels=app=tpu-llm,managed-by=terraform", "--spot", "--valid-until-duration=1800s", *IAP]


@pytest.fixture
def queued_tfvars(tfvars) -> Path:
    tfvars.write_text(tfvars.read_text() + "use_queued_resource = true\n")
    return tfvars


@pytest.fixture
def queued(tmp_path) -> Path:
    return write_outputs(tmp_path / "q.json", "v4-8", 1, use_queued_resource=True, queued_resource_name=f"{NAME}-queued")


def test_tpu_up_creates_the_queued_resource_with_gcloud_as_the_project_service_account(queued, queued_tfvars):
    tfvars = queued_tfvars
    # Terraform made the network, service account and start-up script; gcloud creates the queued
    # resource with them (the provider's node spec takes no service account, metadata or spot).
    done = make("tpu-up", TF_OUTPUTS=queued, TFVARS=tfvars, DRY_RUN_QUEUED_STATE="")
    assert done.returncode == 0, done.stderr
    cmds = commands(done.stdout)
    after_apply = cmds[cmds.index([*TF, "output", "-json"]) + 1:]
    assert after_apply[:2] == [QUEUED_DESCRIBE, QUEUED_CREATE]
    assert after_apply[2:4] == [QUEUED_DESCRIBE, DESCRIBE]  # then it waits for READY and the set-up
    # the start-up script is metadata; the only copy is the one a worker with an older lock runs
    assert [c[6] for c in cmds if c[:6] == SCP[:6]] == ["build/tpu-llm-setup.sh"]
    # an ACTIVE one is left alone
    done = make("tpu-up", TF_OUTPUTS=queued, TFVARS=tfvars)
    assert QUEUED_CREATE not in commands(done.stdout) and QUEUED_DELETE not in commands(done.stdout)


def test_tpu_up_deletes_the_queued_resource_when_switching_back_to_a_vm(queued, tfvars):
    done = make("tpu-up", TF_OUTPUTS=queued, TFVARS=tfvars)  # tfvars without use_queued_resource = true
    assert done.returncode != 0 and "use_queued_resource: true -> false" in done.stderr  # its TPU is READY
    assert QUEUED_DELETE not in commands(done.stdout)
    done = make("tpu-up", TF_OUTPUTS=queued, TFVARS=tfvars, REPLACE=1)  # issue 50: replacing it is asked for
    cmds = commands(done.stdout)
    plan = next(i for i, c in enumerate(cmds) if c[:4] == [*TF, "plan", "-input=false"])
    assert cmds.index(QUEUED_DELETE) < plan


def test_tpu_up_replaces_a_preempted_queued_resource_with_force(queued, queued_tfvars):
    tfvars = queued_tfvars
    done = make("tpu-up", TF_OUTPUTS=queued, TFVARS=tfvars, DRY_RUN_TPU_STATE="PREEMPTED")
    assert done.returncode == 0, done.stderr
    cmds = commands(done.stdout)
    assert QUEUED_DELETE in cmds and cmds.index(QUEUED_DELETE) < cmds.index(
        [*TF, "plan", "-input=false", f"-var-file={tfvars}", "-var=tpu_enabled=true", "-out=.tpu-up.tfplan"])
    assert not any("-replace" in " ".join(c) for c in cmds)  # not through Terraform: its delete has no force


def test_tpu_down_force_deletes_an_active_queued_resource_first(queued, tfvars):
    done = make("tpu-down", TF_OUTPUTS=queued, TFVARS=tfvars)
    assert done.returncode == 0, done.stderr
    assert commands(done.stdout) == [
        STATE_BUCKET, INIT, [*TF, "output", "-json"], DESCRIBE, RUN_STATE, QUEUED_DESCRIBE, QUEUED_DELETE,
        [*TF, "apply", "-input=false", "-auto-approve", f"-var-file={tfvars}", "-var=tpu_enabled=false"],
        [*TF, "output", "-json"]]
    assert f"deleting queued resource {NAME}-queued (ACTIVE) and its TPU with --force" in done.stdout
    done = make("tpu-down", TF_OUTPUTS=queued, TFVARS=tfvars, DRY_RUN_QUEUED_STATE="")  # already gone
    assert QUEUED_DELETE not in commands(done.stdout)
    done = make("tpu-down", TF_OUTPUTS=queued, TFVARS=tfvars, DESTROY_BUCKET=1)  # asked first, then deleted
    cmds = commands(done.stdout)
    assert cmds.index(QUEUED_DELETE) > max(i for i, c in enumerate(cmds) if c[:3] == ["gcloud", "storage", "ls"])
    assert cmds.index(QUEUED_DELETE) < cmds.index([*TF, "destroy", "-input=false", "-auto-approve",
                                                   f"-var-file={tfvars}", "-var=bucket_force_destroy=true"])


def test_tpu_down_keeps_the_bucket_unless_asked(single, tfvars):
    done = make("tpu-down", TF_OUTPUTS=single, TFVARS=tfvars)
    assert done.returncode == 0, done.stderr
    assert commands(done.stdout) == [
        STATE_BUCKET, INIT,
        [*TF, "output", "-json"],
        DESCRIBE, RUN_STATE,  # worker 0 is asked first: no TPU whose run lives is deleted from here
        [*TF, "apply", "-input=false", "-auto-approve", f"-var-file={tfvars}", "-var=tpu_enabled=false"],
        [*TF, "output", "-json"]]
    assert f"Kept: {BUCKET}" in done.stdout
    done = make("tpu-down", TF_OUTPUTS=single, TFVARS=tfvars, DESTROY_BUCKET=1)
    assert done.returncode == 0, done.stderr
    assert commands(done.stdout)[5:] == [
        ["gcloud", "storage", "ls", "--all-versions", f"{BUCKET}/**", f"--project={PROJECT}"],
        ["gcloud", "storage", "ls", "--all-versions", f"{BUCKET}-logs/**", f"--project={PROJECT}"],
        [*TF, "apply", "-input=false", "-auto-approve", f"-var-file={tfvars}", "-var=tpu_enabled=false",
         "-var=bucket_force_destroy=true"],
        [*TF, "destroy", "-input=false", "-auto-approve", f"-var-file={tfvars}", "-var=bucket_force_destroy=true"]]
    assert "a real run asks for the bucket name my-proj-tpu-llm" in done.stdout
    assert single.exists()  # a dry run changes nothing


def test_dry_run_without_tfvars_says_so(single, tmp_path):
    for target in ("tpu-up", "tpu-down"):
        done = make(target, TF_OUTPUTS=single, TFVARS=tmp_path / "absent.tfvars")
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines()[1 if target == "tpu-up" else 0].startswith(
            f"DRY_RUN: {tmp_path / 'absent.tfvars'} not found: a real run stops here (no project set")


def test_ssh_logs_tensorboard_data_upload(single):
    assert commands(make("tpu-ssh", TF_OUTPUTS=single, WORKER=2).stdout) == [
        [*SSH, "--worker=2", "--tunnel-through-iap"]]
    assert commands(make("tpu-logs", TF_OUTPUTS=single).stdout) == [
        DESCRIBE, [*SSH, "--worker=0", "--tunnel-through-iap", "--command=tail -n 200 -F ~/tpu-llm-train.log"]]
    # the TPU is gone (preempted): the copy in the run directory on Cloud Storage
    done = make("tpu-logs", TF_OUTPUTS=single, DRY_RUN_TPU_STATE="PREEMPTED", RUN="exp1")
    assert "tpu-logs: TPU tpu-llm-tpu is PREEMPTED; the training log from Cloud Storage" in done.stdout
    assert commands(done.stdout) == [
        DESCRIBE, ["gcloud", "storage", "ls", f"{BUCKET}/runs/exp1/logs/train-*.log", f"--project={PROJECT}"]]
    done = make("tpu-logs", TF_OUTPUTS=single, LOGS="setup")
    assert commands(done.stdout) == [
        [*SSH, "--worker=all", "--tunnel-through-iap", "--command=tail -n 50 /var/log/tpu-llm-setup.log"]]
    assert "ssh-add ~/.ssh/google_compute_engine" in done.stdout  # the agent gets gcloud's key for --worker=all
    assert commands(make("tpu-status", TF_OUTPUTS=single).stdout) == [
        ["gcloud", "compute", "tpus", "tpu-vm", "describe", NAME, *IAP, "--format=json"],
        ["gcloud", "storage", "ls", f"{BUCKET}/runs/tiny/logs/train-*.log", f"--project={PROJECT}"],
        ["gcloud", "compute", "tpus", "tpu-vm", "list", *IAP, "--format=json"],  # everything of the deployment
        ["gcloud", "compute", "tpus", "queued-resources", "list", *IAP, "--format=json"]]
    assert commands(make("tensorboard", TF_OUTPUTS=single).stdout) == [
        [".venv/bin/tensorboard", "--logdir", f"{BUCKET}/runs", "--port", "6006"]]
    done = make("data-upload", TF_OUTPUTS=single, INPUT="corpus/*.txt", SHARDS=16)
    assert commands(done.stdout) == [
        [".venv/bin/tpu-llm", "data", "prepare", "--input", "corpus/*.txt", "--output", "build/shards", "--tokenizer",
         "byte", "--shards", "16", "--overwrite"],
        [".venv/bin/python", "-m", "tpu_llm.cloud", "upload", "build/shards", f"{BUCKET}/shards"]]
    done = make("data-upload", TF_OUTPUTS=single)
    assert done.returncode != 0 and "needs INPUT=" in done.stderr


# --------------------------------------------------------------------------------------------------
# Clear failures, without DRY_RUN: fake terraform and gcloud on PATH


def fake_tools(tmp_path: Path, gcloud_account: str = "me@example.com", adc: bool = True, apply_output: str = "",
               terraform: bool = True) -> tuple[Path, Path]:
    """A bin directory with fake `gcloud` (and `terraform`) that log their arguments to calls.log."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir(parents=True)
    (bin_dir / "gcloud").write_text(f"""#!/bin/sh
echo "gcloud $*" >> {log}
case "$*" in
  "auth list"*) echo "{gcloud_account}" ;;
  "auth application-default print-access-token"*) {"echo token" if adc else "echo 'Reauthentication failed'; exit 1"} ;;
  *describe*) echo READY ;;
esac
""")
    if terraform:  # shell builtins only: PATH holds nothing but these fakes
        (tmp_path / "apply.txt").write_text(apply_output + "\n")
        (bin_dir / "terraform").write_text(f"""#!/bin/sh
echo "terraform $*" >> {log}
case "$*" in
  *apply*) while IFS= read -r line; do printf '%s\\n' "$line"; done < {tmp_path / "apply.txt"}; exit 1 ;;
esac
""")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    return bin_dir, log


STOCKOUT = """│ Error: Error waiting to create Vm: Error waiting for Creating Vm: Error code 8, message: \
There is no more capacity in the zone "us-central2-b"; you can try in another zone where Cloud TPU Nodes are offered"""
QUOTA = """│ Error: Error creating Vm: googleapi: Error 429: Quota 'TPUV4sPerProjectPerZoneForTPUAPI' exhausted. \
Limit 0 in zone us-central2-b, RESOURCE_EXHAUSTED"""


def test_stockout_is_one_line_and_nothing_is_destroyed(tmp_path, tfvars):
    bin_dir, log = fake_tools(tmp_path, apply_output=STOCKOUT)
    done = tpu_py("up", bin_dir, TFVARS=tfvars, TF_OUTPUTS=tmp_path / "none.json")
    assert STOCKOUT in done.stdout  # terraform's own output is shown, the explanation comes last
    line = one_error_line(done)
    assert "no capacity for v4-32 in us-central2-b" in line and "use_queued_resource = true" in line
    assert "us-central2-b" in line and "nothing was destroyed" in line
    calls = log.read_text()
    assert "terraform -chdir=infra apply" in calls and "destroy" not in calls


def test_quota_is_one_line(tmp_path, tfvars):
    bin_dir, _ = fake_tools(tmp_path, apply_output=QUOTA)
    line = one_error_line(tpu_py("up", bin_dir, TFVARS=tfvars, TF_OUTPUTS=tmp_path / "none.json"))
    assert line.startswith("error: TPU quota exceeded for v4-32 in us-central2-b") and "Quotas" in line


def test_missing_tools_and_credentials_are_one_line(tmp_path, tfvars, single):
    bin_dir, _ = fake_tools(tmp_path / "a", terraform=False)
    assert "terraform not found on PATH" in one_error_line(tpu_py("up", bin_dir, TFVARS=tfvars))
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "gcloud not found on PATH" in one_error_line(tpu_py("up", empty, TFVARS=tfvars))
    assert "gcloud not found on PATH" in one_error_line(tpu_py("train", empty, TF_OUTPUTS=single))
    bin_dir, _ = fake_tools(tmp_path / "b", gcloud_account="")
    assert "gcloud has no active account: run `gcloud auth login`" in one_error_line(
        tpu_py("up", bin_dir, TFVARS=tfvars))
    bin_dir, _ = fake_tools(tmp_path / "c", adc=False)
    assert "gcloud auth application-default login" in one_error_line(tpu_py("up", bin_dir, TFVARS=tfvars))


def test_no_project_set_is_one_line(tmp_path):
    bin_dir, log = fake_tools(tmp_path)
    line = one_error_line(tpu_py("up", bin_dir, TFVARS=tmp_path / "terraform.tfvars"))
    assert "no project set" in line and "terraform.tfvars.example" in line
    example = tmp_path / "example.tfvars"
    example.write_text((ROOT / "infra" / "terraform.tfvars.example").read_text())
    assert "my-project-id" in one_error_line(tpu_py("up", bin_dir, TFVARS=example))
    assert not log.exists()  # nothing ran


def test_failure_explanations():
    from tpu_llm.cloud.shell import explain_failure

    context = {"project": PROJECT, "zone": ZONE, "accelerator": "v4-32", "family": "v4", "tpu_name": NAME,
               "prefix": "tpu-llm"}
    plan = "  # google_compute_firewall.ssh_from_iap will be created\n  quota_label = \"x\"\n"  # not errors
    busy = "error: a run is already training on worker 0 (pid 42)\n"
    assert explain_failure(["gcloud"], 2, busy, context).startswith("a run is already training on worker 0")
    assert explain_failure(["terraform"], 1, plan + "│ Error: boom\n", context) == \
        "terraform failed (exit 1): │ Error: boom; see its output above"
    iap = "ERROR: (gcloud.alpha.compute.tpus.tpu-vm.ssh) Error while connecting [4033: 'not authorized']"
    assert "roles/iap.tunnelResourceAccessor" in explain_failure(["gcloud"], 255, iap, context)
    assert "gcloud components install alpha" in explain_failure(
        ["gcloud"], 2, "ERROR: (gcloud) Invalid choice: 'alpha'.", context)
    assert explain_failure(["gcloud"], 1, f"ERROR: (gcloud.compute.tpus.tpu-vm.ssh) NOT_FOUND: {NAME}", context) \
        .startswith(f"TPU {NAME} not found")


# --------------------------------------------------------------------------------------------------
# Recorded gcloud / terraform answers replayed by fake executables (no DRY_RUN)


def test_tpu_down_force_deletes_the_active_queued_resource_before_terraform(tmp_path, queued, tfvars):
    # Recorded: the queued resource is ACTIVE; Terraform's own delete (no force) would fail on it.
    bin_dir, log = fake_cloud(tmp_path, gcloud=[("compute tpus queued-resources describe*", 0, "ACTIVE")],
                              terraform=[("*output -json*", 0, outputs_json(queued))])
    done = tpu_py("down", bin_dir, TFVARS=tfvars, TF_OUTPUTS=tmp_path / "saved.json")
    assert done.returncode == 0, done.stderr
    calls = [c for c in log.read_text().splitlines() if " auth " not in c]
    assert calls == [
        f"gcloud storage buckets describe gs://my-proj-tpu-llm-tf --project={PROJECT} --format=value(name)",
        f"terraform -chdir=infra init -input=false {' '.join(INIT[4:])}", "terraform -chdir=infra output -json",
        f"gcloud compute tpus tpu-vm describe {NAME} {' '.join(IAP)} --format=value(state)",  # not READY: no run
        f"gcloud compute tpus queued-resources describe {NAME}-queued --format=value(state.state) {' '.join(IAP)}",
        f"gcloud compute tpus queued-resources delete {NAME}-queued --force --quiet {' '.join(IAP)}",
        f"terraform -chdir=infra apply -input=false -auto-approve -var-file={tfvars} -var=tpu_enabled=false",
        "terraform -chdir=infra output -json"]


def test_destroy_bucket_shows_what_and_asks(tmp_path, single, tfvars):
    listing = "\n".join(f"{BUCKET}/runs/tiny/ckpt-{i}.index#16000000000000{i}" for i in range(3))
    bin_dir, log = fake_cloud(tmp_path, gcloud=[(f"storage ls --all-versions {BUCKET}/\\*\\**", 0, listing),
                                                 ("storage ls*", 1, "ERROR: (gcloud.storage.ls) One or more URLs "
                                                  "matched no objects.")],
                              terraform=[("*output -json*", 0, outputs_json(single))])
    done = subprocess.run([sys.executable, "-m", "tpu_llm.cloud", "down"], capture_output=True, text=True,
                          timeout=60, stdin=subprocess.DEVNULL,
                          env=clean_env(PATH=bin_dir, TFVARS=tfvars, TF_OUTPUTS=tmp_path / "o.json", DESTROY_BUCKET=1))
    assert f"  {BUCKET}: 3 object(s)" in done.stdout and f"  {BUCKET}-logs: 0 object(s)" in done.stdout
    line = one_error_line(done)  # no terminal to ask on: refused, nothing deleted
    assert "nothing was deleted" in line and "YES=1" in line
    assert "apply" not in log.read_text() and "destroy" not in log.read_text()
    done = tpu_py("down", bin_dir, TFVARS=tfvars, TF_OUTPUTS=tmp_path / "o.json", DESTROY_BUCKET=1, YES=1)
    assert done.returncode == 0, done.stderr
    assert "terraform -chdir=infra destroy" in log.read_text()


NODE = {"name": f"projects/{PROJECT}/locations/{ZONE}/nodes/{NAME}", "state": "READY", "health": "UNHEALTHY_MAINTENANCE",
        "healthDescription": "The TPU had a maintenance event", "runtimeVersion": "tpu-vm-tf-2.20.0-pod-pjrt",
        "acceleratorType": "v4-32", "networkEndpoints": [{"ipAddress": f"10.8.0.{i}", "port": 8470} for i in (2, 3, 4, 5)],
        "symptoms": [{"symptomType": "HBM_OUT_OF_MEMORY", "workerId": "1", "details": "OOM on worker 1"}]}


def test_status_shows_state_health_workers_and_the_log_tail(tmp_path, pod):
    log_lines = "\n".join(f"step {i} loss {5 - i / 10:.2f}" for i in range(30))
    bin_dir, _ = fake_cloud(tmp_path, gcloud=[
        ("compute tpus tpu-vm describe*--format=json*", 0, json.dumps(NODE)),
        ("storage ls*", 0, f"{BUCKET}/runs/tiny/logs/train-20261203T090000Z.log\n"
                           f"{BUCKET}/runs/tiny/logs/train-20261203T100000Z.log"),
        (f"storage cat {BUCKET}/runs/tiny/logs/train-20261203T100000Z.log*", 0, log_lines)])
    done = tpu_py("status", bin_dir, TF_OUTPUTS=pod)
    assert done.returncode == 0, done.stderr
    out = done.stdout.splitlines()
    assert out[0] == f"tpu-status: {NAME} (v4-32, 4 worker(s), spot) in {ZONE}, project {PROJECT}"
    assert out[1] == ("  TPU: READY, health UNHEALTHY_MAINTENANCE (The TPU had a maintenance event), image "
                      "tpu-vm-tf-2.20.0-pod-pjrt")
    assert out[2] == "  symptom: HBM_OUT_OF_MEMORY on worker 1: OOM on worker 1"
    assert out[3] == "  workers: 4: 0=10.8.0.2, 1=10.8.0.3, 2=10.8.0.4, 3=10.8.0.5"
    assert out[4] == f"  training log {BUCKET}/runs/tiny/logs/train-20261203T100000Z.log (last 20 lines):"
    assert out[5:25] == [f"    step {i} loss {5 - i / 10:.2f}" for i in range(10, 30)]
    assert out[25:] == ["  everything of tpu-llm in us-central2-b (what bills, or may): nothing"]


def test_logs_after_the_tpu_is_gone_come_from_cloud_storage(tmp_path, single):
    bin_dir, log = fake_cloud(tmp_path, gcloud=[
        ("compute tpus tpu-vm describe*", 1, f"ERROR: (gcloud.compute.tpus.tpu-vm.describe) NOT_FOUND: "
                                            f"projects/{PROJECT}/locations/{ZONE}/nodes/{NAME} was not found"),
        ("storage ls*", 0, f"{BUCKET}/runs/exp1/logs/train-20261203T100000Z.log"),
        ("storage cat*", 0, "step 99 loss 1.23\nsaved checkpoint 99")])
    done = tpu_py("logs", bin_dir, TF_OUTPUTS=single, RUN="exp1")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-2:] == ["    step 99 loss 1.23", "    saved checkpoint 99"]
    assert "is gone; the training log from Cloud Storage" in done.stdout
    assert " ssh " not in log.read_text()


# Recorded API answers (the texts the provider and gcloud print) -> the one-line advice
BAD_ZONE = ("│ Error: error listing TPU v2 accelerator types: googleapi: Error 403: Location us-centrl1-a is not "
            "found or access is unauthorized., forbidden\n│ \n│   with data.google_tpu_v2_accelerator_types.available[0],")
POSTCONDITION = """│ Error: Resource postcondition failed
│ 
│   on tpu.tf line 48, in data "google_tpu_v2_accelerator_types" "available":
│   48:       condition     = contains(self.types, var.accelerator_type)
│     ├────────────────
│     │ self.types is list of string with 3 elements
│     │ var.accelerator_type is "v4-7"
│ 
│ accelerator_type v4-7 is not offered in zone us-central1-a; offered there:
│ v5litepod-1, v5litepod-8, v5p-8. Set accelerator_type (or zone) in
│ infra/terraform.tfvars.
╵"""
DRS = ("│ Error: Error applying IAM policy for storage bucket \"b/my-proj-tpu-llm-logs\": Error setting IAM policy: "
       "googleapi: Error 412: One or more users named in the policy do not belong to a permitted customer,  "
       "perhaps due to an organization policy., conditionNotMet")
RUNTIME_404 = ("│ Error: Error creating Vm: googleapi: Error 404: Runtime version tpu-vm-tf-2.20.0-pjrt not found "
               "in zone us-central1-a, notFound")


def test_failure_explanations_for_wrong_inputs():
    from tpu_llm.cloud.shell import explain_failure

    context = {"project": PROJECT, "zone": "us-centrl1-a", "accelerator": "v5litepod-8", "family": "v5litepod",
               "tpu_name": NAME, "prefix": "tpu-llm"}
    line = explain_failure(["terraform"], 1, BAD_ZONE, context)
    assert line.startswith("zone us-centrl1-a is not a Cloud TPU location open to project my-proj") and \
        "roles/owner" not in line and "us-central1-a" in line and "gcloud compute tpus locations list" in line
    assert explain_failure(["terraform"], 1, POSTCONDITION, context) == (
        "infra/terraform.tfvars: accelerator_type v4-7 is not offered in zone us-central1-a; offered there: "
        "v5litepod-1, v5litepod-8, v5p-8. Set accelerator_type (or zone) in infra/terraform.tfvars.")
    assert "set usage_logs = false" in explain_failure(["terraform"], 1, DRS, context)
    line = explain_failure(["terraform"], 1, RUNTIME_404, context)  # during tpu-up: not "run make tpu-up"
    assert "make tpu-up" not in line and "runtime_version" in line and "nothing was destroyed" in line
    line = explain_failure(["gcloud"], 1, f"ERROR: (gcloud.compute.tpus.tpu-vm.ssh) NOT_FOUND: {NAME}", context)
    assert line.startswith(f"TPU {NAME} not found") and "make tpu-status" in line
