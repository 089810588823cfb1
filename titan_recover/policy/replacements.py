"""When a run asks its scheduler for a replacement of lost capacity (``[recover] replace``), pure.

A replica group that stays out of the run longer than ``replace_after_s`` is not coming back by itself
(its launcher restarts a group within seconds; a node lost whole takes its groups with it): the run asks
for a node that joins it and takes free replica ids. One request brings one node, which asks for as many
free ids as the run runs on a node (``per_request``): fewer free ids would turn it away, so a remainder
smaller than that waits. At most ``outstanding`` requests are open at once (a scheduler queue is not a
place to pile jobs up), none is made once the run ended, and every open one is cancelled then, or as
soon as every id it was made for is back by itself. The ids a joined node took are not asked for again
while they start (they are out since before it joined); a later loss of them is. A request that ended
without bringing a group (its job failed, or found no free id) counts against its ids: after ``TRIES`` of
them an id is asked for no more, and the next request for it waits ``replace_after_s`` after the last one
ended, so a job that always fails is not resubmitted in a loop.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from titan_recover.control.protocol import FAILED, JOINED, LEFT, Request

TRIES = 3  # requests per replica id that ended without bringing a group, before it is asked for no more


@dataclass(frozen=True)
class Bounds:
    after_s: float  # a group out of the run this long is asked for
    outstanding: int  # open requests at most
    per_request: int = 1  # replica ids one request's node runs


@dataclass(frozen=True)
class Decision:
    request: tuple[tuple[int, ...], ...] = ()  # the ids of each new request, oldest loss first
    cancel: tuple[int, ...] = ()  # the numbers of open requests to cancel


def decide(now: float, out: Mapping[int, float], requests: Sequence[Request], ended: bool, bounds: Bounds) -> Decision:
    """What to ask for and what to cancel: ``out`` maps each replica id out of the run to when it went out,
    ``requests`` are every request of the run so far, ``ended`` says whether the run ended."""
    open_ = [r for r in requests if r.outcome is None]
    if ended:
        return Decision(cancel=tuple(r.number for r in open_))
    cancel = tuple(r.number for r in open_ if not set(r.replicas) & set(out))  # every id back by itself
    covered = {i for r in open_ if r.number not in cancel for i in r.replicas} | {
        i for r in requests if r.outcome == JOINED for i in r.took if i in out and out[i] <= (r.ended or now)
    }  # a joined node's groups are on their way in: until they are, the loss they repair is not asked for again
    eligible = sorted(
        (since, replica)
        for replica, since in out.items()
        if now - since >= bounds.after_s and replica not in covered and _may_ask(replica, now, requests, bounds)
    )
    ids = [replica for _, replica in eligible]
    room = max(bounds.outstanding - (len(open_) - len(cancel)), 0)
    size = bounds.per_request
    chunks = [tuple(sorted(ids[i : i + size])) for i in range(0, len(ids) - size + 1, size)]
    return Decision(tuple(chunks[:room]), cancel)


def _may_ask(replica: int, now: float, requests: Sequence[Request], bounds: Bounds) -> bool:
    """Whether ``replica`` may be asked for again: fewer than ``TRIES`` requests for it ended without
    bringing a group, the last of them ``after_s`` ago or more."""
    missed = [r.ended for r in requests if replica in r.replicas and r.outcome in (LEFT, FAILED)]
    return len(missed) < TRIES and all(e is not None and now - e >= bounds.after_s for e in missed)
