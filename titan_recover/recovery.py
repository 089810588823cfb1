"""In-step recovery bookkeeping: who owns which microbatch, and what a step summed.

A step's assignment is replayed from the membership the previous step committed
with (its base epoch) through every epoch published since, so every rank derives
the same owner for every microbatch from the coordinator's records alone, however
late it noticed each epoch. Survivors keep what they own; only the lost replicas'
microbatches move.

Each rank tallies what it computed in one float64 vector that travels with the
gradients through the same all-reduce: [loss, label tokens, data digest,
count per microbatch id]. After the reduction every rank can check that each of
the M microbatches was summed exactly once (once per shard) before stepping.
"""

from dataclasses import dataclass
from typing import Sequence

import torch

from titan_recover import workload
from titan_recover.membership import Membership

LOSS, TOKENS, DIGEST, COUNTS = 0, 1, 2, 3


class InvariantError(RuntimeError):
    """A reduced step does not sum exactly the M failure-free microbatches."""


def step_assignment(policy: str, history: Sequence[Membership], num_microbatches: int) -> workload.Assignment:
    """Owners of the step's microbatches after the epochs ``history`` (base epoch first)."""
    assignment = workload.assign(policy, history[0].members, num_microbatches)
    for membership in history[1:]:
        assignment = workload.reassign(policy, assignment, membership.members)
    workload.check_assignment(assignment, num_microbatches)
    return assignment


def new_tally(num_microbatches: int) -> torch.Tensor:
    return torch.zeros(COUNTS + num_microbatches, dtype=torch.float64)


def tally_microbatch(tally: torch.Tensor, microbatch: int, digest: int, tokens: int, loss: torch.Tensor) -> None:
    tally[LOSS] += float(loss)
    tally[TOKENS] += tokens
    tally[DIGEST] += digest
    tally[COUNTS + microbatch] += 1


@dataclass(frozen=True)
class StepSummary:
    loss: float
    tokens: int
    microbatches: tuple[int, ...]
    data_digest: str


def summarize(tally: torch.Tensor, shards: int, expected_tokens: int) -> StepSummary:
    """Checks a reduced tally: every microbatch counted once per shard, all tokens there."""
    counts = tally[COUNTS:].tolist()
    wrong = {m: c / shards for m, c in enumerate(counts) if c != shards}
    if wrong:
        raise InvariantError(
            f"microbatches not summed exactly once (id: times): {wrong}"
        )
    tokens = int(tally[TOKENS])
    if tokens != expected_tokens:
        raise InvariantError(f"step summed {tokens} label tokens, expected {expected_tokens}")
    return StepSummary(
        loss=float(tally[LOSS]),
        tokens=tokens,
        microbatches=tuple(range(len(counts))),
        data_digest=f"{int(tally[DIGEST]):016x}",
    )
