"""Where each recovery's time went (titan_recover.observability.phases): the phases from a run's
events (pure), and the same phases on the status page's JSON and in Prometheus."""

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from titan_recover.observability import phases
from titan_recover.observability.events import RECOVERY_PHASES, Tail
from titan_recover.observability.run_status import RunHistory
from titan_recover.observability.status_server import Metrics, StatusSource

pytestmark = pytest.mark.unit

T = 1_000.0


def a_failure_and_its_rejoin() -> list[dict]:
    """Replica 1 killed at T, found 0.05 s later; two survivor groups' moments; restarted warm, back at T + 4."""
    return [
        {"event": "rejoined", "replica": 1, "step": 21, "downtime_s": 4.0, "time": T + 4.0},  # files merge roughly
        {"event": "failure", "replica": 1, "step": 20, "clock": "fault_injected", "detected": T + 0.05, "time": T},
        {"event": "recovered", "step": 20, "epoch": 1, "members": [0, 2], "latency_s": 0.2, "time": T + 0.2},
        {
            "event": "recovery_moments",
            "replica": 0,
            "epoch": 1,
            "torn_down": T + 0.1,
            "reformed": T + 0.35,
            "time": T + 2.0,
        },
        {  # replica 2 first committed after the rejoiner's admission had moved the epoch on again
            "event": "recovery_moments",
            "replica": 2,
            "epoch": 2,
            "torn_down": T + 0.3,
            "reformed": T + 0.4,
            "time": T + 2.1,
        },
        {"event": "recovery_moments", "replica": 0, "epoch": 7, "torn_down": T + 9, "reformed": T + 9, "time": T + 9},
        {"event": "group_started", "replica": 1, "attempt": 1, "warm": True, "time": T + 0.5},
        {"event": "admitted", "replica": 1, "attempt": 1, "epoch": 2, "time": T + 1.5},
    ]


def test_each_phase_is_the_slowest_survivors_seconds_from_the_fault() -> None:
    (r,) = phases.recoveries(a_failure_and_its_rejoin())
    assert (r["replica"], r["step"], r["clock"], r["warm"]) == (1, 20, "fault_injected", True)
    assert r["phases"] == {
        "detect": 0.05,
        "abort": 0.3,
        "reform": 0.4,
        "first_good_step": 2.1,
        "restart": 0.5,
        "admit": 1.5,
        "rejoin": 4.0,
    }
    assert list(r["phases"]) == list(phases.PHASES) and phases.PHASES[:4] == RECOVERY_PHASES  # the self-test's names
    assert phases.timeline(r).startswith("detect 0.05s > abort 0.30s > reform 0.40s > first_good_step 2.10s")


def test_a_phase_not_reached_or_not_logged_is_none() -> None:
    events = [
        {"event": "failure", "replica": 3, "step": 5, "time": T},  # no detection time: an older log, a torn line
        {"event": "recovered", "step": 5, "epoch": 4, "time": T + 0.3},
        {"event": "recovery_moments", "epoch": 4, "torn_down": None, "reformed": "x", "time": T + 1.0},
        {"event": "step", "step": 6},  # no time: left out
    ]
    (r,) = phases.recoveries(events)
    assert r["phases"] == {
        "detect": None,
        "abort": None,
        "reform": None,
        "first_good_step": 1.0,
        "restart": None,  # e.g. a spare took its place, or the run ended first
        "admit": None,
        "rejoin": None,
    }
    assert r["warm"] is None and phases.timeline(r) == "first_good_step 1.00s"


def test_the_status_page_and_prometheus_carry_every_recoverys_phases() -> None:
    history = RunHistory(replicas=3, replica_ids=3, steps=40, tokens_per_step=100, precision="float32")
    for event in sorted(a_failure_and_its_rejoin(), key=lambda e: e["time"]):
        history.add(event)
    snapshot = history.snapshot(None, T + 10)
    (failure,) = snapshot["failures"]
    assert failure["phases"]["rejoin"] == 4.0 and failure["phases"]["detect"] == 0.05
    assert snapshot["latencies"]["phases"]["abort"] == [0.3]
    source = StatusSource(Tail(lambda: []), history, "abc")
    source.snapshot = snapshot
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Metrics(source))
    text = generate_latest(registry).decode()
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == "titan_recover_recovery_phase_seconds"]
    counts = {s.labels["phase"]: s.value for s in family.samples if s.name.endswith("_count")}
    assert counts == dict.fromkeys(phases.PHASES, 1.0)
    le = {(s.labels["phase"], s.labels["le"]): s.value for s in family.samples if s.name.endswith("_bucket")}
    assert le[("rejoin", "2.5")] == 0 and le[("rejoin", "5.0")] == 1


def test_the_benches_split_a_runs_first_recovery_and_take_each_phases_median_over_the_runs_that_reached_it() -> None:
    from bench.common import phase_medians, recovery_phases

    split = recovery_phases(a_failure_and_its_rejoin())
    assert split == phases.recoveries(a_failure_and_its_rejoin())[0]["phases"] and split["rejoin"] == 4.0
    assert recovery_phases([]) == dict.fromkeys(phases.PHASES)  # no failure: nothing reached
    cold = {**split, "rejoin": 20.0}
    reached_none = dict.fromkeys(phases.PHASES)
    medians = phase_medians([{"phases": split}, {"phases": cold}, {"phases": reached_none}])
    assert medians["rejoin"] == 12.0 and medians["detect"] == split["detect"]
    assert phase_medians([{"phases": reached_none}]) == {}
