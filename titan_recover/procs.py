"""Process plumbing every process kind shares: parent-death signals, stack dumps, the lost-coordinator exit."""

import ctypes
import faulthandler
import os
import signal
import subprocess
import sys

PR_SET_PDEATHSIG = 1
LIBC = ctypes.CDLL(None, use_errno=True)  # loaded here: a forked child must not dlopen (threads may hold its lock)
EXIT_COORDINATOR_LOST = 3
EXITING_S = 10.0  # a coordinator whose port closed is exiting (its interpreter's teardown): how long its exit code may take


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


def dumps_stacks() -> None:
    """``kill -USR1 <pid>`` prints every thread's stack to this process's stderr: what a
    process that looks hung is doing, without stopping it (launcher, coordinator, ranks)."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)


def exit_lost(who: str, reason: str, hint: str) -> None:
    """Ends this process at once with one line on stderr, unprefixed like every error a command
    ends with (``error: ...``): the run cannot go on without its coordinator."""
    print(f"error: {who}: lost the titan_recover coordinator: {reason}. {hint}", file=sys.stderr, flush=True)
    os._exit(EXIT_COORDINATOR_LOST)
