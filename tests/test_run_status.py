"""The status page's pure parts: the fold of the event log into group states and plots, the tail
of a growing log, the Prometheus names, the terminal table and the ``[recover]`` keys."""

import json
import socket
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from titan_recover import config
from titan_recover.control.protocol import CoordinatorState, MessageError
from titan_recover.observability.events import EventLog, Tail, event_files, read_events
from titan_recover.observability.run_status import MAX_POINTS, Live, LiveGroup, RunHistory
from titan_recover.observability.status_server import Metrics, StatusSource
from titan_recover.status import format_status

pytestmark = pytest.mark.unit

T0 = 1_000.0


def config_event() -> dict:
    return {
        "event": "run_config",
        "run": "abc123",
        "replicas": 2,
        "replica_ids": 3,
        "steps": 10,
        "tokens_per_step": 100,
        "precision": "float32",
        "time": T0,
    }


def step(n: int, members: list[int], quotas: dict[str, int], t: float) -> dict:
    return {"event": "step", "step": n, "members": members, "quotas": quotas, "loss": 10.0 - n, "time": t}


def states(history: RunHistory, live: Live | None = None) -> dict[int, str]:
    return {g["replica"]: g["state"] for g in history.snapshot(None, T0 + 100, live)["groups"]}


def test_a_group_goes_live_fenced_restarting_joining_live_from_the_events_alone() -> None:
    h = RunHistory()
    seen = []
    events = [
        config_event(),
        {"event": "group_started", "replica": 0, "attempt": 0, "host": "n0", "time": T0 + 1},
        {"event": "group_started", "replica": 1, "attempt": 0, "host": "n0", "time": T0 + 1},
        {"event": "group_started", "replica": 2, "attempt": 0, "host": "n1", "time": T0 + 1},
        step(1, [0, 1], {"0": 2, "1": 2}, T0 + 2),
        {
            "event": "failure",
            "replica": 1,
            "step": 2,
            "cause": "rank 1 was killed",
            "time": T0 + 3,
            "detected": T0 + 3.5,
        },
        {"event": "recovered", "step": 2, "members": [0], "latency_s": 0.7, "time": T0 + 3.7},
        step(2, [0], {"0": 4}, T0 + 4),
        {"event": "group_started", "replica": 1, "attempt": 1, "host": "n0", "time": T0 + 5},
        {"event": "admitted", "replica": 1, "attempt": 1, "epoch": 2, "step": 3, "time": T0 + 9},
        step(3, [0, 1], {"0": 4}, T0 + 10),
        {
            "event": "rejoined",
            "replica": 1,
            "step": 3,
            "bytes": 2**20,
            "transfer_s": 0.2,
            "downtime_s": 7.0,
            "time": T0 + 10,
        },
    ]
    for e in events:
        h.add(e)
        seen.append(states(h)[1])
    assert states(h)[2] == "spare"  # id past R, never admitted
    collapsed = [s for i, s in enumerate(seen) if i == 0 or s != seen[i - 1]]
    assert collapsed == ["live", "fenced", "restarting", "joining", "live"]
    snap = h.snapshot(None, T0 + 100)
    assert snap["run"]["id"] == "abc123" and snap["run"]["step"] == 3 and snap["run"]["state"] == "running"
    assert snap["failures"][0]["detection_s"] == pytest.approx(0.5) and snap["failures"][0]["recovery_s"] == 0.7
    assert snap["rejoins"][0]["downtime_s"] == 7.0
    assert snap["series"]["live_groups"] == [2, 1, 2] and snap["series"]["step_time_s"] == [None, 2.0, 6.0]
    assert snap["counts"] == {
        "failures": 1,
        "leaves": 0,
        "rejoins": 1,
        "steps": 3,
        "digest_mismatches": 0,
        "sdc_checks": 0,
        "sdc_mismatches": 0,
        "quarantined": 0,
    }
    assert [g["nodes"] for g in snap["groups"]] == [["n0"], ["n0"], ["n1"]]


def test_the_stores_bookkeeping_and_node_messages_say_who_joins_and_how_old_a_beat_is() -> None:
    h = RunHistory(replicas=2, replica_ids=2, steps=10, tokens_per_step=100, precision="float32")
    h.add(step(1, [0, 1], {"0": 2, "1": 2}, T0))
    h.add({"event": "failure", "replica": 1, "step": 2, "cause": "silent", "time": T0 + 1})
    h.add({"event": "recovered", "step": 2, "members": [0], "latency_s": 1.0, "time": T0 + 2})
    saved = {"joining": {}, "spares": {}, "down_since": {"1": T0 + 1}, "attempts": {"0": 0, "1": 0}}
    restarted = Live(saved, {0: LiveGroup(0, ("n0",), 0.1), 1: LiveGroup(1, ("n0",), 0.4)})
    assert states(h, Live(saved, {0: LiveGroup(0, ("n0",), 0.1)})) == {0: "live", 1: "fenced"}
    assert states(h, restarted) == {0: "live", 1: "restarting"}  # its launcher's next incarnation beats
    groups = h.snapshot(None, T0 + 5, restarted)["groups"]
    assert groups[1]["incarnation"] == 1 and groups[1]["heartbeat_age_s"] == 0.4 and groups[1]["down_since"] == T0 + 1
    assert states(h, Live({**saved, "joining": {"1": 3}}, restarted.groups))[1] == "joining"


def test_a_long_run_is_plotted_with_a_bounded_number_of_points() -> None:
    h = RunHistory(replicas=1, replica_ids=1, steps=100_000, tokens_per_step=10, precision="float32")
    for n in range(1, 20_001):
        h.add(step(n, [0], {"0": 1}, T0 + n))
    series = h.snapshot(None, T0)["series"]
    assert len(series["step"]) <= MAX_POINTS + 1 and series["step"][0] == 1 and series["step"][-1] == 20_000
    assert h.snapshot(None, T0)["run"]["steps_per_s"] == pytest.approx(1.0)


def test_steps_read_out_of_order_are_plotted_in_order() -> None:
    h = RunHistory()
    for n in (1, 3, 2):
        h.add(step(n, [0], {"0": 1}, T0 + n))
    assert h.snapshot(None, T0)["series"]["step"] == [1, 2, 3]


def test_a_resume_from_host_memory_plots_the_steps_computed_again_once_as_read_by_the_tail(tmp_path: Path) -> None:
    """Steps 1..4 logged, every group lost, resumed from step 2: steps 3 and 4 logged again count, once."""
    log = EventLog(str(tmp_path))
    lines = [step(n, [0, 1], {"0": 2, "1": 2}, T0 + n) for n in (1, 2, 3, 4)]
    lines.append({"event": "resuming", "step": 2, "lost_step": 5, "recomputed": 2, "groups": [0, 1], "time": T0 + 6})
    lines += [step(n, [0, 1], {"0": 2, "1": 2}, T0 + 5 + n) | {"loss": 20.0 + n} for n in (3, 4)]
    for e in lines:
        log.emit(e.pop("event"), **{k: v for k, v in e.items() if k != "time"})
    log.close()
    tail, h = Tail(lambda: event_files(str(tmp_path))), RunHistory()
    for e in tail.read():
        h.add(e)
    series = h.snapshot(None, T0)["series"]
    assert series["step"] == [1, 2, 3, 4]
    assert series["loss"][2:] == [23.0, 24.0]  # the second commits'


def test_a_group_that_left_on_notice_is_left_not_fenced_and_counted_apart() -> None:
    h = RunHistory(replicas=2, replica_ids=2, steps=10)
    h.add(step(1, [0, 1], {"0": 2, "1": 2}, T0))
    h.add({"event": "left", "replica": 1, "step": 2, "reason": "left on notice", "notice_s": 1.5, "time": T0 + 1})
    h.add(step(2, [0], {"0": 4}, T0 + 2))
    snap = h.snapshot(None, T0 + 3)
    assert {g["replica"]: g["state"] for g in snap["groups"]} == {0: "live", 1: "left"}
    assert snap["counts"]["leaves"] == 1 and snap["counts"]["failures"] == 0
    assert snap["leaves"][0] | {"time": 0} == {
        "replica": 1,
        "step": 2,
        "reason": "left on notice",
        "notice_s": 1.5,
        "time": 0,
    }
    assert "left on notice: 1" in format_status(snap)


def test_the_tail_reads_whole_lines_once_new_files_too_and_each_step_once(tmp_path: Path) -> None:
    first = tmp_path / "recover_events.jsonl"
    tail = Tail(lambda: event_files(str(tmp_path)))
    assert tail.read() == []
    line = json.dumps(step(1, [0], {}, T0)) + "\n"
    first.write_text(line + line[:10])  # a step, and a line still being written
    assert [e["step"] for e in tail.read()] == [1]
    with first.open("a") as f:
        f.write(line[10:] + "not json\n")  # the rest of the same step again: logged twice, read once
    (tmp_path / "recover_events.node1.jsonl").write_text(json.dumps(step(2, [0], {}, T0 + 1)) + "\n")
    assert [e["step"] for e in tail.read()] == [2]
    assert tail.skipped == 1 and tail.read() == []


def test_prometheus_names_follow_its_conventions_and_count_what_happened() -> None:
    h = RunHistory(replicas=2, replica_ids=2, steps=10, tokens_per_step=100, precision="float32")
    h.add(step(1, [0, 1], {"0": 2, "1": 2}, T0))
    h.add({"event": "failure", "replica": 1, "step": 2, "cause": "x", "time": T0 + 1})
    h.add({"event": "recovered", "step": 2, "members": [0], "latency_s": 0.3, "time": T0 + 1.3})
    h.add(step(2, [0], {"0": 4}, T0 + 2))
    source = StatusSource(Tail(lambda: []), h, "abc")
    source.refresh()
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Metrics(source))
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    assert all(name.startswith("titan_recover_") for name in families)
    samples = {s.name: s for f in families.values() for s in f.samples if not s.labels}
    assert samples["titan_recover_failures_total"].value == 1 and samples["titan_recover_rejoins_total"].value == 0
    assert samples["titan_recover_live_groups"].value == 1
    assert samples["titan_recover_recovery_latency_seconds_count"].value == 1
    assert samples["titan_recover_recovery_latency_seconds_sum"].value == pytest.approx(0.3)
    by_state = {s.labels["state"]: s.value for s in families["titan_recover_groups"].samples}
    assert by_state == {"live": 1, "fenced": 1, "restarting": 0, "joining": 0, "spare": 0, "left": 0}
    quota = {s.labels["replica"]: s.value for s in families["titan_recover_group_microbatches"].samples}
    assert quota == {"0": 4, "1": 0}


def test_the_terminal_table_lists_every_group_and_the_failure() -> None:
    h = RunHistory()
    h.add(config_event())
    h.add(step(1, [0], {"0": 4}, T0))
    h.add({"event": "failure", "replica": 1, "step": 1, "cause": "rank 1 was killed", "time": T0 + 1})
    text = format_status(h.snapshot(None, T0 + 2))
    assert "run abc123  RUNNING  step 1/10" in text and "replica 1 at step 1: rank 1 was killed" in text
    rows = [line.split() for line in text.splitlines() if line.strip()[:1].isdigit()]
    assert [(r[0], r[1]) for r in rows] == [("0", "live"), ("1", "fenced"), ("2", "spare")]


def test_the_new_counts_of_the_coordinator_state_are_checked_when_read() -> None:
    state = CoordinatorState(failures=2, rejoins=1, last_recovery_s=0.5, last_downtime_s=9.0)
    assert CoordinatorState.loads("k", state.dumps().encode()) == state
    old = json.loads(state.dumps())
    for key in ("failures", "rejoins", "last_recovery_s", "last_downtime_s"):
        del old[key]  # saved by a leader of an older release: none counted yet
    assert CoordinatorState.loads("k", json.dumps(old).encode()) == CoordinatorState()
    with pytest.raises(MessageError, match="last_recovery_s"):
        CoordinatorState.loads("k", json.dumps({**json.loads(state.dumps()), "last_recovery_s": -1}).encode())


@pytest.mark.parametrize(
    "key, value, says",
    [
        ("status_port", 70_000, "recover.status_port out of range: 70000"),
        ("status_port", -1, "recover.status_port out of range"),
        ("status_bind", "10.0.0.1:80", "recover.status_bind"),
    ],
)
def test_a_bad_status_setting_names_its_key(key: str, value: object, says: str) -> None:
    setting: dict[str, Any] = {key: value}  # out of range or malformed on purpose
    rc = config.Recover(enable=True, **setting)
    with pytest.raises(config.ConfigError, match=says):
        config._check_status_page(rc)


def test_a_status_port_in_use_or_a_bind_not_of_this_host_is_refused_naming_the_key() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(
            config.ConfigError, match=f"recover.status_port = {port}: cannot listen on 127.0.0.1:{port}"
        ):
            config.check_status_page(config.Recover(status_port=port))
    with pytest.raises(config.ConfigError, match="recover.status_bind = '192.0.2.1'"):
        config.check_status_page(config.Recover(status_port=8765, status_bind="192.0.2.1"))  # TEST-NET-1: no host's
    config.check_status_page(config.Recover(status_port=0, status_bind="192.0.2.1"))  # no page: nothing to check


def test_the_page_and_metrics_show_events_the_coordinators_log_cannot_write(tmp_path: Path) -> None:
    """An event log whose folder cannot be made (a file stands where it goes: NotADirectoryError, as a
    removed or read-only dump folder would fail): the events wait, the snapshot and /metrics count them,
    and once the folder can be made they are written in order, then ``events_delayed``."""
    (tmp_path / "shared").write_text("another job's file")
    events = EventLog(str(tmp_path / "shared" / "dump"))
    for n in (1, 2, 3):
        events.emit("step", step=n)
    source = StatusSource(Tail(lambda: []), RunHistory(), "abc", pending=events.pending)
    waiting = source.refresh()["run"]["event_log"]
    assert waiting["events"] == 3 and waiting["since"] is not None and "Not a directory" in waiting["error"]
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Metrics(source))
    samples = {
        s.name: s.value for f in text_string_to_metric_families(generate_latest(registry).decode()) for s in f.samples
    }
    assert samples["titan_recover_event_log_pending_events"] == 3
    (tmp_path / "shared").unlink()
    events.emit("step", step=4)
    written = read_events(events.path)
    assert [e.get("step") for e in written if e["event"] == "step"] == [1, 2, 3, 4]
    (late,) = [e for e in written if e["event"] == "events_delayed"]
    assert late["delayed"] == 4 and late["dropped"] == 0
    assert source.refresh()["run"]["event_log"]["events"] == 0
