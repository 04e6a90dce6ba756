"""`python -m tpu_llm.cloud COMMAND`: the Cloud TPU driver behind the Makefile's tpu-* targets (up, down,
status, train, ssh, logs, tensorboard, data-upload: driver.py, standard library only, so that `make
tpu-up` needs no virtual environment), the Cloud Storage helpers (check, upload, download, runs,
checkpoints, preflight: storage.py), `lock`, which regenerates infra/worker-requirements.txt
(lock.py), and `own`, the owner of a run on TPU worker 0 (run_owner.py)."""

import sys

DRIVER = ("up", "down", "status", "train", "ssh", "logs", "tensorboard", "data-upload", "stop")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    first = argv[0] if argv else ""
    if first in DRIVER:
        from tpu_llm.cloud import driver

        return driver.main(argv)
    if first == "lock":
        from tpu_llm.cloud import lock

        return lock.main(argv[1:])
    if first == "own":  # on TPU worker 0: the process that owns a run (worker_plan.py starts it)
        from tpu_llm.cloud import run_owner

        return run_owner.main(argv[1:])
    from tpu_llm.cloud import storage

    return storage.main(argv)


if __name__ == "__main__":
    sys.exit(main())
