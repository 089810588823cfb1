"""The coordinator's decisions against a real TCPStore, driven pass by pass from the test.

A ``Coordinator`` object serves a real store on a free port; the test plays the ranks
and launchers through real store clients, so every message crosses a socket.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from titan_recover.config import CoordinatorSettings, Recover
from titan_recover.control import keys, transport
from titan_recover.control.client import ControlClient
from titan_recover.control.protocol import Admission, Launcher, NodeGroup, NodeMessage, Report, StepRecord
from titan_recover.control.sealed import SealedStore
from titan_recover.coordinator.shell import REPORT_GRACE_S, Coordinator, serve
from titan_recover.observability.events import EventLog


@pytest.fixture
def make(tmp_path: Path) -> Iterator[Callable[..., tuple[Coordinator, SealedStore]]]:
    made: list[Coordinator] = []

    def make(replicas: int = 2, **recover: Any) -> tuple[Coordinator, SealedStore]:
        job = SimpleNamespace(
            recover=Recover(enable=True, **recover),
            parallelism=SimpleNamespace(
                data_parallel_replicate_degree=replicas,
                data_parallel_shard_degree=1,
                tensor_parallel_degree=1,
                pipeline_parallel_degree=1,
            ),
            training=SimpleNamespace(steps=10, global_batch_size=4, seq_len=16, mixed_precision_param="float32"),
            checkpoint=SimpleNamespace(enable=False, folder="checkpoint"),
        )
        settings = CoordinatorSettings.of(job, str(tmp_path))
        port = transport.free_port()
        c = serve(settings, port)
        made.append(c)
        JOBS[id(c)] = settings
        return c, transport.connect(f"127.0.0.1:{port}", timeout_s=10)

    yield make
    NODES.clear()
    JOBS.clear()
    for c in made:
        del c.control.store  # the coordinator's TCPStore server stops with its last reference


JOBS: dict[int, CoordinatorSettings] = {}


def successor(c: Coordinator, client: SealedStore) -> Coordinator:
    """The next leader of ``c``'s run, on the same store: it takes over the state ``c`` saved."""
    return Coordinator(JOBS[id(c)], client, EventLog(os.path.dirname(c.events.path)))


def events(tmp_path: Path, kind: str) -> list[dict]:
    lines = (tmp_path / "recover_events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == kind]


class FakeNode:
    """Plays a node agent over a real store client: registers, then writes node messages
    exactly as ``agent.NodeAgent`` does (each replica group here has one rank)."""

    def __init__(self, client: SealedStore, name: str = "node-a") -> None:
        self.control, self.launcher, self.seq = ControlClient(client), Launcher(name, "localhost", 1), 0
        self.groups: dict[int, NodeGroup] = {}
        self.control.register(self.launcher, self.message())

    def message(self) -> NodeMessage:
        self.seq += 1
        return NodeMessage(self.seq, dict(self.groups))

    def write(self) -> None:
        self.control.write_node(self.launcher, self.message())

    def write_raw(self, groups: dict[str, object]) -> None:
        """A node message whose groups are written as given (malformed fields)."""
        self.seq += 1
        self.control.store.set(self.launcher.key, json.dumps({"seq": self.seq, "groups": groups}))

    def entry(self, replica: int, incarnation: int | None = None, ready: int = 0) -> None:
        old = self.groups.get(replica, NodeGroup(0, 1, 0, 0, 0.0))
        self.groups[replica] = NodeGroup(
            attempt=old.attempt if incarnation is None else incarnation,
            ranks=1,
            ready=ready if incarnation is not None else old.ready,
            finished=0,
            silent_s=0.0,
        )

    def beat(self, *replicas: int) -> None:
        for r in replicas:
            self.entry(r)
        self.write()

    def hang(self, replica: int, silent_s: float) -> None:
        """Its rank has not beaten for ``silent_s``, as the agent counts it."""
        self.groups[replica] = dataclasses.replace(self.groups[replica], silent_s=silent_s)
        self.write()


NODES: dict[int, FakeNode] = {}


def node(client: SealedStore) -> FakeNode:
    if id(client) not in NODES:
        NODES[id(client)] = FakeNode(client)
    return NODES[id(client)]


def beat(client: SealedStore, *replicas: int) -> None:
    node(client).beat(*replicas)


def poll(c: Coordinator, now: float) -> None:
    """One read of the node messages (the coordinator reads them once per heartbeat interval)."""
    c.next_node_read = 0.0
    c._poll_nodes(now)


def joins(c: Coordinator, now: float) -> bool:
    """Reads the node messages, then admits or parks waiting groups as one coordinator pass does; False once the run
    stops."""
    poll(c, now)
    if c.core.asking:  # a join may fence a group's previous incarnation: steps committed before it come first
        c._poll_steps()
    return c._apply(c.core.on_joins(now))


def fence(c: Coordinator, failed: dict[int, str]) -> bool:
    """The next epoch without ``failed``, as a pass publishes it; False once the run stops."""
    c._poll_steps()  # a step committed just before the failure belongs before it
    return c._apply(c.core.on_failure(failed, time.monotonic()))


def retry_step(c: Coordinator) -> bool:
    """A step's collectives broke with nobody silent: the pass's retry; False once the run stops."""
    c._poll_steps()
    return c._apply(c.core.on_retry(time.monotonic()))


def report(client: SealedStore, **fields: Any) -> None:
    """A failure report, as a rank or a launcher writes it."""
    ControlClient(client).report(Report(**fields))


def raw_report(client: SealedStore, rec: object) -> None:
    """A report slot reserved, then written with ``rec`` as raw JSON (malformed fields)."""
    index = int(client.add(keys.REPORTS, 1))
    client.set(keys.report_key(index), json.dumps(rec))


def fatal(client: SealedStore) -> str:
    error = ControlClient(client).fatal()
    assert error is not None
    return error


def test_a_reserved_but_never_written_report_slot_blocks_no_later_report(make) -> None:
    c, client = make()
    client.add(keys.REPORTS, 1)  # a reporter reserved slot 1 and died before writing it
    report(client, replica=0, epoch=0, suspect=1, cause="torchrun of replica 1 exited")
    now = time.monotonic()
    beat(client, 0, 1)
    poll(c, now)
    c._poll_reports(now)
    failed, _ = c.core.detector.decide(now)
    assert failed == {1: "torchrun of replica 1 exited"}  # slot 2 was read past the empty slot 1
    assert c.core.state.unread_reports == [1]
    c._poll_reports(now + REPORT_GRACE_S + 0.1)
    assert c.core.state.unread_reports == []  # given up on after the grace period: nothing is retried forever


def test_malformed_reports_and_joins_are_ignored_not_fatal(make, caplog: pytest.LogCaptureFixture) -> None:
    c, client = make()
    raw_report(client, {"replica": 0, "epoch": "0", "suspect": 1, "cause": "x"})  # epoch as a string
    raw_report(client, {"replica": 0, "epoch": 0, "suspect": "1", "cause": "x"})
    raw_report(client, {"replica": 0, "epoch": 0, "suspect": 1, "cause": ["x"]})
    raw_report(client, {"replica": 1, "epoch": 0, "suspect": 1, "attempt": -1, "cause": "x"})
    node(client).write_raw({"1": {"attempt": "one", "ranks": 1, "ready": 1, "finished": 0, "silent_s": 0.0}})
    client.set(keys.report_key(99), json.dumps("not even an object"))
    now = time.monotonic()
    c._poll_reports(now)
    assert joins(c, now)
    assert c.core.detector.decide(now) == ({}, False)  # nothing was taken from them
    out = caplog.text  # the coordinator's warnings
    assert out.count("ignoring malformed report") == 4 and "ignoring malformed node message" in out
    assert "a group needs non-negative integers" in out and "(group 1)" in out
    report(client, replica=0, epoch=0, suspect=1, cause="real")
    c._poll_reports(now)
    assert c.core.detector.decide(now)[0] == {1: "real"}  # and later reports still count


def test_a_silent_rank_is_stamped_with_its_last_heartbeat(make, tmp_path: Path) -> None:
    """Latency of a hang counts from when the rank went silent, not from its detection."""
    c, client = make(heartbeat_timeout_s=0.6)
    beat(client, 0, 1)
    frozen = time.monotonic()
    poll(c, frozen)  # then replica 1 is frozen (SIGSTOP from outside: no fault record)
    deadline = time.monotonic() + 10
    while True:
        now = time.monotonic()
        beat(client, 0)
        node(client).hang(1, time.monotonic() - frozen)
        poll(c, now)
        failed, _ = c.core.detector.decide(now)
        if failed:
            break
        assert now < deadline
        time.sleep(0.02)
    assert list(failed) == [1]
    assert fence(c, failed)
    (failure,) = events(tmp_path, "failure")
    (recovered,) = events(tmp_path, "recovered")
    assert failure["clock"] == "last_heartbeat"
    assert 0.6 <= recovered["latency_s"] < 2.0, recovered


def test_a_joiner_that_took_part_in_a_committed_step_keeps_the_run(make) -> None:
    """The leader (the joiner's donor) dies right after the joiner's first commit: the
    joiner holds that step's state, so the run goes on with it."""
    c, client = make()
    assert fence(c, {1: "killed"})
    ask_to_join(client, 1, 1)
    assert joins(c, time.monotonic())
    assert c.core.state.joining == {1: 2} and c.membership.members == (0, 1)
    client.set(keys.decision_key(1, 2), "commit")  # step 1 committed in epoch 2; nobody logged it yet
    assert fence(c, {0: "torchrun of replica 0 exited"})
    assert c.membership.members == (1,)
    assert not client.check([keys.FATAL])


def test_without_a_commit_a_lone_joiner_cannot_carry_the_run(make) -> None:
    c, client = make()
    assert fence(c, {1: "killed"})
    ask_to_join(client, 1, 1)
    assert joins(c, time.monotonic())
    assert not fence(c, {0: "killed"})
    assert "no replica group with training state" in fatal(client)


def _broken_allreduce(c: Coordinator, client: SealedStore, *reporters: int) -> tuple[dict, bool]:
    for r in reporters:
        report(client, replica=r, epoch=c.membership.epoch, suspect=None, cause="all-reduce broke")
    now = time.monotonic()
    beat(client, 0, 1, 2)
    poll(c, now)
    c._poll_reports(now)
    later = now + c.rc.report_confirm_s + 0.01
    beat(client, 0, 1, 2)
    poll(c, later)
    return c.core.detector.decide(later)


def test_retries_of_a_step_are_bounded_then_the_replica_that_held_it_up_is_fenced(make, tmp_path: Path) -> None:
    c, client = make(replicas=3, max_step_retries=2, report_confirm_s=0.2)
    for incarnation in range(2):
        failed, retry = _broken_allreduce(c, client, 0, 2)
        assert (failed, retry) == ({}, True)
        assert retry_step(c)
        assert c.membership.members == (0, 1, 2)  # retried with the same members
    failed, retry = _broken_allreduce(c, client, 0, 2)
    assert retry and retry_step(c)
    assert c.membership.members == (0, 2)  # replica 1 never reported a break: the others waited for it
    (failure,) = events(tmp_path, "failure")
    assert failure["replica"] == 1 and "never did" in failure["cause"]


def test_when_every_replica_reports_breaks_the_run_stops_naming_them(make) -> None:
    c, client = make(replicas=2, max_step_retries=1, report_confirm_s=0.2)
    _broken_allreduce(c, client, 0, 1)
    assert retry_step(c)
    _broken_allreduce(c, client, 0, 1)
    assert not retry_step(c)
    error = fatal(client)
    assert "every replica ([0, 1])" in error and "network" in error


def test_the_same_error_on_two_replicas_stops_the_run_as_the_jobs_own(make, tmp_path: Path) -> None:
    c, client = make(replicas=3)
    error = "NotImplementedError: FlexAttention has no CPU backward"
    for r in (0, 2):
        report(client, replica=r, epoch=0, step=1, suspect=r, cause=f"rank 0 raised {error}", error=error)
    now = time.monotonic()
    c._poll_reports(now)
    failed, _ = c.core.detector.decide(now)
    assert sorted(failed) == [0, 2]
    assert not fence(c, failed)
    (fatal,) = events(tmp_path, "fatal")
    assert "the job's own error" in fatal["error"] and "[0, 2]" in fatal["error"] and error in fatal["error"]


def test_one_replicas_own_error_is_treated_as_its_failure(make) -> None:
    c, client = make(replicas=3)
    report(client, replica=1, epoch=0, step=4, suspect=1, cause="rank 0 raised E", error="E")
    now = time.monotonic()
    c._poll_reports(now)
    assert fence(c, c.core.detector.decide(now)[0])
    assert c.membership.members == (0, 2)


# --- hot spares ------------------------------------------------------------------------


def ask_to_join(client: SealedStore, replica: int, incarnation: int) -> None:
    """Every rank of that incarnation is up and waits to be admitted (its slot says READY)."""
    node(client).entry(replica, incarnation, ready=1)
    node(client).write()


def test_a_spare_waits_while_the_membership_is_full_and_replaces_a_failed_group_at_once(make, tmp_path: Path) -> None:
    c, client = make(spares=1)
    ask_to_join(client, 2, 0)  # the spare, up since the start
    assert joins(c, time.monotonic())
    assert c.membership.members == (0, 1) and c.core.state.spares == {2: 0}
    assert not client.check([keys.admitted_key(2, 0)])
    assert fence(c, {1: "torchrun of replica 1 exited"})
    assert joins(c, time.monotonic())  # the very next pass: no process start in between
    assert c.membership.members == (0, 2) and c.core.state.spares == {}
    assert ControlClient(client).read(keys.admitted_key(2, 0), Admission) == Admission(attempt=0, epoch=2)
    (admitted,) = events(tmp_path, "admitted")
    assert admitted["replica"] == 2 and admitted["replaces"] == 1
    ask_to_join(client, 1, 1)  # the failed group, restarted, becomes the spare
    assert joins(c, time.monotonic())
    assert c.membership.members == (0, 2) and c.core.state.spares == {1: 1}
    assert [e["replica"] for e in events(tmp_path, "spare_ready")] == [2, 1]


def test_a_spare_replacing_a_group_is_timed_from_that_groups_failure(make, tmp_path: Path) -> None:
    c, client = make(spares=1)
    ask_to_join(client, 2, 0)
    joins(c, time.monotonic())
    assert fence(c, {1: "killed"})
    failed_at = c.core.state.down_since[1]
    joins(c, time.monotonic())
    assert c.core.state.repairs == {2: (1, failed_at)}
    assert fence(c, {2: "killed while receiving its state"})  # the spare dies before its first step
    assert c.core.state.down_since == {1: failed_at}  # replica 1's failure is open again, not the spare's
    ask_to_join(client, 1, 1)
    joins(c, time.monotonic())
    assert c.core.state.repairs == {1: (1, failed_at)}
    ControlClient(client).offer_step(
        StepRecord(
            step=1,
            epoch=c.membership.epoch,
            members=[0, 1],
            microbatches=[0, 1],
            data_digest="0",
            loss=1.0,
            grad_norm=None,
            time=failed_at + 30.0,
        )
    )
    c._poll_steps()
    c._apply(c.core.on_rejoined(c._transfers))
    (rejoined,) = events(tmp_path, "rejoined")
    assert rejoined["replica"] == 1 and "replaces" not in rejoined and rejoined["downtime_s"] == pytest.approx(30.0)


def test_a_spare_that_hangs_while_waiting_is_fenced_not_admitted(make, tmp_path: Path) -> None:
    c, client = make(spares=1, heartbeat_timeout_s=1.0, report_confirm_s=0.5)
    ask_to_join(client, 2, 0)
    now = time.monotonic()
    joins(c, now)
    beat(client, 0, 1, 2)
    poll(c, now)
    later = now + 1.5
    for t in (0.4, 0.8, 1.2, 1.5):  # read every node message as often as the coordinator does
        beat(client, 0, 1)
        node(client).hang(2, t)  # the spare's heartbeat stalled (SIGSTOP)
        poll(c, now + t)
    joins(c, later)
    assert c.core.state.spares == {}
    fenced = ControlClient(client).read_fence(2)
    assert fenced is not None and fenced.attempt == 0  # its launcher kills it
    (lost,) = events(tmp_path, "spare_lost")
    assert lost["replica"] == 2 and "waiting as a spare" in lost["cause"]
    assert fence(c, {1: "killed"})
    joins(c, later)
    assert c.membership.members == (0,)  # the hung spare is not admitted
    ask_to_join(client, 2, 1)  # restarted by its launcher: a spare again
    joins(c, later + 0.1)
    assert c.membership.members == (0, 2)


def test_a_store_stall_is_not_taken_for_every_group_going_silent(make, tmp_path: Path) -> None:
    """No node message read for more than half the heartbeat timeout (an etcd election, a frozen
    coordinator): the unchanged messages say nothing, every group gets one timeout from now."""
    c, client = make(heartbeat_timeout_s=2.0)
    now = time.monotonic()
    beat(client, 0, 1)
    poll(c, now)
    poll(c, now + 1.8)  # nothing read in between, nothing written: the store stalled
    assert c.core.detector.decide(now + 2.5) == ({}, False)  # without the grace both were silent 2.5 s
    failed, _ = c.core.detector.decide(now + 1.8 + 2.1)  # still silent a timeout after the stall: failed
    assert sorted(failed) == [0, 1]


def test_a_slow_read_in_which_most_nodes_moved_finds_the_silent_one(make, tmp_path: Path) -> None:
    """A gap over half the heartbeat timeout in which most node messages moved (a read that is slow, as
    folding 100,000 ranks is, not a stalled store): no grace, the silent node's group fails on time."""
    c, client = make(heartbeat_timeout_s=2.0)
    a, b = node(client), FakeNode(client, "node-b")
    now = time.monotonic()
    a.beat(0)
    b.beat(1)
    poll(c, now)
    a.beat(0)  # node-b's lifeline wrote nothing since
    poll(c, now + 1.8)
    failed, _ = c.core.detector.decide(now + 2.1)  # with the grace neither would fail before now + 3.8
    assert sorted(failed) == [1]


def test_a_spare_whose_launcher_reports_it_dead_is_dropped_at_once(make, tmp_path: Path) -> None:
    c, client = make(spares=1)
    ask_to_join(client, 2, 0)
    now = time.monotonic()
    joins(c, now)
    report(client, replica=2, epoch=0, suspect=2, cause="torchrun of replica 2 exited with code 1")
    c._poll_reports(now)
    assert c.core.state.spares == {} and c.core.detector.decide(now) == ({}, False)  # no member failed
    (lost,) = events(tmp_path, "spare_lost")
    assert lost["cause"] == "torchrun of replica 2 exited with code 1"


def test_a_launchers_report_about_another_incarnation_is_ignored(make, tmp_path: Path) -> None:
    """A report crossed the group's restart: it names the incarnation it saw, not the one the run holds."""
    c, client = make(spares=1)
    ask_to_join(client, 2, 1)  # the spare's second incarnation
    now = time.monotonic()
    joins(c, now)
    report(client, replica=2, epoch=0, suspect=2, attempt=0, cause="heartbeat silent for 5.10s")
    report(client, replica=1, epoch=0, suspect=1, attempt=1, cause="torchrun exited")
    c._poll_reports(now)
    assert c.core.state.spares == {2: 1} and c.core.detector.decide(now) == ({}, False)
    report(client, replica=1, epoch=0, suspect=1, attempt=0, cause="torchrun exited")
    c._poll_reports(now)
    assert c.core.detector.decide(now)[0] == {1: "torchrun exited"}  # the incarnation the run holds


def test_a_restarted_group_with_room_is_admitted_without_waiting_as_a_spare(make, tmp_path: Path) -> None:
    c, client = make(spares=1)
    assert fence(c, {1: "killed"})
    ask_to_join(client, 1, 1)
    assert joins(c, time.monotonic())
    assert c.membership.members == (0, 1) and c.core.state.spares == {}
    assert not (tmp_path / "recover_events.jsonl").read_text().count('"spare_ready"')


def test_the_saved_state_holds_an_admission_as_soon_as_it_is_published(make) -> None:
    """A leader that dies right after admitting a group leaves its successor the admission: the state
    is saved after the transition (it was saved with the epoch, before the admitted group's incarnation,
    joining epoch and repair were recorded, so a successor lost them until the next step)."""
    c, client = make(spares=1)
    ask_to_join(client, 2, 0)
    joins(c, time.monotonic())
    assert fence(c, {1: "killed"})
    assert joins(c, time.monotonic())
    saved = ControlClient(client).read_state()
    assert saved is not None and saved == c.core.state
    assert saved.attempts[2] == 0 and saved.joining == {2: c.membership.epoch} and 2 in saved.repairs


# --- admissions, takeovers and malformed records ---------------------------------------


class Recording:
    """A store that remembers the order of the keys set through it (the rest passes through)."""

    def __init__(self, store: SealedStore) -> None:
        self.store = store
        self.sets: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def set(self, key: str, value: str | bytes) -> None:
        self.sets.append(key)
        self.store.set(key, value)


def test_the_admission_is_in_the_store_before_the_epoch_that_includes_it(make) -> None:
    """A joiner reads its admission when its node agent shows it a new epoch: one published first
    cost it that whole epoch while its donors' rendezvous timed out."""
    c, client = make()
    assert fence(c, {1: "killed"})
    c.control.store = recording = Recording(c.control.store)
    ask_to_join(client, 1, 1)
    assert joins(c, time.monotonic()) and c.membership.epoch == 2
    assert recording.sets.index(keys.admitted_key(1, 1)) < recording.sets.index(keys.EPOCH)


def test_a_new_leader_reads_a_report_slot_reserved_before_it_took_over(make) -> None:
    """A reporter reserved a slot, the leader found it empty and died; the reporter writes it after the takeover."""
    c, client = make()
    client.add(keys.REPORTS, 1)  # reserved; its reporter is slow to write it
    c._poll_reports(time.monotonic())
    ControlClient(client).offer_step(
        StepRecord(
            step=1,
            epoch=0,
            members=[0, 1],
            microbatches=[0, 1],
            data_digest="0",
            loss=1.0,
            grad_norm=None,
            time=time.time(),
        )
    )
    c._poll_steps()  # saves the state (next_report is past the empty slot)
    leader = successor(c, client)
    assert leader.core.state.unread_reports == [1]
    ControlClient(client).put(
        keys.report_key(1), Report(epoch=0, cause="torchrun of replica 1 exited", replica=0, suspect=1)
    )
    now = time.monotonic()
    leader._poll_reports(now)
    assert leader.core.detector.decide(now)[0] == {1: "torchrun of replica 1 exited"}


def test_a_malformed_step_record_is_an_event_and_later_steps_are_logged(make, tmp_path: Path) -> None:
    """Members write a step's record once: a malformed one is never rewritten, so the step counts as
    committed without its record (the store says it committed) and the next steps are logged."""
    c, client = make()
    client.set(keys.step_key(1), "{not json")
    client.set(keys.decision_key(1, 0), "commit")
    ControlClient(client).offer_step(
        StepRecord(
            step=2,
            epoch=0,
            members=[0, 1],
            microbatches=[0, 1],
            data_digest="0",
            loss=1.0,
            grad_norm=None,
            time=time.time(),
        )
    )
    c._poll_steps()
    (unrecorded,) = events(tmp_path, "step_unrecorded")
    assert unrecorded["step"] == 1 and unrecorded["epoch"] == 0 and "'step/1'" in unrecorded["error"]
    assert [e["step"] for e in events(tmp_path, "step")] == [2]
    assert c.core.step() == 3


def test_a_malformed_step_record_of_a_step_not_committed_waits(make, tmp_path: Path) -> None:
    c, client = make()
    client.set(keys.step_key(1), json.dumps({"step": 7}))
    c._poll_steps()
    c._poll_steps()
    assert c.core.step() == 1 and not events(tmp_path, "step_unrecorded")


# --- forgetting ------------------------------------------------------------------------


def test_a_silent_launcher_whose_claims_were_taken_over_is_forgotten(make) -> None:
    c, client = make(heartbeat_timeout_s=1.0)
    old, kept = FakeNode(client, "node-old"), FakeNode(client, "node-kept")
    for n, replica in ((old, 0), (kept, 1)):
        client.set(keys.owner_key(replica), n.launcher.dumps())
        n.beat(replica)
    now = time.monotonic()
    poll(c, now)
    assert set(c.nodes) == {old.launcher.key, kept.launcher.key}
    new = FakeNode(client, "node-new")  # the same command started again on node-old's node: it takes its claims over
    client.set(keys.owner_key(0), new.launcher.dumps())
    new.beat(0)
    poll(c, now + 2.0)  # node-old and node-kept are silent for 2 s; only node-kept still holds a claim
    assert set(c.nodes) == {kept.launcher.key, new.launcher.key}
    assert not client.check([old.launcher.key]) and client.check([kept.launcher.key])
    new.beat(0)
    poll(c, now + 2.5)  # the forgotten node's message is not read (a read of a missing key would block)
    assert set(c.nodes) == {kept.launcher.key, new.launcher.key}


def test_a_pass_told_which_keys_were_put_reads_only_those(make) -> None:
    c, client = make()
    report(client, replica=0, epoch=0, suspect=1, cause="torchrun of replica 1 exited")
    ControlClient(client).stop("a rank's data error")
    now = time.monotonic()
    c._poll_reports(now, changed=set())  # a put elsewhere (etcd's watch said which): the counter is not read
    assert c.core.state.next_report == 1 and c.core.detector.decide(now) == ({}, False)
    assert c._pass(changed={"step/3"}) is None  # the fatal is not read either
    c._poll_reports(now, changed={keys.REPORTS})
    assert c.core.detector.decide(now)[0] == {1: "torchrun of replica 1 exited"}
    assert c._pass(changed={keys.FATAL}) == 1


def test_a_launcher_registered_during_a_pass_that_reads_no_node_message_is_named_at_the_next_read(make) -> None:
    c, client = make()
    now = time.monotonic()
    poll(c, now)
    assert not c.nodes
    node(client)  # registers
    c.next_node_read = now + 1
    c._poll_nodes(now, changed={keys.NODES, keys.node_key(1)})  # too early to read node messages: the put is kept
    c._poll_nodes(now + 1, changed=set())
    assert len(c.nodes) == 1


def test_each_nodes_snapshot_memory_is_logged_as_it_grows_and_its_peak_at_the_end(make, tmp_path: Path) -> None:
    """Node messages with the bytes of their launcher's snapshot folder: the coordinator logs a node's figure
    once it reaches 1 MiB and each time it passes 1.25 times the last logged one, the exact peak at the end, and
    nothing for a node with snapshots off."""
    c, client = make()
    a, off = FakeNode(client, "host-a:11:aa"), FakeNode(client, "host-b:12:bb")
    mib, now = 1 << 20, time.monotonic()
    for size in (4321, 10 * mib, 12 * mib, 20 * mib, 15 * mib, 21 * mib, 0):
        a.seq += 1
        a.control.write_node(a.launcher, NodeMessage(a.seq, {}, snapshot_bytes=size))
        off.write()
        poll(c, now)
    assert [(e["node"], e["bytes"]) for e in events(tmp_path, "host_memory")] == [
        ("host-a:11", 10 * mib),
        ("host-a:11", 20 * mib),
    ]
    c.end()
    assert [e["bytes"] for e in events(tmp_path, "host_memory")] == [10 * mib, 20 * mib, 21 * mib]
