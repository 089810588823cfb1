"""Failure domains of the host-memory snapshots' copies: which shards one domain's loss would take whole (pure).

Rank k of every replica group holds shard k of the committed state, and each node keeps a copy of the shards its
ranks hold. A copy lives only as long as its node: where every copy of shard k sits in one failure domain (a rack,
a switch, a power feed), losing that domain loses the shard, and the run goes back to its last DCP checkpoint.
A node's domain comes from its launcher (``Launcher.domain``; "" = unknown). Placing groups is the scheduler's; this
only says where the copies are.
"""

from collections.abc import Iterable, Mapping
from dataclasses import dataclass


def part_ranks(part: int, group_ranks: int, parts: int) -> range:
    """The group ranks node part ``part`` of a group runs: torchrun's ``--node-rank part`` with
    ``group_ranks / parts`` processes per node gives each part a contiguous block."""
    per = group_ranks // parts
    return range(part * per, (part + 1) * per)


@dataclass(frozen=True)
class Exposure:
    """Where the copies of each shard are, as far as the nodes' domains are known."""

    domains: tuple[str, ...]  # the known domains the groups' nodes are in, sorted
    unknown: tuple[int, ...]  # groups with a part on a node of unknown domain
    single: Mapping[str, tuple[int, ...]]  # domain -> shards whose every copy is in it (only with 2+ domains)

    @property
    def shards(self) -> tuple[int, ...]:
        """Every shard one domain's loss would take whole."""
        return tuple(sorted(k for shards in self.single.values() for k in shards))


def exposure(placement: Mapping[int, Iterable[tuple[int, str]]], group_ranks: int, parts: int) -> Exposure:
    """The shards whose every copy is in one known domain while the run spans more than one.

    ``placement``: replica group -> (node part, that part's domain) for each part of the group; ``parts``:
    ``recover.group_nodes``. A shard with a copy on a node of unknown domain is not counted as in one domain: it
    may be spread. With one known domain (or none), or one group (one copy of each shard: while the others are
    away in a loss), nothing can be spread, and nothing is named."""
    where: dict[int, set[str]] = {k: set() for k in range(group_ranks)}  # shard -> domains of its copies
    unknown: set[int] = set()
    for replica, held in placement.items():
        for part, domain in held:
            if not domain:
                unknown.add(replica)
            for k in part_ranks(part, group_ranks, parts):
                where[k].add(domain)
    domains = tuple(sorted({d for found in where.values() for d in found if d}))
    single: dict[str, list[int]] = {}
    if len(domains) > 1 and len(placement) > 1:
        for k, found in sorted(where.items()):
            if len(found) == 1 and "" not in found:
                single.setdefault(next(iter(found)), []).append(k)
    return Exposure(domains, tuple(sorted(unknown)), {d: tuple(ks) for d, ks in sorted(single.items())})


def warning(found: Exposure) -> str:
    """What the coordinator logs when some shard's copies share one domain: which, where, and what to do."""
    where = "; ".join(f"shard(s) {list(shards)} all in {domain!r}" for domain, shards in found.single.items())
    return (
        f"every host-memory copy of some shards sits in one failure domain ({where}; the run's nodes are in "
        f"{len(found.domains)} domains): losing that domain loses those shards, and the run goes back to its last "
        "checkpoint. Spread the replica groups' nodes over domains, so that the nodes running the same part of "
        "different groups are in different domains"
    )
