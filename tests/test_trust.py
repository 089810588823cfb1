"""The control plane's trust model: no key, log line or error holds the run's secret, and a record
without the run's seal is refused and logged, never acted on (docs/trust-model.md)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from conftest import ROOT, SINGLES

from titan_recover.control import keys, transport
from titan_recover.control.client import ControlClient
from titan_recover.control.protocol import Fatal, Fence, NodeMessage
from titan_recover.control.sealed import ForgedRecord, Run
from titan_recover.titan.jobs import job

SECRET = "0123456789abcdef-trust-test-secret"


@pytest.mark.unit
def test_the_runs_name_in_the_store_hides_its_secret_and_differs_per_run_id() -> None:
    a, b = Run(SECRET, "job-1"), Run(SECRET, "job-2")
    assert SECRET not in a.prefix and SECRET not in repr(a) and "job-1" not in a.prefix
    assert a.prefix != b.prefix and a.prefix != Run("another-secret", "job-1").prefix
    assert a.prefix == Run(SECRET, "job-1").prefix  # every process of the run agrees on it


@pytest.mark.unit
def test_a_seal_binds_the_value_to_its_key_and_run() -> None:
    run = Run(SECRET, "job-1")
    sealed = run.seal("fatal", b'{"error": "x"}')
    assert run.unseal("fatal", sealed) == b'{"error": "x"}'
    assert run.seal("owner/1", "") == b"" and run.unseal("owner/1", b"") == b""  # a released claim
    for key, raw, who in [
        ("status", sealed, "the same bytes under another key"),
        ("fatal", sealed[:-1] + b"!", "a changed value"),
        ("fatal", b'{"error": "forged"}', "no seal at all"),
        ("fatal", b"x", "too short to hold one"),
    ]:
        with pytest.raises(ForgedRecord, match="not sealed with this run's secret"):
            run.unseal(key, raw)
    for other in (Run(SECRET, "job-2"), Run("another-secret", "job-1")):
        with pytest.raises(ForgedRecord):
            other.unseal("fatal", sealed)


def test_an_outsider_on_the_port_sees_no_secret_and_cannot_forge_a_record(caplog: pytest.LogCaptureFixture) -> None:
    """A client without the secret lists every key, then writes under the run's own key names."""
    port = transport.free_port()
    run = Run(SECRET, "job-1")
    server = transport.serve(port, 5, run=run)
    client = ControlClient(transport.connect(f"127.0.0.1:{port}", timeout_s=5, run=run))
    client.put(keys.fenced_key(1), Fence(attempt=0, epoch=1))
    outsider = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=2))
    listed = outsider.list_keys()
    assert listed and not any(SECRET in k for k in listed), listed
    fenced = next(k for k in listed if k.endswith(keys.fenced_key(1)))
    prefix = fenced[: -len(keys.fenced_key(1))]
    with caplog.at_level(logging.WARNING, logger="titan_recover.control"):
        outsider.set(prefix + keys.FATAL, Fatal("stopped by an outsider").dumps())
        outsider.set(prefix + keys.STATUS, "done")
        outsider.set(prefix + keys.launcher_key("x"), NodeMessage(1, {}).dumps())
        assert not client.stopped() and client.fatal() is None and not client.finished()
        assert client.store.multi_get([keys.launcher_key("x")]) == [b""]
        outsider.set(fenced, Fence(attempt=5, epoch=9).dumps())  # a replay of a real record's bytes would be sealed
        assert client.read_fence(1) is None
    assert "store key 'fatal' holds a value not sealed with this run's secret: refused" in caplog.text
    client.stop("a real stop")  # the run's own processes still can
    assert client.fatal() == "a real stop"
    with pytest.raises(dist.DistStoreError) as info:  # torch's own timeout text quotes the prefixed key
        client.store.get("never/written")
    assert SECRET not in str(info.value)
    del server


def test_a_forged_fatal_does_not_stop_a_real_run(tmp_path: Path) -> None:
    """The issue's reproduction: an outsider on the coordinator's port lists the keys and forges
    ``fatal`` (and ``status``) while the run trains. The run finishes every step, and neither its
    output nor any key holds the secret. Single-rank groups and no failure of its own: the forgery is
    the only fault."""
    port = transport.free_port()
    env = {**os.environ, keys.SECRET_ENV: SECRET, "PYTHONUNBUFFERED": "1"}
    cmd = [
        sys.executable,
        "-m",
        "titan_recover.launch",
        *job(tmp_path, tiny=True),
        *SINGLES,
        "--training.steps",
        "8",
        "--recover.fault_plan",
        "none",
        "--recover.coordinator_port",
        str(port),
    ]
    out = (tmp_path / "out.log").open("w+")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline, forged, listed = time.monotonic() + 240, False, []
        while not forged and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(1)
            try:
                outsider = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=2))
                listed = outsider.list_keys()
            except (dist.DistError, RuntimeError):
                continue
            steps = [k for k in listed if "/step/" in k]
            if steps:  # training has begun: forge the run's end under its own key names
                prefix = steps[0].split("/step/")[0]
                outsider.set(f"{prefix}/{keys.FATAL}", Fatal("stopped by an outsider").dumps())
                outsider.set(f"{prefix}/{keys.STATUS}", "done")
                forged = True
        assert forged, "the run never reached a step"
        assert proc.wait(timeout=240) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out.seek(0)
    output = out.read()
    assert not any(SECRET in k for k in listed)
    assert SECRET not in output
    assert "holds a value not sealed with this run's secret: refused" in output
    steps = [line for line in (tmp_path / "recover_events.jsonl").read_text().splitlines() if '"event": "step"' in line]
    assert len(steps) == 8, output[-3000:]
