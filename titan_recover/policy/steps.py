"""In-step recovery bookkeeping: who owns which microbatch, and what a step summed.

A step's assignment is replayed from the membership the previous step committed
with (its base epoch) through every epoch published since, so every rank derives
the same owner for every microbatch from the coordinator's records alone, however
late it noticed each epoch. Survivors keep what they own; only the lost replicas'
microbatches move.

Each rank tallies what it computed in one float64 vector that travels with the
gradients through the same all-reduce: [label tokens, data digest, (count, loss) per
microbatch id, compute seconds per replica id, microbatches per replica id, whether each
replica id leaves after the step]. Each
microbatch's loss has a slot of its own, which only its owner writes (x + 0 is exact), and the
step's loss sums the slots in microbatch order: the same bits whoever computed which.
After the reduction every rank can check that each of the M microbatches was summed
exactly once (once per shard) before stepping, and knows how long each replica took
per microbatch: one rank per replica writes its slots, so every rank reads the same
exact value (the next step's quotas depend on it). A group that agreed to leave on notice says
so in the step's own sum, so every member knows at the commit that the next step runs without it.
"""

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from titan_recover.policy import workload
from titan_recover.policy.membership import Membership

TOKENS, DIGEST, MICROBATCHES = 0, 1, 2  # then (count, loss) per microbatch


class InvariantError(RuntimeError):
    """A reduced step does not sum exactly the M failure-free microbatches."""


def step_assignment(
    policy: str, history: Sequence[Membership], num_microbatches: int, rates: Mapping[int, float] | None = None
) -> workload.Assignment:
    """Owners of the step's microbatches after the epochs ``history`` (base epoch first);
    ``rates``: microbatches per second per replica, from the committed steps."""
    assignment = workload.assign(policy, history[0].members, num_microbatches, rates)
    for membership in history[1:]:
        assignment = workload.reassign(policy, assignment, membership.members, rates)
    workload.check_assignment(assignment, num_microbatches)
    return assignment


def new_tally(num_microbatches: int, replica_slots: int = 0) -> torch.Tensor:
    """``replica_slots``: replica ids whose time is measured (none in stock mode)."""
    return torch.zeros(MICROBATCHES + 2 * num_microbatches + 3 * replica_slots, dtype=torch.float64)


def _slots(tally: torch.Tensor, replica_slots: int) -> tuple[int, int, int]:
    """Where the seconds, the microbatch counts and the leave flags per replica start."""
    seconds = len(tally) - 3 * replica_slots
    return seconds, seconds + replica_slots, seconds + 2 * replica_slots


def tally_microbatch(tally: torch.Tensor, microbatch: int, digest: int, tokens: int, loss: torch.Tensor) -> None:
    tally[TOKENS] += tokens
    tally[DIGEST] += digest
    tally[MICROBATCHES + 2 * microbatch] += 1
    tally[MICROBATCHES + 2 * microbatch + 1] += float(loss)


def tally_time(tally: torch.Tensor, replica_slots: int, replica: int, seconds: float) -> None:
    """One microbatch of ``replica`` took ``seconds``; only one rank per replica may call this."""
    seconds_at, counts_at, _ = _slots(tally, replica_slots)
    tally[seconds_at + replica] += seconds
    tally[counts_at + replica] += 1


def tally_leaving(tally: torch.Tensor, replica_slots: int, replica: int) -> None:
    """``replica`` leaves after this step (its group agreed on a notice); only one rank per replica may call this."""
    tally[_slots(tally, replica_slots)[2] + replica] = 1


@dataclass(frozen=True)
class StepSummary:
    loss: float
    tokens: int
    microbatches: tuple[int, ...]
    data_digest: str
    seconds_per_microbatch: dict[int, float]  # replicas that computed some microbatches
    quotas: dict[int, int]  # microbatches each replica computed in the step
    leaving: tuple[int, ...] = ()  # replicas that leave after the step: the next one runs without them


def summarize(tally: torch.Tensor, shards: int, expected_tokens: int, replica_slots: int = 0) -> StepSummary:
    """Checks a reduced tally: every microbatch counted once per shard, all tokens there."""
    seconds_at, counts_at, leaving_at = _slots(tally, replica_slots)
    counts = tally[MICROBATCHES:seconds_at:2].tolist()
    wrong = {m: c / shards for m, c in enumerate(counts) if c != shards}
    if wrong:
        raise InvariantError(f"microbatches not summed exactly once (id: times): {wrong}")
    tokens = int(tally[TOKENS])
    if tokens != expected_tokens:
        raise InvariantError(f"step summed {tokens} label tokens, expected {expected_tokens}")
    seconds, computed = tally[seconds_at:counts_at].tolist(), tally[counts_at:leaving_at].tolist()
    return StepSummary(
        loss=sum(tally[MICROBATCHES + 1 : seconds_at : 2].tolist()),  # in microbatch order
        tokens=tokens,
        microbatches=tuple(range(len(counts))),
        data_digest=f"{int(tally[DIGEST]):016x}",
        seconds_per_microbatch={r: s / n for r, (s, n) in enumerate(zip(seconds, computed)) if n},
        quotas={r: int(n) for r, n in enumerate(computed) if n},
        leaving=tuple(r for r, flag in enumerate(tally[leaving_at:].tolist()) if flag),
    )
