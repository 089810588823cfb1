"""The test jobs' launchers, forked from one process per pytest worker that has imported them already.

Each ``python -m titan_recover.launch`` a test starts paid about 6 CPU-seconds importing torch and TorchTitan
before doing anything (a quarter of a two-group job's CPU). Here a server process imports the launcher's
modules once; each launcher is a ``fork`` of it that takes the test's argv, environment, working directory,
output files and session, then runs ``titan_recover.launch``'s ``__main__`` as ``python -m`` does. What the
launcher starts (the coordinator, torchrun, the ranks) starts as it does for users: fresh interpreters.

The server is single-threaded (a fork copies only the forking thread; no lock can be held by another) and
has run no torch op (no thread pool to inherit). It tells each client its launcher's pid, then its exit
status; it exits when its pytest worker does. ``TITAN_RECOVER_TEST_FORK=0`` starts every launcher as a
plain subprocess instead (to measure what the server saves, or to rule it out).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import os
import runpy
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ["-m", "titan_recover.launch"]
ENV = "TITAN_RECOVER_TEST_FORK"
START_S = 300.0  # the server's imports, on a loaded 2-core machine
# what a launcher imports before it starts anything: its own modules, the data's checks, and the installed
# TorchTitan line's module (``titan`` imports it on first use)
PRELOAD = ("titan_recover.launch.launcher", "titan_recover.data.addressing")


class Forked:
    """A launcher forked by the server: the part of ``subprocess.Popen`` the tests use (its pid, ``poll``,
    ``wait``, ``send_signal``, ``returncode``: negative for a signal, as ``Popen``'s)."""

    def __init__(self, conn: socket.socket, args: Sequence[str]) -> None:
        self.args = list(args)
        self._conn = conn
        self._buffer = b""
        self.pid = int(self._message(None)["pid"])
        self.returncode: int | None = None

    def _message(self, timeout: float | None) -> dict:
        """The server's next line; TimeoutError when none came within ``timeout`` (0: do not wait)."""
        self._conn.settimeout(timeout)
        while b"\n" not in self._buffer:
            try:
                chunk = self._conn.recv(4096)
            except (BlockingIOError, socket.timeout):
                raise TimeoutError from None
            if not chunk:
                raise RuntimeError(f"the launcher server closed the connection of pid {getattr(self, 'pid', '?')}")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self.returncode = int(self._message(0)["exit"])
            except TimeoutError:
                return None
            self._conn.close()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            try:
                self.returncode = int(self._message(timeout)["exit"])
            except TimeoutError:
                raise subprocess.TimeoutExpired(self.args, timeout or 0) from None
            self._conn.close()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Server:
    """This pytest worker's server: started on first use, ended with the worker."""

    def __init__(self) -> None:
        self.folder = tempfile.mkdtemp(prefix="launcher-server-")
        self.path = os.path.join(self.folder, "socket")
        self.proc = subprocess.Popen(
            [sys.executable, __file__, self.path], cwd=ROOT, stdout=subprocess.PIPE, text=True, start_new_session=True
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()  # bounded: the server exits (EOF) if its imports fail
        if line != "ready":
            self.proc.kill()
            raise RuntimeError(f"the launcher server did not start (it said {line!r}; exit {self.proc.wait()})")
        atexit.register(self.close)

    def start(self, request: dict, args: Sequence[str]) -> Forked:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.path)
        conn.sendall(json.dumps(request).encode() + b"\n")
        return Forked(conn, args)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for name in os.listdir(self.folder):
            os.unlink(os.path.join(self.folder, name))
        os.rmdir(self.folder)


_server: _Server | None = None


def forks(args: Sequence[str]) -> bool:
    """Whether ``args`` is a launcher this module starts (``python -m titan_recover.launch ...``)."""
    return list(args[:3]) == [sys.executable, *LAUNCH] and os.environ.get(ENV, "1") != "0"


def start(
    args: Sequence[str],
    env: Mapping[str, str],
    stdout: Path,
    stderr: Path | None = None,
    new_session: bool = False,
) -> Forked | subprocess.Popen:
    """``args`` started with ``env`` in the repo root, its output to ``stdout`` (and ``stderr``, default the
    same file): forked from the server where it is a launcher, else a plain subprocess."""
    global _server
    if not forks(args):
        with stdout.open("w") as out, stderr.open("w") if stderr else contextlib.nullcontext() as err:
            return subprocess.Popen(
                args,
                cwd=ROOT,
                env=dict(env),
                stdout=out,
                stderr=err or subprocess.STDOUT,  # one file: one descriptor, not two offsets writing over each other
                start_new_session=new_session,
            )
    if _server is None:
        _server = _Server()
    for path in {stdout, stderr or stdout}:
        path.write_text("")
    request = {
        "argv": list(args[3:]),
        "env": dict(env),
        "cwd": str(ROOT),
        "stdout": str(stdout),
        "stderr": str(stderr or stdout),
        "new_session": new_session,
    }
    return _server.start(request, args)


def _child(request: dict) -> None:
    """In the forked launcher: the test's process setup, then ``python -m titan_recover.launch ARGV``."""
    code = 1
    try:
        if request["new_session"]:
            os.setsid()
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
        out = os.open(request["stdout"], flags)
        err = out if request["stderr"] == request["stdout"] else os.open(request["stderr"], flags)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(out, 1)
        os.dup2(err, 2)
        unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(line_buffering=True, write_through=unbuffered)  # type: ignore[union-attr]
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        sys.argv = [LAUNCH[1], *request["argv"]]
        gc.unfreeze()
        runpy.run_module(LAUNCH[1], run_name="__main__", alter_sys=True)  # ends in os._exit(its code)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _send(conn: socket.socket, message: dict) -> None:
    try:
        conn.sendall(json.dumps(message).encode() + b"\n")
    except OSError:  # the test gave up on it (its worker ended): nothing to tell
        pass


def serve(path: str) -> None:
    """Imports the launcher's modules, then forks a launcher per request until its pytest worker is gone."""
    import importlib

    from titan_recover import titan

    for name in (*PRELOAD, f"titan_recover.titan.{titan.LINES[titan.installed_line()]}"):
        importlib.import_module(name)
    gc.collect()
    gc.freeze()  # what the imports made stays shared with every fork, not copied by its collector
    parent = os.getppid()
    listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listening.bind(path)
    listening.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(listening, selectors.EVENT_READ)
    print("ready", flush=True)
    waiting: dict[int, socket.socket] = {}  # launcher pid -> its client's connection
    while os.getppid() == parent:
        if selector.select(timeout=0.1):
            conn, _ = listening.accept()
            conn.settimeout(30)
            request = json.loads(conn.makefile("rb").readline())
            pid = os.fork()
            if pid == 0:
                for held in (listening, conn, *waiting.values()):  # the others' connections are the server's
                    held.close()
                selector.close()
                _child(request)
            _send(conn, {"pid": pid})
            waiting[pid] = conn
        while waiting:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = waiting.pop(pid)
            _send(conn, {"exit": os.waitstatus_to_exitcode(status)})
            conn.close()
    for pid in waiting:  # the worker is gone: its launchers' tests with it
        os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
    serve(sys.argv[1])
