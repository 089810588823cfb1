"""The launcher's identification of a fenced incarnation's ranks (real processes)."""

import os
import subprocess
import sys

from titan_recover import store
from titan_recover.launch import is_incarnation


def test_is_incarnation_reads_the_rank_environment() -> None:
    env = {**os.environ, store.REPLICA_ENV: "3", store.ATTEMPT_ENV: "1"}
    code = "import time; print('up', flush=True); time.sleep(30)"
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "up\n"  # past exec: /proc/<pid>/environ is its own
        assert is_incarnation(proc.pid, replica=3, attempt=1)
        assert not is_incarnation(proc.pid, replica=3, attempt=0)  # an older incarnation's pid record
        assert not is_incarnation(proc.pid, replica=1, attempt=1)
        assert not is_incarnation(os.getpid(), replica=3, attempt=1)  # not a rank at all
    finally:
        proc.kill()
        proc.wait()
    assert not is_incarnation(proc.pid, replica=3, attempt=1)  # gone
