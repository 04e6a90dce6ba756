"""`make tpu-up / train / tpu-down` (scripts/tpu.py) against a fake `terraform output -json` file.

With DRY_RUN=1 every terraform and gcloud command is printed (`DRY_RUN: CMD`) instead of run; the
tests parse those lines back into argv lists and assert them exactly, for a single-host (v4-8) and
a multi-host (v4-32) slice. Without DRY_RUN, fake `terraform` and `gcloud` executables on PATH check
the one-line failures (tool missing, not authenticated, no project, stockout, quota) and that a
failed `tpu-up` destroys nothing.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NAME, ZONE, PROJECT, BUCKET = "tpu-llm-tpu", "us-central2-b", "my-proj", "gs://my-proj-tpu-llm"
IAP = ["--zone=us-central2-b", "--project=my-proj"]
SSH = ["gcloud", "alpha", "compute", "tpus", "tpu-vm", "ssh", NAME, *IAP]
SCP = ["gcloud", "alpha", "compute", "tpus", "tpu-vm", "scp"]
DESCRIBE = ["gcloud", "compute", "tpus", "tpu-vm", "describe", NAME, *IAP, "--format=value(state)"]
TF = ["terraform", "-chdir=infra"]


def write_outputs(path: Path, accelerator: str, workers: int, **changes) -> Path:
    """A `terraform output -json` file as infra/outputs.tf would produce it."""
    values = {"project_id": PROJECT, "zone": ZONE, "tpu_enabled": True, "tpu_name": NAME, "queued_resource_name": "",
              "accelerator_type": accelerator, "runtime_version": "tpu-vm-tf-2.20.0-pjrt", "worker_count": workers,
              "multi_host": workers > 1, "spot": True, "use_queued_resource": False, "bucket_name": "my-proj-tpu-llm",
              "bucket_url": BUCKET, "data_url": f"{BUCKET}/shards", "runs_url": f"{BUCKET}/runs",
              "log_bucket_url": f"{BUCKET}-logs", "service_account_email": "sa@my-proj.iam.gserviceaccount.com",
              "ssh_command": "gcloud ...", "startup_script": "#!/bin/bash\necho set-up\n", **changes}
    path.write_text(json.dumps({k: {"sensitive": False, "type": "string", "value": v} for k, v in values.items()}))
    return path


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


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MAKE", "MFLAGS", "DRY_RUN", "TPU_", "TRAIN_ON"))}
    for key in ("DATA", "ARGS", "RUN", "RUN_DIR", "CONFIG", "TOKENIZER", "INPUT", "DESTROY_BUCKET", "TF_OUTPUTS",
                "TFVARS", "STORAGE_EMULATOR_HOST"):
        env.pop(key, None)
    return {**env, **{k: str(v) for k, v in extra.items()}}


def make(target: str, **env) -> subprocess.CompletedProcess:
    """`make TARGET DRY_RUN=1` in the repository, without re-checking .venv."""
    return subprocess.run(["make", "--no-print-directory", "-o", ".venv/.installed", target, "DRY_RUN=1",
                           f"PYTHON={sys.executable}"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=clean_env(**env))


def commands(out: str) -> list[list[str]]:
    """The argv of every `DRY_RUN: CMD` line (a quoted multi-line --command continues on the next lines)."""
    found, lines = [], iter(out.splitlines())
    for line in lines:
        if not line.startswith("DRY_RUN: ") or line.startswith("DRY_RUN: ("):
            continue
        text = line[len("DRY_RUN: "):]
        while True:
            try:
                found.append(shlex.split(text))
                break
            except ValueError:  # No closing quotation: the command goes on
                text += "\n" + next(lines)
    return found


def remote(argv: list[str]) -> list[str]:
    """The lines of an ssh --command=... script."""
    assert argv[-1].startswith("--command=")
    return argv[-1][len("--command="):].splitlines()


# --------------------------------------------------------------------------------------------------
# make train


def test_train_single_host_on_the_vm_with_pjrt(single):
    done = make("train", TF_OUTPUTS=single)
    assert done.returncode == 0, done.stderr
    assert f"train: on Cloud TPU {NAME} (v4-8, 1 worker(s), {ZONE})" in done.stdout
    describe, scp, install, launch = commands(done.stdout)
    assert describe == DESCRIBE
    assert scp == [*SCP, "build/tpu-llm-src.tar.gz", f"{NAME}:tpu-llm-src.tar.gz", *IAP, "--worker=all",
                   "--tunnel-through-iap"]
    busy = ('if [ -f ~/tpu-llm-train.pid ] && kill -0 "$(cat ~/tpu-llm-train.pid)" 2>/dev/null; then echo "error: '
            'a run is already training on worker 0 (pid $(cat ~/tpu-llm-train.pid))" >&2; exit 2; fi')
    assert install == [*SSH, "--worker=all", "--tunnel-through-iap",
                        f"--command={busy}; rm -rf ~/tpu-llm && mkdir -p ~/tpu-llm && tar -xzf ~/tpu-llm-src.tar.gz "
                        "-C ~/tpu-llm && sudo /opt/tpu-llm/setup.sh ~/tpu-llm"]
    assert launch[:-1] == [*SSH, "--worker=0", "--tunnel-through-iap"]
    script = remote(launch)
    assert script[:3] == ["set -e", "cd ~/tpu-llm",
                          f"/opt/tpu-llm/venv/bin/python -m tpu_llm.cloud preflight --run_dir={BUCKET}/runs/tiny"]
    assert ("nohup env NEXT_PLUGGABLE_DEVICE_USE_C_API=true TF_PLUGGABLE_DEVICE_LIBRARY_PATH=/lib/libtpu.so "
            "TPU_LIBRARY_PATH=/lib/libtpu.so /opt/tpu-llm/venv/bin/tpu-llm train --config configs/tiny.yaml --strategy=tpu --tpu=local "
            f"--run_dir={BUCKET}/runs/tiny > ~/tpu-llm-train.log 2>&1 < /dev/null &") in script
    assert script[3] == busy  # the run is checked for again right before it starts
    assert script[-2:] == ['tail -n +1 -f --pid="$pid" ~/tpu-llm-train.log', 'wait "$pid"']


def test_train_pod_on_worker_0_against_the_pod_servers(pod):
    done = make("train", TF_OUTPUTS=pod, CONFIG="configs/gpt2_125m.yaml", ARGS="--train.steps=100")
    assert done.returncode == 0, done.stderr
    assert f"train: on Cloud TPU {NAME} (v4-32, 4 worker(s), {ZONE})" in done.stdout
    describe, scp, install, launch = commands(done.stdout)
    assert describe == DESCRIBE
    assert "--worker=all" in scp and "--worker=all" in install  # code and install go to every host
    assert launch[:-1] == [*SSH, "--worker=0", "--tunnel-through-iap"]  # training starts on worker 0 only
    script = remote(launch)
    shards = f"{BUCKET}/shards/*.tfrecord"
    assert script[2] == ("/opt/tpu-llm/venv/bin/python -m tpu_llm.cloud preflight "
                         f"--run_dir={BUCKET}/runs/gpt2_125m '--data={shards}' --require_tfrecord")
    assert ("nohup env TPU_NAME=tpu-llm-tpu TPU_LOAD_LIBRARY=0 /opt/tpu-llm/venv/bin/tpu-llm train --config "
            f"configs/gpt2_125m.yaml --strategy=tpu --tpu={NAME} --run_dir={BUCKET}/runs/gpt2_125m "
            f"'--data.train={shards}' --data.format=tfrecord --train.steps=100 > ~/tpu-llm-train.log 2>&1 "
            "< /dev/null &") in script
    assert "NEXT_PLUGGABLE_DEVICE_USE_C_API" not in launch[-1] and "TPU_LIBRARY_PATH" not in launch[-1]


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
    init, describe, apply, output, describe2, wait = commands(done.stdout)
    assert init == [*TF, "init", "-input=false"]
    assert describe == describe2 == DESCRIBE
    assert apply == [*TF, "apply", "-input=false", "-auto-approve", f"-var-file={tfvars}", "-var=tpu_enabled=true"]
    assert output == [*TF, "output", "-json"]
    assert wait[:-1] == [*SSH, "--worker=all", "--tunnel-through-iap"]
    assert "/opt/tpu-llm/ready" in wait[-1] and "/opt/tpu-llm/failed" in wait[-1]
    assert "is READY" in done.stdout


def test_tpu_up_recreates_a_preempted_spot_tpu(single, tfvars):
    done = make("tpu-up", TF_OUTPUTS=single, TFVARS=tfvars, DRY_RUN_TPU_STATE="PREEMPTED")
    assert done.returncode == 0, done.stderr
    assert "is PREEMPTED" in done.stdout and "recreating it" in done.stdout
    apply = [c for c in commands(done.stdout) if c[:3] == [*TF, "apply"]]
    assert apply == [[*TF, "apply", "-input=false", "-auto-approve", f"-var-file={tfvars}", "-var=tpu_enabled=true",
                      "-replace=google_tpu_v2_vm.tpu[0]"]]


def test_tpu_up_runs_the_setup_over_ssh_for_a_queued_resource(tmp_path, tfvars):
    outputs = write_outputs(tmp_path / "q.json", "v4-8", 1, use_queued_resource=True,
                            queued_resource_name=f"{NAME}-queued")
    done = make("tpu-up", TF_OUTPUTS=outputs, TFVARS=tfvars)
    assert done.returncode == 0, done.stderr
    cmds = commands(done.stdout)
    assert ["gcloud", "compute", "tpus", "queued-resources", "describe", f"{NAME}-queued", *IAP,
            "--format=value(state.state)"] in cmds
    assert [*SCP, "build/tpu-llm-setup.sh", f"{NAME}:tpu-llm-setup.sh", *IAP, "--worker=all",
            "--tunnel-through-iap"] in cmds
    assert [*SSH, "--worker=all", "--tunnel-through-iap", "--command=sudo bash tpu-llm-setup.sh"] in cmds


def test_tpu_down_keeps_the_bucket_unless_asked(single, tfvars):
    done = make("tpu-down", TF_OUTPUTS=single, TFVARS=tfvars)
    assert done.returncode == 0, done.stderr
    assert commands(done.stdout) == [
        [*TF, "init", "-input=false"],
        [*TF, "apply", "-input=false", "-auto-approve", f"-var-file={tfvars}", "-var=tpu_enabled=false"],
        [*TF, "output", "-json"]]
    assert f"Kept: {BUCKET}" in done.stdout
    done = make("tpu-down", TF_OUTPUTS=single, TFVARS=tfvars, DESTROY_BUCKET=1)
    assert done.returncode == 0, done.stderr
    assert commands(done.stdout)[1:] == [
        [*TF, "apply", "-input=false", "-auto-approve", f"-var-file={tfvars}", "-var=tpu_enabled=false",
         "-var=bucket_force_destroy=true"],
        [*TF, "destroy", "-input=false", "-auto-approve", f"-var-file={tfvars}", "-var=bucket_force_destroy=true"]]
    assert single.exists()  # a dry run changes nothing


def test_ssh_logs_tensorboard_data_upload(single):
    assert commands(make("tpu-ssh", TF_OUTPUTS=single, WORKER=2).stdout) == [
        [*SSH, "--worker=2", "--tunnel-through-iap"]]
    assert commands(make("tpu-logs", TF_OUTPUTS=single).stdout) == [
        [*SSH, "--worker=0", "--tunnel-through-iap", "--command=tail -n 200 -F ~/tpu-llm-train.log"]]
    assert commands(make("tpu-logs", TF_OUTPUTS=single, LOGS="setup").stdout) == [
        [*SSH, "--worker=all", "--tunnel-through-iap", "--command=tail -n 50 /var/log/tpu-llm-setup.log"]]
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


def tpu_py(command: str, bin_dir: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "tpu.py"), command], capture_output=True,
                          text=True, timeout=60, env=clean_env(PATH=bin_dir, **env))


def one_error_line(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    return lines[0]


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
    sys.path.insert(0, str(ROOT / "scripts"))
    from tpu_shell import explain_failure

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
