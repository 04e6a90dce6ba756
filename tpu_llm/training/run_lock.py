"""One writer per run directory: a lock held for the whole life of a `tpu-llm train` (its chief).

Two trainers on one run_dir both ran to the end: with the same config every step was logged twice,
with another learning rate the first run's checkpoints were silently replaced by the second's. The
lock refuses the second one in one line naming the holder (host, pid, since when) and the fix.
`generate` and `export` only read, and take no lock.

Local disk: `fcntl.flock` on `<run_dir>/.tpu-llm-lock`. The kernel releases it when the holder's
process ends, however it ends (SIGKILL, OOM killer, power loss), so a killed run never leaves a
stale lock. The file holds the holder's host, pid and start time while it is held (empty once
released); it is never deleted, since a process may be waiting on the inode it names.

gs://: the object `<run_dir>/.tpu-llm-lock`, created only if it does not exist (a generation
precondition, ifGenerationMatch=0: of two creators exactly one succeeds), holding the holder's host,
pid, start time and lease. A heartbeat thread rewrites it every lease/4 seconds, each time only if it
is still the holder's own generation. The lease (LEASE_SECONDS) is what a holder that died without
releasing it (a preempted VM, SIGKILL) leaves behind: once the object has not been renewed for a
whole lease (the object's `updated` time, set by Cloud Storage, against this machine's clock), the
next start takes it over, conditionally on that stale generation, and says so. A holder whose renewal
failed (taken over, or no renewal for a whole lease) refuses its next save or log line (`check`).

Within one process the lock is counted: a notebook or a test may build a run directory's run, then
train it (`acquire` returns a handle; the lock goes with the last handle released).
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
import threading
import time

from tpu_llm.cloud import gcs
from tpu_llm.errors import UserError
from tpu_llm.platform import files
from tpu_llm.platform.run_layout import LOCK_FILE

LEASE_SECONDS = 120.0  # gs://: how long a lock outlives a holder that stopped renewing it
HOST = socket.gethostname()
FIX = "wait for it to finish or stop it, or use another --run_dir"


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _holder_text(holder: dict) -> str:
    return f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, since {holder.get('since', '?')}"


class LocalLock:
    """flock on `<run_dir>/.tpu-llm-lock` (see the module docstring). Each instance opens the file anew,
    so two instances conflict even in one process (flock belongs to the open file)."""

    def __init__(self, run_dir: str):
        self.run_dir, self.path = run_dir, os.path.join(run_dir, LOCK_FILE)
        self.fd: int | None = None
        self.note = ""

    def acquire(self) -> None:
        try:
            self._acquire()
        except (UserError, BlockingIOError):
            raise
        except OSError as e:  # a read-only or full disk: one line, as check_run_dir_usable says it
            raise UserError(f"run_dir {self.run_dir!r} is not writable ({e.strerror or e}: its lock file "
                            f"{LOCK_FILE}); fix its permissions or free space, or choose another --run_dir") from None

    def _acquire(self) -> None:
        os.makedirs(self.run_dir, exist_ok=True)
        # O_NOFOLLOW: a link planted at the lock's name is refused, not written through
        fd = _open_lock_file(self.path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise _in_use(self.run_dir, holder) from None
        except OSError:
            os.close(fd)
            raise
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps({"host": HOST, "pid": os.getpid(), "since": _now()}) + "\n").encode(), 0)
        except OSError:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            raise
        self.fd = fd

    def check(self) -> None:
        """Nothing can take a held flock away."""

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            os.ftruncate(self.fd, 0)  # nobody holds it: it names nobody
        except OSError:
            pass
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = None

    @staticmethod
    def check_unlocked(run_dir: str) -> None:
        """Refuse if another process holds the lock; writes nothing (the file is not created)."""
        path = os.path.join(run_dir, LOCK_FILE)
        try:
            fd = _open_lock_file(path, os.O_RDONLY)
        except FileNotFoundError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _in_use(run_dir, _read_holder(fd)) from None
        finally:
            os.close(fd)


def _open_lock_file(path: str, flags: int) -> int:
    """The lock file, a regular file of this run directory only: a link, a FIFO (which would block the
    open) or a file hard-linked elsewhere (the holder's line would be written into it) is refused."""
    return files.open_regular(path, "the run's lock file", flags, single_link=True,
                              fix="remove it (tpu-llm makes a new one; no tpu-llm process may be using this run_dir)")


def _read_holder(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        return {}  # written by the holder right after it locked: not yet, or torn


def _in_use(run_dir: str, holder: dict) -> UserError:
    return UserError(f"run_dir {run_dir!r} is in use by another tpu-llm process ({_holder_text(holder)}); {FIX}")


def _in_use_leased(url: str, holder: dict, age: float, lease: float) -> UserError:
    return UserError(f"run_dir {url!r} is in use by another tpu-llm process ({_holder_text(holder)}; its lease was "
                     f"renewed {age:.0f} s ago); {FIX} (a holder that died without releasing it loses the lock when "
                     f"its lease of {lease:g} s runs out)")


class GcsLock:
    """The lock object on gs:// (see the module docstring), in google-cloud-storage calls: its
    generation preconditions are what makes it exclusive (tf.io.gfile has none)."""

    def __init__(self, url: str, lease_seconds: float = LEASE_SECONDS, client=None):
        self.url = url.rstrip("/")
        self.bucket_name, prefix = gcs.parse_gs_url(self.url)
        self.name = f"{prefix}/{LOCK_FILE}".lstrip("/")
        self.lease = float(lease_seconds)
        self.client = client
        self.generation: int | None = None
        self.holder: dict = {}
        self.note = ""  # said once acquired: a stale lock taken over
        self.lost = ""  # why this process no longer holds it
        self.renewed = 0.0  # time.monotonic() of the last renewal
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _bucket(self):
        self.client = self.client or gcs.storage_client()
        return self.client.bucket(self.bucket_name)

    def _errors(self, what: str):
        return gcs.CloudErrors(f"{what} the lock {self.url}/{LOCK_FILE}", self.url)

    def acquire(self) -> None:
        from google.api_core.exceptions import PreconditionFailed

        self.holder = {"host": HOST, "pid": os.getpid(), "since": _now(), "lease_seconds": self.lease}
        with self._errors("taking"):
            for _ in range(5):  # each try loses only to another process that changed the object meanwhile
                current = self._bucket().get_blob(self.name)
                if current is not None:
                    theirs = _parse(current.download_as_bytes(if_generation_match=current.generation))
                    age = time.time() - current.updated.timestamp()
                    lease = float(theirs.get("lease_seconds", self.lease))
                    if age <= lease:
                        raise _in_use_leased(self.url, theirs, age, lease)
                try:
                    blob = self._write(current.generation if current is not None else 0)
                except PreconditionFailed:
                    continue  # created, renewed or taken by another process since it was read: look again
                if current is not None:
                    self.note = (f"took over the lock of {self.url} from {_holder_text(theirs)}: its lease of "
                                 f"{lease:g} s ran out {age - lease:.0f} s ago (a run stopped without releasing it, "
                                 "such as a preempted VM)")
                self.generation, self.renewed = blob.generation, time.monotonic()
                break
            else:
                raise UserError(f"run_dir {self.url!r}: the lock {self.name} kept changing while it was being taken; "
                                "another process is starting on it; " + FIX)
        self._thread = threading.Thread(target=self._heartbeat, name="run-lock-heartbeat", daemon=True)
        self._thread.start()

    def _write(self, generation: int):
        blob = self._bucket().blob(self.name)
        blob.upload_from_string(json.dumps({**self.holder, "renewed": _now()}) + "\n",
                                content_type="application/json", if_generation_match=generation)
        return blob

    def _heartbeat(self) -> None:
        from google.api_core.exceptions import PreconditionFailed

        while not self._stop.wait(self.lease / 4):
            try:
                self.generation = self._write(self.generation).generation
                self.renewed = time.monotonic()
            except PreconditionFailed:
                theirs = self._read_current()
                self.lost = f"it was taken over by {_holder_text(theirs)}" if theirs else "it was deleted"
                return
            except Exception as e:  # noqa: BLE001 - the network: retried on the next beat, until the lease is gone
                if time.monotonic() - self.renewed > self.lease:
                    self.lost = (f"it could not be renewed for longer than its lease of {self.lease:g} s "
                                 f"({type(e).__name__}), so another process may have taken it")
                    return

    def _read_current(self) -> dict:
        try:
            blob = self._bucket().get_blob(self.name)
            return _parse(blob.download_as_bytes()) if blob is not None else {}
        except Exception:  # noqa: BLE001 - only to name the new holder
            return {"host": "?"}

    def check(self) -> None:
        """Refuse to write once the lock is lost (taken over, or not renewed for a whole lease)."""
        if not self.lost and self.generation is not None and time.monotonic() - self.renewed > self.lease:
            self.lost = f"it was not renewed for longer than its lease of {self.lease:g} s"
        if self.lost:
            raise UserError(f"this run lost the lock on run_dir {self.url!r}: {self.lost}; it stops without writing "
                            "more (earlier checkpoints are intact); make sure only one run uses the directory, then "
                            "run the same command to resume")

    def stop_heartbeat(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def release(self) -> None:
        """Delete the lock object if it is still this process's generation (never a new holder's)."""
        self.stop_heartbeat()
        if self.generation is None:
            return
        try:
            self._bucket().blob(self.name).delete(if_generation_match=self.generation)
        except Exception:  # noqa: BLE001 - taken over, gone, or the network: its lease runs out in any case
            pass
        self.generation = None

    @staticmethod
    def check_unlocked(url: str, lease_seconds: float = LEASE_SECONDS) -> None:
        """Refuse if a live holder's lock is there; writes nothing."""
        lock = GcsLock(url, lease_seconds)
        with lock._errors("reading"):
            current = lock._bucket().get_blob(lock.name)
            if current is None:
                return
            theirs = _parse(current.download_as_bytes())
            age = time.time() - current.updated.timestamp()
            lease = float(theirs.get("lease_seconds", lease_seconds))
        if age <= lease:
            raise _in_use_leased(lock.url, theirs, age, lease)


def _parse(data: bytes) -> dict:
    try:
        value = json.loads(data.decode() or "{}")
        return value if isinstance(value, dict) else {}
    except (UnicodeDecodeError, ValueError):
        return {}


# ---- one lock per process and run directory --------------------------------------------------------------

_held: dict[str, list] = {}  # key -> [lock, handles]
_guard = threading.Lock()


def _key(run_dir: str) -> str:
    return run_dir.rstrip("/") if "://" in run_dir else os.path.realpath(run_dir)


class Handle:
    """This process's share of a run directory's lock (`acquire`)."""

    def __init__(self, key: str, lock):
        self.key, self.lock, self.released = key, lock, False

    @property
    def note(self) -> str:
        return self.lock.note

    def check(self) -> None:
        self.lock.check()

    def release(self, created: list[str] = ()) -> None:
        """Let go of this share; the last one releases the lock. `created` (`missing_directories`, read
        before `acquire`): a refused command undoes the new run directory the lock made, when nothing but
        the lock file is in it (`_remove_new`)."""
        with _guard:
            if self.released:
                return
            self.released = True
            entry = _held.get(self.key)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] == 0:
                del _held[self.key]
                entry[0].release()
                if created and isinstance(entry[0], LocalLock):
                    _remove_new(entry[0].run_dir, created)


def missing_directories(run_dir: str) -> list[str]:
    """The directories taking `run_dir`'s lock will create (it and its missing parents), deepest first;
    none on gs://, where a prefix is no directory."""
    if "://" in run_dir:
        return []
    missing, path = [], os.path.abspath(run_dir)
    while not os.path.lexists(path) and path != os.path.dirname(path):
        missing.append(path)
        path = os.path.dirname(path)
    return missing


def _remove_new(run_dir: str, created: list[str]) -> None:
    """A refused command creates nothing: remove the lock file and the directories `created` by taking the
    lock, if nothing else was written into them. (Deleting a lock file is safe here, unlike in general:
    the directory is seconds old and was never a run, so no other process has waited on it.)"""
    try:
        if os.listdir(run_dir) == [LOCK_FILE]:
            os.remove(os.path.join(run_dir, LOCK_FILE))
        for directory in created:
            os.rmdir(directory)  # an empty one only: anything written there since stays
    except OSError:
        pass


def acquire(run_dir: str) -> Handle:
    """Take (or share, within this process) the writer's lock of `run_dir`; a UserError naming the holder
    if another process has it."""
    key = _key(run_dir)
    with _guard:
        entry = _held.get(key)
        if entry is None:
            lock = GcsLock(run_dir) if run_dir.startswith("gs://") else LocalLock(run_dir)
            lock.acquire()
            entry = _held[key] = [lock, 0]
        entry[1] += 1
        return Handle(key, entry[0])


def check_unlocked(run_dir: str) -> None:
    """Refuse early, before anything is read or written, if another process holds `run_dir`'s lock; this
    process's own lock is no obstacle. Writes nothing."""
    if _key(run_dir) in _held:
        return
    if run_dir.startswith("gs://"):
        GcsLock.check_unlocked(run_dir)
    elif "://" not in run_dir:
        LocalLock.check_unlocked(run_dir)
