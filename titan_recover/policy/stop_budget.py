"""Whether a shard's save at a stop fits the notice: pure arithmetic and the lines that say it.

When the run stops in order on a notice, every rank saves its shard's state to the stop folder at once
(``rank.snapshot``: a checksum, then an fsynced write), one copy per shard. Each rank measures the rate of
such a save once at start; its shard's bytes at that rate, against ``recover.notice_budget_s`` (or what is
left of it at the notice), say whether the save lands before the scheduler's kill. A save that does not land
is never used (it is written under a temp name): the next run starts from the last complete checkpoint.
"""

import math
from dataclasses import dataclass


def amount(n: float) -> str:
    """Bytes in decimal units, as disks and links are sold."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def seconds(s: float) -> str:
    return f"{s:.1f} s" if s >= 0.1 else f"{s:.3f} s"


@dataclass(frozen=True)
class SaveFit:
    """One shard's save at a stop against the time it has."""

    state_bytes: int  # the shard's state as the save writes it
    rate: float  # bytes/s: a save's into the stop folder (checksum and fsynced write) as measured, > 0
    budget_s: float  # the time the save has

    @property
    def needed_s(self) -> float:
        return self.state_bytes / self.rate

    @property
    def fits(self) -> bool:
        return self.needed_s <= self.budget_s

    @property
    def fitting_bytes(self) -> int:
        """What the budget holds at the measured rate."""
        return int(self.rate * max(self.budget_s, 0.0))

    @property
    def needed_rate(self) -> float:
        """The rate at which the state would fit the budget (infinite with no time left)."""
        return self.state_bytes / self.budget_s if self.budget_s > 0 else math.inf

    def numbers(self, budget: str) -> str:
        """The figures, ``budget`` naming the time the save has."""
        needs = "cannot fit" if math.isinf(self.needed_rate) else f"needs {amount(self.needed_rate)}/s"
        return (
            f"{amount(self.state_bytes)} at the {amount(self.rate)}/s measured for a save into the stop folder "
            f"(its checksum and fsynced write) takes about "
            f"{seconds(self.needed_s)}, {budget}; that time holds {amount(self.fitting_bytes)} at this rate, and "
            f"{amount(self.state_bytes)} in {seconds(max(self.budget_s, 0.0))} {needs}"
        )


def at_start(fit: SaveFit) -> str:
    """The warning at start, where a whole-job notice's save of this shard would not fit the budget."""
    return (
        f"a whole-job notice's save of this shard's state would not fit recover.notice_budget_s: "
        f"{fit.numbers(f'over the {fit.budget_s:g} s budget')}. Such a stop falls back to the last complete "
        "checkpoint. Raise the scheduler's grace (Slurm's GraceTime, Kubernetes' terminationGracePeriodSeconds) and "
        f"recover.notice_budget_s a few seconds under it, the budget over {math.ceil(fit.needed_s)} s plus a step; "
        "or keep DCP checkpoints on ([checkpoint] enable, a shorter interval) to bound what such a notice loses"
    )


def at_notice(fit: SaveFit, step: int, fallback: str) -> str:
    """The warning at the notice, where this shard's save will not land in the time left."""
    return (
        f"the save of step {step}'s state will not fit the notice: "
        f"{fit.numbers(f'over the {seconds(max(fit.budget_s, 0.0))} at most left of recover.notice_budget_s')}. "
        f"It is written anyway (a write cut short is never used); if it does not land, the next run starts "
        f"from {fallback}"
    )


def fallback(checkpoint_step: int | None, stop_step: int | None) -> str:
    """Where the next run starts when this stop's save does not land: the newer of TorchTitan's last DCP
    checkpoint and an earlier stop's save (the resume picks the newer too), else the start."""
    if stop_step is not None and (checkpoint_step is None or stop_step > checkpoint_step):
        return f"the state saved at an earlier stop, step {stop_step}"
    if checkpoint_step is not None:
        return f"the DCP checkpoint of step {checkpoint_step}"
    return "scratch: there is no DCP checkpoint and no earlier stop's save"


def fallback_step(checkpoint_step: int | None, stop_step: int | None) -> int | None:
    """The step ``fallback`` names (None: scratch)."""
    steps = [s for s in (checkpoint_step, stop_step) if s is not None]
    return max(steps, default=None)
