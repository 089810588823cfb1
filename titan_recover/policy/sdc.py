"""Silent-data-corruption checks (``[recover] sdc_check``): which microbatch a step checks, who computes it
again, and what the groups' digests of it say.

In exact mode a microbatch's gradient has the same bits on any replica group of the same shard layout (the
same parameters, the same data, pinned kernels), so a second group computing it must get the digest the
owner got, shard by shard. At a checked step the microbatch is drawn from the run's seed and the step alone,
so every rank of every group agrees without a message; the next member after its owner computes it on top of
its quota (outside every sum), and each group's digest rides the step's replicate all-reduce in the group's own
slot. On a mismatch the member after those two gives a third opinion: the group it agrees with is right, the
other is outvoted and treated as failed in that step. With two groups there is no third opinion (the step is
computed again, and a second mismatch stops the run); a third that agrees with neither stops it too.

Everything here is pure: digests are integers below ``2**62``, 0 meaning "not computed by this group".
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

DIGEST_BITS = 62  # an int64 slot of the all-reduce holds one group's digest, the others add 0
QUARANTINE_STRIKES = 2  # outvoted this often within the window: quarantined


def _uniform(seed: int, step: int, what: str) -> int:
    """A 64-bit draw every rank makes alike from the run's seed and the step."""
    return int.from_bytes(hashlib.blake2b(f"{seed}:{step}:{what}".encode(), digest_size=8).digest(), "big")


def checked_microbatch(seed: int, step: int, rate: float, num_microbatches: int) -> int | None:
    """The microbatch id ``step`` checks, or None where the step is not drawn (probability ``1 - rate``)."""
    if rate <= 0.0 or _uniform(seed, step, "checked") >= rate * 2**64:
        return None
    return _uniform(seed, step, "microbatch") % num_microbatches


def after(replica: int, members: Sequence[int], skip: Sequence[int] = ()) -> int | None:
    """The first member after ``replica`` in ``members``' order (cyclically) that is neither it nor in ``skip``:
    the checker of its microbatch, or the third opinion; None where there is none."""
    order = sorted(members)
    start = next((i for i, r in enumerate(order) if r > replica), 0)
    for r in order[start:] + order[:start]:
        if r != replica and r not in skip:
            return r
    return None


def digest(chunks: Sequence[bytes | memoryview]) -> int:
    """A nonzero ``DIGEST_BITS``-bit digest of one microbatch's gradient on one rank (its shards' bytes, in
    parameter order)."""
    h = hashlib.blake2b(digest_size=8)
    for chunk in chunks:
        h.update(chunk)
    return (int.from_bytes(h.digest(), "big") & (2**DIGEST_BITS - 1)) | 1


def strikes(earlier: Sequence[float], now: float, window_s: float) -> tuple[list[float], bool]:
    """A group outvoted at ``now``: its strikes within ``window_s`` (this one last, at most ``QUARANTINE_STRIKES``
    kept), and whether it is quarantined."""
    kept = [t for t in earlier if now - t < window_s][-(QUARANTINE_STRIKES - 1) :] + [now]
    return kept, len(kept) >= QUARANTINE_STRIKES


def reach(groups: int, rate: float, interval: int, keep: int) -> tuple[str, bool]:
    """What the run says at start: how soon a device wrong on every microbatch is caught on average (it is caught
    at a checked step whose microbatch it computes, about ``2/groups`` of them) and at the 95th percentile (about
    3 times that: a geometric wait), against how far back the nodes' snapshots reach; and whether they reach that
    far (else a rollback may find none, and the steps before it may have trained in)."""
    mean = 1 / rate if groups <= 2 else groups / (2 * rate)
    p95, back = math.ceil(3 * mean), interval * keep if interval > 0 else 0
    said = (
        f"recover.sdc_check at rate {rate:g} on {groups} groups: a device wrong on every microbatch is caught "
        f"after about {mean:.0f} step(s) on average, {p95} at the 95th percentile; the nodes' snapshots reach back "
        f"{back} step(s) (snapshot_keep {keep} x snapshot_interval {interval})"
    )
    if back >= p95:
        return said + ": a rollback past its gradients finds one", True
    fix = (
        f"raise recover.snapshot_keep to {math.ceil(p95 / interval)}"
        if interval > 0
        else "set recover.snapshot_interval (and snapshot_keep)"
    )
    return said + f": a later catch cannot roll back past all its gradients; {fix}", False


def rollback_step(trusted: int, committed: int, interval: int, keep: int) -> int | None:
    """The snapshot step a rollback goes back to: the newest multiple of ``interval`` at or before ``trusted`` (the
    last step a bad group's gradients were vouched for), if the nodes still keep it (the newest ``keep`` of those at
    or before ``committed``, the last committed step); None where there is none that old (or no snapshots)."""
    if interval <= 0:
        return None
    back, newest = trusted // interval * interval, committed // interval * interval
    return back if back >= 1 and back >= newest - (keep - 1) * interval else None


@dataclass(frozen=True)
class Verdict:
    """What the digests of one checked microbatch say, over every shard."""

    agree: bool  # every group that computed it got the same digest on every shard
    outvoted: tuple[int, ...] = ()  # groups a majority of two disagrees with on some shard
    undecided: bool = False  # some shard's opinions are all different, or only two that differ


def verdict(shards: Sequence[Mapping[int, int]]) -> Verdict:
    """``shards``: per shard, each group's digest of the checked microbatch (groups that did not compute it left
    out). A group outvoted on any shard is outvoted; a shard whose opinions do not give a majority leaves the
    verdict undecided."""
    outvoted: set[int] = set()
    undecided = False
    for opinions in shards:
        values = list(opinions.values())
        if len(set(values)) <= 1:
            continue
        counts = {v: values.count(v) for v in set(values)}
        top = max(counts.values())
        if top < 2 or list(counts.values()).count(top) > 1:
            undecided = True
            continue
        majority = next(v for v, c in counts.items() if c == top)
        outvoted |= {g for g, v in opinions.items() if v != majority}
    return Verdict(agree=not outvoted and not undecided, outvoted=tuple(sorted(outvoted)), undecided=undecided)
