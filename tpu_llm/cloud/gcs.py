"""Reaching Google Cloud Storage (google-cloud-storage; no TensorFlow import): gs:// URLs, the client (the
emulator's when STORAGE_EMULATOR_HOST is set, as the tests do, else Application Default Credentials), its
retries, the library's exceptions turned into one-line UserErrors, and the bucket check a run starts with.

What every Cloud Storage helper builds on, apart from them: the transfers and listings (storage.py)
and the data checks before a TPU run (preflight.py) both use it, as does the run directory's lock on
gs:// (training/run_lock.py).
"""

from __future__ import annotations

import os
import re
import uuid

from tpu_llm.errors import UserError


def parse_gs_url(url: str) -> tuple[str, str]:
    """'gs://bucket/a/b' -> ('bucket', 'a/b'); UserError for anything else."""
    match = re.fullmatch(r"gs://([a-z0-9][a-z0-9._-]{1,220}[a-z0-9])(?:/(.*))?", url or "")
    if not match:
        raise UserError(f"{url!r} is not a gs://BUCKET/PATH URL; give a Cloud Storage location such as "
                        "gs://my-bucket/runs/tiny")
    return match.group(1), (match.group(2) or "").strip("/")


def storage_client(project: str | None = None):
    """A google-cloud-storage client: the emulator's (anonymous) if STORAGE_EMULATOR_HOST is set, else ADC."""
    from google.cloud import storage

    if os.environ.get("STORAGE_EMULATOR_HOST"):
        from google.auth.credentials import AnonymousCredentials

        return storage.Client(project=project or "emulator", credentials=AnonymousCredentials())
    try:
        return storage.Client(project=project)
    except Exception as e:  # google.auth.exceptions.DefaultCredentialsError and friends
        raise _user_error("connecting to Cloud Storage", e) from None


def retry():
    from google.cloud.storage.retry import DEFAULT_RETRY

    return DEFAULT_RETRY  # exponential backoff on 408/429/5xx and connection errors, 120 s deadline


def _user_error(what: str, e: Exception, url: str = "") -> UserError:
    """Translate a google-cloud / google-auth / network exception into a one-line UserError."""
    from google.api_core import exceptions as gexc

    name = type(e).__name__
    bucket = f"gs://{parse_gs_url(url)[0]}" if url.startswith("gs://") else "the bucket"
    if name in ("DefaultCredentialsError", "RefreshError"):
        return UserError(f"{what}: no usable Google Cloud credentials ({name}); run `gcloud auth "
                         "application-default login`, or set GOOGLE_APPLICATION_CREDENTIALS")
    if isinstance(e, gexc.NotFound):
        return UserError(f"{what}: bucket {bucket} does not exist; run `make tpu-up` (it creates the "
                         "bucket) or fix the URL")
    if isinstance(e, (gexc.Forbidden, gexc.Unauthorized)):
        return UserError(f"{what}: permission denied on {bucket} ({_first_line(e)}); grant this identity "
                         "roles/storage.objectUser on the bucket (infra/iam.tf does it for the TPU workers)")
    if isinstance(e, gexc.GoogleAPIError):
        return UserError(f"{what}: Cloud Storage said {_first_line(e)}; retry, or check the bucket in the console")
    if isinstance(e, (ConnectionError, OSError)) or "Connection" in name:
        return UserError(f"{what}: cannot reach Cloud Storage ({name}: {_first_line(e)}); check the network "
                         "and retry")
    return UserError(f"{what}: {name}: {_first_line(e)}")


def _first_line(e: Exception) -> str:
    text = getattr(e, "message", None) or str(e) or type(e).__name__
    return text.strip().splitlines()[0][:200]


class CloudErrors:
    """`with CloudErrors("uploading x", url):` turns library exceptions into UserError."""

    def __init__(self, what: str, url: str = ""):
        self.what, self.url = what, url

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        if e is None or isinstance(e, (UserError, KeyboardInterrupt)):
            return False
        if isinstance(e, Exception) and _is_cloud_error(e):
            raise _user_error(self.what, e, self.url) from None
        return False


def _is_cloud_error(e: Exception) -> bool:
    module = type(e).__module__
    return (module.startswith(("google.", "requests", "urllib3")) or isinstance(e, (ConnectionError, TimeoutError)))


def check_bucket_writable(url: str, client=None) -> str:
    """Fail with a UserError unless `url`'s bucket exists and a probe object can be written under it."""
    bucket_name, prefix = parse_gs_url(url)
    client = client or storage_client()
    with CloudErrors(f"checking {url}", url):
        bucket = client.lookup_bucket(bucket_name, retry=retry())
        if bucket is None:
            raise UserError(f"bucket gs://{bucket_name} does not exist (checking {url}); run `make tpu-up` "
                            "(it creates the bucket) or fix the URL")
        probe = bucket.blob(f"{prefix}/.write-test-{uuid.uuid4().hex[:8]}".lstrip("/"))
        probe.upload_from_string(b"ok", retry=retry())
        probe.delete(retry=retry())
    return bucket_name
