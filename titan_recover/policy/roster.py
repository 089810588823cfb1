"""Who is in the run: one pure decision per membership event, carried out by the coordinator core and the launchers.

The core keeps the run's state and turns a decision into effects (epochs, fences, events); a launcher keeps
its restart count. The rules themselves (admit, hold as a spare, drop a silent spare, take out on a failure
or a leave, grow beyond R, give up on a flapping group) live here, so a new membership state is a new
decision value and its rule here, not a new branch in the core's control flow.
"""

from dataclasses import dataclass, field
from typing import Collection, Mapping

from titan_recover.control.protocol import Membership
from titan_recover.policy.membership import (
    GroupView,
    StateLost,
    TooFewReplicasError,
    job_error,
    join_action,
    next_membership,
)
from titan_recover.policy.restarts import RestartBudget


@dataclass(frozen=True)
class Limits:
    """The job's bounds on membership, from its config."""

    replica_ids: int  # every id of the run: 0..replica_ids-1
    group_ranks: int  # ranks per replica group: a group joins once all are up
    seats: int  # the most members at once: R, or ``max_members`` to grow beyond it
    min_replicas: int  # fewer members left stop the run
    spare_timeout_s: float  # a waiting spare silent this long is dropped


@dataclass(frozen=True)
class Roster:
    """The run's membership as the coordinator holds it: what the decisions read."""

    membership: Membership
    spares: Mapping[int, int] = field(default_factory=dict)  # replica -> its incarnation waiting for a seat
    incarnations: Mapping[int, int] = field(default_factory=dict)  # replica -> its latest incarnation admitted
    dropped: Mapping[int, int] = field(default_factory=dict)  # replica -> its latest incarnation dropped as a spare
    closed: bool = False  # nobody joins any more: the last step is done, or the run stops in order


# ---- joins ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Joins:
    """What to do with the groups asking to join, carried out in this order."""

    replace: tuple[tuple[int, int], ...] = ()  # (replica, incarnation): its previous one is a member: fence, admit
    outside: tuple[int, ...] = ()  # ids outside the run: ignored
    gone: tuple[int, ...] = ()  # spares whose incarnation no longer asks: forgotten
    drop: tuple[tuple[int, str], ...] = ()  # (spare, cause): silent while waiting: fenced, so its launcher restarts it
    admit: tuple[tuple[int, int], ...] = ()  # (replica, incarnation): members in a new epoch, while seats are free
    hold: tuple[tuple[int, int], ...] = ()  # (replica, incarnation): new spares, waiting for a free seat


def joins(
    roster: Roster,
    limits: Limits,
    asking: Mapping[int, int],
    views: Mapping[tuple[int, int], GroupView],
    last_beat: Mapping[int, float | None],
    now: float,
) -> Joins:
    """Groups whose ranks are all up (``asking``: replica -> its latest incarnation asking, ``views`` its ranks)
    are admitted while fewer than ``limits.seats`` are members (restarted ones, hot spares, groups of nodes started
    later); the others wait as spares. A spare whose heartbeat stalled (``last_beat``: when each spare last beat)
    is dropped instead of being admitted to hold the others up."""
    if roster.closed:
        return Joins()
    replace: list[tuple[int, int]] = []
    outside: list[int] = []
    ready: dict[int, int] = {}
    for replica, incarnation in asking.items():
        if replica >= limits.replica_ids:
            outside.append(replica)
            continue
        seen = max(roster.incarnations.get(replica, -1), roster.dropped.get(replica, -1))
        up = views[(replica, incarnation)].ready
        action = join_action(roster.membership.members, replica, seen, incarnation, up, limits.group_ranks)
        if action == "replace":
            replace.append((replica, incarnation))
        elif action == "admit":
            ready[replica] = incarnation
    waiting = {r: a for r, a in roster.spares.items() if ready.get(r) == a}  # same incarnation, still asking
    drop = tuple(
        (r, f"heartbeat silent for {now - last:.2f}s while waiting as a spare")
        for r in sorted(waiting)
        if (last := last_beat.get(r)) is not None and now - last >= limits.spare_timeout_s
    )
    dropped = {r for r, _ in drop}
    order = [r for r in sorted(ready) if r not in dropped]
    free = max(0, limits.seats - len(roster.membership.members))
    return Joins(
        replace=tuple(replace),
        outside=tuple(outside),
        gone=tuple(sorted(set(roster.spares) - set(waiting))),
        drop=drop,
        admit=tuple((r, ready[r]) for r in order[:free]),
        hold=tuple((r, ready[r]) for r in order[free:] if r not in waiting),
    )


# ---- reports ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Leave:
    """A member leaves on notice (drained by the operator, or its node goes away): out of the next epoch at
    once, as a failure is, but no failure: nothing counted, no seat held for its return."""

    replica: int


@dataclass(frozen=True)
class DropSpare:
    """A waiting spare failed: fenced, so its launcher restarts it."""

    replica: int
    cause: str


def reported(roster: Roster, suspect: int | None, left: bool, cause: str) -> Leave | DropSpare | None:
    """A report naming ``suspect`` (``left``: its own leave on notice). None: nothing to decide here, a
    member's failure is the failure detector's."""
    if suspect is None:
        return None
    if suspect in roster.spares:
        return DropSpare(suspect, cause)
    return Leave(suspect) if left and suspect in roster.membership.members else None


# ---- taking out -------------------------------------------------------------------------


@dataclass(frozen=True)
class TakeOut:
    """The members out of the next epoch, and that epoch; ``stop`` says why the run stops instead."""

    left: tuple[int, ...]  # leaves on notice: no failure
    crashed: tuple[int, ...]  # failures: counted, a seat held for their return
    membership: Membership | None = None
    stop: str = ""
    lost: bool = False  # ``stop`` because no member with state is left (``StateLost``)


def take_out(
    roster: Roster,
    limits: Limits,
    failed: Collection[int],
    leaving: Collection[int],
    joining: Collection[int],
    errors: Mapping[int, tuple[str, int]],
) -> TakeOut:
    """The next epoch without ``failed`` (the same members when it is empty: a retry). Those ``leaving`` on
    notice go as leaves; the run stops on the job's own error (``errors``: replica -> its ranks' error and
    step) or when too few members with state (not ``joining``) are left."""
    left = tuple(sorted(r for r in failed if r in leaving))
    crashed = tuple(sorted(r for r in failed if r not in leaving))
    error = job_error(errors, roster.membership.members)
    if error is not None:
        return TakeOut(
            left, crashed, stop=f"the job's own error, not a hardware failure: {error}; fix it and run again"
        )
    try:
        new = next_membership(roster.membership, failed, limits.min_replicas, joining)
    except TooFewReplicasError as e:
        return TakeOut(left, crashed, stop=str(e), lost=isinstance(e, StateLost))
    return TakeOut(left, crashed, new)


# ---- a launcher's restarts --------------------------------------------------------------


@dataclass(frozen=True)
class Restart:
    """Start the group's next incarnation (the launcher records it against the budget)."""


@dataclass(frozen=True)
class GiveUp:
    """Restart the group no more; ``why`` names the keys that say so."""

    why: str


def on_exit(budget: RestartBudget, now: float) -> Restart | GiveUp:
    """A group's torchrun failed at ``now``: restarted within its budget, else given up on (it is flapping)."""
    return Restart() if budget.allows(now) else GiveUp(budget.refusal(now))
