"""The ssh-agent check before `gcloud compute tpus tpu-vm ssh/scp --worker=all` (for tpu_llm/cloud/driver.py).

For more than one worker gcloud verifies that the agent holds its key (googlecloudsdk
command_lib/compute/tpus/tpu_vm/ssh_utils.VerifyKeyInAgent: the `ssh-keygen -lf KEY` fingerprint must
appear in `ssh-add -l`) and raises when an agent runs without it; with no agent it only warns. The key
(~/.ssh/google_compute_engine) is made by gcloud's first ssh, inside `make tpu-up`, so the user never
had a moment to `ssh-add` it. Here: with an agent running and the key present but not in it, add it;
when that fails (a passphrase and no terminal), stop with the exact command, before anything is copied.
Standard library only.
"""

from __future__ import annotations

import os
import subprocess

from tpu_llm.cloud.shell import LaunchError, Runner

KEY = os.path.join("~", ".ssh", "google_compute_engine")


def _run(argv: list[str]) -> tuple[int, str]:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, check=False, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        return 127, ""
    return done.returncode, done.stdout + done.stderr


def ensure_key_in_agent(runner: Runner, key: str = KEY) -> None:
    """Add gcloud's key to a running ssh-agent that lacks it, or raise LaunchError with the command."""
    path = os.path.expanduser(key)
    if runner.dry_run:
        print(f"DRY_RUN: (with an ssh-agent running that lacks {key}: ssh-add {key})", flush=True)
        return
    if not os.environ.get("SSH_AUTH_SOCK"):
        return  # no agent: gcloud only warns
    if not os.path.exists(path):
        # The first `make tpu-up`: gcloud would make the key inside the --worker=all command and then
        # find it missing from the agent. Make it the way gcloud does (RSA, no passphrase, same file).
        print(f"ssh-agent: creating gcloud's key {key}", flush=True)
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        status, out = _run(["ssh-keygen", "-t", "rsa", "-N", "", "-f", path, "-q"])
        if status != 0 or not os.path.exists(path):
            raise LaunchError(f"could not create {key} (ssh-keygen: {out.strip()[-160:] or f'exit {status}'}): run "
                              f"`gcloud compute tpus tpu-vm ssh TPU --worker=0` once, then `ssh-add {key}`")
    status, out = _run(["ssh-keygen", "-lf", path])
    fields = out.split()
    if status != 0 or len(fields) < 2:
        return  # gcloud skips its check the same way
    status, listed = _run(["ssh-add", "-l"])
    if status not in (0, 1):  # 1: the agent holds no key; 2: no agent reachable
        return
    if fields[1] in listed:
        return
    print(f"ssh-agent: adding {key} (gcloud needs it in the agent for --worker=all)", flush=True)
    runner.show(["ssh-add", key])
    status, out = _run(["ssh-add", path])
    if status != 0:
        raise LaunchError(f"an ssh-agent is running without {key}, which gcloud needs for more than one worker, and "
                          f"adding it failed ({out.strip().splitlines()[-1] if out.strip() else f'exit {status}'}): "
                          f"run `ssh-add {key}` in this terminal, then the target again; nothing was copied")
