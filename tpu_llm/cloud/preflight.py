"""The data checks before a TPU run (`python -m tpu_llm.cloud preflight`, what `make train` runs on TPU
worker 0 before training): the run directory's bucket is writable, and the gs:// data exists; on a pod
slice, TFRecord shards rather than text (read by their first bytes: a length and its masked CRC32C).
Globs are matched as Cloud Storage tools match them (`*` within a path segment, `**` across).
"""

from __future__ import annotations

import re
import struct

from tpu_llm.cloud.gcs import CloudErrors, check_bucket_writable, parse_gs_url, retry, storage_client
from tpu_llm.errors import UserError

TFRECORD_HEADER = 12  # uint64 length + uint32 masked CRC32C of the length


def _masked_crc32c(data: bytes) -> int:
    import google_crc32c  # ships with google-cloud-storage (google-resumable-media)

    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def looks_like_tfrecord(head: bytes) -> bool:
    """True if `head` starts like a TFRecord file: a length whose masked CRC32C follows it."""
    if len(head) < TFRECORD_HEADER:
        return False
    (length,), (crc,) = struct.unpack("<Q", head[:8]), struct.unpack("<I", head[8:12])
    return _masked_crc32c(head[:8]) == crc and 0 < length < (1 << 40)


def _glob_regex(path: str) -> re.Pattern:
    """A glob as Cloud Storage tools read it: `*` and `?` stay within one path segment, `**` crosses them."""
    out, i = [], 0
    while i < len(path):
        if path.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        c = path[i]
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[" and "]" in path[i + 2:]:
            end = path.index("]", i + 2)
            out.append("[" + path[i + 1:end].replace("!", "^", 1) + "]")
            i = end
        else:
            out.append(re.escape(c))
        i += 1
    return re.compile("".join(out))


def glob_objects(pattern: str, client=None) -> list[str]:
    """gs:// URLs of the objects matching a glob such as gs://bucket/shards/*.tfrecord (sorted)."""
    bucket_name, path = parse_gs_url(pattern)
    client = client or storage_client()
    literal = re.split(r"[*?\[]", path, maxsplit=1)[0]
    regex = _glob_regex(path)
    with CloudErrors(f"listing {pattern}", pattern):
        if client.lookup_bucket(bucket_name, retry=retry()) is None:
            raise UserError(f"bucket gs://{bucket_name} does not exist (listing {pattern}); run `make tpu-up` "
                            "or fix the URL")
        names = [b.name for b in client.list_blobs(bucket_name, prefix=literal, retry=retry())]
    return sorted(f"gs://{bucket_name}/{n}" for n in names if regex.fullmatch(n))


def _read_head(url: str, client, size: int = TFRECORD_HEADER) -> bytes:
    bucket_name, name = parse_gs_url(url)
    with CloudErrors(f"reading {url}", url):
        return client.bucket(bucket_name).blob(name).download_as_bytes(start=0, end=size - 1, retry=retry())


def check_tfrecord_data(data: str, client=None, hint: str = "") -> list[str]:
    """Every comma-separated gs:// glob in `data` matches objects that are TFRecord files; their URLs.

    Pod slices need this: their input pipeline runs in the TF servers of every host, which lack
    tensorflow-text's ops, so they read pre-tokenized shards and never raw text.
    """
    client = client or storage_client()
    files: list[str] = []
    for pattern in (p.strip() for p in data.split(",") if p.strip()):
        if not pattern.startswith("gs://"):
            raise UserError(f"data {pattern!r} is not on Cloud Storage; TPU pod slices read gs:// shards "
                            f"(make data-upload){hint}")
        matched = glob_objects(pattern, client)
        if not matched:
            raise UserError(f"data: no objects match {pattern}; upload shards with `make data-upload` or fix "
                            f"DATA{hint}")
        files += matched
    for url in files[:3]:  # the names and the first records of a few files
        head = _read_head(url, client)
        if ".tfrecord" not in url.rsplit("/", 1)[-1] or not looks_like_tfrecord(head):
            kind = "text" if _is_text(head) else "not a TFRecord file"
            raise UserError(f"data: {url} is {kind}; TPU pod slices read pre-tokenized TFRecord shards "
                            f"(tensorflow-text's ops are not in the pod's TF servers): run `make data-upload "
                            f"INPUT=...` and train on the *.tfrecord shards it writes{hint}")
    return files


def _is_text(head: bytes) -> bool:
    try:
        head.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return b"\0" not in head


def preflight(run_dir: str, data: str = "", require_tfrecord: bool = False, client=None) -> str:
    """Before a TPU run: the run directory's bucket is writable and gs:// data exists (and is TFRecord)."""
    client = client or storage_client()
    bucket = check_bucket_writable(run_dir, client)
    summary = f"preflight: gs://{bucket} is writable"
    if require_tfrecord:
        files = check_tfrecord_data(data, client)
        summary += f"; data: {len(files)} TFRecord shard(s)"
    elif data:
        gs = [p.strip() for p in data.split(",") if p.strip().startswith("gs://")]
        for pattern in gs:
            if not glob_objects(pattern, client):
                raise UserError(f"data: no objects match {pattern}; upload with `make data-upload` or fix DATA")
        if gs:
            summary += f"; data: {len(gs)} gs:// pattern(s) found"
    return summary
