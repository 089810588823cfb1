"""The status page, Prometheus, TensorBoard and W&B, watched during one real run (the tests' tiny
job): replica 1 is SIGKILLed mid-backward at step 3, restarts and rejoins. The test polls ``/status.json``,
``/metrics`` and ``/`` while it trains, opens the page in headless Chromium once the group is
back, and reads TensorBoard's and W&B's files afterwards."""

import html
import json
import os
import re
import secrets
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from titan_recover.control import keys, transport
from titan_recover.control.sealed import Run
from titan_recover.observability.events import read_events
from titan_recover.status import fetch
from titan_recover.titan.jobs import job

ROOT = Path(__file__).resolve().parents[1]
STEPS = 12
# replica 1 killed at step 3; replica 0 waits in step 4 until the restarted group is admitted (the tiny
# model's steps are far shorter than a restart), and in step 9 long enough for Chromium to load the page
PLAN = (
    "kill replica=1 rank=1 step=3 phase=backward; sleep replica=0 step=4 phase=optimizer seconds=90 until=epoch; "
    "sleep replica=0 step=9 phase=optimizer seconds=10"
)
RUN_ID = "status-test"
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",  # root needs --no-sandbox
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--virtual-time-budget=5000",
    "--window-size=1280,1200",
]


@dataclass
class Watched:
    dump: Path
    secret: str
    returncode: int = -1
    output: str = ""
    snapshots: list[dict] = field(default_factory=list)
    metrics: list[str] = field(default_factory=list)
    pages: list[bytes] = field(default_factory=list)
    dom: str | None = None
    screenshot: Path | None = None
    browser: str = ""  # why there is no DOM, if there is none


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def browse(url: str, dump: Path) -> tuple[str | None, Path | None, str]:
    """The page as Chromium renders it (its DOM after the scripts ran) and a screenshot of it."""
    binary = chromium()
    if binary is None:
        return None, None, "no Chromium here (./run_tests.sh installs Debian's chromium where it runs as root)"
    shot = dump / "status.png"
    with tempfile.TemporaryDirectory() as profile:
        flags = [binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}"]
        dom = subprocess.run([*flags, "--dump-dom", url + "?once"], capture_output=True, text=True, timeout=120)
        subprocess.run([*flags, f"--screenshot={shot}", url + "?once"], capture_output=True, timeout=120)
    return dom.stdout, shot if shot.exists() else None, dom.stderr[-2000:]


@pytest.fixture(scope="module")
def watched(tmp_path_factory: pytest.TempPathFactory) -> Watched:
    dump = tmp_path_factory.mktemp("status")
    port = transport.free_port()
    url = f"http://127.0.0.1:{port}/"
    w = Watched(dump, secrets.token_hex(16))
    cmd = [
        sys.executable,
        "-m",
        "titan_recover.launch",
        *job(dump, tiny=True),
        "--training.steps",
        str(STEPS),
        "--recover.fault_plan",
        PLAN,
        "--recover.status_port",
        str(port),
        "--recover.snapshot_interval",
        "2",  # a snapshot in host memory before the kill, and every two steps: the page and /metrics show its bytes
        "--metrics.enable_tensorboard",
        "--metrics.enable_wandb",
    ]
    env = {
        **os.environ,
        keys.SECRET_ENV: w.secret,
        keys.RUN_ENV: RUN_ID,
        "WANDB_MODE": "offline",
        "PYTHONUNBUFFERED": "1",
    }
    with open(dump / "launcher.log", "w+") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 400
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                try:
                    snapshot = fetch(url)
                    w.metrics.append(urllib.request.urlopen(url + "metrics", timeout=5).read().decode())
                    w.pages.append(urllib.request.urlopen(url, timeout=5).read())
                except OSError:
                    time.sleep(0.5)  # not serving yet, or the run just ended
                    continue
                w.snapshots.append(snapshot)
                if (
                    w.dom is None
                    and not w.browser
                    and snapshot["counts"]["rejoins"]
                    and snapshot["run"]["state"] == "running"
                ):
                    w.dom, w.screenshot, w.browser = browse(url, dump)
                    w.browser = w.browser or "Chromium rendered nothing"
                time.sleep(0.3)
        finally:
            if proc.poll() is None:
                proc.kill()
            w.returncode = proc.wait()
            out.seek(0)
            w.output = out.read()
    return w


def test_the_run_survives_and_is_served_while_it_trains(watched: Watched) -> None:
    assert watched.returncode == 0, watched.output[-3000:]
    assert "status page at http://127.0.0.1:" in watched.output
    assert len(watched.snapshots) >= 10, f"only {len(watched.snapshots)} answers during the run"
    assert watched.snapshots[-1]["run"]["step"] >= STEPS - 4
    steps = [e for e in read_events(str(watched.dump / "recover_events.jsonl")) if e["event"] == "step"]
    assert sorted(e["step"] for e in steps) == list(range(1, STEPS + 1))  # every step once
    assert {len(e["microbatches"]) for e in steps} == {4}  # M microbatches, the killed group's share taken over


def test_the_killed_group_goes_live_restarting_joining_live_in_that_order(watched: Watched) -> None:
    order = ["live", "fenced", "restarting", "joining"]
    seen = [next(g["state"] for g in s["groups"] if g["replica"] == 1) for s in watched.snapshots]
    collapsed = [s for i, s in enumerate(seen) if i == 0 or s != seen[i - 1]]
    assert collapsed[0] == "live" and collapsed[-1] == "live", collapsed
    middle = collapsed[1:-1]
    assert middle and {"restarting", "joining"} & set(middle), collapsed
    assert [order.index(s) for s in middle] == sorted(order.index(s) for s in middle), collapsed  # never back
    assert all(g["state"] == "live" for s in watched.snapshots for g in s["groups"] if g["replica"] == 0)
    incarnations = [next(g["incarnation"] for g in s["groups"] if g["replica"] == 1) for s in watched.snapshots]
    assert incarnations == sorted(incarnations) and incarnations[-1] == 1
    last = watched.snapshots[-1]
    assert last["failures"][0]["replica"] == 1 and last["failures"][0]["recovery_s"] is not None
    phases = last["failures"][0]["phases"]  # seconds from the fault, growing phase by phase
    assert phases["detect"] is not None and phases["restart"] <= phases["admit"] <= phases["rejoin"], phases
    assert phases["first_good_step"] is not None, phases
    assert last["rejoins"][0]["replica"] == 1 and last["rejoins"][0]["bytes"] > 0
    assert all(g["heartbeat_age_s"] is not None and g["heartbeat_age_s"] < 5 for g in last["groups"])


def test_prometheus_counters_only_grow_and_count_the_failure_and_the_rejoin(watched: Watched) -> None:
    def value(text: str, name: str) -> float:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and not sample.labels:
                    return sample.value
        raise AssertionError(f"{name} not in /metrics")

    for name in ("titan_recover_failures_total", "titan_recover_rejoins_total", "titan_recover_step"):
        values = [value(text, name) for text in watched.metrics]
        assert values == sorted(values), (name, values)
    final = watched.metrics[-1]
    assert value(final, "titan_recover_failures_total") == 1 and value(final, "titan_recover_rejoins_total") == 1
    assert value(final, "titan_recover_recovery_latency_seconds_count") == 1
    assert value(final, "titan_recover_rejoin_downtime_seconds_count") == 1
    counts = {
        s.labels["phase"]: s.value
        for f in text_string_to_metric_families(final)
        for s in f.samples
        if s.name == "titan_recover_recovery_phase_seconds_count"
    }
    assert counts["detect"] == counts["rejoin"] == 1, counts
    lows = [value(text, "titan_recover_live_groups") for text in watched.metrics]
    assert min(lows) == 1 and lows[-1] == 2


def test_the_page_metrics_and_summary_show_the_nodes_snapshot_memory(watched: Watched) -> None:
    """One launcher: one node (its host and pid), whose snapshot folder's bytes the node messages carried."""
    figures: dict[str, list[tuple[str, float]]] = {
        "titan_recover_snapshot_bytes": [],
        "titan_recover_snapshot_peak_bytes": [],
    }
    for text in watched.metrics:
        for family in text_string_to_metric_families(text):
            if family.name in figures:
                figures[family.name] += [(s.labels["node"], s.value) for s in family.samples]
    [node] = {node for pairs in figures.values() for node, _ in pairs}
    assert re.fullmatch(rf"{re.escape(socket.gethostname())}:\d+", node), node
    largest = max(value for _, value in figures["titan_recover_snapshot_bytes"])
    assert largest > 0 and max(v for _, v in figures["titan_recover_snapshot_peak_bytes"]) >= largest
    peaks = [s["host_memory"][0]["peak_bytes"] for s in watched.snapshots if s["host_memory"]]
    assert peaks and peaks == sorted(peaks) and peaks[-1] >= largest, peaks  # a peak never goes down
    logged = [e for e in read_events(str(watched.dump / "recover_events.jsonl")) if e["event"] == "host_memory"]
    assert logged and {e["node"] for e in logged} == {node} and max(e["bytes"] for e in logged) >= largest, logged
    assert f"    node {node}: {max(e['bytes'] for e in logged) / 2**20:.1f} MiB" in watched.output  # the summary
    if watched.dom is not None:
        shown = html.unescape(found(r'<span id="host-memory"[^>]*>([^<]*)</span>', watched.dom).group(1))
        assert re.fullmatch(rf"{re.escape(node)}: [\d.]+ MiB \(peak [\d.]+ MiB\)", shown), shown


def test_no_response_holds_the_secret(watched: Watched) -> None:
    run = Run(watched.secret, RUN_ID)
    answers = [json.dumps(s) for s in watched.snapshots] + watched.metrics + [p.decode() for p in watched.pages]
    assert not [a for a in answers if watched.secret in a or run.tag in a]
    assert {s["run"]["id"] for s in watched.snapshots} == {run.public_id}


def found(pattern: str, text: str, flags: int = 0) -> re.Match[str]:
    """The first match of ``pattern`` in ``text``, which the test expects to be there."""
    match = re.search(pattern, text, flags)
    assert match is not None, (pattern, text[:2000])
    return match


def test_a_person_sees_the_groups_the_failure_and_the_plots(watched: Watched) -> None:
    if watched.dom is None:
        pytest.skip(watched.browser)
    dom = watched.dom
    assert int(found(r'data-rendered="(\d+)"', dom).group(1)) >= 1, dom[:2000]
    assert re.search(r'<tr data-replica="0" data-state="live"', dom) and re.search(
        r'<tr data-replica="1" data-state="live"', dom
    )
    failures = found(r'<table id="failures".*?</table>', dom, re.S).group(0)
    assert re.search(r'<tr data-replica="1".*?<td class="cause">[^<]+</td>', failures, re.S), failures
    timeline = html.unescape(found(r'<td class="mono phases">([^<]+)</td>', failures).group(1))
    assert re.fullmatch(r"detect [\d.]+ > .* > rejoin [\d.]+", timeline), timeline  # a timeline per failure
    for plot in ("plot-loss", "plot-live", "plot-steptime"):
        svg = found(rf'<svg[^>]*id="{plot}".*?</svg>', dom, re.S).group(0)
        path = found(r'<path(?=[^>]*class="line")[^>]*\bd="([^"]+)"', svg).group(1)
        assert path.count("L") >= 3, (plot, path)  # a line through the steps so far
    assert watched.screenshot is not None and watched.screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert watched.screenshot.stat().st_size > 20_000  # a page drawn, not a blank one


def test_tensorboard_holds_the_recovery_figures_across_the_groups_incarnations(watched: Watched) -> None:
    from tensorboard.backend.event_processing.event_accumulator import (
        EventAccumulator,
    )

    scalars = {}
    for replica in (0, 1):
        folder = watched.dump / "tb" / f"replica{replica}"
        acc = EventAccumulator(str(folder))
        acc.Reload()
        scalars[replica] = {
            tag: {e.step: e.value for e in acc.Scalars(tag)}
            for tag in acc.Tags()["scalars"]
            if tag.startswith("recover/")
        }
        assert {
            "recover/live_groups",
            "recover/microbatches",
            "recover/failures",
            "recover/last_recovery_latency_s",
            "recover/last_rejoin_downtime_s",
        } <= set(scalars[replica]), scalars[replica].keys()
    assert (
        len(list((watched.dump / "tb" / "replica1").glob("events.out.tfevents.*"))) == 2
    )  # one per incarnation, one folder
    failures = scalars[1]["recover/failures"]
    assert (
        failures[1] == 0 and failures[max(failures)] == 1
    )  # incarnation 0 logged step 1, incarnation 1 the later ones
    assert min(scalars[0]["recover/live_groups"].values()) == 1 and scalars[0]["recover/live_groups"][STEPS] == 2
    assert max(scalars[0]["recover/microbatches"].values()) == 4  # M = 4: replica 0 alone carried them all


def wandb_history(path: Path) -> list[dict]:
    """The history rows of an offline W&B run file: a LevelDB-style log of protobuf records (32 KiB
    blocks, 7-byte record headers) that wandb 0.31 no longer reads back in Python."""
    from wandb.proto import wandb_internal_pb2

    data, rows, pending, pos = path.read_bytes(), [], b"", 7
    assert data[:4] == b":W&B", data[:8]
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or (length, kind) == (0, 0):
            pos += left
            continue
        pending, pos = pending + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]  # a class protobuf builds at import
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                rows.append(
                    {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                )
    return rows


def test_wandb_offline_holds_the_recovery_figures_one_run_per_group(watched: Watched) -> None:
    runs = {}
    for replica in (0, 1):
        files = sorted((watched.dump / "tb" / f"replica{replica}" / "wandb").glob("offline-run-*/run-*.wandb"))
        assert files and {f.name for f in files} == {
            f"run-{Run(watched.secret, RUN_ID).public_id}-replica{replica}.wandb"
        }
        runs[replica] = [row for f in files for row in wandb_history(f)]
        assert runs[replica] and all(
            "recover/failures" in row and "recover/live_groups" in row for row in runs[replica]
        )
    assert (
        len(list((watched.dump / "tb" / "replica1" / "wandb").glob("offline-run-*"))) == 2
    )  # both incarnations, same run id
    assert {row["recover/failures"] for row in runs[0]} == {0, 1}
    assert runs[1][-1]["recover/failures"] == 1 and runs[1][-1]["recover/last_rejoin_downtime_s"] > 0
