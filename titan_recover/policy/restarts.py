"""The restart budget: at most ``max_restarts`` restarts within any ``window_s`` seconds.

A budget for the whole run ran out in a run of weeks, where some failure comes every few
hours, and the cluster then shrank for good. Counting only recent restarts keeps healing
those, and still gives up on a group that fails again and again (it is flapping).
Pure logic: the caller passes the clock.
"""

from dataclasses import dataclass, field


def restart_allowed(past: list[float], now: float, max_restarts: int, window_s: float) -> bool:
    """Whether one more restart at ``now`` fits: fewer than ``max_restarts`` of ``past`` lie within the window."""
    return sum(1 for t in past if now - t < window_s) < max_restarts


@dataclass
class RestartBudget:
    """The restarts of one replica group (or of the whole stock job), at monotonic times."""

    max_restarts: int
    window_s: float
    times: list[float] = field(default_factory=list)

    def recent(self, now: float) -> list[float]:
        """Restarts that still count against the budget at ``now``."""
        return [t for t in self.times if now - t < self.window_s]

    def allows(self, now: float) -> bool:
        """Whether one more restart at ``now`` fits the budget."""
        return restart_allowed(self.times, now, self.max_restarts, self.window_s)

    def record(self, now: float) -> None:
        """Counts a restart at ``now``."""
        self.times = [*self.recent(now), now]  # older ones never count again

    def take(self, now: float) -> bool:
        """Records a restart at ``now`` if the budget allows one; False: no restart left in the window."""
        if not self.allows(now):
            return False
        self.record(now)
        return True

    def refusal(self, now: float) -> str:
        """Why ``take(now)`` refused, naming the keys that set the budget."""
        if self.max_restarts == 0:
            return "recover.max_restarts = 0 allows no restart"
        ago = ", ".join(f"{now - t:.0f} s" for t in self.recent(now))
        return (
            f"it failed {self.max_restarts + 1} times within {self.window_s:g} s (restarted {ago} ago, "
            f"and failed again now; recover.max_restarts = {self.max_restarts} per recover.restart_window_s): "
            "it is flapping"
        )

    def used(self, now: float) -> str:
        """The restarts counted at ``now``, e.g. "restart 2 of 3 within 3600 s"."""
        return f"restart {len(self.recent(now))} of {self.max_restarts} within {self.window_s:g} s"
