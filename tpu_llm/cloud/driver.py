#!/usr/bin/env python3
"""Cloud TPU glue behind the Makefile: tpu-up, train, tpu-down, tpu-status, tpu-ssh, tpu-logs, tensorboard, data-upload.

    python -m tpu_llm.cloud up | down | status | train --local-command CMD | ssh | logs | tensorboard | data-upload

Terraform (infra/) makes the TPU, network, bucket and service account; this script reads what it
made from `terraform output -json` (saved to infra/.outputs.json by `up`) and drives the workers
with `gcloud compute tpus tpu-vm ssh/scp --worker=...`. With use_queued_resource, this script
creates the queued resource with gcloud (on Terraform's network, service account and start-up
script) and deletes it with `--force` before any destroy or re-creation: the provider's queued
resource can neither take a service account nor delete an ACTIVE queued resource. Standard
library only.

How training is launched (as Google's own TF-on-TPU test harness does it; worker_plan.py):
  single-host slice  on the VM, `--strategy=tpu --tpu=local`, with TPU_LIBRARY_PATH=/opt/tpu-llm/libtpu.so (the
                     venv's pinned libtpu, which the set-up links there) and, on every generation, PJRT:
                     NEXT_PLUGGABLE_DEVICE_USE_C_API=true TF_PLUGGABLE_DEVICE_LIBRARY_PATH=/opt/tpu-llm/libtpu.so
                     (tpu_chips.runtime_variables)
  multi-host slice   on worker 0 only, `--strategy=tpu --tpu=NAME`, with TPU_NAME=NAME TPU_LOAD_LIBRARY=0:
                     the resolver reaches the TF servers of every host, the TPU runtime's TF worker
                     container that the set-up points each host at (infra/startup.sh.tftpl). Their input
                     pipeline cannot run tensorflow-text's ops, so pods read pre-tokenized TFRecord shards
                     (`make data-upload`).
The code is copied to every worker and installed there first; the run directory is on the bucket.

Settings come from the environment (the Makefile passes its variables through):
  DRY_RUN=1          print every terraform/gcloud command instead of running it
  CONFIG, RUN, RUN_DIR, DATA, TOKENIZER, TOKENIZER_MODEL, ARGS   what to train (see the Makefile)
  INPUT, SHARDS, OVERWRITE                                       data-upload
  TRAIN_ON=auto|tpu|local, WORKER, LOGS=train|gcs|setup, PORT, TPU_WAIT_MINUTES
  KEEP_QUEUED=1 [KEEP_QUEUED_HOURS=24]   tpu-up: a queued resource that may wait unattended
  DOWN_AFTER=1, TTL_HOURS=N  train: worker 0 deletes its TPU when the run ends (after N hours at most; TTL_HOURS
                     given when attaching to a live run sets that run's limit); a failed delete fails make train
  REPLACE=1          tpu-up: replace the running TPU (a queued resource's too) when the tfvars changed it
                     (refused otherwise)
  FORCE=1            tpu-down, tpu-up REPLACE=1: do not ask worker 0 whether a run is training there
  DESTROY_BUCKET=1 [YES=1]   tpu-down deletes everything, buckets included, after showing what and
                             asking (YES=1: without asking)
  TPU_SSH=iap|internal   ssh through Identity-Aware Proxy (default; needs gcloud's alpha component)
                         or to internal IPs (from a VM inside the VPC)
  TF_DIR, TFVARS, TF_OUTPUTS   where the Terraform files, variables and saved outputs are
  TF_STATE_BUCKET    the Terraform state's bucket (default: the data bucket's name + "-tf", made when missing)
  DRY_RUN_TPU_STATE      the TPU state a dry run pretends `gcloud ... describe` answered (tests)
  DRY_RUN_QUEUED_STATE   the same for the queued resource (default ACTIVE; "" = it does not exist)
  DRY_RUN_RUN_STATE      what worker 0 says of its run in a dry run (default `tpu-llm-run: idle`)
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from tpu_llm.cloud.base import lock_sha256  # noqa: F401 - tests and tools read the lock's hash from here
from tpu_llm.cloud.launch import Launch
from tpu_llm.cloud.provision import Provision
from tpu_llm.cloud.shell import EXIT_ERROR, LaunchError
from tpu_llm.cloud.watch import Watch
from tpu_llm.cloud.worker_plan import TrainPlan  # noqa: F401

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout


class Launcher(Provision, Launch, Watch):
    """Every command of the Makefile's tpu-* targets, on one set of settings (base.Cloud)."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tpu_llm.cloud",
                                     description="Cloud TPU glue (see the Makefile's tpu-* targets)")
    parser.add_argument("command", choices=["up", "down", "status", "train", "ssh", "logs", "tensorboard",
                                            "data-upload", "stop"])
    parser.add_argument("--local-command", default="", help="train: the command for a local run (ARGS is appended)")
    args = parser.parse_args(argv)
    os.chdir(ROOT)
    launcher = Launcher()
    actions = {"up": launcher.up, "down": launcher.down, "status": launcher.status, "ssh": launcher.ssh_session,
               "stop": launcher.stop, "logs": launcher.logs, "tensorboard": launcher.tensorboard,
               "data-upload": launcher.data_upload, "train": lambda: launcher.train(args.local_command)}
    # SIGTERM (a closed terminal, a CI timeout) is handled like Ctrl-C: a queued request is withdrawn, and
    # whatever bills is said
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        return actions[args.command]() or 0
    except LaunchError as e:
        note = f"; {launcher.billing}" if launcher.billing and launcher.billing not in str(e) else ""
        print(f"error: {e}{note}", file=sys.stderr, flush=True)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("interrupted" + (f": {launcher.billing}" if launcher.billing else ""), file=sys.stderr, flush=True)
        return 130

if __name__ == "__main__":
    sys.exit(main())
