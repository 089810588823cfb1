"""When the etcd a run forms on its nodes replaces a member (``launch.members``' keepers): pure decisions.

A member whose client address has not answered for ``after_s`` is removed, then a node that volunteered (a
launcher without a member) is added in its place and told to start one from the live members' data. Removal
comes first: adding to a cluster of three with one member lost makes four, and three of four is a quorum the
two live members cannot make. One change at a time, decided by the keeper of the live member with the lowest
name (every keeper sees the same members; a keeper that sees no majority answer decides nothing, so one cut
off never removes the live side). A member added whose node never starts it is removed after ``after_s`` too.
A member's own node, back without its data (``volunteers_instead``), volunteers and stands in for its lost
member: that one is removed, and the node added back as a new member.
With no volunteer (three nodes, or every other node lost), a lost member stays listed (removing it changes no
quorum: two live members are needed either way) and comes back by itself if its node does.
"""

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Seen:
    """One member as a keeper saw it this pass: ``name`` "" for a member added and not started yet."""

    id: str
    name: str
    peer: str
    answers: bool


@dataclass(frozen=True)
class Volunteer:
    """A node that would run a member: where its peers would reach it."""

    host: str
    peer: str


@dataclass(frozen=True)
class Remove:
    member: Seen
    silent_s: float


@dataclass(frozen=True)
class Add:
    volunteer: Volunteer
    name: str  # the new member's name
    cluster: str  # its ``--initial-cluster``: every started member's ``name=peer``, and its own


Change = Remove | Add


def volunteers_instead(listed: dict[str, bool] | None, peer: str, kept: bool) -> bool:
    """Whether the launcher of a host the ``nodes://`` URL names, starting, volunteers rather than start its member
    (at ``peer``): the run's cluster (``listed``: each member's peer and whether it ever started, that is published
    a client address; None where it did not answer, as at a run's first start) removed that member, or it ran
    before and its data is gone (``kept`` False: a node replaced, a new disk). Started empty as a member of the
    first start, it would come back as the same member without its data, which etcd cannot tell from a member
    that lost writes it acknowledged; the keepers replace it by a new member instead, started from the live
    members' data. A member of the first start not started yet is listed by name, without a client address."""
    if listed is None:
        return False
    return peer not in listed or (listed[peer] and not kept)


def index_of(name: str) -> int:
    """``m3`` -> 3; -1 for a name not of that form (a member the run did not name)."""
    return int(name[1:]) if name.startswith("m") and name[1:].isdigit() else -1


@dataclass
class Keeping:
    """A keeper's memory between passes: since when each member has been silent (or not started)."""

    size: int  # how many members the cluster should have (3 or 5)
    after_s: float
    silent_since: dict[str, float] = field(default_factory=dict)

    def decide(self, members: list[Seen], volunteers: list[Volunteer], mine: str, now: float) -> Change | None:
        """The change keeper ``mine`` (its member's name) makes now, or None."""
        for m in members:
            if m.answers:
                self.silent_since.pop(m.id, None)
            else:
                self.silent_since.setdefault(m.id, now)
        for gone in set(self.silent_since) - {m.id for m in members}:
            del self.silent_since[gone]
        live = [m for m in members if m.answers and m.name]
        if 2 * len(live) <= len(members) or mine != min((m.name for m in live), key=index_of, default=""):
            return None
        silent = [m for m in members if not m.answers and now - self.silent_since[m.id] >= self.after_s]
        taken = {m.peer for m in members if m not in silent}  # a lost member's node may come back to replace it
        candidate = next((v for v in volunteers if v.peer not in taken), None)
        if not candidate:  # a lost member stays listed: two live of three hold the quorum two of two would
            silent = [m for m in silent if not m.name]  # (a member added and never started goes all the same)
        if silent:
            lost = min(silent, key=lambda m: self.silent_since[m.id])
            return Remove(lost, now - self.silent_since[lost.id])
        if len(members) >= self.size or any(not m.answers for m in members) or candidate is None:
            return None  # full, or a member lost or just added not yet removed or started, or nobody to add
        name = f"m{1 + max(index_of(m.name) for m in members)}"
        cluster = ",".join(f"{m.name}={m.peer}" for m in members) + f",{name}={candidate.peer}"
        return Add(candidate, name, cluster)
