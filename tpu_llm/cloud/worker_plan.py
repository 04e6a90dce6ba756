"""What `make train` runs on TPU worker 0, and the source it copies to every worker (for tpu_llm/cloud/driver.py).

  single-host slice  `--strategy=tpu --tpu=local` with the PJRT variables
                     NEXT_PLUGGABLE_DEVICE_USE_C_API=true TF_PLUGGABLE_DEVICE_LIBRARY_PATH=/opt/tpu-llm/libtpu.so
                     (and TPU_LIBRARY_PATH, see PJRT_ENV): the venv's pinned libtpu, linked there by the set-up
  multi-host slice   `--strategy=tpu --tpu=NAME` with TPU_NAME=NAME TPU_LOAD_LIBRARY=0: the TF servers are the
                     TF worker containers the set-up runs on every host (infra/startup.sh.tftpl), and they run
                     the input pipeline, so the data must be TFRecord shards on gs://

The run is started with nohup (it survives a dropped ssh; `make tpu-logs` re-attaches), after
`python -m tpu_llm.cloud preflight` checked the bucket and the data from the worker itself. Its log
is copied to RUN_DIR/logs/train-TIMESTAMP.log every LOG_COPY_SECONDS while it runs and once when it
ends, so it outlives a preempted or deleted TPU (`make tpu-logs` / `make tpu-status` read it there).
"""

from __future__ import annotations

import os
import shlex
import tarfile

from tpu_llm.cloud.shell import LaunchError, Outputs

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
# Copies the log to Cloud Storage while the run ($0) lives, then once more (the workers' service
# account has objectUser on the bucket; gcloud comes with the TPU VM images). Detached like the
# run, so a dropped ssh does not stop it; a preemption loses at most the last LOG_COPY_SECONDS.
LOG_COPY = ("nohup bash -c 'while kill -0 \"$0\" 2>/dev/null; do gcloud storage cp --quiet "
            f"{TRAIN_LOG} \"$1\" >/dev/null 2>&1; sleep {LOG_COPY_SECONDS}; done; gcloud storage cp --quiet "
            f"{TRAIN_LOG} \"$1\"' \"$pid\" \"$log_url\" >/dev/null 2>&1 < /dev/null &")
# Single host: PJRT through the pinned libtpu wheel of the venv (tensorflow-tpu 2.20.0 declares
# libtpu~=0.0.14; the lock pins 0.0.14; newer ones, e.g. 0.0.52, make `import tensorflow` abort:
# "ConfigureDistributedTpuOp_DoWork not available in this library"). The set-up checks its version and
# links it at LIBTPU; TPU_LIBRARY_PATH makes TensorFlow's own import-time load take that file too.
# Every image is a base image, which has no TensorFlow (docs/cloud-tpu.md).
LIBTPU = f"{STATE_DIR}/libtpu.so"
PJRT_ENV = {"NEXT_PLUGGABLE_DEVICE_USE_C_API": "true", "TF_PLUGGABLE_DEVICE_LIBRARY_PATH": LIBTPU,
            "TPU_LIBRARY_PATH": LIBTPU}


# Refuse to start (or to reinstall under) a run while one is training on worker 0.
BUSY_CHECK = (f"if [ -f {PID_FILE} ] && kill -0 \"$(cat {PID_FILE})\" 2>/dev/null; then "
              f"echo \"error: a run is already training on worker 0 (pid $(cat {PID_FILE}))\" >&2; exit 2; fi")
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

    def __init__(self, o: Outputs, config: str, run_dir: str, data: str, extra: list[str]):
        self.o, self.config, self.run_dir, self.data, self.extra = o, config, run_dir, data, extra
        self.pod = bool(o["multi_host"])

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
        return cls(o, config, run_dir, data, extra)

    def train_argv(self) -> list[str]:
        argv = [f"{VENV}/bin/tpu-llm", "train", "--config", self.config, "--strategy=tpu",
                f"--tpu={self.o['tpu_name'] if self.pod else 'local'}", f"--run_dir={self.run_dir}"]
        if self.data:
            argv.append(f"--data.train={self.data}")
        if self.pod:
            argv.append("--data.format=tfrecord")
        return argv + self.extra

    def environment(self) -> dict[str, str]:
        return {"TPU_NAME": str(self.o["tpu_name"]), "TPU_LOAD_LIBRARY": "0"} if self.pod else dict(PJRT_ENV)

    def remote_script(self) -> str:
        preflight = [f"{VENV}/bin/python", "-m", "tpu_llm.cloud", "preflight", f"--run_dir={self.run_dir}"]
        if self.data:
            preflight.append(f"--data={self.data}")
        if self.pod:
            preflight.append("--require_tfrecord")
        env_words = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.environment().items())
        return "\n".join([
            "set -e",
            "cd ~/tpu-llm",
            shlex.join(preflight),
            BUSY_CHECK,
            f"log_url={shlex.quote(self.run_dir + '/' + LOG_DIR)}/train-$(date -u +%Y%m%dT%H%M%SZ).log",
            f"nohup env {env_words} {shlex.join(self.train_argv())} > {TRAIN_LOG} 2>&1 < /dev/null &",
            "pid=$!",
            f"echo \"$pid\" > {PID_FILE}",
            LOG_COPY,
            f"echo \"train: the log is copied to $log_url every {LOG_COPY_SECONDS} s\"",
            f"tail -n +1 -f --pid=\"$pid\" {TRAIN_LOG}",
            "wait \"$pid\"",
        ])


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
