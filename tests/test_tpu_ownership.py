"""Issue 39: a run that owns its TPU, nothing billing unseen, no silent replacement, pods on base images.

Against recorded gcloud/terraform behaviour, offline:
  - the launch script `make train` sends to worker 0 (from its DRY_RUN line), run here with bash in a
    scratch HOME, with a fake trainer and a fake gcloud; gcloud re-runs a TPU ssh command whose ssh
    exits 255 (command_lib/compute/tpus/tpu_vm/ssh_utils.py), so the script runs twice on one run;
  - the driver itself (`python -m tpu_llm.cloud ...`) with fake gcloud/terraform on PATH: a dropped
    launch connection, Ctrl-C (SIGINT) or SIGTERM while a queued resource waits, a plan that would
    replace a running TPU (`terraform show -json` of a saved plan, as Terraform 1.x prints it);
  - infra/runtime's image rule, applied by the Terraform binary to a zone list without 2.20 pod images.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import NAME, PROJECT, ZONE, clean_env, commands, fake_cloud, make, one_error_line, outputs_json, write_outputs
from tpu_worker import DELETE, Worker0, launch_script, ready_tpu, single_host

pytestmark = pytest.mark.slow  # bash, the driver and terraform in subprocesses

ROOT = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------------------------------
# Worker 0 owns the run, and the TPU with DOWN_AFTER=1


@pytest.mark.parametrize("status", [0, 1], ids=["run-ends", "run-fails"])
def test_worker_0_deletes_its_tpu_when_the_run_ends_or_fails(tmp_path, status):
    worker = Worker0(tmp_path, launch_script(tmp_path, DOWN_AFTER="1"))
    done = subprocess.run(["bash", "-c", worker.script], capture_output=True, text=True, timeout=120,
                          env=worker.env(FAKE_STATUS=status))
    assert done.returncode == status, done.stdout + done.stderr
    assert "fake trainer: done" in done.stdout  # the log streamed back to the laptop
    assert worker.deletes() == [DELETE], worker.calls.read_text()
    log = worker.log()
    assert f"the run ended with exit status {status}" in log and "delete requested" in log


def test_without_down_after_nothing_is_deleted(tmp_path):
    worker = Worker0(tmp_path, launch_script(tmp_path))
    done = subprocess.run(["bash", "-c", worker.script], capture_output=True, text=True, timeout=120, env=worker.env())
    assert done.returncode == 0, done.stdout + done.stderr
    assert worker.deletes() == []
    assert any(c.startswith("gcloud storage cp --quiet") for c in worker.calls.read_text().splitlines())  # the log copy


def test_ttl_hours_stops_the_run_and_deletes_the_tpu(tmp_path):
    worker = Worker0(tmp_path, launch_script(tmp_path, TTL_HOURS="0.0003"))  # about a second
    done = subprocess.run(["bash", "-c", worker.script], capture_output=True, text=True, timeout=120,
                          env=worker.env(FAKE_RELEASE=tmp_path / "never"))
    assert done.returncode == 143, done.stdout + done.stderr  # SIGTERM: the trainer saved and stopped
    assert "TTL_HOURS=0.0003 reached: SIGTERM to the run" in worker.log()
    assert "fake trainer: SIGTERM, checkpoint saved" in worker.log()
    assert worker.deletes() == [DELETE]


def test_a_dropped_connection_reattaches_and_deletes_nothing_while_the_run_lives(tmp_path):
    worker = Worker0(tmp_path, launch_script(tmp_path, DOWN_AFTER="1"))
    first = worker.start(FAKE_RELEASE=worker.release)
    worker.wait_for("fake trainer started")
    os.killpg(first.pid, signal.SIGHUP)  # the ssh session drops: its processes get SIGHUP
    first.wait(timeout=30)
    second = worker.start(FAKE_RELEASE=worker.release)  # gcloud runs the same command again
    time.sleep(2)
    assert second.poll() is None, second.stdout.read()  # attached, not refused
    assert worker.deletes() == []  # the run lives: nothing deleted
    worker.release.touch()
    out, _ = second.communicate(timeout=60)
    assert second.returncode == 0, out
    assert worker.log().count("fake trainer started") == 1  # one run, not two
    assert worker.deletes() == [DELETE]


def test_a_second_make_train_with_other_settings_is_refused_while_a_run_lives(tmp_path):
    worker = Worker0(tmp_path, launch_script(tmp_path))
    first = worker.start(FAKE_RELEASE=worker.release)
    worker.wait_for("fake trainer started")
    (tmp_path / "b").mkdir()
    other = Worker0(tmp_path / "b", launch_script(tmp_path / "b", RUN="other")).script.replace(str(tmp_path / "b"),
                                                                                                 str(tmp_path))
    done = subprocess.run(["bash", "-c", other], capture_output=True, text=True, timeout=60, env=worker.env())
    assert done.returncode == 75 and "a run is already training on worker 0" in done.stdout + done.stderr
    worker.release.touch()
    first.communicate(timeout=60)


# --------------------------------------------------------------------------------------------------
# The laptop side: a dropped launch connection deletes nothing


def test_a_lost_launch_connection_with_down_after_deletes_nothing(tmp_path):
    bin_dir, log, env = ready_tpu(tmp_path, ("*tpu-vm ssh*--command=set -e*", 255, "Connection closed by remote host."
                                             "\nRetrying: SSH command error."))
    done = subprocess.run([sys.executable, "-m", "tpu_llm.cloud", "train"], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env=clean_env(DOWN_AFTER=1, **env))
    deletes = [c for c in log.read_text().splitlines()
               if c.startswith(("gcloud compute tpus tpu-vm delete", "gcloud compute tpus queued-resources delete"))
               or (c.startswith("terraform") and ("tpu_enabled=false" in c or " destroy" in c))]
    assert deletes == [], deletes
    line = one_error_line(done)
    assert "a run it started goes on there" in line and f"worker 0 deletes TPU {NAME} when the run ends" in line


# --------------------------------------------------------------------------------------------------
# Ctrl-C while a queued resource waits


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_interrupted_queued_wait_deletes_the_request(tmp_path, sig):
    queued = write_outputs(tmp_path / "q.json", "v4-8", 1, use_queued_resource=True, queued_resource_name=f"{NAME}-queued")
    tfvars = tmp_path / "terraform.tfvars"
    tfvars.write_text(f'project_id = "{PROJECT}"\nuse_queued_resource = true\n')
    bin_dir, log = fake_cloud(tmp_path, gcloud=[
        ("compute tpus queued-resources describe*", 0, "WAITING_FOR_RESOURCES"),
        ("compute tpus tpu-vm describe*", 1, "ERROR: (gcloud.compute.tpus.tpu-vm.describe) NOT_FOUND: not found")],
        terraform=[("*output -json*", 0, outputs_json(queued))])
    up = subprocess.Popen([sys.executable, "-m", "tpu_llm.cloud", "up"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, cwd=ROOT, env=clean_env(PATH=bin_dir, TFVARS=tfvars, TF_OUTPUTS=tmp_path / "s.json",
                                                             TPU_WAIT_MINUTES=10, TPU_POLL_SECONDS=0.2))
    deadline = time.monotonic() + 60
    while log.read_text().count("queued-resources describe") < 3 if log.exists() else True:
        assert time.monotonic() < deadline and up.poll() is None, up.communicate()
        time.sleep(0.1)
    up.send_signal(sig)
    out, err = up.communicate(timeout=60)
    deleted = f"queued-resources delete {NAME}-queued --force --quiet" in log.read_text()
    last = err.strip().splitlines()[-1] if err.strip() else ""
    assert deleted or f"gcloud compute tpus queued-resources delete {NAME}-queued" in last, (out, err)
    assert deleted, (out, err)  # the fake gcloud deletes it without trouble
    assert "deleted" in last and "nothing waits" in last, err


def queued_cloud(tmp_path: Path, *answers):
    """A tpu-up whose queued resource is recorded by `answers` (gcloud's), with its outputs and tfvars."""
    queued = write_outputs(tmp_path / "q.json", "v4-8", 1, use_queued_resource=True, queued_resource_name=f"{NAME}-queued")
    tfvars = tmp_path / "terraform.tfvars"
    tfvars.write_text(f'project_id = "{PROJECT}"\nuse_queued_resource = true\n')
    bin_dir, log = fake_cloud(tmp_path, gcloud=[*answers, (
        "compute tpus tpu-vm describe*", 1, "ERROR: (gcloud.compute.tpus.tpu-vm.describe) NOT_FOUND: not found")],
        terraform=[("*output -json*", 0, outputs_json(queued))])
    return bin_dir, log, dict(TFVARS=tfvars, TF_OUTPUTS=tmp_path / "s.json")


EXPIRED = {"state": {"state": "FAILED", "failedData": {"error": {"code": 4, "message": "The queued resource's "
                                                                 "valid-until time has passed."}}}}


def test_a_failed_queued_resource_is_explained_and_deleted(tmp_path):
    bin_dir, log, env = queued_cloud(tmp_path, ("compute tpus queued-resources describe*json*", 0, json.dumps(EXPIRED)),
                                     ("compute tpus queued-resources describe*", 0, "FAILED"))
    done = subprocess.run([sys.executable, "-m", "tpu_llm.cloud", "up"], capture_output=True, text=True, timeout=60,
                          cwd=ROOT, env=clean_env(PATH=bin_dir, TPU_POLL_SECONDS=0, **env))
    assert "queued resource tpu-llm-tpu-queued is FAILED (The queued resource's valid-until time has passed.)" \
        in done.stdout, done.stdout + done.stderr
    assert f"queued-resources delete {NAME}-queued --force --quiet" in log.read_text()


def test_keep_queued_requests_hours_not_the_wait(tmp_path):
    bin_dir, log, env = queued_cloud(tmp_path, ("compute tpus queued-resources describe*", 1,
                                                "ERROR: (gcloud.compute.tpus.queued-resources.describe) NOT_FOUND"))
    for extra, seconds in (({}, 60), ({"KEEP_QUEUED": 1}, 86400), ({"KEEP_QUEUED": 1, "KEEP_QUEUED_HOURS": 2}, 7200)):
        subprocess.run([sys.executable, "-m", "tpu_llm.cloud", "up"], capture_output=True, text=True, timeout=60,
                       cwd=ROOT, env=clean_env(PATH=bin_dir, TPU_WAIT_MINUTES="0.001", TPU_POLL_SECONDS=0, **env, **extra))
        (create,) = [c for c in log.read_text().splitlines() if " queued-resources create " in c][-1:]
        assert f"--valid-until-duration={seconds}s" in create, create  # the wait (at least a minute), or hours


# --------------------------------------------------------------------------------------------------
# No silent replacement of a running TPU

REPLACE_PLAN = {"format_version": "1.2", "resource_changes": [
    {"address": "google_tpu_v2_vm.tpu[0]", "type": "google_tpu_v2_vm", "name": "tpu", "index": 0,
     "change": {"actions": ["delete", "create"], "before": {"runtime_version": "tpu-vm-tf-2.20.0-pod-pjrt"},
                "after": {}, "after_unknown": {"runtime_version": True}, "replace_paths": [["runtime_version"]]},
     "action_reason": "replace_because_cannot_update"},
    {"address": "google_storage_bucket.data", "type": "google_storage_bucket", "name": "data",
     "change": {"actions": ["no-op"], "before": {}, "after": {}}}]}


def test_tpu_up_refuses_to_replace_a_running_tpu_unless_asked(tmp_path):
    pod = write_outputs(tmp_path / "pod.json", "v4-32", 4, runtime_version="tpu-vm-tf-2.20.0-pod-pjrt")
    tfvars = tmp_path / "terraform.tfvars"
    tfvars.write_text(f'project_id = "{PROJECT}"\nzone = "{ZONE}"\naccelerator_type = "v4-32"\n')
    bin_dir, log = fake_cloud(tmp_path, gcloud=[("compute tpus tpu-vm describe*", 0, "READY"),
                                                ("*echo tpu-llm-run:*", 0, "tpu-llm-run: idle")],
                              terraform=[("*show -json*", 0, json.dumps(REPLACE_PLAN)),
                                         ("*output -json*", 0, outputs_json(pod))])
    env = dict(PATH=bin_dir, TFVARS=tfvars, TF_OUTPUTS=pod, SSH_AUTH_SOCK="")
    done = subprocess.run([sys.executable, "-m", "tpu_llm.cloud", "up"], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env=clean_env(**env))
    line = one_error_line(done)
    assert f"would replace the running TPU {NAME} (READY)" in line and "runtime_version" in line and "REPLACE=1" in line
    applies = [c for c in log.read_text().splitlines() if " apply " in c]
    assert all("-target=google_project_service.apis" in c for c in applies), applies  # the TPU's apply never ran
    done = subprocess.run([sys.executable, "-m", "tpu_llm.cloud", "up"], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env=clean_env(REPLACE=1, **env))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "terraform -chdir=infra apply -input=false .tpu-up.tfplan" in log.read_text()


# --------------------------------------------------------------------------------------------------
# A pod plans on a zone without any TensorFlow pod image


def test_a_pod_plans_on_base_images_where_no_tf_pod_image_exists(rule):
    zone = ["tpu-ubuntu2204-base", "v2-alpha-tpuv5-lite", "v2-alpha-tpuv5", "v2-alpha-tpuv6e",
            "tpu-vm-tf-2.16.1-pjrt", "tpu-vm-tf-2.16.1-pod-pjrt", "tpu-vm-tf-2.18.0-pod-pjrt-v5e-and-v6"]
    for family, image in (("v5p", "v2-alpha-tpuv5"), ("v5litepod", "v2-alpha-tpuv5-lite"), ("v4", "v2-alpha-tpuv5")):
        got = rule(zone, family, True)
        assert (got["runtime_version"], got["problem"]) == (image, ""), got


# --------------------------------------------------------------------------------------------------
# make tpu-down asks worker 0 first


def test_tpu_down_refuses_while_a_run_lives_unless_forced(tmp_path):
    single, tfvars = single_host(tmp_path)
    done = make("tpu-down", TF_OUTPUTS=single, TFVARS=tfvars, DRY_RUN_RUN_STATE="tpu-llm-run: alive 0123456789ab 4242")
    (line,) = [ln for ln in done.stderr.splitlines() if ln.startswith("error:")]
    assert f"a run is training on TPU {NAME} (worker 0, pid 4242); nothing was deleted: `make tpu-stop`" in line
    assert "`make tpu-down FORCE=1` deletes the TPU under the run" in line
    assert not [c for c in commands(done.stdout) if "apply" in c]
    done = make("tpu-down", TF_OUTPUTS=single, TFVARS=tfvars, DRY_RUN_RUN_STATE="tpu-llm-run: alive 0123456789ab 4242",
                FORCE="1")
    assert done.returncode == 0, done.stderr
    assert not [c for c in commands(done.stdout) if c[-1].startswith("--command=for f in")]  # not asked
    assert [c for c in commands(done.stdout) if "-var=tpu_enabled=false" in c]


def test_tpu_down_cannot_ask_worker_0_and_says_the_tpu_bills(tmp_path):
    bin_dir, log, env = ready_tpu(tmp_path, ("*tpu-vm ssh*", 255, "ERROR: (gcloud.alpha.compute.tpus.tpu-vm.ssh) Error "
                                             "while connecting [4033: 'not authorized']"))
    done = subprocess.run([sys.executable, "-m", "tpu_llm.cloud", "down"], capture_output=True, text=True, timeout=60,
                          cwd=ROOT, env=clean_env(**{**env, "TF_OUTPUTS": tmp_path / "saved.json"}))
    line = one_error_line(done)
    assert "cannot tell whether a run is training on worker 0: ssh through Identity-Aware Proxy failed" in line
    assert f"nothing was deleted, and TPU {NAME} is billing" in line and "FORCE=1" in line
    assert "tpu_enabled=false" not in log.read_text()


def test_a_failing_delete_is_retried_then_said_in_the_log(tmp_path, monkeypatch):
    from tpu_llm.cloud import run_owner

    bin_dir, calls = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    (bin_dir / "gcloud").write_text(f'#!/bin/sh\necho "$*" >> {calls}\ncase "$*" in *delete*) '
                                    'echo "ERROR: PERMISSION_DENIED: tpu.nodes.delete" >&2; exit 1 ;; esac\n')
    (bin_dir / "gcloud").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    (tmp_path / run_owner.TEARDOWN_FILE).write_text(DELETE + "\n")
    log = tmp_path / "train.log"
    status = run_owner.main([f"--log={log}", f"--home={tmp_path}", "--attempts=2", "--retry-seconds=0",
                             "--log-url=gs://b/l.log", "--", "sh", "-c", "echo trained; exit 3"])
    assert status == 3 and (tmp_path / run_owner.STATUS_FILE).read_text() == "3\n"
    text = log.read_text()
    assert "trained" in text and "the run ended with exit status 3" in text
    assert "delete attempt 2 of 2 failed: ERROR: PERMISSION_DENIED: tpu.nodes.delete" in text
    assert "could not delete this TPU; it is billing: delete it by hand with `gcloud compute tpus tpu-vm delete" in text
    deletes = [c for c in calls.read_text().splitlines() if c.startswith("compute tpus tpu-vm delete")]
    assert len(deletes) == 2 and calls.read_text().splitlines()[-1].startswith("storage cp")  # the log says it too


# --------------------------------------------------------------------------------------------------
# make tpu-status lists everything of the deployment that bills, or may

NODES = [{"name": f"projects/{PROJECT}/locations/{ZONE}/nodes/{NAME}", "state": "READY",
          "createTime": "2026-12-05T07:48:12.123456789Z"},
         {"name": f"projects/{PROJECT}/locations/{ZONE}/nodes/someone-elses-tpu", "state": "READY",
          "createTime": "2026-12-01T00:00:00Z"}]
QUEUED_LIST = [{"name": f"projects/{PROJECT}/locations/{ZONE}/queuedResources/{NAME}-queued",
                "state": {"state": "SUSPENDED"}, "createTime": "2026-12-03T09:00:00Z"}]


def test_tpu_status_lists_every_tpu_and_queued_resource_of_the_deployment(tmp_path):
    down = write_outputs(tmp_path / "o.json", "v4-8", 1, tpu_enabled=False)  # after tpu-down: still checked
    bin_dir, _ = fake_cloud(tmp_path, gcloud=[("compute tpus tpu-vm list*", 0, json.dumps(NODES)),
                                              ("compute tpus queued-resources list*", 0, json.dumps(QUEUED_LIST)),
                                              ("storage ls*", 0, "")])
    done = subprocess.run([sys.executable, "-m", "tpu_llm.cloud", "status"], capture_output=True, text=True,
                          timeout=60, cwd=ROOT, env=clean_env(PATH=bin_dir, TF_OUTPUTS=down))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    start = lines.index(f"  everything of tpu-llm in {ZONE} (what bills, or may):")
    assert re.fullmatch(rf"    TPU {NAME}: READY, (\d+ d )?(\d+ h )?\d+ min old", lines[start + 1]), lines
    assert re.fullmatch(rf"    queued resource {NAME}-queued: SUSPENDED, (\d+ d )?(\d+ h )?\d+ min old", lines[start + 2])
    assert "someone-elses-tpu" not in done.stdout


def test_ages_read_the_api_s_timestamps():
    import datetime

    from tpu_llm.cloud.watch import age

    now = datetime.datetime(2026, 12, 5, 10, 0, tzinfo=datetime.timezone.utc)
    assert age("2026-12-05T07:48:12.123456789Z", now) == "2 h 11 min old"
    assert age("2026-12-03T09:59:00Z", now) == "2 d 0 h 1 min old"
    assert age("", now) == age("garbage", now) == "age unknown"


def test_every_failure_once_a_tpu_exists_ends_saying_it_bills(tmp_path):
    bin_dir, _, env = ready_tpu(tmp_path, ("*--worker=all*/opt/tpu-llm/ready*", 1, "set-up on t1v-n-0 failed"),
                                ("*--command=set -e*", 1, "Traceback (most recent call last):\nValueError: boom"))
    for command, what in (("up", "the worker set-up did not finish"), ("train", "stopped with exit status 1")):
        done = subprocess.run([sys.executable, "-m", "tpu_llm.cloud", command], capture_output=True, text=True,
                              timeout=60, cwd=ROOT, env=clean_env(**env))
        line = one_error_line(done)
        assert what in line and line.endswith(f"; TPU {NAME} is still up and billing: `make tpu-down` deletes it"), line


def test_the_plan_reader_names_the_attributes_that_force_a_new_tpu():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from tpu_llm.cloud.provision import replaced_tpus

    assert replaced_tpus(json.dumps(REPLACE_PLAN)) == [
        "google_tpu_v2_vm.tpu[0] (runtime_version: 'tpu-vm-tf-2.20.0-pod-pjrt' -> (known after apply))"]
    assert replaced_tpus('{"resource_changes": []}') == [] and replaced_tpus("") == []
    json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                               lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                          max_size=4), max_leaves=20)

    @settings(max_examples=200, deadline=None)
    @given(st.dictionaries(st.sampled_from(["resource_changes", "format_version"]), json_values)
           | st.builds(lambda c: {"resource_changes": [c]}, st.fixed_dictionaries(
               {"type": st.just("google_tpu_v2_vm"), "change": st.dictionaries(st.sampled_from(
                   ["actions", "before", "after", "after_unknown", "replace_paths"]), json_values)})))
    def any_plan_reads_without_a_crash(plan):
        assert all(isinstance(line, str) for line in replaced_tpus(json.dumps(plan)))

    any_plan_reads_without_a_crash()


# --------------------------------------------------------------------------------------------------
# Remote state: make tpu-down from a fresh clone


def test_the_state_bucket_is_made_first_and_a_fresh_clone_can_tear_down(tmp_path):
    single, tfvars = single_host(tmp_path)
    tf_dir = tmp_path / "infra"  # a fresh clone's infra/, but with the local state of an older checkout
    tf_dir.mkdir()
    (tf_dir / "terraform.tfstate").write_text('{"version": 4}')
    bin_dir, log = fake_cloud(tmp_path, gcloud=[
        ("storage buckets describe*", 1, "ERROR: (gcloud.storage.buckets.describe) gs://my-proj-tpu-llm-tf not found: "
                                         "404."),
        ("compute tpus tpu-vm describe*", 0, "PREEMPTED")], terraform=[("*output -json*", 0, outputs_json(single))])
    done = subprocess.run([sys.executable, "-m", "tpu_llm.cloud", "down"], capture_output=True, text=True, timeout=60,
                          cwd=ROOT, env=clean_env(PATH=bin_dir, TFVARS=tfvars, TF_DIR=tf_dir,
                                                  TF_OUTPUTS=tmp_path / "no-outputs-yet.json"))
    assert done.returncode == 0, done.stdout + done.stderr
    calls = [c for c in log.read_text().splitlines() if " auth " not in c]
    bucket = "gs://my-proj-tpu-llm-tf"
    assert calls[:4] == [
        f"gcloud storage buckets describe {bucket} --project={PROJECT} --format=value(name)",
        f"gcloud storage buckets create {bucket} --project={PROJECT} --location=US-CENTRAL2 "
        "--uniform-bucket-level-access --public-access-prevention",
        f"gcloud storage buckets update {bucket} --versioning",
        f"terraform -chdir={tf_dir} init -input=false -backend-config=bucket=my-proj-tpu-llm-tf "
        "-backend-config=prefix=terraform/state -migrate-state -force-copy"]
    assert any("-var=tpu_enabled=false" in c for c in calls)  # the TPU went, from the remote state's outputs
    assert not (tf_dir / "terraform.tfstate").exists() and (tf_dir / "terraform.tfstate.migrated").exists()
    assert "the local state is now in gs://my-proj-tpu-llm-tf/terraform/state" in done.stdout


# --------------------------------------------------------------------------------------------------
# The platform's edge


def test_tpu7x_is_refused_in_one_line_before_anything_runs(tmp_path):
    tfvars = tmp_path / "terraform.tfvars"
    tfvars.write_text(f'project_id = "{PROJECT}"\naccelerator_type = "tpu7x-16"\n')
    done = make("tpu-up", TFVARS=tfvars, TF_OUTPUTS=tmp_path / "none.json")
    (line,) = [ln for ln in done.stderr.splitlines() if ln.startswith("error:")]
    assert "TPU7x (Ironwood) does not run TensorFlow (tensorflow-tpu ends at 2.20.0)" in line and "v6e" in line
    assert commands(done.stdout) == []
