"""The local channel between a node agent and its ranks, and the agent's node message.

Real shared-memory files, real threads and, for the rank side, a real second process:
nothing here talks to a store.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT

from titan_recover.control import protocol
from titan_recover.control.protocol import NodeGroup, NodeMessage, Stuck
from titan_recover.control.sealed import Run
from titan_recover.node.agent import SNAPSHOT_MEASURE_S, NodeAgent, SlotWatch
from titan_recover.node.channel import (
    BEAT,
    DONE,
    FINISHED,
    PID,
    READY,
    RUNNING,
    STATE,
    STUCK,
    Channel,
    ChannelError,
    RankBeat,
    remove_orphans,
)


@pytest.fixture
def channel(tmp_path: Path) -> Channel:
    return Channel.create(replica=3, incarnation=1, slots=2, directory=str(tmp_path))


def wait_until(predicate, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout_s}s"
        time.sleep(0.01)


def test_a_rank_in_another_process_sees_the_epoch_the_agent_pushes(channel: Channel) -> None:
    code = (
        "import sys, time\n"
        "from titan_recover.node.channel import Channel, RUNNING\n"
        "c = Channel.open(sys.argv[1]); c.set_state(1, RUNNING)\n"
        "while c.epoch() < 4: time.sleep(0.001)\n"
        "print(c.epoch(), c.flags(), flush=True)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, channel.path], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: channel.read_slots()[1, STATE] == RUNNING, 30)
        assert channel.read_slots()[1, PID] == proc.pid  # the agent can kill it by pid
        channel.publish(4, DONE)
        assert proc.communicate(timeout=30)[0].split() == ["4", str(DONE)]
    finally:
        proc.kill()


@pytest.mark.unit
def test_a_file_that_is_not_a_channel_is_refused_naming_it(tmp_path: Path) -> None:
    bogus = tmp_path / "bogus"
    bogus.write_bytes(b"\0" * 4096)
    with pytest.raises(ChannelError, match="not a titan_recover node channel"):
        Channel.open(str(bogus))
    with pytest.raises(ChannelError, match="cannot open the node channel"):
        Channel.open(str(tmp_path / "missing"))
    with pytest.raises(ChannelError, match="has no slot"):
        Channel.create(0, 0, 2, str(tmp_path)).beat(2)


def test_a_stuck_main_loop_marks_its_slot_and_stops_beating_then_resumes(channel: Channel) -> None:
    beat = RankBeat(channel, 0, interval_s=0.02, progress_timeout_s=0.5, agent_timeout_s=1e6, on_lost=pytest.fail)
    try:
        for _ in range(40):  # ticking: beats, never stuck
            beat.tick("microbatch 0")
            channel.tick()
            time.sleep(0.02)
        slots = channel.read_slots()
        assert slots[0, BEAT] > 5 and slots[0, STATE] != STUCK
        wait_until(lambda: channel.read_slots()[0, STATE] == STUCK, 5)  # no tick for 0.5 s
        silent = channel.read_slots()[0, BEAT]
        time.sleep(0.2)
        assert channel.read_slots()[0, BEAT] == silent  # and it stopped beating
        beat.tick("microbatch 1")
        wait_until(lambda: channel.read_slots()[0, BEAT] > silent, 5)  # progress again: beats again
    finally:
        beat.stop()


@pytest.mark.unit
def test_a_rank_has_beaten_once_its_lifeline_starts(channel: Channel) -> None:
    """A rank may train its first steps before its beat thread's first interval ends (later still under load)
    and hang there: its slot has beaten already, so its agent measures the silence instead of counting a rank
    still starting (a SIGSTOPped group was then fenced only after max_step_retries broken steps)."""
    beat = RankBeat(channel, 0, interval_s=3600, progress_timeout_s=1e6, agent_timeout_s=1e6, on_lost=pytest.fail)
    try:
        assert channel.read_slots()[0, BEAT] == 1
        watch = SlotWatch.new(2, now=100.0)
        watch.entry(1, channel.read_slots(), 100.0)  # the agent's first look; the thread never beats again
        entry = watch.entry(1, channel.read_slots(), 111.0)
        assert (entry.ranks, entry.silent_s) == (1, 11.0)
    finally:
        beat.stop()


def test_a_rank_whose_agent_stops_beating_is_told_within_the_bound(channel: Channel) -> None:
    lost: list[tuple[float, str]] = []
    beat = RankBeat(channel, 1, 0.02, 1e6, agent_timeout_s=0.5, on_lost=lambda r: lost.append((time.monotonic(), r)))
    try:
        for _ in range(30):  # a live agent: no verdict
            channel.tick()
            time.sleep(0.02)
        assert lost == []
        frozen = time.monotonic()
        wait_until(lambda: bool(lost), 5)
        assert 0.4 <= lost[0][0] - frozen < 2.0 and "node agent" in lost[0][1]
    finally:
        beat.stop()


@pytest.mark.unit
def test_slot_watch_counts_ranks_and_the_most_silent_one(channel: Channel) -> None:
    watch = SlotWatch.new(2, now=100.0)
    channel.beat(0)
    channel.beat(1)
    assert watch.entry(1, channel.read_slots(), 100.5) == NodeGroup(
        attempt=1, ranks=2, ready=0, finished=0, silent_s=0.0
    )
    channel.beat(0)  # rank 1 goes silent
    channel.set_step(1, 7)
    entry = watch.entry(1, channel.read_slots(), 102.0)
    assert entry.silent_s == 1.5 and entry.ranks == 2
    channel.set_state(1, STUCK)
    assert watch.entry(1, channel.read_slots(), 102.1).stuck == Stuck(rank=1, step=7)
    channel.set_state(0, FINISHED)
    channel.set_state(1, READY)
    entry = watch.entry(1, channel.read_slots(), 103.0)
    assert (entry.finished, entry.ready) == (1, 1) and entry.stuck is None and "stuck" not in entry.to_json()


@pytest.mark.unit
def test_the_node_message_carries_the_snapshot_folders_bytes_measured_at_a_bounded_rate(tmp_path: Path) -> None:
    """The file sizes under the launcher's folder, measured again only once ``SNAPSHOT_MEASURE_S`` passed; no
    figure with snapshots off."""
    folder = tmp_path / "titan_recover-snapshots-ab-1"
    (folder / "shard0").mkdir(parents=True)
    (folder / "shard0" / "step000000000010").write_bytes(b"x" * 3000)
    agent = NodeAgent("127.0.0.1:1", Run("secret", ""), slots=1, snapshots=str(folder))
    first = NodeMessage.loads("launcher/h:1:ab", agent.message().dumps().encode())
    assert first.snapshot_bytes == 3000
    (folder / "shard1").mkdir()
    (folder / "shard1" / "step000000000010").write_bytes(b"y" * 500)
    assert agent.message().snapshot_bytes == 3000  # measured a moment ago: not again yet
    agent._measured_at -= SNAPSHOT_MEASURE_S  # as if the interval passed
    assert agent.message().snapshot_bytes == 3500
    assert NodeAgent("127.0.0.1:1", Run("secret", ""), slots=1).message().snapshot_bytes is None
    assert "snapshot_bytes" not in json.loads(NodeAgent("127.0.0.1:1", Run("secret", ""), slots=1).message().dumps())


@pytest.mark.unit
def test_the_node_message_passes_the_coordinators_check_and_new_incarnations_get_fresh_files(tmp_path: Path) -> None:
    agent = NodeAgent("127.0.0.1:1", Run("secret", ""), slots=2)
    first = agent.open(0, 0)
    agent.open(1, 0)
    Channel.open(first).beat(0)
    raw = agent.message().dumps().encode()
    groups = NodeMessage.loads("launcher/x", raw).groups
    assert sorted(groups) == [0, 1] and groups[0].ranks == 1 and json.loads(raw)["seq"] == 1
    second = agent.open(0, 1)  # a restart: the old file is gone, the new one starts clean
    assert not os.path.exists(first) and os.path.exists(second)
    assert NodeMessage.loads("launcher/x", agent.message().dumps().encode()).groups[0].attempt == 1
    agent.close()
    assert not os.path.exists(second)


def test_a_rank_silent_past_the_timeout_is_reported_by_its_agent_once_per_incarnation() -> None:
    """A hang is found on its node, at the timeout, not at the coordinator's next pass over all nodes."""
    agent = NodeAgent("127.0.0.1:1", Run("secret", ""), slots=2, hang_timeout_s=0.2)
    agent.epoch = 3

    def beat_rank_0_for(seconds: float, channel: Channel) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            channel.beat(0)
            agent.message()  # what the lifeline does every heartbeat interval
            time.sleep(0.02)

    try:
        first = Channel.open(agent.open(0, 0))
        first.beat(1)
        beat_rank_0_for(0.1, first)
        assert agent.take_hangs() == []  # silent 0.1 s: not yet
        beat_rank_0_for(0.3, first)
        [report] = agent.take_hangs()
        assert (report.replica, report.suspect, report.epoch) == (0, 0, 3)
        assert report.cause.startswith("heartbeat silent for 0.2") and "local rank 1 of attempt 0" in report.cause
        beat_rank_0_for(0.1, first)
        assert agent.take_hangs() == []  # once per incarnation
        restart = Channel.open(agent.open(0, 1))
        restart.beat(1)
        beat_rank_0_for(0.3, restart)
        assert "of attempt 1" in agent.take_hangs()[0].cause
        quiet = NodeAgent("127.0.0.1:1", Run("secret", ""), slots=1)  # no timeout: left to the coordinator
        Channel.open(quiet.open(0, 0)).beat(0)
        time.sleep(0.05)
        quiet.message()
        assert quiet.take_hangs() == []
        quiet.close()
    finally:
        agent.close()


@pytest.mark.unit
def test_only_a_restart_none_of_whose_ranks_was_admitted_counts_as_never_admitted() -> None:
    """What the launcher stops at once when the run ends, instead of waiting for it to finish."""
    agent = NodeAgent("127.0.0.1:1", Run("secret", ""), slots=2)
    try:
        agent.open(0, 0)
        assert not agent.never_admitted(0)  # a first incarnation stays STARTING while it trains
        assert not agent.never_admitted(1)  # not a group of this node
        restart = Channel.open(agent.open(0, 1))
        assert agent.never_admitted(0)  # starting
        restart.set_state(0, READY)
        assert agent.never_admitted(0)  # waiting for its admission
        restart.set_state(1, RUNNING)
        assert not agent.never_admitted(0)  # admitted: it holds the state and finishes like any member
    finally:
        agent.close()


@pytest.mark.unit
@pytest.mark.parametrize(
    "groups",
    [
        {"0": {"attempt": -1, "ranks": 1, "ready": 0, "finished": 0, "silent_s": 0}},
        {"x": {"attempt": 0, "ranks": 1, "ready": 0, "finished": 0, "silent_s": 0}},
        {"0": {"attempt": 0, "ranks": 1, "ready": 0, "finished": 0}},
        {"0": {"attempt": 0, "ranks": 1, "ready": 0, "finished": 0, "silent_s": "1"}},
        {"0": {"attempt": 0, "ranks": 1, "ready": 0, "finished": 0, "silent_s": 0, "stuck": {"rank": "0"}}},
    ],
)
def test_a_malformed_node_message_is_refused_naming_the_key(groups: dict) -> None:
    with pytest.raises(protocol.MessageError, match="launcher/x"):
        NodeMessage.loads("launcher/x", json.dumps({"seq": 1, "groups": groups}).encode())


def test_the_channel_files_of_a_sigkilled_agent_are_removed_by_the_next_launcher(tmp_path: Path) -> None:
    """A SIGKILLed launcher cannot unlink its channel files; the next launcher on the node removes them
    (those of live agents and files that are not channels stay)."""
    code = (
        "import sys, time; from titan_recover.node.channel import Channel; "
        f"c = Channel.create(1, 0, 2, directory={str(tmp_path)!r}); print(c.path, flush=True); time.sleep(60)"
    )
    agent = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert agent.stdout is not None
    dead = agent.stdout.readline().strip()
    agent.kill()
    agent.wait()
    live = Channel.create(2, 0, 2, directory=str(tmp_path))
    other = tmp_path / "titan_recover-notes.txt"
    other.write_text("not a channel")
    assert os.path.exists(dead)
    assert remove_orphans(str(tmp_path)) == [os.path.basename(dead)]
    assert not os.path.exists(dead) and os.path.exists(live.path) and other.exists()
    live.remove()
