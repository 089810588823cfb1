"""Fault injection inside a rank: the real signals, sleeps and errors of the ``[recover] fault_plan``
(its grammar: ``policy.fault_plan``), fired at the points the trainer reaches."""

import contextlib
import os
import signal
import time
from typing import Callable, Iterator

import torch

from titan_recover.policy.fault_plan import Fault, FaultPlanError, parse_fault_plan


class InjectedError(RuntimeError):
    """The ``raise`` action: an error of the job's own code, as a test needs one."""


class FaultInjector:
    """Fires this rank's faults of the plan at the points the trainer reaches."""

    def __init__(
        self,
        plan: str,
        replica: int,
        rank: int,
        on_fire: Callable[[Fault], None],
        incarnation: int = 0,
        epoch: Callable[[], int] | None = None,
    ) -> None:
        plan_faults = parse_fault_plan(plan)
        self.faults = [
            f
            for f in plan_faults
            if f.action != "slow" and (f.replica, f.rank, f.incarnation) == (replica, rank, incarnation)
        ]
        self.slow = [f for f in plan_faults if f.action == "slow" and f.replica == replica]
        self._slowing: set[Fault] = set()
        self.on_fire = on_fire
        self.epoch = epoch  # the rank's view of the epoch (None in stock mode: until=epoch sleeps it all)
        self.first: int | None = None  # this incarnation's first step (step=+N faults count from it)

    def slow_factor(self, step: int) -> float:
        """How many times as long this rank's microbatches take at ``step`` (1.0: not slowed);
        a slow fault fires (is reported) at its first slowed microbatch."""
        factor = 1.0
        for f in self.slow:
            if f.step is None or f.step <= step:
                factor *= f.factor
                if f not in self._slowing:
                    self._slowing.add(f)
                    self.on_fire(f)
        return factor

    def _match(self, step: int | None, phase: str, index: int | None = None, count: int = 0) -> Fault | None:
        if self.first is None and step is not None:
            self.first = step
        for f in self.faults:
            if f.phase != phase or f.at_step(self.first) not in (None, step):
                continue
            if index is None or index == min(f.microbatch, count - 1):
                return f
        return None

    def _fire(self, fault: Fault, model: torch.nn.Module | None = None) -> None:
        if fault not in self.faults:
            return  # each fault fires once
        self.faults.remove(fault)
        self.on_fire(fault)
        if fault.action == "sleep":
            self._sleep(fault)
            return
        if fault.action == "raise":
            raise InjectedError(f"injected error at step {fault.step} ({fault.phase})")
        if fault.action == "corrupt":
            if model is None:
                raise FaultPlanError(f"corrupt needs the model, which phase {fault.phase} does not reach")
            with torch.no_grad():
                p = next(model.parameters())
                (p.to_local() if hasattr(p, "to_local") else p).neg_()
            return
        os.kill(os.getpid(), signal.SIGKILL if fault.action == "kill" else signal.SIGSTOP)
        time.sleep(60)  # signals are asynchronous; never run on past a kill

    def _sleep(self, fault: Fault) -> None:
        """Slow, not dead: the heartbeat thread keeps beating."""
        if fault.until != "epoch" or self.epoch is None:
            time.sleep(fault.seconds)
            return
        deadline, start = time.monotonic() + fault.seconds, self.epoch()
        while self.epoch() == start and time.monotonic() < deadline:
            time.sleep(0.02)

    def at(self, step: int | None, phase: str, model: torch.nn.Module | None = None) -> None:
        """Call at the allreduce, optimizer, join and donate points (``model``: what corrupt alters); a
        ``step`` of None (a transfer header without one) matches only the faults that name no step."""
        fault = self._match(step, phase)
        if fault is not None:
            self._fire(fault, model)

    @contextlib.contextmanager
    def microbatch(self, model: torch.nn.Module, step: int, index: int, count: int) -> Iterator[None]:
        """Arms forward/backward faults for the ``index``-th of ``count`` microbatches."""
        fwd = self._match(step, "forward", index, count)
        bwd = self._match(step, "backward", index, count)
        exp = self._match(step, "experts", index, count)
        handles = []
        if fwd is not None or bwd is not None:

            def hook(_module: torch.nn.Module, _args: object, output: torch.Tensor) -> None:
                if fwd is not None:
                    self._fire(fwd, model)
                if bwd is not None and output.requires_grad:
                    output.register_hook(lambda grad: self._fire(bwd, model))

            handles.append(_middle_block(model).register_forward_hook(hook))
        if exp is not None:  # after any pre-hook expert parallelism put there: its tokens are already sent
            handles.append(middle_experts(model).register_forward_pre_hook(lambda *_: self._fire(exp, model)))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()


def middle_experts(model: torch.nn.Module) -> torch.nn.Module:
    """The routed experts (TorchTitan's ``GroupedExperts`` on either line, 0.2's gpt_oss's own
    ``GptOssGroupedExperts``, or FSDP's subclasses of them) of the middle mixture-of-experts layer: with
    expert parallelism they are called between the token all-to-alls."""
    experts = [m for m in model.modules() if any(c.__name__.endswith("GroupedExperts") for c in type(m).__mro__)]
    if not experts:
        raise FaultPlanError("phase=experts needs a mixture-of-experts layer, and this model (or stage) has none")
    return experts[len(experts) // 2]


def _middle_block(model: torch.nn.Module) -> torch.nn.Module:
    layers = getattr(model, "layers", None)
    if isinstance(layers, (torch.nn.ModuleDict, torch.nn.ModuleList)) and len(layers):
        blocks = list(layers.values()) if isinstance(layers, torch.nn.ModuleDict) else list(layers)
        return blocks[len(blocks) // 2]
    return model
