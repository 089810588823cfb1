"""Membership and failure decisions: pure logic, no processes, no store.

The coordinator feeds heartbeats and reports in and publishes what comes out, so
every rule here is testable in microseconds.
"""

import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

from titan_recover.control.protocol import Membership, NodeGroup


class TooFewReplicasError(RuntimeError):
    """Fewer live replica groups than ``recover.min_replicas``."""


class StateLost(TooFewReplicasError):
    """No member with training state is left: every group is gone or still waiting for its state. With
    host-memory snapshots the run resumes from them (``policy.resume``); without, from a checkpoint."""


def next_membership(
    current: Membership, failed: Iterable[int], min_replicas: int, joining: Iterable[int] = ()
) -> Membership:
    """The membership after fencing ``failed``; a new epoch even when nobody left (a retry).

    ``joining`` are members still waiting for their state: at least one member must
    hold the training state, or nobody could hand it on.
    """
    gone = set(failed)
    members = tuple(m for m in current.members if m not in gone)
    holders = set(members) - set(joining)
    if len(members) < min_replicas:
        raise (TooFewReplicasError if holders else StateLost)(
            f"only {len(members)} replica group(s) left {list(members)} after losing "
            f"{sorted(gone)}; recover.min_replicas is {min_replicas}"
        )
    if not holders:
        raise StateLost(
            f"no replica group with training state is left after losing {sorted(gone)} "
            f"(only rejoining groups {list(members)}); resume from a checkpoint"
        )
    return Membership(current.epoch + 1, members)


def admit(current: Membership, joiner: int) -> Membership:
    """The membership that admits a (re)started replica group, in a new epoch."""
    if joiner in current.members:
        raise ValueError(f"replica {joiner} is already a member of epoch {current.epoch}; fence it first")
    return Membership(current.epoch + 1, tuple(sorted((*current.members, joiner))))


def repaired_failure(joiner: int, down_since: dict[int, float]) -> int | None:
    """Which failed replica an admission makes good: the joiner's own failure when it was a
    failed member coming back, else the longest-standing one (a spare takes its place), or
    None when nothing failed (a group that joins a run that lacked it from the start)."""
    if joiner in down_since:
        return joiner
    return min(down_since, key=lambda r: (down_since[r], r)) if down_since else None


def joiners(history: Sequence[Membership]) -> tuple[int, ...]:
    """Members of the last epoch that lack the state the step started from.

    ``history`` runs from the epoch the previous step committed with to now. A
    member absent from any of these epochs was (re)admitted during the step: it
    must receive the state before it can take part in the step's all-reduce.
    """
    last = history[-1].members
    return tuple(r for r in last if any(r not in m.members for m in history))


def awaited(history: Sequence[Membership], leaving: Iterable[int]) -> tuple[int, ...]:
    """The groups of ``leaving`` (they said in the previous step's all-reduce that they leave after it) still in
    every epoch of ``history`` (from that step's commit epoch on): the step's all-reduce would wait for them, so
    it waits for an epoch without them instead. One absent from any epoch since is gone, even if admitted again."""
    return tuple(sorted(r for r in set(leaving) if all(r in m.members for m in history)))


def donor(membership: Membership, joining: Sequence[int], joiner: int) -> int:
    """Which member sends ``joiner`` its state: joiners are spread over the members with state."""
    donors = [m for m in membership.members if m not in joining]
    if not donors:
        raise TooFewReplicasError(f"epoch {membership.epoch} has no member with training state")
    return donors[sorted(joining).index(joiner) % len(donors)]


def join_action(
    members: Sequence[int], replica: int, admitted_incarnation: int, incarnation: int, ready: int, shards: int
) -> str:
    """What the coordinator does with a join request of incarnation ``incarnation`` of ``replica``.

    "wait": not every rank of the group is up yet, or the request is stale;
    "admit": admit it in a new epoch; "replace": its previous incarnation is still a
    member (the restart beat detection), so fence that first, then admit.
    """
    if incarnation <= admitted_incarnation or ready < shards:
        return "wait"
    return "replace" if replica in members else "admit"


@dataclass(frozen=True)
class GroupView:
    """One incarnation of a replica group, folded from the node messages of the nodes it runs on."""

    ranks: int  # ranks that have beaten (or finished)
    ready: int  # ranks waiting to be admitted
    finished: int
    alive_at: float  # when its most silent rank last beat (coordinator's clock)
    stuck: str | None = None  # why a rank's main loop counts as stuck, if one's does
    # when the most silent of the launchers running it last wrote its node message (coordinator's clock): one that
    # stopped writing (its node gone) restarts nothing
    launcher_at: float = math.inf


def group_views(entries: Iterable[tuple[int, NodeGroup, float]]) -> dict[tuple[int, int], GroupView]:
    """(replica, incarnation) -> its view, from (replica, node message entry, when that message was
    last seen changing): counts add up over nodes, the most silent node sets ``alive_at`` and ``launcher_at``."""
    views: dict[tuple[int, int], GroupView] = {}
    for replica, entry, seen in entries:
        key = (replica, entry.attempt)
        stuck = entry.stuck
        why = (
            None if stuck is None else f"the main loop of its rank {stuck.rank} made no progress (at step {stuck.step})"
        )
        view = GroupView(entry.ranks, entry.ready, entry.finished, seen - entry.silent_s, why, seen)
        old = views.get(key)
        if old is not None:
            view = GroupView(
                view.ranks + old.ranks,
                view.ready + old.ready,
                view.finished + old.finished,
                min(view.alive_at, old.alive_at),
                old.stuck or why,
                min(view.launcher_at, old.launcher_at),
            )
        views[key] = view
    return views


def store_stalled(gap_s: float, timeout_s: float, moved: int, read: int) -> bool:
    """Whether ``read`` node messages, unread for ``gap_s``, say nothing about the groups: the gap is over
    half the heartbeat timeout (an etcd election, a frozen coordinator, a slow read) and fewer than half of
    the messages moved. A live lifeline rewrites its message every interval, so where most moved the store
    took their writes, and the unmoved nodes are silent indeed: a read that is slow, not stalled (a
    coordinator folding 100,000 ranks), must not give a dead node a new timeout at every read."""
    return gap_s > timeout_s / 2 and 2 * moved < read


@dataclass
class FailureDetector:
    """Decides which replica groups have failed from heartbeats and reports.

    - A report that names a suspect (a rank whose own group's collective broke, or the
      launcher seeing a group's process exit) fences that group at once.
    - A report without a suspect (a replicate-dim collective error: some peer is gone)
      fences, ``confirm_s`` later, every member whose heartbeat was silent that long;
      if nobody was silent, the epoch is retried with the same members. A waiting report
      (peers' commit votes or digests long missing) fences the same way and retries nothing:
      a peer that died between collectives is found without waiting ``timeout_s``.
    - A group one of whose ranks has not beaten for ``timeout_s`` (or ``startup_s`` before
      every rank's first beat) is failed: this catches hangs and dead nodes. Beats arrive
      folded per group from the node messages (``group_views``).
    A slow rank whose heartbeat thread still runs is never failed.
    """

    members: tuple[int, ...]
    timeout_s: float
    confirm_s: float
    startup_s: float
    start: float
    _beats: dict[int, float] = field(default_factory=dict)  # replica -> when its most silent rank last beat
    _suspects: dict[int, str] = field(default_factory=dict)
    _unnamed: list[tuple[float, str, bool]] = field(default_factory=list)  # (when, cause, whether it retries)

    def set_members(self, members: Iterable[int], now: float | None = None) -> None:
        """Called with each new epoch. Pending unnamed reports were about the old epoch
        and are dropped; new members count as having beaten at ``now`` (a joiner's old
        beats are stale)."""
        new = tuple(sorted(members))
        fresh = set(new) - set(self.members)
        self.members = new
        self._suspects = {r: c for r, c in self._suspects.items() if r in self.members}
        self._unnamed = []
        for replica in fresh:
            self.expect(replica, self.start if now is None else now)

    def expect(self, replica: int, now: float) -> None:
        """The replica counts as having beaten at ``now``: a group that has just come up
        (beats of its earlier incarnation are stale)."""
        self._beats[replica] = now

    def beat(self, replica: int, alive_at: float) -> None:
        """Every rank of the replica's current incarnation had beaten at ``alive_at``."""
        self._beats[replica] = max(alive_at, self._beats.get(replica, alive_at))

    def silent_since(self, replica: int) -> float | None:
        """When the replica's most silent rank last beat (None if one never did)."""
        return self._beats.get(replica)

    def report(self, suspect: int | None, cause: str, now: float, waiting: bool = False) -> None:
        if suspect is None:
            self._unnamed.append((now, cause, not waiting))
        elif suspect in self.members:
            self._suspects.setdefault(suspect, cause)

    def withdraw(self, replicas: Iterable[int]) -> None:
        """The reports naming these are void: their leave became the run's stop in order."""
        for replica in replicas:
            self._suspects.pop(replica, None)

    def _silent_for(self, replica: int, now: float) -> tuple[float, bool]:
        """Longest silence among the replica's ranks, and whether one never beat."""
        last = self._beats.get(replica)
        return (now - self.start, True) if last is None else (now - last, False)

    def decide(self, now: float) -> tuple[dict[int, str], bool]:
        """Returns (failed replica -> cause, retry): retry means bump the epoch anyway."""
        failed = dict(self._suspects)
        retry = False
        due = [(c, retries) for t, c, retries in self._unnamed if now >= t + self.confirm_s]
        for replica in self.members:
            if replica in failed:
                continue
            silent, never = self._silent_for(replica, now)
            if never and silent >= self.startup_s:
                failed[replica] = f"no heartbeat within {self.startup_s:g}s of start"
            elif not never and silent >= self.timeout_s:
                failed[replica] = f"heartbeat silent for {silent:.2f}s"
            elif due and not never and silent >= self.confirm_s:
                cause, retries = due[0]
                after = "after collective error" if retries else "while its peers waited"
                failed[replica] = f"silent {silent:.2f}s {after} ({cause})"
        if due:
            self._unnamed = [u for u in self._unnamed if now < u[0] + self.confirm_s]
            retry = not failed and any(retries for _, retries in due)
        return failed, retry


def retry_verdict(
    members: Sequence[int], reporters: Iterable[int], retries: int, max_retries: int
) -> tuple[str, tuple[int, ...]]:
    """What to do when a step's collectives broke again with nobody silent.

    "retry" while fewer than ``max_retries`` retries of this step have run; then
    "fence" the members that never reported a break (the ones everybody else waited
    for: slow, or stuck where no heartbeat can tell), or "stop" when every member
    reported one (no culprit to blame: a network fault between the groups).
    """
    if retries < max_retries:
        return "retry", ()
    culprits = tuple(m for m in members if m not in set(reporters))
    if culprits and len(culprits) < len(members):
        return "fence", culprits
    return "stop", tuple(members)


def job_error(errors: Mapping[int, tuple[str, int]], members: Sequence[int]) -> str | None:
    """The error that is the job's own, not a hardware fault, or None.

    ``errors`` maps a replica to the (error, step) its ranks raised. Replica groups do
    not share hardware, so one error at one step on two of them, or on every member,
    comes from the job (its code, config or data), and restarting would only repeat it.
    """
    seen: dict[tuple[str, int], set[int]] = {}
    for replica, key in errors.items():
        seen.setdefault(key, set()).add(replica)
    for (error, step), replicas in sorted(seen.items(), key=lambda kv: -len(kv[1])):
        if len(replicas) >= 2 or set(members) <= replicas:
            return f"replica groups {sorted(replicas)} all raised, at step {step}: {error}"
    return None


def diverged(digests: dict[int, str], leader: int) -> set[int]:
    """Replicas whose parameter digest differs from the reference: the digest a majority
    holds, or the leader's when no digest has a majority (two replicas disagreeing)."""
    counts: dict[str, int] = {}
    for d in digests.values():
        counts[d] = counts.get(d, 0) + 1
    best = max(counts, key=counts.__getitem__, default=None)
    reference = best if best is not None and 2 * counts[best] > len(digests) else digests.get(leader, best)
    return {r for r, d in digests.items() if d != reference}
