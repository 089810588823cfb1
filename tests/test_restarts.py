"""The restart budget per time window (titan_recover.policy.restarts) and the launcher's use of it (no processes)."""

import logging

import pytest
import torch.distributed as dist

from titan_recover.control import claims, keys, transport
from titan_recover.control.client import ControlClient
from titan_recover.control.protocol import Fence, Launcher, Rendezvous
from titan_recover.control.sealed import Run
from titan_recover.launch.torchruns import Meeting, Span, Torchruns
from titan_recover.node.agent import NodeAgent
from titan_recover.policy.restarts import RestartBudget, restart_allowed

pytestmark = pytest.mark.unit

HOUR = 3600.0


@pytest.mark.parametrize(
    "past, now, allowed",
    [
        ([], 0.0, True),
        ([0.0, 10.0], 20.0, True),
        ([0.0, 10.0, 20.0], 30.0, False),  # 3 within the hour: the 4th failure is one too many
        ([0.0, 10.0, 20.0], HOUR - 1, False),
        ([0.0, 10.0, 20.0], HOUR, True),  # the first is an hour old: it no longer counts
        ([0.0, 10.0, 20.0, HOUR, HOUR + 5], HOUR + 15, False),  # 10, 20 still count with the two new ones
        ([0.0, 10.0, 20.0, HOUR, HOUR + 5], HOUR + 20, True),
    ],
)
def test_restart_allowed_counts_only_the_window(past: list[float], now: float, allowed: bool) -> None:
    assert restart_allowed(past, now, max_restarts=3, window_s=HOUR) is allowed


def test_no_restarts_means_none_ever() -> None:
    assert not restart_allowed([], 0.0, max_restarts=0, window_s=HOUR)
    budget = RestartBudget(0, HOUR)
    assert not budget.take(1e9)
    assert budget.refusal(1e9) == "recover.max_restarts = 0 allows no restart"


def test_a_failure_every_few_hours_never_runs_out() -> None:
    budget = RestartBudget(3, HOUR)
    assert all(budget.take(t * 3 * HOUR) for t in range(1000))  # weeks of one failure per 3 hours
    assert budget.times == [999 * 3 * HOUR]  # older restarts are dropped


def test_flapping_is_refused_and_said_so() -> None:
    budget = RestartBudget(3, HOUR)
    assert [budget.take(t) for t in (0.0, 100.0, 1000.0)] == [True, True, True]
    assert budget.used(1000.0) == "restart 3 of 3 within 3600 s"
    assert not budget.take(1200.0)
    assert budget.times == [0.0, 100.0, 1000.0]  # a refusal records nothing
    assert budget.refusal(1200.0) == (
        "it failed 4 times within 3600 s (restarted 1200 s, 1100 s, 200 s ago, and failed again now; "
        "recover.max_restarts = 3 per recover.restart_window_s): it is flapping"
    )
    assert budget.take(HOUR)  # the one at 0 left the window


class FakeProc:
    def __init__(self) -> None:
        self.code: int | None = None

    def poll(self) -> int | None:
        return self.code

    @property
    def returncode(self) -> int | None:
        return self.code


def fake_proc(groups: Torchruns, replica: int) -> FakeProc:
    """The stand-in ``_start`` gave ``replica``'s torchrun."""
    proc = groups.procs[replica]
    assert isinstance(proc, FakeProc)
    return proc


def fake_client() -> ControlClient:
    """A run's client on an in-process store (torch's HashStore): the calls Torchruns.watch makes."""
    client = ControlClient(transport.in_run(dist.HashStore(), Run("restarts-test", "")))
    client.store.set(keys.EPOCH, "0")
    return client


def causes(client: ControlClient) -> list[str]:
    """The causes of the failure reports written so far, in order."""
    reports = [client.read_report(i) for i in range(1, client.report_count() + 1)]
    return [r.cause for r in reports if r is not None]


def test_replica_groups_restart_per_window_and_give_up_on_flapping(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)  # the launcher logs restarts at info
    started: list[tuple[int, int]] = []  # (replica, incarnation) of every torchrun started

    def start(self: Torchruns, replica: int) -> FakeProc:
        started.append((replica, self.incarnations[replica]))
        return FakeProc()

    monkeypatch.setattr(Torchruns, "_start", start)
    now = [0.0]
    me = Launcher.this()
    groups = Torchruns(
        [],
        {0: {}, 1: {}},
        1,
        max_restarts=1,
        restart_window_s=HOUR,
        launcher=me,
        agent=NodeAgent("127.0.0.1:1", Run("secret", ""), 1),
        clock=lambda: now[0],
    )
    client = fake_client()
    claims.claim(client, me, [0, 1], stale_s=1.0, log=print)
    for r in (0, 1):
        groups.start(r, client.next_incarnation(r))

    def fail(at: float) -> None:
        now[0] = at
        fake_proc(groups, 1).code = 9
        assert groups.watch(client)

    fail(10.0)
    fail(10.0 + 2 * HOUR)  # the first restart is outside the window: a whole-run budget of 1 refused this
    assert started == [(0, 0), (1, 0), (1, 1), (1, 2)]  # incarnation numbers keep growing
    fail(20.0 + 2 * HOUR)  # the second failure within the hour
    assert started == [(0, 0), (1, 0), (1, 1), (1, 2)] and groups.given_up == {1}
    assert groups.watch(client) and len(started) == 4  # given up for good
    assert causes(client) == [
        "torchrun of replica 1 exited with code 9",
        "torchrun of replica 1 exited with code 9",
        "torchrun of replica 1 exited with code 9 (no restarts left in the window)",
    ]
    out = caplog.text
    assert "replica group 1 exited with code 9; restart 1 of 1 within 3600 s (attempt 2)" in out
    assert (
        "replica group 1 exited with code 9; it failed 2 times within 3600 s (restarted 10 s ago, and failed "
        "again now; recover.max_restarts = 1 per recover.restart_window_s): it is flapping; not restarting it; "
        "the run goes on with the other groups"
    ) in out


def test_a_group_taken_over_by_another_launcher_is_left_to_it(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """This launcher looked dead (e.g. SIGSTOPped) and a replacement claimed its group: it must
    neither report that group's exit (it would fence the replacement's incarnation) nor restart it."""
    caplog.set_level(logging.INFO)  # the launcher logs restarts at info
    monkeypatch.setattr(Torchruns, "_start", lambda self, replica: FakeProc())
    me, replacement = Launcher.this(), Launcher.this()
    groups = Torchruns(
        [],
        {1: {}},
        1,
        max_restarts=3,
        restart_window_s=HOUR,
        launcher=me,
        agent=NodeAgent("127.0.0.1:1", Run("secret", ""), 1),
    )
    client = fake_client()
    claims.claim(client, me, [1], stale_s=1.0, log=print)
    groups.start(1, client.next_incarnation(1))
    client.store.compare_set(keys.owner_key(1), me.dumps(), replacement.dumps())  # the replacement's takeover
    fake_proc(groups, 1).code = -9  # fenced by the replacement's join, its ranks killed
    assert groups.watch(client)
    assert groups.given_up == {1} and groups.incarnations == {1: 0} and causes(client) == []
    assert "replica group 1 exited with code -9; another launcher took it over" in caplog.text
    assert groups.done()


def test_a_part_of_a_spanning_group_follows_part_0s_incarnations(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Part 1 of group 0 (group_nodes = 2): it starts only an incarnation part 0 published and nobody
    fenced, reports its own exit but restarts nothing itself (part 0's budget decides), and waits
    for the next incarnation; a launcher that took part 1 over skips the one its predecessor joined."""
    caplog.set_level(logging.INFO)  # the launcher logs restarts at info
    started: list[tuple[int, int, int]] = []  # (replica, incarnation, port)

    def start(self: Torchruns, replica: int) -> FakeProc:
        started.append((replica, self.incarnations[replica], self.meetings[replica].port))
        return FakeProc()

    monkeypatch.setattr(Torchruns, "_start", start)
    me, client = Launcher.this(), fake_client()
    client.store.set(keys.EPOCH, "0")
    groups = Torchruns(
        [],
        {0: {}},
        1,
        max_restarts=0,
        restart_window_s=HOUR,
        launcher=me,
        agent=NodeAgent("127.0.0.1:1", Run("secret", ""), 1),
        span=Span(1, 2),
    )
    claims.claim(client, me, [0], stale_s=1.0, log=print, part=1)
    groups.begin(client, 0, taken_over=False)
    assert groups.watch(client) and started == [] and not groups.done()  # nothing published yet
    publish = lambda incarnation, port: client.publish_rendezvous(0, Rendezvous(incarnation, "10.0.0.5", port))  # noqa: E731
    publish(0, 29600)
    assert groups.watch(client) and started == [(0, 0, 29600)]
    assert groups.meetings[0] == Meeting("10.0.0.5", 29600, 1, 2, 600.0)
    assert client.store.get(keys.joined_key(0, 1)) == b"0" and client.joined(0, 1) == 0
    fake_proc(groups, 0).code = 1  # its part fails: reported, not restarted here (no budget of its own: max_restarts 0)
    assert (
        groups.watch(client)
        and started == [(0, 0, 29600)]
        and causes(client) == ["torchrun of replica 0 (part 1 of 2) exited with code 1"]
    )
    assert groups.watch(client) and len(started) == 1  # the failed incarnation is not joined again
    client.fence(0, Fence(attempt=1, epoch=2))
    publish(1, 29601)
    assert groups.watch(client) and len(started) == 1  # published but fenced already: part 0 publishes another
    publish(2, 29602)
    assert groups.watch(client) and started[-1] == (0, 2, 29602)
    out = caplog.text
    assert "replica group 0 (part 1 of 2) exited with code 1; waiting for part 0 to start its next incarnation" in out
    assert "replica group 0 (part 1 of 2): joining incarnation 2 at 10.0.0.5:29602" in out

    replacement = Torchruns(
        [],
        {0: {}},
        1,
        max_restarts=0,
        restart_window_s=HOUR,
        launcher=me,
        agent=NodeAgent("127.0.0.1:1", Run("secret", ""), 1),
        span=Span(1, 2),
    )
    replacement.begin(client, 0, taken_over=True)  # its predecessor joined incarnation 2
    assert replacement.watch(client) and started[-1] == (0, 2, 29602)  # not joined
    assert causes(client)[-1] == "replica group 0 (part 1 of 2) lost with its launcher (attempt 2)"
    publish(3, 29603)
    assert replacement.watch(client) and started[-1] == (0, 3, 29603)
