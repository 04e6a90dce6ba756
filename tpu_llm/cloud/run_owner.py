"""The run on TPU worker 0, owned by a process of its own: `python -m tpu_llm.cloud own ...` (for worker_plan.py).

`make train`'s launch script starts it detached (nohup) on worker 0; it survives a dropped ssh and
outlives the training process, so everything that must happen at the run's end happens on the TPU,
not on the laptop:

  - it runs the pre-flight check, then the training, as its children (their output into the log), and
    records the run's exit status in STATUS_FILE, which the launch script reports, also when gcloud ran
    it again after a dropped connection and it attached to this run instead of starting another;
  - it copies the log to Cloud Storage every `--copy-seconds` while the run lives, and at its end;
  - with a time limit, it sends the training SIGTERM when it is reached (the trainer saves a checkpoint
    at the next step and exits, tpu_llm/training/fault.py), and SIGKILL `--grace-seconds` later. The
    limit is DEADLINE_FILE ("END_EPOCH_SECONDS HOURS"), read every second: `--ttl-hours` writes it at
    the start, and a later `make train TTL_HOURS=N` that attaches to the run rewrites it, so the new
    limit applies to the run going on;
  - when the run has ended, for whatever reason, and TEARDOWN_FILE holds a command (DOWN_AFTER=1 or
    TTL_HOURS: `gcloud compute tpus tpu-vm delete ... --async`), it runs that command as the VM's own
    service account (infra/iam.tf grants it the right to delete TPU nodes and nothing more), retried,
    and writes the outcome into the log, whose last copy then says whether the TPU is gone; when every
    attempt failed, also TEARDOWN_FAILED_FILE (the last error), which the launch script reports.

The launch script writes TEARDOWN_FILE before it starts this process, and again when a later `make
train DOWN_AFTER=1` attaches to the run, so the decision is read when the run ends. Standard library
only: it runs in the workers' venv, next to the trainer.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time

HOME = "~"
TRAIN_PID_FILE = "tpu-llm-train.pid"  # the training process (`make tpu-stop` sends it SIGTERM)
OWNER_PID_FILE = "tpu-llm-owner.pid"  # this process, written by the launch script
STATUS_FILE = "tpu-llm-run.status"  # the run's exit status, written last
TEARDOWN_FILE = "tpu-llm-run.teardown"  # the command that deletes the TPU once the run ended, or absent
# Written only when that command failed every attempt: its last error line. The launch script reports it
# and exits TEARDOWN_FAILED, so `make train` never calls a failed delete a teardown (worker_plan.py).
TEARDOWN_FAILED_FILE = "tpu-llm-run.teardown-failed"
DEADLINE_FILE = "tpu-llm-run.deadline"  # "END HOURS": the run's time limit (epoch seconds) and its TTL_HOURS


def state_path(name: str, home: str = HOME) -> str:
    return os.path.join(os.path.expanduser(home), name)


class Owner:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.log = open(os.path.expanduser(args.log), "ab", buffering=0)  # noqa: SIM115 - open for the run's life
        self.last_copy = 0.0

    def note(self, text: str) -> None:
        """A line of this process in the run's log (`tpu-llm-owner: ...`)."""
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.log.write(f"tpu-llm-owner {stamp}: {text}\n".encode())

    def copy_log(self, force: bool = False) -> None:
        """The log to Cloud Storage (quietly: a failed copy is retried at the next one)."""
        if not self.args.log_url or (not force and time.monotonic() - self.last_copy < self.args.copy_seconds):
            return
        self.last_copy = time.monotonic()
        try:
            subprocess.run(["gcloud", "storage", "cp", "--quiet", os.path.expanduser(self.args.log), self.args.log_url],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, timeout=300,
                           check=False)
        except (OSError, subprocess.TimeoutExpired):
            pass

    def deadline(self) -> tuple[float, str] | None:
        """The run's time limit from DEADLINE_FILE: (epoch seconds, TTL_HOURS as given), or None without one.
        Read each time: an attaching `make train TTL_HOURS=N` may have set a new one."""
        try:
            with open(state_path(DEADLINE_FILE, self.args.home), encoding="utf-8") as f:
                end, hours = (f.read().split() + ["?"])[:2]
            return float(end), hours
        except (OSError, ValueError):
            return None

    def set_deadline(self, hours: float) -> None:
        write_atomic(state_path(DEADLINE_FILE, self.args.home), f"{time.time() + hours * 3600:.0f} {hours:g}\n")

    def run_child(self, argv: list[str], pid_file: str = "") -> int:
        """Run argv with its output in the log until it exits; SIGTERM once the time limit (deadline()) is
        reached, SIGKILL after the grace time. Its exit status (128 + N for a signal N, as a shell reports it)."""
        try:
            child = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        except OSError as e:
            self.note(f"could not start {shlex.join(argv[:3])}...: {e}")
            return 127
        if pid_file:
            write_atomic(pid_file, f"{child.pid}\n")
        stopped_at, known = None, self.deadline()
        while True:
            try:
                status = child.wait(timeout=1.0)
                break
            except subprocess.TimeoutExpired:
                pass
            now, limit = time.monotonic(), self.deadline()
            if limit != known and limit is not None:
                self.note(f"time limit TTL_HOURS={limit[1]}: the run stops at "
                          f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(limit[0]))}")
                known = limit
            if limit is not None and stopped_at is None and time.time() >= limit[0]:
                self.note(f"TTL_HOURS={limit[1]} reached: SIGTERM to the run (it saves a checkpoint "
                          "at the next step and stops)")
                child.send_signal(signal.SIGTERM)
                stopped_at = now
            elif stopped_at is not None and now >= stopped_at + self.args.grace_seconds:
                self.note(f"the run is still going {self.args.grace_seconds:g} s after SIGTERM: SIGKILL")
                child.kill()
                stopped_at = float("inf")
            self.copy_log()
        return 128 - status if status < 0 else status

    def teardown(self) -> None:
        """Delete the TPU if TEARDOWN_FILE asks for it: the command, retried with a growing pause."""
        path = state_path(TEARDOWN_FILE, self.args.home)
        if not os.path.exists(path):
            return
        with open(path, encoding="utf-8") as f:
            argv = shlex.split(f.read())
        if not argv:
            return
        self.note(f"the run ended; deleting this TPU as the run asked (DOWN_AFTER=1 or TTL_HOURS): {shlex.join(argv)}")
        self.copy_log(force=True)  # in case the VM goes before the next copy
        out, why = "", "no attempt ran"
        for attempt in range(1, self.args.attempts + 1):
            try:
                done = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=600,
                                      check=False)
                status, out = done.returncode, (done.stdout + done.stderr).strip()
            except (OSError, subprocess.TimeoutExpired) as e:
                status, out = 1, str(e)
            if status == 0:
                self.note(f"delete requested ({out.splitlines()[-1] if out else 'no output'}); the TPU stops billing "
                          "once it is gone (`make tpu-status` shows it)")
                self.copy_log(force=True)
                return
            why = out.splitlines()[-1] if out else f"exit status {status}"
            self.note(f"delete attempt {attempt} of {self.args.attempts} failed: {why}")
            if attempt < self.args.attempts:
                time.sleep(self.args.retry_seconds * attempt)
        hand = [word for word in argv if word != "--async"]
        self.note(f"could not delete this TPU; it is billing: delete it by hand with `{shlex.join(hand)}`, or run "
                  "`make tpu-down` on your machine")
        write_atomic(state_path(TEARDOWN_FAILED_FILE, self.args.home), f"{why}\n")
        self.copy_log(force=True)

    def run(self) -> int:
        args = self.args
        if args.ttl_hours > 0 and self.deadline() is None:  # the launch script wrote it, unless started by hand
            self.set_deadline(args.ttl_hours)
        self.note(f"owner of this run (pid {os.getpid()})" + (f"; time limit TTL_HOURS={args.ttl_hours:g}"
                                                                if args.ttl_hours > 0 else ""))
        status = self.run_child(shlex.split(args.preflight)) if args.preflight else 0
        if status != 0:
            self.note(f"the pre-flight check failed (exit status {status}); training did not start")
        else:
            status = self.run_child(args.train, pid_file=state_path(TRAIN_PID_FILE, args.home))
            self.note(f"the run ended with exit status {status}")
        write_atomic(state_path(STATUS_FILE, args.home), f"{status}\n")
        self.copy_log(force=True)
        self.teardown()
        return status


def write_atomic(path: str, text: str) -> None:
    """Write by rename, so a reader (the launch script) never sees half a file."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tpu_llm.cloud own", description=__doc__.split("\n")[0])
    p.add_argument("--log", required=True, help="the run's log file (the launch script created it)")
    p.add_argument("--log-url", default="", help="gs:// object the log is copied to")
    p.add_argument("--preflight", default="", help="a command (one shell-quoted string) run before the training")
    p.add_argument("--ttl-hours", type=float, default=0.0, help="stop the run after this many hours (0: no limit)")
    p.add_argument("--grace-seconds", type=float, default=600.0, help="SIGKILL this long after the TTL's SIGTERM")
    p.add_argument("--copy-seconds", type=float, default=30.0, help="copy the log to --log-url this often")
    p.add_argument("--attempts", type=int, default=5, help="tries of the teardown command")
    p.add_argument("--retry-seconds", type=float, default=15.0, help="pause after the Nth failed try: N times this")
    p.add_argument("--home", default=HOME, help="where the state files are (the launch script's ~)")
    p.add_argument("train", nargs=argparse.REMAINDER, help="-- the training command line")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.train[:1] == ["--"]:
        args.train = args.train[1:]
    if not args.train:
        print("error: own: no training command after --", file=sys.stderr)
        return 2
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # the ssh session that started it may end at any time
    return Owner(args).run()


if __name__ == "__main__":
    sys.exit(main())
