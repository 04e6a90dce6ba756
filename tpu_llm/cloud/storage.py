"""Google Cloud Storage helpers for runs on Cloud TPU (google-cloud-storage; no TensorFlow import).

The trainer itself reads and writes `gs://` through `tf.io.gfile`. These helpers cover what happens
around a run, where a clear answer matters more than raw speed; this module holds the transfers, the
listings and the command line, gcs.py the client, its errors and the bucket check, preflight.py the
data checks before a TPU run:

  check_bucket_writable(url)   (gcs.py) the bucket exists and this identity can write to it (a probe
                               object is written and deleted), before a long run starts
  upload_dir(local, url)       upload shards: files over 8 MiB as resumable uploads in CHUNK_SIZE
                               chunks (smaller ones in one request), retried with backoff;
                               files already uploaded with the same MD5 are skipped, so an
                               interrupted upload resumes where it stopped
  download_dir(url, local)     the reverse (e.g. a checkpoint directory), same skipping and retries
  list_runs(runs_url)          run directories under gs://BUCKET/runs with their newest checkpoint
  list_checkpoints(run_url)    checkpoint steps of one run
  preflight(run_dir, data)     (preflight.py) what `make train` runs on TPU worker 0 before training

Every failure a user can fix is a `tpu_llm.errors.UserError` whose one-line message names the
culprit and the fix. `python -m tpu_llm.cloud --help` exposes the same functions on the command
line. Setting STORAGE_EMULATOR_HOST (as the tests do, with gcp-storage-emulator) points the client
at a local emulator with anonymous credentials.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import hashlib
import os
import sys
from typing import Callable, Iterator

from tpu_llm.cloud.gcs import CloudErrors, check_bucket_writable, parse_gs_url, retry, storage_client
from tpu_llm.cloud.preflight import preflight
from tpu_llm.errors import EXIT_USER_ERROR, UserError
from tpu_llm.platform.run_layout import CHECKPOINT_DIR, checkpoint_step

CHUNK_SIZE = 16 * 1024 * 1024  # resumable-upload chunk (a multiple of 256 KiB); larger files go in chunks


# --------------------------------------------------------------------------------------------------
# Upload and download


def _md5_b64(path: str) -> str:
    digest = hashlib.md5()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return base64.b64encode(digest.digest()).decode()


def _local_files(local_dir: str) -> dict[str, str]:
    """Relative POSIX path -> absolute path of every file under `local_dir` (sorted, hidden kept)."""
    out = {}
    for root, _, names in os.walk(local_dir):
        for name in names:
            path = os.path.join(root, name)
            out[os.path.relpath(path, local_dir).replace(os.sep, "/")] = path
    return dict(sorted(out.items()))


def _remote_blobs(client, bucket_name: str, prefix: str) -> dict[str, object]:
    """Relative name -> blob of every object under gs://bucket/prefix/."""
    start = f"{prefix}/" if prefix else ""
    return {b.name[len(start):]: b for b in client.list_blobs(bucket_name, prefix=start, retry=retry())
            if not b.name.endswith("/")}


# written beside the shards by `tpu-llm data prepare`: one kind, so a stale tokenizer.model goes with them
SHARD_COMPANIONS = ("meta.json", "tokenizer.json", "tokenizer.model")


def _kind(name: str) -> str:
    """'data-00001-of-00004.tfrecord' -> '.tfrecord'; a shard companion -> 'shard companion'; '' if none."""
    if name in SHARD_COMPANIONS:
        return "shard companion"
    return "." + name.split(".", 1)[1] if "." in name.strip(".") else ""


def _same_kind(rel: str, files: dict[str, str]) -> bool:
    """Whether the remote object `rel` is of a kind the upload writes: in a folder that receives local
    files, with the same kind as one of them. Only such objects may be deleted by --overwrite."""
    folder, name = rel.rpartition("/")[::2]
    kind = _kind(name)
    return bool(kind) and any(local.rpartition("/")[0] == folder and _kind(local.rpartition("/")[2]) == kind
                              for local in files)


@dataclasses.dataclass
class TransferReport:
    transferred: list[str] = dataclasses.field(default_factory=list)
    skipped: list[str] = dataclasses.field(default_factory=list)  # already there with the same MD5
    deleted: list[str] = dataclasses.field(default_factory=list)
    bytes: int = 0


def upload_file(client, bucket_name: str, name: str, path: str, generation: int | None = None,
                chunk_size: int = CHUNK_SIZE) -> None:
    """Upload one file: in one request up to 8 MiB, else resumable in `chunk_size` chunks; retried.

    `generation` makes the write conditional (0: the object must not exist; N: it must still be
    generation N), which also makes retrying it safe.
    """
    blob = client.bucket(bucket_name).blob(name, chunk_size=chunk_size)
    blob.upload_from_filename(path, if_generation_match=generation, retry=retry())


def upload_dir(local_dir: str, url: str, overwrite: bool = False, client=None,
               chunk_size: int = CHUNK_SIZE, progress: Callable[[str], None] | None = None) -> TransferReport:
    """Upload every file under `local_dir` to `url` (gs://bucket/prefix), keeping relative paths.

    Files already at the destination with the same MD5 are skipped: re-running an interrupted upload
    resumes it. A destination object with other content, or a stale object of the kind being
    uploaded (`_same_kind`: e.g. a shard of an earlier `--shards` count, an old tokenizer.model),
    stops the upload with a UserError unless `overwrite`, which replaces the first and deletes the
    second. Nothing else under the prefix is touched (a run directory's checkpoints beside the
    shards stay), and `overwrite` refuses the bucket's root, where other runs live.
    """
    if not os.path.isdir(local_dir):
        raise UserError(f"upload: {local_dir!r} is not a directory; run `tpu-llm data prepare --output "
                        f"{local_dir}` first")
    bucket_name, prefix = parse_gs_url(url)
    if overwrite and not prefix:
        raise UserError(f"upload --overwrite into the root of gs://{bucket_name} could delete other runs' objects; "
                        f"upload to a folder such as gs://{bucket_name}/shards")
    client = client or storage_client()
    check_bucket_writable(url, client)
    files = _local_files(local_dir)
    if not files:
        raise UserError(f"upload: {local_dir} holds no files; nothing to upload")
    report = TransferReport()
    with CloudErrors(f"uploading {local_dir} to {url}", url):
        remote = _remote_blobs(client, bucket_name, prefix)
        changed = [rel for rel, path in files.items() if rel in remote and remote[rel].md5_hash != _md5_b64(path)]
        extra = sorted(rel for rel in set(remote) - set(files) if _same_kind(rel, files))
        if (changed or extra) and not overwrite:
            what = " and ".join([f"{len(changed)} file(s) with other content (e.g. {changed[0]})"] * bool(changed)
                                + [f"{len(extra)} stale object(s) of the kind uploaded, not in {local_dir} "
                                   f"(e.g. {extra[0]})"] * bool(extra))
            fix = " and ".join(["replace the changed files"] * bool(changed)
                               + ["delete the stale objects"] * bool(extra))
            raise UserError(f"upload: {url} already holds {what}; pass --overwrite (make data-upload "
                            f"OVERWRITE=1) to {fix}, or upload to another location")
        if extra and progress:  # said before anything is deleted
            progress(f"deleting {len(extra)} stale object(s) under {url} (--overwrite): {', '.join(extra[:10])}"
                     + (f" and {len(extra) - 10} more" if len(extra) > 10 else ""))
        for rel, path in files.items():
            name = f"{prefix}/{rel}" if prefix else rel
            blob = remote.get(rel)
            if blob is not None and rel not in changed:
                report.skipped.append(rel)
                continue
            upload_file(client, bucket_name, name, path, generation=blob.generation if blob else 0,
                        chunk_size=chunk_size)
            report.transferred.append(rel)
            report.bytes += os.path.getsize(path)
            if progress:
                progress(f"uploaded {rel} ({os.path.getsize(path):,} bytes)")
        for rel in extra:
            remote[rel].delete(retry=retry())
            report.deleted.append(rel)
    return report


def download_dir(url: str, local_dir: str, client=None,
                 progress: Callable[[str], None] | None = None) -> TransferReport:
    """Download every object under `url` into `local_dir`; files already there with the same MD5 are skipped.

    Each file is written under a temporary name and renamed when complete, so an interrupted
    download never leaves a truncated file that a later run would take as complete.
    """
    bucket_name, prefix = parse_gs_url(url)
    client = client or storage_client()
    report = TransferReport()
    with CloudErrors(f"downloading {url}", url):
        if client.lookup_bucket(bucket_name, retry=retry()) is None:
            raise UserError(f"bucket gs://{bucket_name} does not exist (downloading {url}); fix the URL")
        remote = _remote_blobs(client, bucket_name, prefix)
        if not remote:
            raise UserError(f"download: nothing under {url}; check the path (`python -m tpu_llm.cloud runs "
                            f"gs://{bucket_name}/runs` lists run directories)")
        for rel, blob in sorted(remote.items()):
            path = os.path.join(local_dir, *rel.split("/"))
            if os.path.exists(path) and _md5_b64(path) == blob.md5_hash:
                report.skipped.append(rel)
                continue
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.part"
            blob.download_to_filename(tmp, retry=retry())
            os.replace(tmp, path)
            report.transferred.append(rel)
            report.bytes += os.path.getsize(path)
            if progress:
                progress(f"downloaded {rel}")
    return report


# --------------------------------------------------------------------------------------------------
# Runs and checkpoints


@dataclasses.dataclass
class RunInfo:
    name: str
    url: str
    checkpoints: list[int]

    @property
    def latest_step(self) -> int | None:
        return self.checkpoints[-1] if self.checkpoints else None


def list_runs(runs_url: str, client=None) -> list[RunInfo]:
    """Run directories directly under `runs_url` (e.g. gs://bucket/runs), each with its checkpoint steps."""
    bucket_name, prefix = parse_gs_url(runs_url)
    client = client or storage_client()
    runs: dict[str, list[int]] = {}
    with CloudErrors(f"listing runs in {runs_url}", runs_url):
        if client.lookup_bucket(bucket_name, retry=retry()) is None:
            raise UserError(f"bucket gs://{bucket_name} does not exist (listing {runs_url}); run `make tpu-up` "
                            "or fix the URL")
        for rel, _ in _remote_blobs(client, bucket_name, prefix).items():
            if "/" not in rel:
                continue
            name, rest = rel.split("/", 1)
            steps = runs.setdefault(name, [])
            step = _index_step(rest)
            if step is not None:
                steps.append(step)
    base = runs_url.rstrip("/")
    return [RunInfo(name, f"{base}/{name}", sorted(steps)) for name, steps in sorted(runs.items())]


def list_checkpoints(run_url: str, client=None) -> list[int]:
    """Steps of the checkpoints in `run_url`/checkpoints, oldest first ([] when there are none)."""
    bucket_name, prefix = parse_gs_url(run_url)
    client = client or storage_client()
    with CloudErrors(f"listing checkpoints in {run_url}", run_url):
        names = _remote_blobs(client, bucket_name, f"{prefix}/{CHECKPOINT_DIR}".lstrip("/"))
    return sorted(step for rel in names if (step := _index_step(f"{CHECKPOINT_DIR}/{rel}")) is not None)


def _index_step(rel: str) -> int | None:
    """N of a checkpoint's index file `.../checkpoints/ckpt-N.index` (`rel`: an object's name below a run)."""
    folder, _, name = rel.rpartition("/")
    return checkpoint_step(name, ".index") if folder.rpartition("/")[2] == CHECKPOINT_DIR else None


# --------------------------------------------------------------------------------------------------
# Command line: python -m tpu_llm.cloud ...


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tpu_llm.cloud", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("check", help="the bucket of URL exists and is writable")
    s.add_argument("url")
    s = sub.add_parser("upload", help="upload a directory (resumable; skips files already uploaded)")
    s.add_argument("local_dir")
    s.add_argument("url")
    s.add_argument("--overwrite", action="store_true", help="replace different objects and delete stale ones of the "
                   "kind uploaded (other shards, an old tokenizer); never the bucket root")
    s = sub.add_parser("download", help="download a gs:// directory (skips files already downloaded)")
    s.add_argument("url")
    s.add_argument("local_dir")
    s = sub.add_parser("runs", help="list run directories and their newest checkpoint")
    s.add_argument("runs_url")
    s = sub.add_parser("checkpoints", help="list the checkpoint steps of a run")
    s.add_argument("run_url")
    s = sub.add_parser("preflight", help="checks `make train` runs on TPU worker 0 before training")
    s.add_argument("--run_dir", required=True)
    s.add_argument("--data", default="")
    s.add_argument("--require_tfrecord", action="store_true")
    return p


def _iter_lines(args) -> Iterator[str]:
    if args.command == "check":
        yield f"gs://{check_bucket_writable(args.url)} exists and is writable"
    elif args.command == "upload":
        r = upload_dir(args.local_dir, args.url, overwrite=args.overwrite, progress=print)
        yield (f"uploaded {len(r.transferred)} file(s) ({r.bytes:,} bytes) to {args.url}; {len(r.skipped)} "
               f"already there" + (f"; deleted {len(r.deleted)}" if r.deleted else ""))
    elif args.command == "download":
        r = download_dir(args.url, args.local_dir, progress=print)
        yield f"downloaded {len(r.transferred)} file(s) ({r.bytes:,} bytes); {len(r.skipped)} already there"
    elif args.command == "runs":
        runs = list_runs(args.runs_url)
        for run in runs:
            yield f"{run.url}  newest checkpoint: {run.latest_step if run.checkpoints else 'none'}"
        if not runs:
            yield f"no runs under {args.runs_url}"
    elif args.command == "checkpoints":
        steps = list_checkpoints(args.run_url)
        yield " ".join(map(str, steps)) if steps else f"no checkpoints in {args.run_url}"
    elif args.command == "preflight":
        yield preflight(args.run_dir, args.data, args.require_tfrecord)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        for line in _iter_lines(args):
            print(line, flush=True)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main())
