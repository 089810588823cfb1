"""The node self-test (``python -m titan_recover.selftest``): its verdicts from the probe's figures, and
the self-test on this machine's CPUs, as an operator runs it (real processes, real signals).

The run includes ``[recover] exact`` with a kill at R = 2 and at R = 3 and a step redone on the coarser grid,
bit-equal to the failure-free R = 2 run; the suite has no other run of that. It leaves out the ``default job``
check, for CI time (about 140 of its 220 s on a slow day): its two runs are the default job killed and rejoined
against its twin, which ``test_e2e`` and ``test_rejoin`` run; ``python -m titan_recover.selftest`` runs it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from titan_recover import selftest
from titan_recover.observability.events import RECOVERY_PHASES
from titan_recover.rank import probe

ROOT = Path(__file__).resolve().parents[1]


def recovery(**phases: float | None) -> dict:
    full = {"detect": 0.01, "abort": 0.05, "reform": 0.1, "first_good_step": 0.2, **phases}
    return {
        "fault": "SIGKILL",
        "during": "all-reduce",
        "phases": full,
        "memory_returned": True,
        "survivors": [{"first_good_step": full["first_good_step"], "sum_right": True}],
    }


@pytest.mark.unit
def test_every_way_a_recovery_can_go_wrong_is_a_problem() -> None:
    assert selftest.collective_problems([recovery()], {0: 0, 1: 0}) == []
    assert selftest.collective_problems([recovery(reform=None)], {0: 0}) == [
        "SIGKILL during all-reduce: reform never happened"
    ]
    assert selftest.collective_problems([recovery(first_good_step=65.8)], {0: 0}) == [
        "SIGKILL during all-reduce: first_good_step 65.80s > 10s"
    ]
    wrong = recovery()
    wrong["survivors"][0]["sum_right"] = False
    assert "summed wrong" in selftest.collective_problems([wrong], {0: 0})[0]
    assert selftest.collective_problems([{**recovery(), "memory_returned": False}], {0: 0}) == [
        "SIGKILL during all-reduce: survivors' memory not back"
    ]
    assert selftest.collective_problems([recovery()], {0: None, 1: -6}) == [
        "survivor 0 still running at the bound (wedged)",
        "survivor 1 exited with code -6",
    ]


@pytest.mark.unit
def test_the_probes_phases_are_the_slowest_survivors_and_memory_counts_only_those_that_finished() -> None:
    fault = probe.Fault(
        replica=3, signal="SIGKILL", during="state transfer", t=100.0, verdict_t=100.02, epoch=3, members=[0, 1, 2]
    )
    records = [
        {"replica": 0, "event": "step", "epoch": 2, "t": 99.0, "allocated_mb": 10.0, "ok": True},
        {"replica": 0, "event": "aborted", "epoch": 2, "t": 100.05, "during": "state transfer"},
        {"replica": 0, "event": "launched", "epoch": 3, "t": 100.2},
        {"replica": 0, "event": "step", "epoch": 3, "t": 100.3, "allocated_mb": 10.0, "ok": True},
        {"replica": 0, "event": "done", "t": 101.0, "allocated_mb": 9.0, "kept": 0},
        {"replica": 1, "event": "aborted", "epoch": 2, "t": 100.5, "during": "all-reduce"},
        {"replica": 1, "event": "launched", "epoch": 3, "t": 100.6},
        {"replica": 1, "event": "step", "epoch": 3, "t": 100.9, "allocated_mb": 10.0, "ok": True},
        {"replica": 1, "event": "done", "t": 101.0, "allocated_mb": 12.0, "kept": 0},  # more than before: not back
        {"replica": 2, "event": "aborted", "epoch": 2, "t": 100.1, "during": "all-reduce"},  # fenced later: no "done"
    ]
    (out,) = probe.summarize([fault], records)
    assert out["phases"] == {"detect": 0.02, "abort": 0.5, "reform": None, "first_good_step": None}  # 2 never re-formed
    assert out["survivors"][0]["aborted_during"] == "state transfer"
    assert (
        out["memory_returned"] is True
    )  # replica 1 had no step before the fault: nothing to compare; 2 never finished
    records.insert(5, {"replica": 1, "event": "step", "epoch": 2, "t": 99.5, "allocated_mb": 10.0, "ok": True})
    assert probe.summarize([fault], records)[0]["memory_returned"] is False


@pytest.mark.unit
def test_a_check_that_cannot_run_fails_the_self_test_saying_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    def broken(facts: dict, work: Path) -> dict:
        raise TimeoutError("replica 4 never reached its fault point (all-reduce) within 180s")

    monkeypatch.setitem(selftest.RUNNERS, "collectives", broken)
    assert selftest.main(["--only", "collectives", "--out", str(tmp_path / "r.json")]) == 1
    out = capsys.readouterr().out
    assert (
        "collectives  FAIL" in out
        and "problem: TimeoutError: replica 4 never reached" in out
        and "self-test FAILED" in out
    )
    assert json.loads((tmp_path / "r.json").read_text())["passed"] is False


@pytest.mark.toml("the self-test's exact runs use the 0.2 flags")
def test_the_self_test_passes_on_this_machines_cpus(tmp_path: Path) -> None:
    out = tmp_path / "selftest.json"
    only = "preflight,collectives,exact"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "titan_recover.selftest",
            "--only",
            only,
            "--out",
            str(out),
            "--work",
            str(tmp_path / "runs"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "self-test PASSED" in done.stdout and "check        result  seconds" in done.stdout
    result = json.loads(out.read_text())
    assert result["host"]["gpus"] == 0 and result["checks"]["preflight"]["passed"]
    collectives = result["checks"]["collectives"]
    assert collectives["backend"] == "gloo" and collectives["memory_returned"]
    assert [(r["fault"], r["during"]) for r in collectives["recoveries"]] == [
        ("SIGKILL", "all-reduce"),
        ("SIGKILL", "state transfer"),
        ("SIGSTOP", "all-reduce"),
    ]
    for r in collectives["recoveries"]:
        assert list(r["phases"]) == list(RECOVERY_PHASES)
        assert 0 < r["phases"]["detect"] <= r["phases"]["first_good_step"] <= selftest.BOUND_S, r["phases"]
    stopped = collectives["recoveries"][2]["phases"]["detect"]
    # a stopped replica is found by its silence (its last beat came up to BEAT_S before the signal)
    assert probe.SILENT_S - probe.BEAT_S <= stopped < probe.SILENT_S + 2
    assert list(result["checks"]) == only.split(",")
    exact = result["checks"]["exact"]
    assert [v.split(" (")[0] for v in exact["verdicts"].values()] == ["the same bits", "the same bits"]
    assert exact["redone_steps"] == {"free": [2], "R=2": [2], "R=3": [2]}
