"""Each node's host-memory snapshot memory as reported (``observability.host_memory``): which figures the
coordinator logs, the summary's line, the status page's JSON and ``/metrics``. Pure: events and node messages in,
text and JSON out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from titan_recover.observability.events import EVENTS_FILE, Tail
from titan_recover.observability.host_memory import GROWTH, MIN_LOGGED, Peaks, node_of, peaks_of
from titan_recover.observability.run_status import Live, RunHistory
from titan_recover.observability.status_server import Metrics, StatusSource
from titan_recover.observability.summary import format_summary, summarize_events

pytestmark = pytest.mark.unit

MIB = 1 << 20


def test_a_node_is_its_launchers_host_and_pid() -> None:
    assert node_of("launcher/gpu-node-7:4242:9f3a") == "gpu-node-7:4242"
    assert node_of("launcher/node-a") == "node-a"


def test_a_figure_is_logged_from_the_floor_on_each_time_it_grows_past_the_margin_and_the_peak_at_the_end() -> None:
    peaks = Peaks()
    logged = [f for f in (0, MIN_LOGGED - 1) if peaks.observe("a:1", f)]
    assert logged == [] and peaks.unlogged() == {"a:1": MIN_LOGGED - 1}  # below the floor: only the end logs it
    figures = [10 * MIB, 12 * MIB, int(12.6 * MIB), 8 * MIB, 13 * MIB, 40 * MIB, 0, 41 * MIB]
    logged = [f for f in figures if peaks.observe("a:1", f)]
    assert logged == [10 * MIB, int(12.6 * MIB), 40 * MIB]  # each past GROWTH times the last logged one
    assert all(b > a * GROWTH for a, b in zip(logged, logged[1:]))
    assert peaks.latest == {"a:1": 41 * MIB} and peaks.peak == {"a:1": 41 * MIB}
    assert peaks.unlogged() == {"a:1": 41 * MIB}  # the end logs the exact peak
    peaks.observe("b:2", 50 * MIB)
    assert peaks.unlogged() == {"a:1": 41 * MIB}  # b's peak is logged already


def test_the_events_logged_per_node_stay_few_as_a_folder_fills_and_refills() -> None:
    """A folder filling byte by byte to 200 GB and then cycling (a copy written, an old one deleted): the number
    of events grows with the log of the peak, not with the figures read."""
    peaks, logged, figure = Peaks(), 0, 1
    while figure < 200 * 10**9:
        logged += peaks.observe("a:1", figure)
        figure = figure * 11 // 10 + 1
    for _ in range(1000):
        logged += peaks.observe("a:1", 100 * 10**9) + peaks.observe("a:1", 200 * 10**9)
    assert logged <= 55 and len(peaks.unlogged()) <= 1


def events(*figures: tuple[str, int]) -> list[dict]:
    return [{"event": "host_memory", "node": n, "bytes": b, "time": 100.0 + i} for i, (n, b) in enumerate(figures)]


def test_the_summary_says_each_nodes_peak(tmp_path: Path) -> None:
    log = events(("node0:11", 10 * MIB), ("node1:12", 70 * MIB), ("node0:11", 141 * MIB), ("node0:11", 130 * MIB))
    log += [{"event": "host_memory", "node": "bad", "bytes": -1, "time": 200.0}]  # a line without a figure
    path = tmp_path / EVENTS_FILE
    path.write_text("".join(json.dumps(e) + "\n" for e in log))
    s = summarize_events(str(path))
    assert s["snapshot_peaks"] == {"node0:11": 141 * MIB, "node1:12": 70 * MIB}
    text = format_summary(s, tokens_per_step=1)
    assert "snapshot memory      : the peak of each node's host-memory snapshot folder" in text
    assert "    node node0:11: 141.0 MiB\n    node node1:12: 70.0 MiB" in text
    assert peaks_of([]) == {} and "snapshot memory" not in format_summary(summarize_events(), tokens_per_step=1)


def history(*figures: tuple[str, int]) -> RunHistory:
    h = RunHistory(replicas=1, replica_ids=1, steps=10, tokens_per_step=100, precision="float32")
    for e in events(*figures):
        h.add(e)
    return h


def test_the_status_json_has_each_nodes_bytes_now_and_its_peak() -> None:
    h = history(("n0:1", 20 * MIB), ("n0:1", 30 * MIB))
    live = Live(None, {}, {"n0:1": 25 * MIB, "n1:2": 40 * MIB})
    assert h.snapshot(None, 300.0, live)["host_memory"] == [
        {"node": "n0:1", "bytes": 25 * MIB, "peak_bytes": 30 * MIB},
        {"node": "n1:2", "bytes": 40 * MIB, "peak_bytes": 40 * MIB},  # above any event: the bytes now are the peak
    ]
    down = Live(None, {}, {"n0:1": 25 * MIB, "n1:2": 35 * MIB})  # n1 not logged at 40 MiB (no margin): still its peak
    assert h.snapshot(None, 301.0, down)["host_memory"][1] == {
        "node": "n1:2",
        "bytes": 35 * MIB,
        "peak_bytes": 40 * MIB,
    }
    assert [(n["node"], n["bytes"], n["peak_bytes"]) for n in h.snapshot(None, 302.0)["host_memory"]] == [
        ("n0:1", None, 30 * MIB),
        ("n1:2", None, 40 * MIB),
    ]  # the events alone, or the store unreadable: no figure now
    assert history().snapshot(None, 300.0, Live(None))["host_memory"] == []  # snapshots off: no node


def metrics(source: StatusSource) -> dict[str, dict[str, float]]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Metrics(source))
    text = generate_latest(registry).decode()
    assert "# HELP titan_recover_snapshot_bytes " in text and "# TYPE titan_recover_snapshot_bytes gauge" in text
    assert "# TYPE titan_recover_snapshot_peak_bytes gauge" in text
    return {
        f.name: {s.labels["node"]: s.value for s in f.samples}
        for f in text_string_to_metric_families(text)
        if f.name.startswith("titan_recover_snapshot")
    }


def test_metrics_give_each_nodes_bytes_and_peak_as_gauges_labelled_by_node() -> None:
    source = StatusSource(Tail(lambda: []), history(("n0:1", 30 * MIB)), "abc")
    source.snapshot = source.history.snapshot(None, 300.0, Live(None, {}, {"n0:1": 0}))  # as the store reads now
    assert metrics(source) == {
        "titan_recover_snapshot_bytes": {"n0:1": 0.0},  # the folder freed: its peak stays
        "titan_recover_snapshot_peak_bytes": {"n0:1": 30.0 * MIB},
    }
    source.refresh()  # the events alone (a finished run's page): no figure now
    assert metrics(source) == {
        "titan_recover_snapshot_bytes": {},
        "titan_recover_snapshot_peak_bytes": {"n0:1": 30.0 * MIB},
    }
