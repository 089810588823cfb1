"""Process plumbing every process kind shares: parent-death signals, stack dumps, the lost-coordinator exit,
a rank's leaving, the sockets a blocked C++ call waits on, and settings a C++ constructor reads from the
environment."""

import ctypes
import faulthandler
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import traceback
from contextlib import contextmanager
from typing import Callable, Iterator, Mapping, NoReturn

from titan_recover.control.keys import EXIT_COORDINATOR_LOST

PR_SET_PDEATHSIG = 1
LIBC = ctypes.CDLL(None, use_errno=True)  # loaded here: a forked child must not dlopen (threads may hold its lock)
# a coordinator whose port closed is exiting (its interpreter's teardown): how long its exit code may take
EXITING_S = 10.0


def die_with_parent() -> None:
    """Asks the kernel to SIGKILL this process when its parent dies: a SIGKILLed
    launcher (or torchrun agent) then leaves no orphaned rank behind."""
    parent = os.getppid()
    LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent or parent == 1:  # the parent died before the request took effect (init adopted us)
        os.kill(os.getpid(), signal.SIGKILL)


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (another user's counts: it cannot be signalled, but lives)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command's name (its state first); None where ``/proc``
    cannot say (gone, or no ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def holds_memory(pid: int) -> bool:
    """Whether process ``pid`` still exists as more than a zombie (an exited process whose parent has not
    reaped it yet holds no memory, a GPU's included)."""
    fields = _stat(pid)
    if not fields:
        return pid_alive(pid)  # no /proc: as far as the kernel's signal check tells
    return fields[0] != "Z"


def cpu_ticks(pid: int) -> int | None:
    """The CPU time process ``pid`` has used, user and system, in clock ticks; None where ``/proc`` cannot
    say (gone, or no ``/proc``). A starting process's count moves (imports use CPU); a stopped or blocked one's
    stands still."""
    fields = _stat(pid)
    try:
        return None if fields is None else int(fields[11]) + int(fields[12])  # utime, stime: stat(5)'s 14th, 15th
    except (IndexError, ValueError):
        return None


def stop_within(proc: subprocess.Popen, timeout_s: float) -> bool:
    """Waits up to ``timeout_s`` for ``proc`` to exit, then SIGKILLs and reaps it: a frozen child
    must not hang its parent. Whether it exited on its own."""
    try:
        proc.wait(timeout=timeout_s)
        return True
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return False


def on_notice(notice: Callable[[], None]) -> None:
    """SIGTERM calls ``notice`` instead of ending this process: it is a scheduler's notice that the node
    goes away (Kubernetes sends it to a pod's first process, Slurm and systemd to every process of the
    node), and the process leaves in order within the notice (``recover.notice_budget_s``)."""
    signal.signal(signal.SIGTERM, lambda signum, frame: notice())


def dumps_stacks() -> None:
    """``kill -USR1 <pid>`` prints every thread's stack to this process's stderr: what a
    process that looks hung is doing, without stopping it (launcher, coordinator, ranks)."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)


def exit_lost(who: str, reason: str, hint: str) -> None:
    """Ends this process at once with one line on stderr, unprefixed like every error a command
    ends with (``error: ...``): the run cannot go on without its coordinator."""
    print(f"error: {who}: lost the titan_recover coordinator: {reason}. {hint}", file=sys.stderr, flush=True)
    os._exit(EXIT_COORDINATOR_LOST)


def sockets() -> set[tuple[int, str]]:
    """This process's open sockets, each as its descriptor and its inode (``socket:[123]``): a number
    another thread closed and the next socket took again is a new pair."""
    found = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed meanwhile (the listing's own descriptor, for one)
            continue
        if link.startswith("socket:"):
            found.add((int(name), link))
    return found


def shut_down(fd: int) -> None:
    """Shuts socket ``fd`` down both ways: a C++ call blocked reading it (a TCPStore client's wait)
    returns with an error at once. The caller owns the socket: it must still be open."""
    with socket.socket(fileno=os.dup(fd)) as s:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:  # not connected any more: nothing waits on it
            pass


ENVIRON_LOCK = threading.Lock()  # one ``environ`` at a time: threads build process groups concurrently


@contextmanager
def environ(settings: Mapping[str, str]) -> Iterator[None]:
    """``settings`` in the process environment while the block runs, the earlier values back after it:
    for C++ objects that read their settings from the environment in their constructor (torch's
    ProcessGroupNCCL), when one object needs other values than the process has. Blocks run one at a
    time, so two threads never see each other's settings."""
    with ENVIRON_LOCK:
        before = {name: os.environ.get(name) for name in settings}
        os.environ.update(settings)
        try:
            yield
        finally:
            for name, value in before.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def leave(main: Callable[[], None]) -> NoReturn:
    """Runs ``main``, then ends the process with its exit code (0, a SystemExit's, or 1 after the
    traceback) without the interpreter's teardown, once logs and output are flushed. A rank's
    teardown would destroy what may still wait on a finished or dead peer: a gloo group with a
    collective pending waits out its whole timeout in its destructor (gloo cannot cancel one), and a
    background thread whose C++ wait ends during teardown aborts the process (SIGABRT)."""
    code = 0
    try:
        main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:  # reported as the interpreter would, then leave
        traceback.print_exc()
        code = 1
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)
