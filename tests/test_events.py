"""Tests for titan_recover.observability.events (the JSONL event log) and titan_recover.observability.summary."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import run_job

from titan_recover.observability.events import EVENTS_FILE, EventLog, events_path, read_events, read_log
from titan_recover.observability.summary import format_summary, last_leader_file, summarize_events

ROOT = Path(__file__).resolve().parents[1]

# --- EventLog -----------------------------------------------------------------------


@pytest.mark.unit
def test_events_path() -> None:
    assert events_path("/some/dump") == f"/some/dump/{EVENTS_FILE}"
    assert EVENTS_FILE == "recover_events.jsonl"


@pytest.mark.unit
def test_emit_creates_folder_and_appends(tmp_path: Path) -> None:
    folder = tmp_path / "new" / "dump"
    log = EventLog(str(folder))
    before = time.time()
    rec = log.emit("step", step=1, loss=2.5)
    log.emit("failure", replica=1, step=2, cause="x", time=123.0)
    log.close()
    assert rec["event"] == "step" and rec["step"] == 1 and before <= rec["time"] <= time.time()
    lines = (folder / EVENTS_FILE).read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        rec,
        {"event": "failure", "replica": 1, "step": 2, "cause": "x", "time": 123.0},
    ]
    # a second log on the same folder appends, it does not truncate
    again = EventLog(str(folder))
    again.emit("fatal", error="e")
    again.close()
    assert [e["event"] for e in read_events(str(folder / EVENTS_FILE))] == ["step", "failure", "fatal"]


# Each writer emits at least ``n`` lines and keeps going until the file holds bytes it did
# not write (the other writer has started), then writes one more line: so each writer has
# a line after the other's first line and the two provably overlap, without any sleep.
WRITE_UNTIL_OVERLAP = """
import os
from titan_recover.observability.events import EventLog

def write_until_overlap(folder, writer, n, payload, cap=200000):
    log = EventLog(folder)
    mine = 0
    try:
        for i in range(cap):
            line = log.emit("spam", writer=writer, i=i, pad=writer * payload)
            mine += len(__import__("json").dumps(line, sort_keys=True)) + 1
            if i + 1 >= n and os.path.getsize(log.path) > mine:
                # the other writer has written: one more line lands after its first one
                log.emit("spam", writer=writer, i=i + 1, pad=writer * payload)
                return i + 2
        raise RuntimeError(f"writer {writer} never saw the other writer")
    finally:
        log.close()
"""
namespace: dict = {}
exec(WRITE_UNTIL_OVERLAP, namespace)  # the same function in this process as in the children
write_until_overlap = namespace["write_until_overlap"]


def _check_no_interleaving(path: Path, writers: tuple[str, str], payload: int) -> None:
    raw = path.read_bytes()
    assert raw.endswith(b"\n")
    lines = raw.decode().split("\n")[:-1]
    seen: dict[str, list[int]] = {w: [] for w in writers}
    order = []
    for line in lines:
        record = json.loads(line)  # a torn or interleaved line would not parse
        assert record["event"] == "spam"
        assert record["pad"] == record["writer"] * payload
        seen[record["writer"]].append(record["i"])
        order.append(record["writer"])
    for writer in writers:
        assert seen[writer] == list(range(len(seen[writer])))  # every line, in its writer's order
        assert len(seen[writer]) >= 100
    switches = sum(a != b for a, b in zip(order, order[1:]))
    assert switches >= 2, "the writers did not overlap"


@pytest.mark.unit
def test_two_logs_in_threads_never_interleave(tmp_path: Path) -> None:
    payload = 3000
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def write(writer: str) -> None:
        barrier.wait()
        try:
            write_until_overlap(str(tmp_path), writer, 100, payload)
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=write, args=(w,)) for w in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    _check_no_interleaving(tmp_path / EVENTS_FILE, ("a", "b"), payload)


WRITER = (
    WRITE_UNTIL_OVERLAP
    + """
import sys
sys.stdin.read()  # start together
write_until_overlap(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
"""
)


def test_two_processes_never_interleave(tmp_path: Path) -> None:
    payload = 2000
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, str(tmp_path), w, "100", str(payload)],
            cwd=ROOT,
            stdin=subprocess.PIPE,
        )
        for w in ("p", "q")
    ]
    for p in procs:
        assert p.stdin is not None
        p.stdin.close()
    for p in procs:
        assert p.wait(timeout=60) == 0
    _check_no_interleaving(tmp_path / EVENTS_FILE, ("p", "q"), payload)


# --- read_events ----------------------------------------------------------------------


@pytest.mark.unit
def test_the_summary_is_the_node_whose_candidate_led_last_or_none_without_a_leader(tmp_path: Path) -> None:
    """On etcd each node's candidate logs to its node's file: the last ``leader`` event names the node that prints
    the run's summary (the first node may be gone); the TCPStore's one coordinator logs none."""
    files = [tmp_path / "recover_events.node0.jsonl", tmp_path / "recover_events.node1.jsonl"]
    files[0].write_text('{"event": "leader", "time": 1.0}\n{"event": "step", "step": 1, "time": 9.0}\n')
    files[1].write_text('{"event": "leader", "time": 5.0}\n')
    assert last_leader_file([str(f) for f in files]) == str(files[1])
    files[1].write_text('{"event": "step", "step": 1, "time": 2.0}\n')
    assert last_leader_file([str(f) for f in files]) == str(files[0])
    files[0].write_text('{"event": "step", "step": 1, "time": 2.0}\n')
    assert last_leader_file([str(f) for f in files]) is None


@pytest.mark.unit
def test_read_events_skips_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    path.write_text('{"event": "a"}\n\n   \n{"event": "b", "x": 1}\n')
    assert list(read_events(str(path))) == [{"event": "a"}, {"event": "b", "x": 1}]


@pytest.mark.unit
def test_read_log_skips_a_line_that_is_not_json_naming_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    path.write_text('{"event": "a"}\n\n{"event": "b"\n{"event": "c"}\n')
    log = read_log(str(path))
    assert [e["event"] for e in log.events] == ["a", "c"]
    assert len(log.skipped) == 1 and log.skipped[0].startswith(f"{path}:3: not JSON")


@pytest.mark.unit
@pytest.mark.parametrize(
    "line, why",
    [
        ('{"step": 1}', "not an event object"),
        ("[1, 2]", "not an event object"),
        ('"event"', "not an event object"),
        ("3", "not an event object"),
        ('{"event": 3}', "not an event object"),
        ('{"event": "step", "step": "2"}', "a step event without an integer step"),
        ('{"event": "a", "time": "noon"}', "time is not a number"),
        ("\x00\x00{}", "not JSON"),
    ],
)
def test_read_log_skips_a_line_that_is_not_an_event(tmp_path: Path, line: str, why: str) -> None:
    path = tmp_path / "log.jsonl"
    path.write_text('{"event": "a"}\n' + line + "\n")
    log = read_log(str(path))
    assert log.events == [{"event": "a"}]
    assert len(log.skipped) == 1 and log.skipped[0].startswith(f"{path}:2: {why}")


# --- summary ------------------------------------------------------------------------------

HAND_WRITTEN: list[dict[str, Any]] = [
    {"event": "step", "step": 1, "time": 100.0, "loss": 8.0, "microbatches": [0, 1, 2, 3], "members": [0, 1]},
    {"event": "step", "step": 2, "time": 102.0, "loss": 7.5, "microbatches": [0, 1, 2, 3], "members": [0, 1]},
    {"event": "rank_memory", "replica": 0, "rank": 0, "max_rss_mb": 100.0, "time": 102.1},
    {"event": "failure", "replica": 1, "step": 3, "cause": "torchrun of replica 1 exited with code -9", "time": 102.5},
    {"event": "recovered", "step": 3, "epoch": 1, "members": [0], "latency_s": 0.12345, "time": 102.6},
    {"event": "step", "step": 3, "time": 104.5, "loss": 7.25, "microbatches": [0, 1, 2, 3], "members": [0]},
    {"event": "step", "step": 4, "time": 106.0, "loss": 6.875, "microbatches": [0, 1, 2, 3], "members": [0]},
]


def write_log(path: Path, events: list[dict]) -> str:
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    return str(path)


@pytest.mark.unit
def test_summarize_events(tmp_path: Path) -> None:
    s = summarize_events(write_log(tmp_path / EVENTS_FILE, HAND_WRITTEN))
    assert s["steps"] == 4
    assert s["microbatches_per_step"] == [4]
    assert s["failures"] == [{"replica": 1, "step": 3, "cause": "torchrun of replica 1 exited with code -9"}]
    assert s["recovery_latency_s"] == [0.123]
    assert s["final_members"] == [0]
    assert s["final_loss"] == 6.875
    assert s["fatal"] == []
    assert s["step_time_s"] == pytest.approx(2.0)  # (106 - 100) / 3


@pytest.mark.unit
def test_format_summary_contains_the_numbers(tmp_path: Path) -> None:
    s = summarize_events(write_log(tmp_path / EVENTS_FILE, HAND_WRITTEN))
    text = format_summary(s, tokens_per_step=4096)
    assert "steps committed      : 4" in text
    assert "microbatches per step: [4]" in text
    assert "failures             : 1" in text
    assert "replica 1 at step 3: torchrun of replica 1 exited with code -9" in text
    assert "recovery latency (s) : [0.123]" in text
    assert "mean step time (s)   : 2.000" in text
    assert "tokens/s             : 2048" in text
    assert "final loss           : 6.8750" in text
    assert "final members        : [0]" in text
    assert "FATAL" not in text


@pytest.mark.unit
def test_summary_of_a_fatal_run_without_steps(tmp_path: Path) -> None:
    events = [
        {"event": "failure", "replica": 0, "step": 1, "cause": "a", "time": 1.0},
        {"event": "failure", "replica": 1, "step": 1, "cause": "b", "time": 1.0},
        {"event": "fatal", "step": 1, "error": "only 0 replica group(s) left []", "time": 1.1},
    ]
    s = summarize_events(write_log(tmp_path / EVENTS_FILE, events))
    assert s["steps"] == 0 and s["final_loss"] is None and s["final_members"] == []
    assert "step_time_s" not in s
    assert len(s["failures"]) == 2
    text = format_summary(s, tokens_per_step=100)
    assert "FATAL: only 0 replica group(s) left []" in text
    assert "final loss" not in text and "tokens/s" not in text and "recovery latency" not in text


@pytest.mark.unit
def test_summary_of_a_single_step_has_no_step_time(tmp_path: Path) -> None:
    s = summarize_events(write_log(tmp_path / EVENTS_FILE, HAND_WRITTEN[:1]))
    assert s["steps"] == 1 and "step_time_s" not in s
    assert s["final_loss"] == 8.0 and s["final_members"] == [0, 1]
    assert "mean step time" not in format_summary(s, tokens_per_step=1)


@pytest.mark.unit
def test_summary_mixed_microbatch_counts(tmp_path: Path) -> None:
    events = [dict(HAND_WRITTEN[0]), dict(HAND_WRITTEN[1], microbatches=[0, 1]), dict(HAND_WRITTEN[5])]
    s = summarize_events(write_log(tmp_path / EVENTS_FILE, events))
    assert s["microbatches_per_step"] == [2, 4]


@pytest.mark.unit
def test_summarize_events_of_what_event_log_wrote(tmp_path: Path) -> None:
    log = EventLog(str(tmp_path))
    log.emit("step", step=1, loss=3.0, microbatches=[0, 1], members=[0, 1], time=10.0)
    log.emit("step", step=2, loss=2.0, microbatches=[0, 1], members=[0, 1], time=11.0)
    log.close()
    s = summarize_events(events_path(str(tmp_path)))
    assert (s["steps"], s["final_loss"], s["step_time_s"]) == (2, 2.0, 1.0)


# --- reading a run's logs back: at-least-once lines, torn lines, one file per node ------------------


@pytest.mark.unit
def test_a_stale_leaders_duplicate_step_is_counted_once(tmp_path: Path) -> None:
    """A leader confirms its lease, freezes, loses it; its successor logs the step; the stale
    leader then writes the same line: the summary counts the step once and says so."""
    from titan_recover.coordinator.shell import LeaderEvents

    def record(i: int, **more: object) -> dict:
        return {**{k: v for k, v in HAND_WRITTEN[i].items() if k != "event"}, **more}

    stale = LeaderEvents(str(tmp_path), confirm=lambda: None)  # its confirmation passed before the freeze
    stale.step(record(0))
    successor = EventLog(str(tmp_path))
    successor.step(record(1, data_epochs=[1], samples=8))
    stale.step(record(1, data_epochs=[1], samples=8))  # the frozen leader wakes and writes it again
    successor.step(record(5))
    stale.close()
    successor.close()
    s = summarize_events(str(tmp_path / EVENTS_FILE))
    assert s["steps"] == 3 and s["final_loss"] == 7.25
    assert s["duplicates"] == [2, 2]  # its data_epoch line and its step line
    assert "duplicate lines      : 2 (step 2 logged again" in format_summary(s, tokens_per_step=1)
    assert [e["step"] for e in read_events(str(tmp_path / EVENTS_FILE)) if e["event"] == "data_epoch"] == [2]


@pytest.mark.unit
def test_a_partial_last_line_does_not_crash_summarize_events(tmp_path: Path) -> None:
    path = tmp_path / EVENTS_FILE
    write_log(path, HAND_WRITTEN[:2])
    with open(path, "a") as f:
        f.write('{"event": "step", "step": 3, "lo')  # the writer was killed mid-line
    s = summarize_events(str(path))
    assert s["steps"] == 2 and s["final_loss"] == 7.5
    assert len(s["skipped"]) == 1 and s["skipped"][0].startswith(f"{path}:3: not JSON")
    assert "unreadable lines     : 1 skipped" in format_summary(s, tokens_per_step=1)


@pytest.mark.unit
def test_two_node_files_in_one_folder_are_merged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each node's processes append to a file of their own (appends from several hosts to one
    file are not atomic on NFS); the summary reads every node's file in the folder."""
    from titan_recover.observability import events

    node0 = EventLog(str(tmp_path))  # the unnamed log: a single-node run's, or node 0's
    monkeypatch.setenv(events.NODE_ENV, "node1")
    node1 = EventLog(str(tmp_path))
    assert node1.path == str(tmp_path / "recover_events.node1.jsonl")
    for i, e in enumerate(HAND_WRITTEN):  # a leader on node 0 until step 2, then one on node 1
        (node0 if i < 3 else node1).emit(**e)
    node1.emit(**HAND_WRITTEN[5])  # node 1's new leader logs again the last step it found saved
    node0.close()
    node1.close()
    files = events.event_files(str(tmp_path))
    assert files == [str(tmp_path / EVENTS_FILE), str(tmp_path / "recover_events.node1.jsonl")]
    s = summarize_events(*files)
    assert (s["steps"], s["final_loss"], s["duplicates"], s["files"]) == (4, 6.875, [3], files)
    assert s["failures"] and s["recovery_latency_s"] == [0.123]
    assert "event files          : recover_events.jsonl, recover_events.node1.jsonl" in format_summary(s, 1)
    assert events.logged_steps(str(tmp_path / EVENTS_FILE)) == {1, 2, 3, 4}  # a new leader on node 0 sees node 1's


@pytest.mark.unit
def test_a_new_run_moves_the_earlier_runs_logs_aside_keeping_the_newest(tmp_path: Path) -> None:
    """A requeued or resumed job begins a new run in the same dump folder: every node's file of the run before
    moves under its own name to previous/<n>, where the folder's readers do not take it for a node of this run
    and event_files of that folder reads it; the oldest go past ``keep``."""
    from titan_recover.observability import events

    names = [EVENTS_FILE, "recover_events.node0.jsonl", "recover_events.node1.jsonl"]
    assert events.rotate_events(str(tmp_path)) is None and not (tmp_path / "previous").exists()  # nothing yet
    for run in range(1, 6):
        for name in names:
            (tmp_path / name).write_text(json.dumps({"event": "step", "step": run, "time": 1.0}) + "\n")
        (tmp_path / "checkpoint").mkdir(exist_ok=True)  # the rest of the dump folder stays
        assert events.rotate_events(str(tmp_path), keep=3) == str(tmp_path / "previous" / str(run))
        assert events.event_files(str(tmp_path)) == []
    assert sorted(p.name for p in (tmp_path / "previous").iterdir()) == ["3", "4", "5"]
    last = events.event_files(str(tmp_path / "previous" / "5"))
    assert [Path(p).name for p in last] == names
    assert {e["step"] for e in read_log(*last).events} == {5}
    assert (tmp_path / "checkpoint").is_dir()


@pytest.mark.unit
def test_a_node_name_that_cannot_name_a_file_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from titan_recover.observability import events

    monkeypatch.setenv(events.NODE_ENV, "../x")
    with pytest.raises(ValueError, match="TITAN_RECOVER_NODE='../x'"):
        EventLog(str(tmp_path))


@pytest.mark.unit
def test_the_summary_says_when_steps_are_missing(tmp_path: Path) -> None:
    """Only node 1's log in the folder, whose leader took over at step 3 of 6: the summary names
    the steps it cannot see instead of under-counting silently."""
    path = write_log(tmp_path / "recover_events.node1.jsonl", HAND_WRITTEN[3:])
    s = summarize_events(path, last_step=6)
    assert s["steps"] == 2 and s["missing_steps"] == [5, 6]
    text = format_summary(s, tokens_per_step=1)
    assert "MISSING              : steps 5-6 are in none of these files" in text
    assert "only node node1's event file" in text
    complete = summarize_events(write_log(tmp_path / EVENTS_FILE, HAND_WRITTEN), last_step=4)
    assert complete["missing_steps"] == [] and "MISSING" not in format_summary(complete, 1)


@pytest.mark.unit
def test_compare_reads_every_node_file_of_a_dump_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from titan_recover.compare import main

    steps = [dict(e, data_digest=f"d{e['step']}") for e in HAND_WRITTEN if e["event"] == "step"]
    reference = write_log(tmp_path / "ref.jsonl", steps)
    run = tmp_path / "run"
    run.mkdir()
    write_log(run / EVENTS_FILE, steps[:3])
    write_log(run / "recover_events.node1.jsonl", steps[2:])  # step 3 logged by both leaders
    assert main([reference, str(run)]) == 0
    out = capsys.readouterr().out
    assert "1 line(s) logged again, counted once" in out and "4 steps compared" in out
    with pytest.raises(SystemExit) as info:
        main([reference, str(tmp_path / "nowhere")])
    assert info.value.code == 2 and "nowhere" in capsys.readouterr().err


def test_a_named_nodes_run_logs_to_its_own_file_and_its_summary_reads_every_node_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real run on node "node0" (coordinator and ranks inherit the name) beside another node's
    file, written during the run and cut short mid-line: the summary names both files, skips the
    partial line, misses no step. A previous run's file is moved aside (previous/1) when the run begins."""
    from titan_recover.observability import events

    dump = tmp_path / "dump"
    dump.mkdir()
    stale = dump / "recover_events.node2.jsonl"
    stale.write_text('{"event": "step", "step": 99, "time": 1.0}\n')  # an earlier run's node 2
    own_file = dump / "recover_events.node0.jsonl"

    def node1_writes() -> None:
        deadline = time.monotonic() + 200
        while not own_file.exists() and time.monotonic() < deadline:  # the run has begun
            time.sleep(0.05)
        (dump / "recover_events.node1.jsonl").write_text(
            '{"event": "rank_memory", "replica": 1, "rank": 0, "time": 1.0}\n{"event": "rank_mem'
        )  # node 1 died mid-line

    writer = threading.Thread(target=node1_writes, daemon=True)
    writer.start()
    monkeypatch.setenv(events.NODE_ENV, "node0")
    run = run_job(
        dump, "--parallelism.data_parallel_replicate_degree", "1", "--recover.fault_plan", "none", timeout=240
    )
    writer.join(timeout=1)
    assert run.returncode == 0, run.output[-3000:]
    assert not (dump / EVENTS_FILE).exists() and not stale.exists()
    assert (dump / "previous" / "1" / stale.name).read_text() == '{"event": "step", "step": 99, "time": 1.0}\n'
    own = read_log(str(own_file))
    assert [e["step"] for e in own.events if e["event"] == "step"] == list(range(1, 7))  # the coordinator's lines
    assert any(e["event"] == "rank_memory" for e in own.events)  # ... and the ranks'
    assert "event files          : recover_events.node0.jsonl, recover_events.node1.jsonl" in run.output
    assert "unreadable lines     : 1 skipped, the first " in run.output
    assert "steps committed      : 6" in run.output
    assert "MISSING" not in run.output and "only node" not in run.output and "Traceback" not in run.output


# --- a resume from the nodes' memory: the steps it computes again count once ----------------------

RESUMED_RUN: list[dict[str, Any]] = [
    {"event": "step", "step": 1, "time": 100.0, "loss": 8.0, "microbatches": [0, 1], "members": [0, 1]},
    {"event": "param_digest", "step": 1, "replica": 0, "digest": "a1", "time": 100.1},
    {"event": "step", "step": 2, "time": 102.0, "loss": 7.5, "microbatches": [0, 1], "members": [0, 1]},
    {"event": "param_digest", "step": 2, "replica": 0, "digest": "a2", "time": 102.1},
    {"event": "data_epoch", "step": 3, "epoch": 1, "samples": 8, "time": 103.9},
    {"event": "step", "step": 3, "time": 104.0, "loss": 7.25, "microbatches": [0, 1], "members": [0, 1]},
    {"event": "param_digest", "step": 3, "replica": 1, "digest": "a3", "time": 104.1},
    {"event": "state_lost", "step": 4, "epoch": 1, "groups": [0, 1], "cause": "both nodes went away", "time": 105.0},
    {"event": "resuming", "step": 1, "lost_step": 4, "recomputed": 2, "groups": [0], "time": 120.0},
    {"event": "resumed", "step": 2, "from_step": 1, "lost_step": 4, "seconds": 17.0, "time": 122.0},
    {"event": "step", "step": 2, "time": 122.0, "loss": 7.5, "microbatches": [0, 1], "members": [0]},
    {"event": "param_digest", "step": 2, "replica": 0, "digest": "b2", "time": 122.1},
    {"event": "data_epoch", "step": 3, "epoch": 1, "samples": 8, "time": 123.9},
    {"event": "step", "step": 3, "time": 124.0, "loss": 7.0, "microbatches": [0, 1], "members": [0]},
    {"event": "step", "step": 4, "time": 126.0, "loss": 6.5, "microbatches": [0, 1], "members": [0]},
]


@pytest.mark.unit
def test_steps_a_resume_computed_again_count_once_with_their_second_lines(tmp_path: Path) -> None:
    log = read_log(write_log(tmp_path / EVENTS_FILE, RESUMED_RUN))
    kept = [(e["event"], e["step"], e["time"]) for e in log.events if e["event"] in ("step", "data_epoch")]
    assert kept == [
        ("step", 1, 100.0),
        ("step", 2, 122.0),
        ("data_epoch", 3, 123.9),
        ("step", 3, 124.0),
        ("step", 4, 126.0),
    ]
    assert [(e["event"], e["step"]) for e in log.undone] == [
        ("step", 2),
        ("param_digest", 2),
        ("data_epoch", 3),
        ("step", 3),
        ("param_digest", 3),
    ]
    assert [e["digest"] for e in log.events if e["event"] == "param_digest"] == ["a1", "b2"]  # the undone digests go
    assert log.duplicates == []  # computed again is not logged again
    assert [e["event"] for e in log.events].count("resuming") == 1


@pytest.mark.unit
def test_the_summary_of_a_resumed_run_counts_each_step_once_and_says_how_it_came_back(tmp_path: Path) -> None:
    s = summarize_events(write_log(tmp_path / EVENTS_FILE, RESUMED_RUN))
    assert (s["steps"], s["final_loss"], s["duplicates"], s["missing_steps"]) == (4, 6.5, [], [])
    assert s["digest_steps"] == [1, 2]
    assert s["state_lost"] == [4]
    assert s["resumed"] == [{"from_step": 1, "lost_step": 4, "recomputed": 2, "seconds": 17.0}]
    text = format_summary(s, tokens_per_step=1)
    assert "every group lost     : in step(s) [4]" in text
    assert "resumed from memory at step 1 (2 step(s) computed again), back 17.0s after the loss" in text
    unresumed = summarize_events(write_log(tmp_path / "cut.jsonl", RESUMED_RUN[:9]))
    assert unresumed["steps"] == 1 and unresumed["resumed"][0]["seconds"] is None
    assert "no step committed after it" in format_summary(unresumed, tokens_per_step=1)


@pytest.mark.unit
def test_a_run_without_a_resume_says_nothing_of_one(tmp_path: Path) -> None:
    s = summarize_events(write_log(tmp_path / EVENTS_FILE, HAND_WRITTEN))
    assert s["state_lost"] == [] and s["resumed"] == []
    assert read_log(write_log(tmp_path / "again.jsonl", HAND_WRITTEN)).undone == []
    assert "every group lost" not in format_summary(s, tokens_per_step=1)
