"""Fault injection: the ``[recover] fault_plan`` grammar and the real signals it sends.

Grammar (whitespace-separated ``key=value`` after an action, entries joined by ``;``)::

    plan   := "none" | entry (";" entry)*
    entry  := "kill" key=value ...
    keys   := replica=INT   replica group whose rank dies (required)
              rank=INT      rank inside that group (its shard index; default 0)
              step=INT      training step, 1-based (required)
              phase=NAME    forward | backward | allreduce | optimizer (default backward)
              microbatch=INT  which of the replica's microbatches in that step, counted
                            from 0 in the order it computes them (forward/backward only;
                            default 1, or its last one if it has fewer)

``kill`` sends SIGKILL to the chosen rank itself at that point: mid-forward and
mid-backward mean inside the middle transformer block of that microbatch; allreduce
means after the replicate all-reduce was launched; optimizer means after the step
was agreed, before ``optimizer.step()``.
"""

import contextlib
import os
import signal
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

PHASES = ("forward", "backward", "allreduce", "optimizer")
ACTIONS = ("kill",)


class FaultPlanError(ValueError):
    """A fault plan that does not parse; the message names the bad part."""


@dataclass(frozen=True)
class Fault:
    action: str
    replica: int
    step: int
    rank: int = 0
    phase: str = "backward"
    microbatch: int = 1


def parse_fault_plan(plan: str) -> tuple[Fault, ...]:
    """Parses a fault plan string into faults; ``"none"`` or ``""`` is no fault."""
    if plan.strip().lower() in ("", "none"):
        return ()
    faults = []
    for entry in plan.split(";"):
        words = entry.split()
        if not words:
            raise FaultPlanError(f"empty entry in fault plan {plan!r}")
        action, args = words[0], words[1:]
        if action not in ACTIONS:
            raise FaultPlanError(f"unknown action {action!r} in {entry.strip()!r}; choose one of {ACTIONS}")
        fields: dict[str, object] = {}
        for arg in args:
            key, sep, value = arg.partition("=")
            if not sep or not value:
                raise FaultPlanError(f"expected key=value, got {arg!r} in {entry.strip()!r}")
            if key == "phase":
                if value not in PHASES:
                    raise FaultPlanError(f"unknown phase {value!r}; choose one of {PHASES}")
                fields[key] = value
            elif key in ("replica", "rank", "step", "microbatch"):
                try:
                    number = int(value)
                except ValueError:
                    raise FaultPlanError(f"{key} must be an integer, got {value!r}") from None
                if number < (1 if key == "step" else 0):
                    raise FaultPlanError(f"{key} out of range: {number}")
                fields[key] = number
            else:
                raise FaultPlanError(f"unknown key {key!r} in {entry.strip()!r}")
        for required in ("replica", "step"):
            if required not in fields:
                raise FaultPlanError(f"{required}= is required in {entry.strip()!r}")
        faults.append(Fault(action=action, **fields))  # type: ignore[arg-type]
    return tuple(faults)


class FaultInjector:
    """Fires this rank's faults of the plan at the points the trainer reaches."""

    def __init__(
        self,
        plan: str,
        replica: int,
        rank: int,
        on_fire: Callable[[Fault], None],
    ) -> None:
        self.faults = [f for f in parse_fault_plan(plan) if (f.replica, f.rank) == (replica, rank)]
        self.on_fire = on_fire

    def _match(self, step: int, phase: str, index: int | None = None, count: int = 0) -> Fault | None:
        for f in self.faults:
            if f.step != step or f.phase != phase:
                continue
            if index is None or index == min(f.microbatch, count - 1):
                return f
        return None

    def _fire(self, fault: Fault) -> None:
        self.on_fire(fault)
        if fault.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)  # SIGKILL is asynchronous; never run on past it

    def at(self, step: int, phase: str) -> None:
        """Call at the allreduce and optimizer points."""
        fault = self._match(step, phase)
        if fault is not None:
            self._fire(fault)

    @contextlib.contextmanager
    def microbatch(self, model: torch.nn.Module, step: int, index: int, count: int) -> Iterator[None]:
        """Arms forward/backward faults for the ``index``-th of ``count`` microbatches."""
        fwd = self._match(step, "forward", index, count)
        bwd = self._match(step, "backward", index, count)
        if fwd is None and bwd is None:
            yield
            return
        block = _middle_block(model)

        def hook(_module: torch.nn.Module, _args: object, output: torch.Tensor) -> None:
            if fwd is not None:
                self._fire(fwd)
            if bwd is not None and output.requires_grad:
                output.register_hook(lambda grad: self._fire(bwd))

        handle = block.register_forward_hook(hook)
        try:
            yield
        finally:
            handle.remove()


def _middle_block(model: torch.nn.Module) -> torch.nn.Module:
    layers = getattr(model, "layers", None)
    if isinstance(layers, (torch.nn.ModuleDict, torch.nn.ModuleList)) and len(layers):
        blocks = list(layers.values()) if isinstance(layers, torch.nn.ModuleDict) else list(layers)
        return blocks[len(blocks) // 2]
    return model
