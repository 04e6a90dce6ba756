"""Issue 29: the first `make tpu-up && make train` on a fresh project, and no TPU left billing unseen.

Offline, with recorded answers: the runtime-image rule of infra/runtime run by the Terraform binary on
zone image lists with and without TensorFlow 2.20; fake gcloud / terraform / ssh-keygen / ssh-add on
PATH for the driver (a queued resource past its wait, an ssh-agent holding other keys, the run that
`make train` started); the workers' set-up wait run locally against ready markers of two locks.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import hcl2
import pytest
from helpers import (BUCKET, IAP, NAME, SCP, clean_env, commands, fake_cloud, make, one_error_line, outputs_json,
                     terraform, tpu_py, write_outputs)

from tpu_llm.cloud import driver

pytestmark = pytest.mark.slow  # terraform and the driver in subprocesses

ROOT = Path(__file__).resolve().parent.parent
INFRA = ROOT / "infra"


# --------------------------------------------------------------------------------------------------
# 1. The runtime image: chosen from what the zone offers


# Recorded `gcloud compute tpus tpu-vm versions list` names: the TF images stop before 2.20 (Google's
# "TPU software versions" page lists them up to 2.18, with -v5e-and-v6 suffixes seen for v5e/v6e); the
# second list has 2.20 TF images too, which no rule takes any more.
WITHOUT_220 = ["tpu-ubuntu2204-base", "v2-alpha-tpuv5-lite", "v2-alpha-tpuv5", "v2-alpha-tpuv6e",
               "tpu-vm-tf-2.16.1-pjrt", "tpu-vm-tf-2.16.1-pod-pjrt", "tpu-vm-tf-2.18.0-pjrt-v5e-and-v6",
               "tpu-vm-tf-2.18.0-pod-pjrt-v5e-and-v6", "tpu-vm-tf-2.18.0-pod-pjrt"]
WITH_220 = [*WITHOUT_220, "tpu-vm-tf-2.20.0-pjrt", "tpu-vm-tf-2.20.0-pod-pjrt",
            "tpu-vm-tf-2.20.0-pod-pjrt-v5e-and-v6"]


def test_single_host_takes_the_family_base_image_and_the_venv_libtpu(rule):
    for family, image in (("v5litepod", "v2-alpha-tpuv5-lite"), ("v5p", "v2-alpha-tpuv5"), ("v6e", "v2-alpha-tpuv6e"),
                          ("v4", "tpu-ubuntu2204-base")):
        for versions in (WITHOUT_220, WITH_220):
            got = rule(versions, family, False)
            assert (got["runtime_version"], got["libtpu_from"], got["problem"]) == (image, "venv", ""), got
    assert "base image" in rule(WITHOUT_220, "v5litepod", False)["reason"]


def test_a_pod_takes_the_base_image_of_google_s_tf_release_tests_and_the_tf_worker_container(rule):
    from tpu_llm.cloud import pod_check

    for family, image in (("v5litepod", "v2-alpha-tpuv5-lite"), ("v5p", "v2-alpha-tpuv5"), ("v4", "v2-alpha-tpuv5"),
                          ("v6e", "v2-alpha-tpuv6e")):
        for versions in (WITHOUT_220, WITH_220):  # a TensorFlow pod image in the zone changes nothing
            got = rule(versions, family, True)
            assert (got["runtime_version"], got["problem"], got["libtpu_from"]) == (image, "", "container"), got
            assert got["tf_worker_image"] == pod_check.tf_worker_image("2.20.0")
    assert "outside Google's TF release tests" in rule(WITH_220, "v6e", True)["reason"]
    assert "outside" not in rule(WITH_220, "v5p", True)["reason"]
    assert rule(WITH_220, "v5p", False)["tf_worker_image"] == ""


def test_an_image_the_zone_does_not_offer_stops_the_plan_naming_what_it_offers(rule):
    got = rule(["tpu-ubuntu2204-base", "tpu-vm-tf-2.16.1-pod-pjrt"], "v5p", True)
    assert got["problem"] == ("runtime image v2-alpha-tpuv5 is not offered in this zone; offered there: "
                              "tpu-ubuntu2204-base, tpu-vm-tf-2.16.1-pod-pjrt")
    # the plan stops on it: a precondition of the TPU and of the runtime_version output
    tpu = (INFRA / "tpu.tf").read_text() + (INFRA / "outputs.tf").read_text()
    assert tpu.count("module.runtime.problem ==") == 2


def test_the_driver_prints_the_plan_s_choice(tmp_path):
    out = write_outputs(tmp_path / "o.json", "v5litepod-8", 1, runtime_choice="v2-alpha-tpuv5-lite: single host: ...")
    tfvars = tmp_path / "terraform.tfvars"
    tfvars.write_text('project_id = "my-proj"\n')
    done = make("tpu-up", TF_OUTPUTS=out, TFVARS=tfvars)
    assert "tpu-up: runtime image v2-alpha-tpuv5-lite: single host: ..." in done.stdout, done.stdout


def test_the_setup_checks_the_venv_libtpu_is_the_pinned_one():
    text = (INFRA / "startup.sh.tftpl").read_text()
    assert 'fail "the venv\'s libtpu is' in text and 'ln -sf "$${found#* }" "$LIBTPU"' in text
    lock = (INFRA / "worker-requirements.txt").read_text()
    assert re.search(r"^libtpu==0\.0\.14 ", lock, re.M)
    # the single-host run names that link, never /lib/libtpu.so, on every generation, through PJRT on every one
    # (tpu_chips.runtime_variables; issue 50: Google's TF images and release tests run v2 to v5p on PJRT too)
    from tpu_llm.cloud.worker_plan import TrainPlan
    for accelerator, pjrt in (("v2-8", True), ("v3-8", True), ("v4-8", True), ("v5litepod-8", True),
                              ("v5p-8", True), ("v6e-8", True)):
        plan = TrainPlan({"multi_host": False, "tpu_name": "t", "accelerator_type": accelerator}, "c", "gs://b", "", [])
        assert set(plan.environment().values()) - {"true"} == {"/opt/tpu-llm/libtpu.so"}
        assert ("NEXT_PLUGGABLE_DEVICE_USE_C_API" in plan.environment()) is pjrt, accelerator


# --------------------------------------------------------------------------------------------------
# 2. Set-up that follows the lock


def test_lock_hash_is_terraform_sha256_of_the_file(tmp_path):
    tf = terraform()
    done = subprocess.run([tf, "console"], input=f'sha256(file("{INFRA / "worker-requirements.txt"}"))\n',
                          capture_output=True, text=True, cwd=tmp_path)
    assert done.stdout.strip().strip('"') == driver.lock_sha256(str(INFRA))


def wait_command(tmp_path: Path, lock: str) -> str:
    """The set-up wait `make tpu-up` runs on every worker, pointed at a local state directory."""
    outputs = write_outputs(tmp_path / "o.json", "v4-8", 1)
    tfvars = tmp_path / "terraform.tfvars"
    tfvars.write_text('project_id = "my-proj"\n')
    done = make("tpu-up", TF_OUTPUTS=outputs, TFVARS=tfvars, TPU_WAIT_MINUTES="0.02")
    wait = commands(done.stdout)[-1][-1].removeprefix("--command=")
    assert f"lock={driver.lock_sha256(str(INFRA))}" in wait
    return wait.replace(driver.lock_sha256(str(INFRA)), lock).replace("/opt/tpu-llm", str(tmp_path)) \
        .replace("sudo bash", "bash").replace("sleep 10", "sleep 0")


@pytest.mark.parametrize("marker, reruns", [("lock=NEW", False), ("lock=OLD", True), (None, True)],
                         ids=["same-lock", "older-lock", "failed"])
def test_a_worker_set_up_for_another_lock_runs_the_current_script(tmp_path, marker, reruns):
    (tmp_path / "tpu-llm-setup.sh").write_text(f"echo current-script-ran > {tmp_path}/ran\n")
    if marker:
        (tmp_path / "ready").write_text(f"2026-12-04T00:00:00Z\n{marker}\n")
    else:
        (tmp_path / "failed").write_text("boom\n")
    done = subprocess.run(["bash", "-c", wait_command(tmp_path, "NEW")], capture_output=True, text=True,
                          env={**os.environ, "HOME": str(tmp_path)}, timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "ran").exists() == reruns


def test_train_installs_with_the_current_setup_script_not_the_boot_copy():
    from tpu_llm.cloud.worker_plan import INSTALL
    assert INSTALL.endswith("sudo bash ~/tpu-llm/tpu-llm-setup.sh ~/tpu-llm")
    text = (INFRA / "startup.sh.tftpl").read_text()
    assert 'rm -rf "$VENV" "$STATE_DIR/ready"' in text and 'echo "lock=$LOCK_SHA256"' in text


# --------------------------------------------------------------------------------------------------
# 3. Status and logs follow the run `make train` started


def test_status_and_logs_follow_the_last_run(tmp_path):
    single = write_outputs(tmp_path / "o.json", "v4-8", 1)
    bin_dir, log = fake_cloud(tmp_path, gcloud=[
        ("compute tpus tpu-vm describe*--format=json*", 0, "{}"),
        ("compute tpus tpu-vm describe*", 0, "READY"),
        (f"storage ls {BUCKET}/runs/exp7/*", 0, f"{BUCKET}/runs/exp7/logs/train-20261204T100000Z.log"),
        ("storage cat*", 0, "step 7 loss 0.7")])
    last = tmp_path / "last-run.json"
    env = dict(TF_OUTPUTS=single, TF_LAST_RUN=last, SSH_AUTH_SOCK="")
    done = subprocess.run([sys.executable, "-m", "tpu_llm.cloud", "train"], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env=clean_env(PATH=bin_dir, RUN="exp7", **env))
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(last.read_text())["run_dir"] == f"{BUCKET}/runs/exp7"
    done = tpu_py("status", bin_dir, **env)  # no RUN given: the run make train started, not configs/tiny.yaml's
    assert done.returncode == 0, done.stderr
    assert f"training log {BUCKET}/runs/exp7/logs/train-20261204T100000Z.log" in done.stdout
    assert "    step 7 loss 0.7" in done.stdout
    done = tpu_py("logs", bin_dir, LOGS="gcs", **env)
    assert done.stdout.splitlines()[-1] == "    step 7 loss 0.7", done.stdout + done.stderr


# --------------------------------------------------------------------------------------------------
# 4. ssh-agent: the key gcloud needs for --worker=all


def agent_tools(tmp_path: Path, add_status: int) -> tuple[Path, dict]:
    bin_dir, log = fake_cloud(tmp_path, gcloud=[("compute tpus tpu-vm describe*", 0, "READY")])
    (bin_dir / "ssh-keygen").write_text("#!/bin/sh\necho '3072 SHA256:mine me@host (RSA)'\n")
    (bin_dir / "ssh-add").write_text(f"""#!/bin/sh
if [ "$1" = "-l" ]; then echo '256 SHA256:someone-else other@host (ED25519)'; exit 0; fi
echo "ssh-add $*" >> {log}
{"echo 'Enter passphrase for key: (no terminal)' >&2; exit 1" if add_status else "exit 0"}
""")
    for tool in ("ssh-keygen", "ssh-add"):
        (bin_dir / tool).chmod(0o755)
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "google_compute_engine").write_text("PRIVATE KEY\n")
    pod = write_outputs(tmp_path / "pod.json", "v4-32", 4)
    return bin_dir, dict(TF_OUTPUTS=pod, HOME=home, SSH_AUTH_SOCK=tmp_path / "agent.sock", TF_LAST_RUN=tmp_path / "l")


def test_a_running_agent_without_the_key_gets_it_before_the_first_copy(tmp_path):
    bin_dir, env = agent_tools(tmp_path, add_status=0)
    done = subprocess.run([sys.executable, "-m", "tpu_llm.cloud", "train"], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env=clean_env(PATH=bin_dir, DATA=f"{BUCKET}/shards/*.tfrecord", **env))
    assert done.returncode == 0, done.stdout + done.stderr
    calls = (tmp_path / "calls.log").read_text().splitlines()
    add = calls.index(f"ssh-add {env['HOME']}/.ssh/google_compute_engine")
    first_scp = next(i for i, c in enumerate(calls) if " scp " in c)
    assert add < first_scp


def test_a_missing_key_is_made_and_added_before_the_first_copy(tmp_path):
    bin_dir, env = agent_tools(tmp_path, add_status=0)
    key = Path(env["HOME"]) / ".ssh" / "google_compute_engine"
    key.unlink()
    (bin_dir / "ssh-keygen").write_text(f"""#!/bin/sh
if [ "$1" = "-lf" ]; then echo '3072 SHA256:mine me@host (RSA)'; exit 0; fi
echo "ssh-keygen $*" >> {tmp_path / "calls.log"}
echo KEY > {key}
""")
    done = subprocess.run([sys.executable, "-m", "tpu_llm.cloud", "train"], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env=clean_env(PATH=bin_dir, DATA=f"{BUCKET}/shards/*.tfrecord", **env))
    assert done.returncode == 0, done.stdout + done.stderr
    calls = (tmp_path / "calls.log").read_text().splitlines()
    assert calls.index(f"ssh-keygen -t rsa -N  -f {key} -q") < calls.index(f"ssh-add {key}") < \
        next(i for i, c in enumerate(calls) if " scp " in c)


def test_an_agent_that_refuses_the_key_stops_with_the_command_before_copying(tmp_path):
    bin_dir, env = agent_tools(tmp_path, add_status=1)
    done = subprocess.run([sys.executable, "-m", "tpu_llm.cloud", "train"], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env=clean_env(PATH=bin_dir, DATA=f"{BUCKET}/shards/*.tfrecord", **env))
    line = one_error_line(done)
    assert "run `ssh-add ~/.ssh/google_compute_engine` in this terminal" in line and "nothing was copied" in line
    assert " scp " not in (tmp_path / "calls.log").read_text()


# --------------------------------------------------------------------------------------------------
# 5. A queued resource never outlives the wait unattended


@pytest.mark.parametrize("keep", [False, True], ids=["deleted", "KEEP_QUEUED=1"])
def test_a_queued_resource_past_its_wait_is_deleted_unless_kept(tmp_path, keep):
    queued = write_outputs(tmp_path / "q.json", "v4-8", 1, use_queued_resource=True,
                           queued_resource_name=f"{NAME}-queued")
    tfvars = tmp_path / "terraform.tfvars"
    tfvars.write_text('project_id = "my-proj"\nuse_queued_resource = true\n')
    bin_dir, log = fake_cloud(tmp_path, gcloud=[
        ("compute tpus queued-resources describe*", 0, "WAITING_FOR_RESOURCES"),
        ("compute tpus tpu-vm describe*", 1, "ERROR: (gcloud.compute.tpus.tpu-vm.describe) NOT_FOUND: not found")],
        terraform=[("*output -json*", 0, outputs_json(queued))])
    extra = {"KEEP_QUEUED": "1"} if keep else {}
    done = tpu_py("up", bin_dir, TFVARS=tfvars, TF_OUTPUTS=tmp_path / "saved.json", TPU_WAIT_MINUTES="0.001",
                  TPU_POLL_SECONDS="0", **extra)
    line = one_error_line(done)
    calls = log.read_text()
    # (a new request carries --valid-until-duration=<the wait>: tests/test_tpu_launch.py QUEUED_CREATE)
    deleted = f"queued-resources delete {NAME}-queued --force --quiet" in calls
    assert deleted == (not keep)
    if keep:
        assert "KEEP_QUEUED=1: the queued resource keeps waiting" in line and "make tpu-down" in line
    else:
        assert "the queued resource was deleted, so no TPU comes up unattended" in line


# --------------------------------------------------------------------------------------------------
# 6. Least privilege, APIs, hosts from the API, tpu-stop, DOWN_AFTER, previews before paying


def test_least_privilege_and_the_resource_manager_api():
    with open(INFRA / "iam.tf", encoding="utf-8") as f:
        iam = hcl2.load(f)
    roles = "".join(json.dumps(block) for block in iam["locals"])
    assert "roles/storage.objectUser" in roles and "objectAdmin" not in roles
    assert 'local.multi_host ? [\\"roles/tpu.viewer\\"] : []' in roles
    assert "cloudresourcemanager.googleapis.com" in (INFRA / "apis.tf").read_text()
    outputs = (INFRA / "outputs.tf").read_text()
    assert "length(google_tpu_v2_vm.tpu[0].network_endpoints)" in outputs


def test_tpu_up_takes_the_host_count_from_the_api(tmp_path):
    pod = write_outputs(tmp_path / "pod.json", "v6e-16", 2)  # the plan's 8-per-host estimate
    bin_dir, log = fake_cloud(tmp_path, gcloud=[
        ("compute tpus tpu-vm describe*networkEndpoints*", 0,
         json.dumps({"networkEndpoints": [{"ipAddress": f"10.0.0.{i}"} for i in range(4)]})),
        ("compute tpus tpu-vm describe*", 0, "READY")], terraform=[("*output -json*", 0, outputs_json(pod))])
    tfvars = tmp_path / "terraform.tfvars"
    tfvars.write_text('project_id = "my-proj"\naccelerator_type = "v6e-16"\n')
    done = tpu_py("up", bin_dir, TFVARS=tfvars, TF_OUTPUTS=tmp_path / "saved.json", SSH_AUTH_SOCK="")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "the TPU API lists 4 hosts (2 estimated); using 4" in done.stdout
    assert "(v6e-16, 4 worker(s))" in done.stdout
    saved = json.loads((tmp_path / "saved.json").read_text())  # kept: make train and tpu-status say 4 too
    assert saved["worker_count"]["value"] == 4


def test_tpu_stop_sends_sigterm_on_worker_0_and_down_after_leaves_the_teardown_to_worker_0(tmp_path):
    single = write_outputs(tmp_path / "o.json", "v4-8", 1)
    done = make("tpu-stop", TF_OUTPUTS=single)
    assert done.returncode == 0, done.stderr
    (stop,) = commands(done.stdout)
    assert stop[:10] == ["gcloud", "alpha", "compute", "tpus", "tpu-vm", "ssh", NAME, *IAP, "--worker=0"]
    assert 'kill -TERM "$pid"' in stop[-1] and "make tpu-down" in done.stdout
    tfvars = tmp_path / "terraform.tfvars"
    tfvars.write_text('project_id = "my-proj"\n')
    done = make("train", TF_OUTPUTS=single, TFVARS=tfvars, DOWN_AFTER="1")
    assert done.returncode == 0, done.stderr
    cmds = commands(done.stdout)
    launch = next(i for i, c in enumerate(cmds) if c[-1].startswith("--command=set -e"))
    assert launch == len(cmds) - 1  # nothing after the launch: this machine deletes nothing
    delete = f"gcloud compute tpus tpu-vm delete {NAME} --zone=us-central2-b --project=my-proj --quiet --async"
    assert f"printf '%s\\n' '{delete}' > ~/tpu-llm-run.teardown" in cmds[launch][-1]  # worker 0 does, at the end
    assert f"train: worker 0 deletes TPU {NAME} when the run ends or fails (DOWN_AFTER=1), as its service account: " \
           f"{delete}; this machine deletes nothing" in done.stdout


@pytest.mark.parametrize("target", ["train", "tpu-status", "tpu-ssh", "tpu-logs", "tpu-stop", "tpu-up"])
def test_dry_run_previews_every_target_from_tfvars_alone(tmp_path, target):
    tfvars = tmp_path / "terraform.tfvars"
    tfvars.write_text('project_id = "fresh-proj"\nzone = "us-east5-a"\naccelerator_type = "v5p-16"\n')
    done = make(target, TF_OUTPUTS=tmp_path / "missing.json", TFVARS=tfvars, TRAIN_ON="tpu")
    assert done.returncode == 0, done.stdout + done.stderr
    cmds = [c for c in commands(done.stdout) if c[0] == "gcloud"]
    assert cmds, done.stdout
    assert all("--project=fresh-proj" in c for c in cmds), cmds
    assert all("--zone=us-east5-a" in c for c in cmds if c[1] not in ("storage", "container")), cmds  # zone-less
    if target == "tpu-up":  # a pod's TF worker container is asked of its registry first, before anything is made
        assert cmds[0][:4] == ["gcloud", "container", "images", "describe"], cmds
    if target == "tpu-up":  # the pod set-up is shown before anything is paid for
        assert ("tpu-up: pod set-up on every worker: tensorflow-tpu from the lock, and the TPU runtime serving "
                "TensorFlow from gcr.io/cloud-tpu-v2-images/grpc_tpu_worker:tf-2.20.0-pjrt on port 8470") in done.stdout
    if target == "train":  # a 2-host v5p-16: worker 0 against the pod's servers, data from the bucket's shards
        assert any(c[:6] == SCP[:6] for c in cmds)
        assert "--tpu=tpu-llm-tpu" in cmds[-1][-1] and "gs://fresh-proj-tpu-llm/shards/*.tfrecord" in cmds[-1][-1]
