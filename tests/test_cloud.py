"""tpu_llm.cloud against gcp-storage-emulator on 127.0.0.1 (started here, on a free port, in memory).

Upload (small files and a resumable upload in chunks), resume after an interruption, conflicts and
--overwrite, download, listing runs and checkpoints, the pod pre-flight (TFRecord vs text), and the
one-line errors for a missing bucket and missing credentials.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import tensorflow as tf
from helpers import free_port

from tpu_llm.cloud import gcs, preflight
from tpu_llm.cloud import storage as cloud
from tpu_llm.errors import UserError

ROOT = Path(__file__).resolve().parent.parent


# gcp-storage-emulator with Cloud Storage's generation preconditions, which it ignores: a write or
# delete with ifGenerationMatch=G is refused (412) unless the object's generation is G (0: it must not
# exist). The run-directory lock on gs:// rests on them; the emulator's handlers are wrapped before
# its server builds its routes from them.
EMULATOR = """
import sys
from http import HTTPStatus
from gcp_storage_emulator.exceptions import NotFound
from gcp_storage_emulator.handlers import objects

def object_name(request):
    if "object_id" in request.params:
        return request.params["object_id"]
    if "name" in request.query:
        return request.query["name"][0]
    data = request.data if isinstance(request.data, dict) else {}
    return (data.get("meta") or data).get("name")

def preconditioned(handler):
    def checked(request, response, storage, *args, **kwargs):
        wanted = request.query.get("ifGenerationMatch")
        if wanted and "upload_id" not in request.query:
            try:
                current = storage.get_file_obj(request.params["bucket_name"], object_name(request))["generation"]
            except NotFound:
                current = "0"
            if str(current) != wanted[0]:
                response.status = HTTPStatus.PRECONDITION_FAILED
                response.json({"error": {"code": 412, "message": "At least one of the pre-conditions you "
                                                                 "specified did not hold."}})
                return None
        return handler(request, response, storage, *args, **kwargs)
    return checked

objects.insert, objects.delete = preconditioned(objects.insert), preconditioned(objects.delete)
from gcp_storage_emulator.__main__ import main
main(sys.argv[1:])
"""


@pytest.fixture(scope="module")
def emulator():
    """STORAGE_EMULATOR_HOST of a gcp-storage-emulator process that lives as long as this module's tests
    (with generation preconditions: EMULATOR)."""
    pytest.importorskip("gcp_storage_emulator", reason="the dev extra installs gcp-storage-emulator")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", EMULATOR, "start", "--host", "127.0.0.1",
                             "--port", str(port), "--in-memory"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"gcp-storage-emulator did not start on port {port}")
            time.sleep(0.1)
    host = f"http://127.0.0.1:{port}"
    old = os.environ.get("STORAGE_EMULATOR_HOST")
    os.environ["STORAGE_EMULATOR_HOST"] = host
    try:
        yield host
    finally:
        if old is None:
            os.environ.pop("STORAGE_EMULATOR_HOST", None)
        else:
            os.environ["STORAGE_EMULATOR_HOST"] = old
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture
def bucket(emulator):
    """A new, empty bucket name."""
    name = f"b-{uuid.uuid4().hex[:12]}"
    gcs.storage_client().create_bucket(name)
    return name


def write_files(directory: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        path = directory / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return directory


def test_parse_gs_url():
    assert gcs.parse_gs_url("gs://bkt/runs/tiny/") == ("bkt", "runs/tiny")
    assert gcs.parse_gs_url("gs://bkt") == ("bkt", "")
    with pytest.raises(UserError, match="not a gs://BUCKET/PATH URL"):
        gcs.parse_gs_url("/local/path")


@pytest.mark.slow
def test_bucket_check_and_missing_bucket_error(bucket):
    assert gcs.check_bucket_writable(f"gs://{bucket}/runs/tiny") == bucket
    assert not list(gcs.storage_client().list_blobs(bucket))  # the probe object is gone
    with pytest.raises(UserError) as e:
        gcs.check_bucket_writable("gs://no-such-bucket-here/runs/tiny")
    message = str(e.value)
    assert "gs://no-such-bucket-here does not exist" in message and "make tpu-up" in message
    assert "\n" not in message


@pytest.mark.slow
def test_upload_is_resumable_and_resumes_after_an_interruption(bucket, tmp_path, monkeypatch):
    big = bytes(range(256)) * (36 * 1024) + b"tail"  # 9 MiB: above 8 MiB the library uploads resumably, in chunks
    files = {"data-00000-of-00003.tfrecord": b"a" * 1000, "data-00001-of-00003.tfrecord": big,
             "data-00002-of-00003.tfrecord": b"c" * 10, "meta.json": b"{}", "sub/tokenizer.json": b"{}"}
    local = write_files(tmp_path / "shards", files)
    url = f"gs://{bucket}/shards"
    real_upload, calls = cloud.upload_file, []

    def interrupted(*args, **kwargs):
        calls.append(args[2])
        if len(calls) == 2:
            raise ConnectionResetError("connection dropped mid-upload")
        return real_upload(*args, **kwargs)

    monkeypatch.setattr(cloud, "upload_file", interrupted)
    with pytest.raises(UserError, match="cannot reach Cloud Storage"):
        cloud.upload_dir(str(local), url, chunk_size=2 * 1024 * 1024)
    first = gcs.storage_client().bucket(bucket).get_blob("shards/data-00000-of-00003.tfrecord")
    monkeypatch.setattr(cloud, "upload_file", real_upload)

    from google.cloud.storage.blob import Blob

    resumable = []
    real_resumable = Blob._do_resumable_upload
    monkeypatch.setattr(Blob, "_do_resumable_upload",
                        lambda self, *a, **k: resumable.append(self.name) or real_resumable(self, *a, **k))
    report = cloud.upload_dir(str(local), url, chunk_size=2 * 1024 * 1024)  # the same command again resumes
    assert resumable == ["shards/data-00001-of-00003.tfrecord"]
    assert report.skipped == ["data-00000-of-00003.tfrecord"]
    assert sorted(report.transferred) == sorted(set(files) - {"data-00000-of-00003.tfrecord"})
    again = gcs.storage_client().bucket(bucket).get_blob("shards/data-00000-of-00003.tfrecord")
    assert again.generation == first.generation  # not uploaded twice
    assert cloud.upload_dir(str(local), url).skipped == sorted(files)  # nothing left to do

    out = tmp_path / "back"
    report = cloud.download_dir(url, str(out))
    assert sorted(report.transferred) == sorted(files)
    for rel, data in files.items():
        assert (out / rel).read_bytes() == data
    assert cloud.download_dir(url, str(out)).skipped == sorted(files)
    assert not list(out.rglob("*.part"))


@pytest.mark.slow
def test_upload_conflicts_need_overwrite(bucket, tmp_path):
    local = write_files(tmp_path / "shards", {"a.tfrecord": b"one", "b.tfrecord": b"two"})
    url = f"gs://{bucket}/shards"
    cloud.upload_dir(str(local), url)
    (local / "a.tfrecord").write_bytes(b"changed")
    (local / "b.tfrecord").unlink()
    with pytest.raises(UserError, match="--overwrite"):
        cloud.upload_dir(str(local), url)
    report = cloud.upload_dir(str(local), url, overwrite=True)
    assert report.transferred == ["a.tfrecord"] and report.deleted == ["b.tfrecord"]
    blobs = {b.name: b.download_as_bytes() for b in gcs.storage_client().list_blobs(bucket)}
    assert blobs == {"shards/a.tfrecord": b"changed"}


@pytest.mark.slow
def test_overwrite_deletes_only_stale_objects_of_the_kind_uploaded(bucket, tmp_path):
    client = gcs.storage_client().bucket(bucket)
    kept = {"runs/tiny/checkpoints/ckpt-2.index": b"i", "runs/tiny/checkpoints/checkpoint": b"c",
            "data/notes.txt": b"n", "data/old/data-00000-of-00001.tfrecord": b"o"}
    stale = {"data/data-00002-of-00003.tfrecord": b"s", "data/tokenizer.model": b"m"}  # an earlier prepare's
    for name, data in {**kept, **stale, "data/data-00000-of-00002.tfrecord": b"old"}.items():
        client.blob(name).upload_from_string(data)
    local = write_files(tmp_path / "shards", {"data-00000-of-00002.tfrecord": b"new", "data-00001-of-00002.tfrecord":
                                              b"1", "meta.json": b"{}", "tokenizer.json": b"{}"})

    with pytest.raises(UserError) as e:  # the reproduction: every run in the bucket was deleted
        cloud.upload_dir(str(local), f"gs://{bucket}", overwrite=True)
    assert "root of gs://" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(UserError) as e:
        cloud.upload_dir(str(local), f"gs://{bucket}/data")
    message = str(e.value)
    assert "1 file(s) with other content (e.g. data-00000-of-00002.tfrecord) and 2 stale object(s)" in message
    assert "--overwrite (make data-upload OVERWRITE=1) to replace the changed files and delete the stale objects" \
        in message
    said = []
    report = cloud.upload_dir(str(local), f"gs://{bucket}/data", overwrite=True, progress=said.append)
    assert report.deleted == ["data-00002-of-00003.tfrecord", "tokenizer.model"]
    assert said[0] == (f"deleting 2 stale object(s) under gs://{bucket}/data (--overwrite): "
                       "data-00002-of-00003.tfrecord, tokenizer.model")
    names = {b.name for b in gcs.storage_client().list_blobs(bucket)}
    assert set(kept) <= names and not set(stale) & names  # the checkpoints and other folders are untouched


@pytest.mark.slow
def test_list_runs_and_checkpoints(bucket, tmp_path):
    layout = {"a/config.yaml": b"x", "a/checkpoints/checkpoint": b"x", "a/checkpoints/ckpt-200.index": b"x",
              "a/checkpoints/ckpt-200.data-00000-of-00001": b"x", "a/checkpoints/ckpt-100.index": b"x",
              "a/logs/train/events.out": b"x", "b/config.yaml": b"x"}
    cloud.upload_dir(str(write_files(tmp_path / "runs", layout)), f"gs://{bucket}/runs")
    runs = cloud.list_runs(f"gs://{bucket}/runs")
    assert [(r.name, r.url, r.checkpoints, r.latest_step) for r in runs] == [
        ("a", f"gs://{bucket}/runs/a", [100, 200], 200), ("b", f"gs://{bucket}/runs/b", [], None)]
    assert cloud.list_checkpoints(f"gs://{bucket}/runs/a") == [100, 200]
    assert cloud.list_checkpoints(f"gs://{bucket}/runs/b") == []
    assert preflight.glob_objects(f"gs://{bucket}/runs/*/config.yaml") == [f"gs://{bucket}/runs/a/config.yaml",
                                                                           f"gs://{bucket}/runs/b/config.yaml"]


@pytest.mark.slow
def test_preflight_tells_tfrecord_shards_from_text(bucket, tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    with tf.io.TFRecordWriter(str(shards / "data-00000-of-00001.tfrecord")) as w:
        w.write(b"a record")
    assert preflight.looks_like_tfrecord((shards / "data-00000-of-00001.tfrecord").read_bytes())
    assert not preflight.looks_like_tfrecord(b"def f():\n    return 1\n")
    cloud.upload_dir(str(shards), f"gs://{bucket}/shards")
    write = gcs.storage_client().bucket(bucket).blob
    write("text/doc.txt").upload_from_string("plain text, not shards\n" * 10)
    write("fake/data.tfrecord").upload_from_string("text in a file named like a shard\n" * 10)

    run_dir = f"gs://{bucket}/runs/tiny"
    assert "1 TFRecord shard" in preflight.preflight(run_dir, f"gs://{bucket}/shards/*.tfrecord", require_tfrecord=True)
    with pytest.raises(UserError, match="is text; TPU pod slices read pre-tokenized TFRecord shards"):
        preflight.preflight(run_dir, f"gs://{bucket}/fake/*.tfrecord", require_tfrecord=True)
    with pytest.raises(UserError, match="is text"):
        preflight.preflight(run_dir, f"gs://{bucket}/text/*.txt", require_tfrecord=True)
    with pytest.raises(UserError, match="no objects match .*make data-upload"):
        preflight.preflight(run_dir, f"gs://{bucket}/nothing/*.tfrecord", require_tfrecord=True)
    assert "writable" in preflight.preflight(run_dir, f"gs://{bucket}/text/*.txt")  # single host: text is fine
    with pytest.raises(UserError, match="does not exist"):
        preflight.preflight("gs://no-such-bucket-here/runs/x")


@pytest.mark.slow
def test_command_line_errors_are_one_line(emulator):
    done = subprocess.run([sys.executable, "-m", "tpu_llm.cloud", "check", "gs://no-such-bucket-here/runs/x"],
                          capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "STORAGE_EMULATOR_HOST": emulator})
    assert done.returncode == 2
    assert done.stderr.startswith("error: bucket gs://no-such-bucket-here does not exist")
    assert done.stderr.count("\n") == 1


def test_missing_credentials_is_a_user_error(monkeypatch, tmp_path):
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing.json"))
    with pytest.raises(UserError, match="application-default login"):
        gcs.check_bucket_writable("gs://some-bucket/runs/x")


# ---- the run directory's lock on gs:// (tpu_llm/training/run_lock.py) -------------------------------------


@pytest.mark.slow
def test_emulator_honours_generation_preconditions(bucket):
    from google.api_core.exceptions import PreconditionFailed

    blob = gcs.storage_client().bucket(bucket).blob("x")
    blob.upload_from_string(b"one", if_generation_match=0)
    with pytest.raises(PreconditionFailed):
        gcs.storage_client().bucket(bucket).blob("x").upload_from_string(b"two", if_generation_match=0)
    with pytest.raises(PreconditionFailed):
        blob.delete(if_generation_match=blob.generation + 1)
    assert gcs.storage_client().bucket(bucket).blob("x").download_as_bytes() == b"one"


@pytest.mark.slow
def test_gs_lock_one_writer_a_lease_kept_alive_and_a_stale_lock_taken_over(bucket):
    """Issue 28 #2 on gs://: a lock object created only if none exists (ifGenerationMatch=0), naming its
    holder, its lease renewed by a heartbeat; a second writer is refused while the lease runs, and
    takes over (saying so) once it ran out: a holder killed without releasing it (a preempted VM)."""
    from tpu_llm.training import run_lock

    url = f"gs://{bucket}/runs/tiny"
    first = run_lock.GcsLock(url, lease_seconds=1.5)
    first.acquire()
    holder = json.loads(gcs.storage_client().bucket(bucket).blob("runs/tiny/.tpu-llm-lock").download_as_bytes())
    assert holder["pid"] == os.getpid() and holder["host"] == run_lock.HOST and holder["lease_seconds"] == 1.5
    time.sleep(2.5)  # longer than the lease: the heartbeat renewed it
    with pytest.raises(UserError) as refused:
        run_lock.GcsLock(url, lease_seconds=1.5).acquire()
    message = str(refused.value)
    assert message.startswith(f"run_dir {url!r} is in use by another tpu-llm process (host {run_lock.HOST}, pid "
                              f"{os.getpid()}, since {holder['since']}; its lease was renewed ") and "\n" not in message
    assert message.endswith("s ago); wait for it to finish or stop it, or use another --run_dir (a holder that "
                            "died without releasing it loses the lock when its lease of 1.5 s runs out)"), message
    with pytest.raises(UserError, match="is in use by another tpu-llm process"):
        run_lock.check_unlocked(url)
    first.check()

    first.stop_heartbeat()  # as if killed: the lock stays, its lease runs out
    time.sleep(2)
    second = run_lock.GcsLock(url, lease_seconds=1.5)
    second.acquire()
    assert second.note.startswith(f"took over the lock of {url} from host {run_lock.HOST}, pid {os.getpid()}, since "
                                  f"{holder['since']}: its lease of 1.5 s ran out "), second.note
    with pytest.raises(UserError, match=f"lost the lock on run_dir {url!r}"):
        first.check()  # the old holder, were it alive, stops writing
    first.release()  # deletes nothing of the new holder's
    assert gcs.storage_client().bucket(bucket).get_blob("runs/tiny/.tpu-llm-lock") is not None
    second.release()
    assert gcs.storage_client().bucket(bucket).get_blob("runs/tiny/.tpu-llm-lock") is None
    run_lock.check_unlocked(url)
