"""The launcher's and the data command line's refusals, run in the test's own process.

A refusal is exit 2 (``EXIT_BAD_INPUT``) and one ``error: ...`` line on stderr, before anything starts. As a
subprocess, each one paid 7-15 CPU-seconds importing torch and TorchTitan to print that line; here
``launcher.main(argv)`` (or ``data.cli.main(argv)``) runs in the pytest worker, with the environment
variables set through ``pytest.MonkeyPatch``, the subprocess's working directory (the repo root),
``subprocess.Popen`` raising (a refusal provably starts no process), stdout and stderr read with ``capfd``,
and the global state it may change (``os.environ``, logging, signal handlers) put back. It returns a
``subprocess.CompletedProcess``, as ``subprocess.run`` did.

Only for refusals that return before any process starts: one raised after a process started (inside
``run_recover``) stays a subprocess test, as do a few smoke tests of the entry points themselves
(``launch_process``, ``conftest.run_data_cli``).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from titan_recover.titan.jobs import job

ROOT = Path(__file__).resolve().parents[1]
DUMP = ROOT / "outputs" / "llama3_debug_cpu"  # the shipped job's own
STARTED = "the launcher started a process before refusing"


def _no_process(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError(STARTED)


def _logging_state() -> dict[logging.Logger, tuple[list[logging.Handler], int, bool, bool]]:
    loggers = [
        logging.getLogger(),
        *(x for x in logging.Logger.manager.loggerDict.values() if isinstance(x, logging.Logger)),
    ]
    return {x: (list(x.handlers), x.level, x.propagate, x.disabled) for x in loggers}


@contextmanager
def restored() -> Iterator[None]:
    """Puts back what a ``main`` (or a test of logging) may change for later tests in this worker:
    ``os.environ``, the loggers that existed before (handlers, level, propagation), ``logging.disable``
    and the signal handlers."""
    environ = dict(os.environ)
    loggers, disabled = _logging_state(), logging.root.manager.disable
    handlers = {s: signal.getsignal(s) for s in signal.valid_signals()}
    try:
        yield
    finally:
        for key in set(os.environ) - set(environ):
            del os.environ[key]
        os.environ.update(environ)
        for logger, (kept, level, propagate, off) in loggers.items():
            logger.handlers[:] = kept
            logger.setLevel(level)
            logger.propagate, logger.disabled = propagate, off
        logging.disable(disabled)
        for s, handler in handlers.items():
            if handler is not None and signal.getsignal(s) != handler:
                signal.signal(s, handler)


def run_main(
    main: Callable[[list[str]], int],
    argv: Sequence[str],
    capfd: pytest.CaptureFixture[str],
    env: Mapping[str, str | None] | None = None,
) -> subprocess.CompletedProcess[str]:
    """``main(argv)`` as its ``python -m`` process would run it, in this process: ``env`` on top of this
    process's environment (None: unset), and a SystemExit (argparse's refusal) read as the exit code."""
    capfd.readouterr()  # what this test printed before belongs to nobody's stderr here
    with restored(), pytest.MonkeyPatch.context() as mp:
        mp.chdir(ROOT)
        for key, value in (env or {}).items():
            if value is None:
                mp.delenv(key, raising=False)
            else:
                mp.setenv(key, value)
        mp.setattr(subprocess, "Popen", _no_process)
        try:
            code = main(list(argv))
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        sys.stdout.flush()
        sys.stderr.flush()
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(list(argv), code, out, err)


def launch_argv(
    argv: Sequence[str], capfd: pytest.CaptureFixture[str], env: Mapping[str, str | None] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m titan_recover.launch ARGV``, in this process: a refusal must return before any process starts."""
    from titan_recover.launch.launcher import main

    return run_main(main, argv, capfd, env)


def launch(
    capfd: pytest.CaptureFixture[str], *overrides: str, env: Mapping[str, str | None] | None = None
) -> subprocess.CompletedProcess[str]:
    """The shipped config with ``overrides`` as a user launches it (``launch_argv``)."""
    return launch_argv([*job(DUMP), *overrides], capfd, env)


def launch_process(*overrides: str, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m titan_recover.launch`` with the shipped config in a real process, as a user runs it: the entry
    point's own behaviour (exit code, one error line, no traceback). It must refuse in seconds."""
    return subprocess.run(
        [sys.executable, "-m", "titan_recover.launch", *job(DUMP), *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )


def data_cli(capfd: pytest.CaptureFixture[str], *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m titan_recover.data ARGS``, in this process (``conftest.run_data_cli`` runs it in a real one)."""
    from titan_recover.data.cli import main

    return run_main(main, args, capfd)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]
