"""Resuming from host-memory snapshots when every replica group lost its state: pure decisions.

After each ``snapshot_interval``-th commit, rank k of every group holds the same bits (shard k of the
committed state), and each rank copies its shard into its node's memory. When no member with state is
left, the restarted groups' ranks list the steps whose copy they verified on their own node; the run
resumes from the newest step of which every shard has a copy on some group's node. The groups holding a
copy of some shard of it are admitted: a rank holding its shard loads it locally, one that does not takes it
from the same rank of a group that does, so a shard's copies need not sit with the other shards' (a rack
lost with groups spanning racks leaves each shard on a different group). Groups holding none of it rejoin
from those as from any live member.
"""

from dataclasses import dataclass
from typing import Collection, Mapping


@dataclass(frozen=True)
class ResumePlan:
    """Resume from ``step`` with ``groups`` (those holding a copy of some shard of it): rank k of each group in
    ``holders[k]`` loads shard k from its node's memory; rank k of the other groups receives it from one of those."""

    step: int
    groups: tuple[int, ...]
    holders: tuple[tuple[int, ...], ...]

    @property
    def whole(self) -> tuple[int, ...]:
        """The groups that hold every shard on their own nodes."""
        return tuple(r for r in self.groups if all(r in held for held in self.holders))


def resume_plan(found: Mapping[int, Mapping[int, Collection[int]]], group_ranks: int, at_most: int) -> ResumePlan | str:
    """The plan, or why there is none (naming the shards without a copy).

    ``found``: replica -> group rank -> the steps that rank verified on its node; ``at_most``: the last step
    committed before the loss (a newer copy cannot exist; one that claims to is ignored)."""
    if not found:
        return "no replica group came back to resume from its nodes' memory"
    held: list[dict[int, list[int]]] = [{} for _ in range(group_ranks)]  # shard -> step -> replicas
    for replica, ranks in sorted(found.items()):
        for k in range(group_ranks):
            for step in set(ranks.get(k, ())):
                if step <= at_most:
                    held[k].setdefault(step, []).append(replica)
    common = set.intersection(*(set(steps) for steps in held)) if group_ranks else set()
    if common:
        step = max(common)
        holders = tuple(tuple(steps[step]) for steps in held)
        return ResumePlan(step, tuple(sorted({r for replicas in holders for r in replicas})), holders)
    missing = [k for k in range(group_ranks) if not held[k]]
    have = "; ".join(f"shard {k}: steps {sorted(steps)}" for k, steps in enumerate(held) if steps)
    if missing:
        return f"no restarted group's nodes hold a verified snapshot of shard(s) {missing}" + (
            f" (the others: {have})" if have else ""
        )
    return f"every shard has a verified snapshot, but of no one step ({have})"
