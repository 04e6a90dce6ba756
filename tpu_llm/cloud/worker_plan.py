"""What `make train` runs on TPU worker 0, and the source it copies to every worker (for tpu_llm/cloud/driver.py).

  single-host slice  `--strategy=tpu --tpu=local` with the generation's runtime variables (tpu_chips.runtime_variables)
                     for the venv's pinned libtpu, linked at /opt/tpu-llm/libtpu.so by the set-up: PJRT on every
                     generation (v2 through v6e), NEXT_PLUGGABLE_DEVICE_USE_C_API=true
                     TF_PLUGGABLE_DEVICE_LIBRARY_PATH=... and TPU_LIBRARY_PATH=...
  multi-host slice   `--strategy=tpu --tpu=NAME` with TPU_NAME=NAME TPU_LOAD_LIBRARY=0: the TF servers are the
                     TF worker containers the set-up runs on every host (infra/startup.sh.tftpl), and they run
                     the input pipeline, so the data must be TFRecord shards on gs://

The run belongs to a process of its own on worker 0 (`python -m tpu_llm.cloud own`, run_owner.py),
started with nohup: it survives a dropped ssh, runs `python -m tpu_llm.cloud preflight` (the bucket
and the data, checked from the worker itself) and then the training, copies the log to
RUN_DIR/logs/train-TIMESTAMP.log every LOG_COPY_SECONDS and at the end (so it outlives a preempted or
deleted TPU: `make tpu-logs` / `make tpu-status` read it there), records the exit status, and with
DOWN_AFTER=1 or TTL_HOURS deletes the TPU itself when the run ends, fails or runs out of time.

Launching is idempotent: gcloud runs a TPU ssh command again when its ssh exits 255 (up to 10 times),
and a later `make train` may follow a dropped one. The launch script attaches to a live run started
with the same settings (or by the same command), and refuses one started with other settings.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import tarfile
import time
import uuid

from tpu_llm.cloud.shell import LaunchError, Outputs
from tpu_llm.platform.tpu_chips import kind_of_type, runtime_variables

STATE_DIR = "/opt/tpu-llm"  # where infra/startup.sh.tftpl installs (state_dir and venv in infra/tpu.tf)
VENV = f"{STATE_DIR}/venv"
SOURCE_ARCHIVE = "build/tpu-llm-src.tar.gz"
SETUP_SCRIPT = "tpu-llm-setup.sh"  # the current rendering of infra/startup.sh.tftpl (outputs startup_script)
PACKED_LOCK = "worker-requirements.txt"  # the checkout's lock, packed beside it: the set-up installs this one
LOCK_PATH = os.path.join("infra", "worker-requirements.txt")
SOURCE_FILES = ("pyproject.toml", "README.md", "tpu_llm", "configs")
TRAIN_LOG = "~/tpu-llm-train.log"
PID_FILE = "~/tpu-llm-train.pid"
LOG_DIR = "logs"  # under the run directory: train-YYYYMMDDTHHMMSSZ.log, one per `make train`
LOG_COPY_SECONDS = 30
OWNER_PID_FILE = "~/tpu-llm-owner.pid"  # the run's owner process (run_owner.py; the files it keeps are named there)
RUN_FILES = {name: f"~/tpu-llm-run.{name}" for name in ("launch", "key", "status", "teardown", "teardown-failed",
                                                         "deadline")}
BUSY = 75  # the launch's exit status when another run holds worker 0 (EX_TEMPFAIL: again once it ended)
TEARDOWN_FAILED = 76  # the launch's exit status when the run ended but worker 0 could not delete its TPU
SSH_LOST = 255  # ssh's own failure, which gcloud retries up to 10 times before it gives up
# Single host: the pinned libtpu wheel of the venv (tensorflow-tpu 2.20.0 declares libtpu~=0.0.14; the
# lock pins 0.0.14; newer ones, e.g. 0.0.52, make `import tensorflow` abort: "ConfigureDistributedTpuOp_DoWork
# not available in this library"), through the runtime Google documents for the slice's generation
# (tpu_chips.runtime_variables: PJRT on every generation, v2 through v6e). The set-up checks its version and links it at
# LIBTPU. Every image is a base image, which has no TensorFlow (docs/cloud-tpu.md).
LIBTPU = f"{STATE_DIR}/libtpu.so"


# Refuse to start (or to reinstall under) a run while one is training on worker 0: its owner (which
# spans the pre-flight check, the training and the teardown) or a trainer started before owners existed.
BUSY_CHECK = (f"for f in {OWNER_PID_FILE} {PID_FILE}; do if [ -f $f ] && kill -0 \"$(cat $f)\" 2>/dev/null; then "
              f"echo \"error: a run is already training on worker 0 (pid $(cat $f))\" >&2; exit {BUSY}; fi; done")
# What the driver asks worker 0 before it launches or deletes anything: `tpu-llm-run: alive KEY PID TEARDOWN`
# (TEARDOWN: `teardown` when the live run's owner deletes the TPU at its end, else `keep`: what `make train`
# says of the TPU's end comes from here, not from this machine's DOWN_AFTER) or idle.
RUN_STATE = (f"for f in {OWNER_PID_FILE} {PID_FILE}; do if [ -f $f ] && kill -0 \"$(cat $f)\" 2>/dev/null; then "
             f"echo \"tpu-llm-run: alive $(cat {RUN_FILES['key']} 2>/dev/null || echo -) $(cat $f) "
             f"$([ -s {RUN_FILES['teardown']} ] && echo teardown || echo keep)\"; exit 0; fi; "
             "done; echo tpu-llm-run: idle")
# On every worker: unpack the copied source and install it with the set-up script packed beside it, the
# current lock's (not the copy the worker booted with: a changed lock rebuilds the venv).
INSTALL = (f"{BUSY_CHECK}; rm -rf ~/tpu-llm && mkdir -p ~/tpu-llm && "
           f"tar -xzf ~/tpu-llm-src.tar.gz -C ~/tpu-llm && sudo bash ~/tpu-llm/{SETUP_SCRIPT} ~/tpu-llm")


def env(name: str, default: str = "") -> str:
    return os.environ.get(name, "").strip() or default


def flag(name: str) -> bool:
    return env(name, "0").lower() not in ("0", "", "false", "no")


class TrainPlan:
    """What to run on worker 0: the command line, its environment and the checks before it."""

    def __init__(self, o: Outputs, config: str, run_dir: str, data: str, extra: list[str], down_after: bool = False,
                 ttl_hours: float = 0.0):
        self.o, self.config, self.run_dir, self.data, self.extra = o, config, run_dir, data, extra
        self.pod = bool(o["multi_host"])
        self.down_after = down_after or ttl_hours > 0  # a time limit bounds the TPU's life, not only the run's
        self.ttl_hours = ttl_hours
        # the time limit as an instant, fixed here: gcloud's re-runs of the launch write the same one
        self.deadline = int(time.time() + ttl_hours * 3600) if ttl_hours > 0 else 0
        self.launch_id = uuid.uuid4().hex[:12]  # this `make train`: gcloud's re-runs of its ssh carry the same

    @classmethod
    def from_env(cls, o: Outputs) -> "TrainPlan":
        config = env("CONFIG", "configs/tiny.yaml")
        if not os.path.isfile(config):
            raise LaunchError(f"CONFIG={config} not found; give a YAML file inside this repository, e.g. "
                              "configs/gpt2_125m.yaml")
        extra, data, run_dir = [], env("DATA"), env("RUN_DIR")
        for arg in shlex.split(env("ARGS")):  # --data.train / --run_dir in ARGS get the same checks
            if arg.startswith("--data.train="):
                data = arg.split("=", 1)[1]
            elif arg.startswith("--run_dir="):
                run_dir = arg.split("=", 1)[1]
            else:
                extra.append(arg)
        run_dir = run_dir or default_run_dir(o, config)
        if not run_dir.startswith("gs://"):
            raise LaunchError(f"run_dir {run_dir} is not on Cloud Storage; TPU workers keep nothing on their disks "
                              f"(a preempted TPU loses them), so use a gs:// path such as {default_run_dir(o, config)}")
        if bool(o["multi_host"]):
            data = data or f"{o['data_url']}/*.tfrecord"
            check_pod_data(o, data)
        for pattern in (p.strip() for p in data.split(",") if p.strip()):
            if not pattern.startswith("gs://"):
                raise LaunchError(f"DATA={pattern} is not on Cloud Storage; the TPU workers cannot read this "
                                  f"machine's files: `make data-upload INPUT=...` puts shards in {o['data_url']}")
        for key in ("TOKENIZER", "TOKENIZER_MODEL"):
            if env(key):
                extra.insert(0, f"--data.{key.lower()}={env(key)}")
        return cls(o, config, run_dir, data, extra, down_after=flag("DOWN_AFTER"), ttl_hours=ttl_hours())

    def train_argv(self) -> list[str]:
        argv = [f"{VENV}/bin/tpu-llm", "train", "--config", self.config, "--strategy=tpu",
                f"--tpu={self.o['tpu_name'] if self.pod else 'local'}", f"--run_dir={self.run_dir}"]
        if self.data:
            argv.append(f"--data.train={self.data}")
        if self.pod:
            argv.append("--data.format=tfrecord")
        return argv + self.extra

    def environment(self) -> dict[str, str]:
        if self.pod:
            return {"TPU_NAME": str(self.o["tpu_name"]), "TPU_LOAD_LIBRARY": "0"}
        return runtime_variables(kind_of_type(str(self.o["accelerator_type"])), LIBTPU)

    def preflight_argv(self) -> list[str]:
        argv = [f"{VENV}/bin/python", "-m", "tpu_llm.cloud", "preflight", f"--run_dir={self.run_dir}"]
        if self.data:
            argv.append(f"--data={self.data}")
        if self.pod:
            argv.append("--require_tfrecord")
        return argv

    def run_key(self) -> str:
        """Names what is trained: a later `make train` with the same settings attaches to the live run."""
        what = [self.run_dir, *self.preflight_argv(), *self.train_argv(), *sorted(self.environment().items())]
        return hashlib.sha256(repr(what).encode()).hexdigest()[:12]

    def teardown_argv(self) -> list[str]:
        """What worker 0 runs, as its service account, to delete its TPU when the run ended (DOWN_AFTER=1).
        The node, also of a queued resource: that one is then SUSPENDED and bills nothing, and the next
        `make tpu-up` or `make tpu-down` deletes it (as Google's TF test harness deletes nodes first)."""
        return ["gcloud", "compute", "tpus", "tpu-vm", "delete", str(self.o["tpu_name"]), f"--zone={self.o['zone']}",
                f"--project={self.o['project_id']}", "--quiet", "--async"]

    def owner_argv(self) -> list[str]:
        argv = [f"{VENV}/bin/python", "-m", "tpu_llm.cloud", "own", f"--log={TRAIN_LOG}", "--log-url=LOG_URL",
                f"--copy-seconds={LOG_COPY_SECONDS}", f"--preflight={shlex.join(self.preflight_argv())}"]
        if self.ttl_hours > 0:
            argv.append(f"--ttl-hours={self.ttl_hours:g}")
        env_words = [f"{k}={v}" for k, v in self.environment().items()]
        return [*argv, "--", "env", *env_words, *self.train_argv()]

    def remote_script(self) -> str:
        """The launch on worker 0: start the run's owner, or attach to the live run this command (a re-run by
        gcloud after a dropped ssh) or the same settings started; then follow its log, exit with its status."""
        files = RUN_FILES
        teardown = ([f"printf '%s\\n' {shlex.quote(shlex.join(self.teardown_argv()))} > {files['teardown']}"]
                    if self.down_after else [])
        # TTL_HOURS as the owner reads it (run_owner.DEADLINE_FILE), also for a run this launch attaches to
        limit = ([f"printf '%s %s\\n' {self.deadline} {self.ttl_hours:g} > {files['deadline']}.tmp && "
                  f"mv {files['deadline']}.tmp {files['deadline']}"] if self.ttl_hours > 0 else [])
        log_url = f"{shlex.quote(self.run_dir + '/' + LOG_DIR)}/train-$(date -u +%Y%m%dT%H%M%SZ).log"
        owner = shlex.join(self.owner_argv()).replace("--log-url=LOG_URL", '"--log-url=$log_url"')
        alive = f"[ -f {OWNER_PID_FILE} ] && kill -0 \"$(cat {OWNER_PID_FILE})\" 2>/dev/null"
        return "\n".join([
            "set -e",
            "cd ~/tpu-llm",
            f"launch={self.launch_id}",
            f"key={self.run_key()}",
            f"if {alive}; then",
            f"  if [ \"$(cat {files['key']} 2>/dev/null)\" != \"$key\" ]; then",
            f"    echo \"error: a run is already training on worker 0 (pid $(cat {OWNER_PID_FILE}), other settings)\" >&2",
            f"    exit {BUSY}",
            "  fi",
            f"  echo \"train: attaching to the run with these settings, going on worker 0 (pid $(cat {OWNER_PID_FILE}))\"",
            *[f"  {line}" for line in teardown + limit],
            "  from=50",
            f"elif [ \"$(cat {files['launch']} 2>/dev/null)\" = \"$launch\" ]; then",
            "  echo \"train: the run this command started has ended (the connection dropped; gcloud ran it again)\"",
            "  from=50",
            "else",
            f"  {BUSY_CHECK}",
            f"  printf '%s\\n' \"$launch\" > {files['launch']}",
            f"  printf '%s\\n' \"$key\" > {files['key']}",
            f"  rm -f {files['status']} {files['teardown']} {files['teardown-failed']} {files['deadline']} {PID_FILE}",
            *[f"  {line}" for line in teardown + limit],
            f"  log_url={log_url}",
            f"  : > {TRAIN_LOG}",
            f"  nohup {owner} > /dev/null 2>&1 < /dev/null &",
            f"  echo \"$!\" > {OWNER_PID_FILE}",
            f"  echo \"train: the log is copied to $log_url every {LOG_COPY_SECONDS} s\"",
            "  from=+1",
            "fi",
            f"tail -n \"$from\" -f --pid=\"$(cat {OWNER_PID_FILE})\" {TRAIN_LOG}",
            f"for _ in $(seq 60); do if [ -f {files['status']} ]; then break; fi; sleep 1; done",
            f"if [ -f {files['teardown-failed']} ]; then",  # the owner's delete failed: never a clean end
            f"  echo \"error: the run ended (exit status $(cat {files['status']} 2>/dev/null || echo unknown)), but worker 0 "
            f"could not delete this TPU: $(cat {files['teardown-failed']})\" >&2",
            f"  exit {TEARDOWN_FAILED}",
            "fi",
            f"if [ -f {files['status']} ]; then exit \"$(cat {files['status']})\"; fi",
            f"echo \"error: worker 0 recorded no exit status for the run ({TRAIN_LOG} says why)\" >&2",
            "exit 1",
        ])


def ttl_hours() -> float:
    """TTL_HOURS: the run's time limit on the TPU (0: none)."""
    text = env("TTL_HOURS", "0")
    try:
        hours = float(text)
    except ValueError:
        hours = -1.0
    if not hours >= 0 or hours == float("inf"):
        raise LaunchError(f"TTL_HOURS={text}: give the hours the run may last on the TPU, e.g. TTL_HOURS=12 (worker 0 "
                          "then stops the run and deletes the TPU)")
    return hours


def default_run_dir(o: Outputs, config: str | None = None) -> str:
    """RUN_DIR, else RUNS_URL/RUN, else RUNS_URL/<the config's name> (what `make train` uses)."""
    if env("RUN_DIR"):
        return env("RUN_DIR")
    config = config or env("CONFIG", "configs/tiny.yaml")
    return f"{o['runs_url']}/{env('RUN', os.path.splitext(os.path.basename(config))[0])}"


def check_pod_data(o: Outputs, data: str) -> None:
    """Pod slices read pre-tokenized TFRecord shards on the bucket; anything else fails here, clearly."""
    for pattern in (p.strip() for p in data.split(",") if p.strip()):
        name = pattern.rsplit("/", 1)[-1]
        if not pattern.startswith("gs://") or ".tfrecord" not in name:
            raise LaunchError(
                f"DATA={pattern}: a pod slice ({o['accelerator_type']}, {o['worker_count']} hosts) reads pre-tokenized "
                "TFRecord shards on the bucket, not raw text or local files (its input pipeline runs in every "
                "host's TF server, which lacks tensorflow-text's ops); run `make data-upload INPUT='corpus/*.txt'` "
                f"and train on DATA='{o['data_url']}/*.tfrecord' (the default)")


def source_paths(config: str) -> list[str]:
    """What a worker needs to install and run tpu-llm: the package, its metadata, the configs (+ CONFIG)."""
    inside = any(os.path.normpath(config).startswith(top + os.sep) for top in SOURCE_FILES)
    return [*SOURCE_FILES] + ([] if inside else [os.path.normpath(config)])


def pack_source(archive: str, config: str, setup_script: str | None = None) -> None:
    """source_paths() (and the set-up script as SETUP_SCRIPT, the lock as PACKED_LOCK) as a .tar.gz, without caches."""
    os.makedirs(os.path.dirname(archive), exist_ok=True)
    with tarfile.open(archive, "w:gz") as tar:
        for top in source_paths(config):
            if os.path.exists(top):
                tar.add(top, filter=lambda info: None if "__pycache__" in info.name or info.name.endswith(".pyc")
                        else info)
        if setup_script:
            tar.add(setup_script, arcname=SETUP_SCRIPT)
        if os.path.exists(LOCK_PATH):  # the current lock, not the one rendered into the set-up at `make tpu-up`
            tar.add(LOCK_PATH, arcname=PACKED_LOCK)
