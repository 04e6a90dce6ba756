"""Child processes that end with the process that started them.

`tpu-llm launch` starts one process per task of its cluster, `tpu-llm bench` a training run per case,
`bench memory` a compile. When the parent dies by SIGKILL (`kill -9`, the OOM killer, a closed
notebook), nothing runs in it to stop them: a parameter-server worker or ps task serves forever
under PID 1, holding its memory, and never prints (so no broken pipe ends it). `Popen` and `run`
here start a child that gets one SIGTERM when its parent is gone; a tpu-llm task then stops at the
next step boundary and saves a checkpoint, as on any SIGTERM (tpu_llm/training/fault.py).

Linux: the kernel sends the signal (prctl PR_SET_PDEATHSIG). A small Python prelude sets it and then
execs the command, so the child keeps its pid and needs nothing of its own. A prelude rather than
`preexec_fn`, which is not safe once the parent has threads (the launcher's output readers): code
between fork and exec can deadlock on a lock some other thread held. The parent may die before the
prelude runs; then the signal would never come, so the prelude checks that its parent is still the
one that started it, and exits if not.

The kernel sends the signal each time the child is handed to a new parent: when a multi-threaded
parent is killed, first to another of its threads, then to PID 1, so two or three signals can come
within milliseconds, and a second SIGTERM means "stop now, without saving" to a tpu-llm run. So a
tpu-llm child (the CLI calls `as_child` first thing) turns them into one: it asks for SIGUSR2
instead, blocked in every thread and taken by one that sends the process a single SIGTERM, and
checks its parent again. Any other program keeps SIGTERM. The kernel's "parent" is the thread that
started the child: start children from a thread that lives as long as they do (the main thread, as
every caller here does).

Elsewhere (macOS, BSD): the child inherits the read end of a pipe whose write end only the parent
holds; the kernel closes it when the parent dies, however it dies. A tpu-llm child watches it from
a thread and sends itself SIGTERM at end of file. A child that is not tpu-llm (a program other than
`python -m tpu_llm`) is not watched there.

A child's output usually goes to its parent through a pipe, which breaks with the parent: the next
line printed would raise BrokenPipeError and end the run before the checkpoint its SIGTERM asked
for. So `outlive_reader` (the CLI calls it in a tethered child) sends stdout and stderr to /dev/null
from the first write that finds no reader.

Standard library only: the CLI calls this before TensorFlow loads.
"""

from __future__ import annotations

import errno
import os
import signal
import stat
import subprocess
import sys
import threading

ENV = "TPU_LLM_TETHER"  # in a child: "pdeathsig:PARENT_PID" or "pipe:FD" (the fd to watch); `as_child` removes it
MODE = "pdeathsig" if sys.platform.startswith("linux") else "pipe"  # tests set "pipe" to try the other way
PR_SET_PDEATHSIG = 1
PARENT_GONE = signal.SIGUSR2 if hasattr(signal, "SIGUSR2") else None  # a tpu-llm child's own death signal

# Runs as `python -I -S -c _PRELUDE PARENT_PID COMMAND...`: asks for SIGTERM when the parent dies,
# makes sure the parent has not died already, then becomes COMMAND (same pid, same environment).
_PRELUDE = r"""
import ctypes, os, signal, sys
if ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0):  # 1: PR_SET_PDEATHSIG
    sys.exit("tether: prctl(PR_SET_PDEATHSIG) failed: " + os.strerror(ctypes.get_errno()))
if os.getppid() != int(sys.argv[1]):  # the parent died before prctl took effect: no signal would come
    os._exit(128 + int(signal.SIGTERM))
os.environ["TPU_LLM_TETHER"] = "pdeathsig:" + sys.argv[1]
signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGUSR2])  # a tpu-llm parent blocks it: not for its children
try:
    os.execvp(sys.argv[2], sys.argv[2:])
except OSError as e:
    sys.exit(f"tether: cannot run {sys.argv[2]}: {e.strerror}")
"""

_pipe: tuple[int, int] | None = None  # pipe mode: (read, write); the write end lives as long as this process
_pipe_lock = threading.Lock()


def _parent_pipe() -> int:
    """The read end that pipe-mode children inherit (one pipe for every child of this process)."""
    global _pipe
    with _pipe_lock:
        if _pipe is None:
            _pipe = os.pipe()  # both ends non-inheritable (PEP 446): only pass_fds hands the read end on
        return _pipe[0]


def tie(args, kwargs: dict, enter=()) -> tuple[list[str], dict]:
    """(args, kwargs) for subprocess.Popen or run, rewritten so that the child ends with this process.
    `enter`: a command prefix that execs the rest in another namespace (`nsenter ...`); the prelude
    runs after it, as near the command as it can be (a change of credentials clears the setting)."""
    args = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
    if kwargs.get("shell"):
        raise ValueError("tether: give the command as a list, not through a shell")
    env = dict(os.environ if kwargs.get("env") is None else kwargs["env"])
    env.pop(ENV, None)  # ours is set below (pipe) or by the prelude, once it took effect
    if MODE == "pdeathsig":
        args = [*enter, sys.executable, "-I", "-S", "-c", _PRELUDE, str(os.getpid()), *map(os.fspath, args)]
    else:
        fd = _parent_pipe()
        env[ENV] = f"pipe:{fd}"
        kwargs["pass_fds"] = (*kwargs.get("pass_fds", ()), fd)
        args = [*enter, *args]
    kwargs["env"] = env
    return args, kwargs


def Popen(args, enter=(), **kwargs) -> subprocess.Popen:  # noqa: N802 - as subprocess.Popen
    """subprocess.Popen, for a child that gets SIGTERM when this process dies (`enter`: see `tie`)."""
    args, kwargs = tie(args, kwargs, enter)
    return subprocess.Popen(args, **kwargs)


def run(args, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run, for a child that gets SIGTERM when this process dies."""
    args, kwargs = tie(args, kwargs)
    return subprocess.run(args, **kwargs)


# ---- in the child -----------------------------------------------------------------------------------


def as_child() -> bool:
    """In a tpu-llm process started by `Popen` or `run`: one SIGTERM when the parent is gone (see the
    module's docstring). Call it before the process starts any thread: the blocked SIGUSR2 must be
    blocked in all of them. False (and nothing done) in any other process."""
    how = os.environ.pop(ENV, "")  # not for this process's own children: they are tied to it, or not at all
    kind, _, value = how.partition(":")
    if kind == "pdeathsig" and value.isdigit() and PARENT_GONE is not None:
        signal.pthread_sigmask(signal.SIG_BLOCK, [PARENT_GONE])  # every thread started from now on inherits it
        threading.Thread(target=_on_parent_gone, name="tether", daemon=True).start()
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(PARENT_GONE), 0, 0, 0) == 0 and os.getppid() != int(value):
            os.kill(os.getpid(), PARENT_GONE)  # the parent died while this process started up
        return True
    if kind == "pipe":
        fd = int(value) if value.isdigit() else -1
        try:  # an inherited fd is a pipe; anything else (a number reused) is not ours to read
            if not stat.S_ISFIFO(os.fstat(fd).st_mode):
                return True
        except OSError:
            return True
        threading.Thread(target=_watch_pipe, args=(fd,), name="tether", daemon=True).start()
        return True
    return False


def _on_parent_gone() -> None:
    signal.sigwait([PARENT_GONE])  # later ones stay pending, blocked: only this one counts
    os.kill(os.getpid(), signal.SIGTERM)  # as any SIGTERM: stop at a step boundary and save


def _watch_pipe(fd: int) -> None:
    try:
        while os.read(fd, 1024):  # nobody writes: this returns only at end of file, when the parent is gone
            pass
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGTERM)


def outlive_reader() -> None:
    """From the first write that finds no reader, stdout and stderr go to /dev/null (`OutlivesReader`)."""
    sys.stdout, sys.stderr = OutlivesReader(sys.stdout), OutlivesReader(sys.stderr)


class OutlivesReader:
    """A text stream that, from the first write whose reader is gone (EPIPE), sends its file
    descriptor to /dev/null instead of raising: the process finishes what it is doing (a save)
    unheard, rather than dying mid-save of a BrokenPipeError, or exiting 120 when Python's last flush
    fails."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._to_devnull()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._to_devnull()

    def _to_devnull(self) -> None:
        try:
            fd = self._stream.fileno()
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, fd)
            os.close(null)
            self._stream.flush()  # what was buffered goes to /dev/null now
        except (OSError, ValueError) as e:  # no fd of its own (a test's capture), or gone: just swallow
            if getattr(e, "errno", None) not in (None, errno.EPIPE, errno.EBADF):
                raise

    def __getattr__(self, name):
        return getattr(self._stream, name)
