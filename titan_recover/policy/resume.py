"""Resuming from host-memory snapshots when every replica group lost its state: pure decisions.

After each ``snapshot_interval``-th commit, rank k of every group holds the same bits (shard k of the
committed state), and each rank copies its shard into its node's memory. When no member with state is
left, the restarted groups' ranks list the steps whose copy they verified on their own node; the run
resumes from the newest step at which some group holds every shard, and that group's ranks load it
locally. The other groups rejoin from it as from any live member.
"""

from dataclasses import dataclass
from typing import Collection, Mapping


@dataclass(frozen=True)
class ResumePlan:
    """Resume from ``step``: ``groups`` load it from their nodes' memory; the others rejoin from them."""

    step: int
    groups: tuple[int, ...]


def resume_plan(found: Mapping[int, Mapping[int, Collection[int]]], group_ranks: int, at_most: int) -> ResumePlan | str:
    """The plan, or why there is none (naming the shards without a copy).

    ``found``: replica -> group rank -> the steps that rank verified on its node; ``at_most``: the last step
    committed before the loss (a newer copy cannot exist; one that claims to is ignored)."""
    complete: dict[int, list[int]] = {}
    for replica, ranks in found.items():
        shared = set.intersection(*(set(ranks.get(k, ())) for k in range(group_ranks))) if group_ranks else set()
        for step in shared:
            if step <= at_most:
                complete.setdefault(step, []).append(replica)
    if complete:
        step = max(complete)
        return ResumePlan(step, tuple(sorted(complete[step])))
    if not found:
        return "no replica group came back to resume from its nodes' memory"
    copies = {
        k: sorted({s for ranks in found.values() for s in ranks.get(k, ()) if s <= at_most}) for k in range(group_ranks)
    }
    missing = [k for k, steps in copies.items() if not steps]
    held = "; ".join(f"shard {k}: steps {steps}" for k, steps in copies.items() if steps)
    if missing:
        return f"no restarted group's nodes hold a verified snapshot of shard(s) {missing}" + (
            f" (the others: {held})" if held else ""
        )
    return (
        f"every shard has a verified snapshot, but no one group holds all of one step ({held}): "
        "resuming from copies spread over groups is not supported yet"
    )
