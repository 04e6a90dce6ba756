"""Worker 0 of a Cloud TPU, offline (the Cloud tests: tests/test_tpu_ownership.py, tests/test_tpu_truth.py):
the launch script `make train` sends to worker 0 (from its DRY_RUN line), a scratch HOME with a fake trainer
and a fake gcloud to run it in (`Worker0`), and fake gcloud/terraform around a READY single-host TPU for the
driver (`ready_tpu`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from helpers import NAME, PROJECT, ZONE, commands, fake_cloud, make, outputs_json, remote, write_outputs

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = "/opt/tpu-llm/venv/bin"
DELETE = f"gcloud compute tpus tpu-vm delete {NAME} --zone={ZONE} --project={PROJECT} --quiet --async"

FAKE_TRAINER = """#!/bin/bash
echo "fake trainer started: $*"
trap 'echo "fake trainer: SIGTERM, checkpoint saved"; exit 143' TERM
while [ -n "${FAKE_RELEASE:-}" ] && [ ! -f "$FAKE_RELEASE" ]; do sleep 0.1 & wait $!; done
echo "fake trainer: done"
exit "${FAKE_STATUS:-0}"
"""


def single_host(tmp_path: Path) -> tuple[Path, Path]:
    """The saved outputs of a single-host TPU that exists, and a terraform.tfvars for it."""
    tfvars = tmp_path / "terraform.tfvars"
    tfvars.write_text(f'project_id = "{PROJECT}"\nzone = "{ZONE}"\n')
    return write_outputs(tmp_path / "o.json", "v4-8", 1), tfvars


def ready_tpu(tmp_path: Path, *answers) -> tuple[Path, Path, dict]:
    """Fake gcloud/terraform around a READY single-host TPU, with `answers` recorded first; the driver's env."""
    single, tfvars = single_host(tmp_path)
    bin_dir, log = fake_cloud(tmp_path, gcloud=[*answers, ("compute tpus tpu-vm describe*", 0, "READY")],
                              terraform=[("*output -json*", 0, outputs_json(single))])
    return bin_dir, log, dict(PATH=bin_dir, TFVARS=tfvars, TF_OUTPUTS=single, SSH_AUTH_SOCK="",
                              TF_LAST_RUN=tmp_path / "last.json")


def launch_script(tmp_path: Path, **env) -> str:
    """The script `make train` runs on worker 0 of a single-host TPU (DRY_RUN), with `env` settings."""
    outputs, tfvars = single_host(tmp_path)
    done = make("train", TF_OUTPUTS=outputs, TFVARS=tfvars, **env)
    assert done.returncode == 0, done.stdout + done.stderr
    (launch,) = [c for c in commands(done.stdout) if c[-1].startswith("--command=set -e")]
    return "\n".join(remote(launch))


class Worker0:
    """A scratch HOME standing in for worker 0: the venv's python is this one, the trainer a fake, gcloud a
    fake that logs its arguments (log copies and deletes)."""

    def __init__(self, tmp_path: Path, script: str):
        self.home, self.bin = tmp_path / "home", tmp_path / "worker-bin"
        (self.home / "tpu-llm").mkdir(parents=True)
        self.bin.mkdir()
        self.calls = tmp_path / "worker-calls.log"
        (self.bin / "gcloud").write_text(f'#!/bin/sh\necho "gcloud $*" >> {self.calls}\n')
        (self.bin / "tpu-llm").write_text(FAKE_TRAINER)
        for tool in self.bin.iterdir():
            tool.chmod(0o755)
        self.release = tmp_path / "release"
        self.script = (script.replace(f"{VENV_BIN}/python -m tpu_llm.cloud preflight", "true")
                       .replace(f"{VENV_BIN}/python", sys.executable).replace(f"{VENV_BIN}/tpu-llm", str(self.bin / "tpu-llm")))

    def env(self, **extra) -> dict:
        return {**os.environ, "HOME": str(self.home), "PATH": f"{self.bin}:{os.environ['PATH']}",
                "PYTHONPATH": str(ROOT), **{k: str(v) for k, v in extra.items()}}

    def start(self, **extra) -> subprocess.Popen:
        # SIGHUP as an ssh session's shell has it (default: fatal), even when the suite itself runs under
        # nohup, whose ignored SIGHUP a child shell inherits and cannot reset
        return subprocess.Popen(["bash", "-c", self.script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=self.env(**extra), start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))

    def log(self) -> str:
        path = self.home / "tpu-llm-train.log"
        return path.read_text() if path.exists() else ""

    def deletes(self) -> list[str]:
        calls = self.calls.read_text().splitlines() if self.calls.exists() else []
        return [c for c in calls if " delete " in c]

    def wait_for(self, text: str, seconds: float = 30) -> None:
        deadline = time.monotonic() + seconds
        while text not in self.log():
            assert time.monotonic() < deadline, f"{text!r} never appeared in the log:\n{self.log()}"
            time.sleep(0.1)
