"""Deterministic microbatch-to-replica assignment for fault-tolerant steps.

Every optimizer step must sum exactly the same ``M`` microbatches no matter how
many replica groups die mid-step.  This module decides which replica owns which
microbatch ids, at the start of a step (:func:`assign`) and after losing
replicas inside a step (:func:`reassign`).  Every rank runs it independently
and must reach the same answer without communicating, so everything here is
pure Python with exact integer/rational arithmetic: no dict-order dependence,
no float rounding, no torch.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction

Assignment = dict[int, tuple[int, ...]]
"""Replica id -> sorted microbatch ids it owns in the current step."""

Policy = Callable[[tuple[int, ...], int, Mapping[int, float] | None], dict[int, int]]
"""``(live sorted, num_items, speeds) -> quota per live replica`` summing to ``num_items``."""


class WorkloadError(ValueError):
    """Invalid input to, or output of, the workload assignment."""


def _apportion(live: tuple[int, ...], weights: Mapping[int, Fraction], num_items: int) -> dict[int, int]:
    """Split ``num_items`` proportionally to ``weights`` by largest remainder.

    Exact ``Fraction`` arithmetic and ties broken by lowest replica id make the
    result identical on every rank for identical inputs.
    """
    total = sum(weights.values())
    quotas: dict[int, int] = {}
    remainders: list[tuple[Fraction, int]] = []
    for replica in live:
        exact = num_items * weights[replica] / total
        floor = math.floor(exact)
        quotas[replica] = floor
        remainders.append((exact - floor, replica))
    leftover = num_items - sum(quotas.values())
    remainders.sort(key=lambda rem_replica: (-rem_replica[0], rem_replica[1]))
    for _, replica in remainders[:leftover]:
        quotas[replica] += 1
    return quotas


def balanced(live: tuple[int, ...], num_items: int, speeds: Mapping[int, float] | None = None) -> dict[int, int]:
    """Equal quotas; the remainder goes one each to the lowest replica ids.

    With ``M`` divisible by ``R`` this reproduces stock HSDP's ``M / R`` per replica.
    """
    return _apportion(live, {replica: Fraction(1) for replica in live}, num_items)


def speed(live: tuple[int, ...], num_items: int, speeds: Mapping[int, float] | None = None) -> dict[int, int]:
    """Quotas proportional to measured speeds (microbatches/s), so stragglers get less.

    Live replicas without a measurement (e.g. rejoiners) get the mean of the
    measured live speeds, or 1.0 if none are measured; ``speeds=None`` is
    :func:`balanced`.  Speeds of replicas not in ``live`` are ignored.
    """
    if speeds is None:
        return balanced(live, num_items)
    measured: dict[int, Fraction] = {}
    for replica in live:
        if replica not in speeds:
            continue
        value = float(speeds[replica])
        if not math.isfinite(value) or value <= 0:
            raise WorkloadError(f"speed for replica {replica} must be finite and > 0, got {value!r}")
        measured[replica] = Fraction(value)
    default = sum(measured.values(), Fraction(0)) / len(measured) if measured else Fraction(1)
    return _apportion(live, {replica: measured.get(replica, default) for replica in live}, num_items)


POLICIES: dict[str, Policy] = {"balanced": balanced, "speed": speed}


@dataclass(frozen=True)
class Speeds:
    """Seconds per microbatch of each replica, as the committed steps measured them.

    ``estimate`` follows the measurements (an exponential average); ``applied`` is what
    the quotas are computed from, and moves to the estimate only when that would cut the
    step's predicted time by more than the threshold, so noise does not reshuffle work
    every step. Every rank derives both from the same committed tallies with the same
    float64 operations, so every rank holds the same values with no extra round.
    """

    estimate: dict[int, float] = field(default_factory=dict)
    applied: dict[int, float] = field(default_factory=dict)

    def rates(self) -> dict[int, float] | None:
        """Microbatches per second for the ``speed`` policy; None (equal quotas) before any measurement."""
        return {r: 1.0 / t for r, t in self.applied.items()} or None

    def to_json(self) -> dict[str, dict[str, float]]:
        return {
            "estimate": {str(r): t for r, t in self.estimate.items()},
            "applied": {str(r): t for r, t in self.applied.items()},
        }

    @staticmethod
    def from_json(obj: object) -> "Speeds":
        """Validates what a peer sent (a state transfer header): replica ids to finite times > 0."""

        def times(part: object) -> dict[int, float]:
            if not isinstance(part, dict):
                raise WorkloadError(f"speeds must map replica ids to seconds, got {part!r:.200}")
            out = {}
            for key, value in part.items():
                if (
                    not (isinstance(key, str) and key.isdigit())
                    or isinstance(value, bool)
                    or not isinstance(value, (int, float))
                    or not math.isfinite(value)
                    or value <= 0
                ):
                    raise WorkloadError(f"speeds: bad entry {key!r}: {value!r}")
                out[int(key)] = float(value)
            return out

        if not isinstance(obj, dict):
            raise WorkloadError(f"speeds must be an object, got {obj!r:.200}")
        return Speeds(times(obj.get("estimate")), times(obj.get("applied")))


def predicted_step_s(quotas: Mapping[int, int], seconds: Mapping[int, float]) -> float:
    """A step lasts as long as its slowest replica: max of quota x seconds per microbatch."""
    known = [seconds[r] for r in quotas if r in seconds]
    default = sum(known) / len(known) if known else 1.0
    return max((q * seconds.get(r, default) for r, q in quotas.items()), default=0.0)


def update_speeds(
    speeds: Speeds,
    measured: Mapping[int, float],
    live: Iterable[int],
    num_items: int,
    smoothing: float,
    threshold: float,
) -> Speeds:
    """The speeds after a committed step that measured ``measured`` (seconds per microbatch of
    the replicas that computed some). Replicas that computed nothing keep their estimate."""
    estimate = dict(speeds.estimate)
    for replica, seconds in sorted(measured.items()):
        if not math.isfinite(seconds) or seconds <= 0:
            raise WorkloadError(f"seconds per microbatch of replica {replica} must be finite and > 0, got {seconds!r}")
        old = estimate.get(replica)
        estimate[replica] = seconds if old is None else old + smoothing * (seconds - old)
    replicas = _normalize_live(live)
    current = speed(replicas, num_items, Speeds(applied=speeds.applied).rates())
    candidate = speed(replicas, num_items, Speeds(applied=estimate).rates())
    if predicted_step_s(candidate, estimate) < (1 - threshold) * predicted_step_s(current, estimate):
        return Speeds(estimate, dict(estimate))
    return Speeds(estimate, dict(speeds.applied))


def register_policy(name: str, fn: Policy) -> None:
    """Add a policy under ``name``; refusing overwrites keeps ranks from silently disagreeing."""
    if name in POLICIES:
        raise WorkloadError(f"workload policy {name!r} is already registered")
    if not callable(fn):
        raise TypeError(f"workload policy {name!r} must be callable, got {fn!r}")
    POLICIES[name] = fn


def get_policy(name: str) -> Policy:
    """Look up a policy, naming the valid choices on a typo."""
    try:
        return POLICIES[name]
    except KeyError:
        choices = ", ".join(sorted(POLICIES))
        raise WorkloadError(f"unknown workload policy {name!r}; choose one of: {choices}") from None


def _normalize_live(live: Iterable[int]) -> tuple[int, ...]:
    """Sort and validate replica ids so input order never changes the answer."""
    replicas = list(live)
    if not replicas:
        raise WorkloadError("no live replicas")
    for replica in replicas:
        if isinstance(replica, bool) or not isinstance(replica, int):
            raise WorkloadError(f"replica ids must be ints, got {replica!r}")
    duplicates = sorted(replica for replica, count in Counter(replicas).items() if count > 1)
    if duplicates:
        raise WorkloadError(f"replica ids must be unique, got duplicates {duplicates}")
    return tuple(sorted(replicas))


def _quotas(policy: str, live: tuple[int, ...], num_items: int, speeds: Mapping[int, float] | None) -> dict[int, int]:
    """Run a policy and verify its contract, since registered policies are user code."""
    quotas = get_policy(policy)(live, num_items, speeds)
    valid = (
        set(quotas) == set(live)
        and all(isinstance(q, int) and not isinstance(q, bool) and q >= 0 for q in quotas.values())
        and sum(quotas.values()) == num_items
    )
    if not valid:
        raise WorkloadError(
            f"workload policy {policy!r} returned {quotas!r} for live replicas {list(live)} and "
            f"{num_items} items; need one int >= 0 per live replica summing to {num_items}"
        )
    return quotas


def _hand_out(items: list[int], live: tuple[int, ...], quotas: Mapping[int, int]) -> Assignment:
    """Give sorted ``items`` out in contiguous chunks in replica-id order."""
    result: Assignment = {}
    start = 0
    for replica in live:
        result[replica] = tuple(items[start : start + quotas[replica]])
        start += quotas[replica]
    return result


def assign(
    policy: str, live: Iterable[int], num_microbatches: int, speeds: Mapping[int, float] | None = None
) -> Assignment:
    """Start-of-step assignment: contiguous id blocks in replica-id order.

    Contiguity matches stock TorchTitan HSDP data order (replica ``i`` of ``R``
    gets ``[i*M/R, (i+1)*M/R)`` when ``R`` divides ``M``), so a failure-free
    step consumes data exactly like an unmodified run.
    """
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int):
        raise WorkloadError(f"num_microbatches must be an int, got {num_microbatches!r}")
    if num_microbatches < 1:
        raise WorkloadError(f"num_microbatches must be >= 1, got {num_microbatches}")
    replicas = _normalize_live(live)
    quotas = _quotas(policy, replicas, num_microbatches, speeds)
    return _hand_out(list(range(num_microbatches)), replicas, quotas)


def reassign(
    policy: str, assignment: Assignment, live: Iterable[int], speeds: Mapping[int, float] | None = None
) -> Assignment:
    """In-step recovery: survivors keep their ids, lost replicas' ids are redistributed.

    Survivors never give up ids because that work is done or in flight and
    must not be counted twice.  The lost ids (sorted) are split among ``live``
    by the policy's quotas, in contiguous chunks in replica-id order.  A live
    replica absent from ``assignment`` (e.g. a rejoiner) is treated like any
    survivor owning nothing: it takes its policy share of the lost ids, which
    may be empty.  The result's keys are exactly ``live`` and its ids exactly
    the input's, so repeated calls (several failures in one step) stay exact.
    """
    replicas = _normalize_live(live)
    owned = Counter(mb for ids in assignment.values() for mb in ids)
    duplicated = sorted(mb for mb, count in owned.items() if count > 1)
    if duplicated:
        raise WorkloadError(f"assignment gives microbatch ids {duplicated} to more than one replica")
    alive = set(replicas)
    lost = sorted(mb for replica, ids in assignment.items() if replica not in alive for mb in ids)
    quotas = _quotas(policy, replicas, len(lost), speeds)
    extra = _hand_out(lost, replicas, quotas)
    return {replica: tuple(sorted((*assignment.get(replica, ()), *extra[replica]))) for replica in replicas}


def check_assignment(assignment: Assignment, num_microbatches: int) -> None:
    """Verify each id in ``0..M-1`` is owned exactly once, so the step's gradient sum is exact."""
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise WorkloadError(f"num_microbatches must be an int >= 1, got {num_microbatches!r}")
    counts = Counter(mb for ids in assignment.values() for mb in ids)
    in_range = {mb for mb in counts if type(mb) is int and 0 <= mb < num_microbatches}
    # Ints first in numeric order, then anything non-int by repr, so the message is stable.
    out_of_range = sorted(set(counts) - in_range, key=lambda mb: (0, mb, "") if type(mb) is int else (1, 0, repr(mb)))
    duplicated = sorted(mb for mb in in_range if counts[mb] > 1)
    missing = sorted(set(range(num_microbatches)) - in_range)
    problems = []
    if missing:
        problems.append(f"missing microbatch ids {missing}")
    if duplicated:
        problems.append(f"duplicated microbatch ids {duplicated}")
    if out_of_range:
        problems.append(f"microbatch ids out of range [0, {num_microbatches}): {out_of_range}")
    if problems:
        raise WorkloadError("invalid assignment: " + "; ".join(problems))
