"""Issue 50 (Cloud 3): a Cloud run that reports only the truth.

Offline, with the fakes of tests/test_tpu_ownership.py: the launch script `make train` sends to worker 0,
run with bash in a scratch HOME (fake trainer, fake gcloud), and the driver against fake gcloud/terraform.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import NAME, PROJECT, ZONE, clean_env, one_error_line
from test_tpu_ownership import DELETE, Worker0, launch_script, ready_tpu

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
