"""Fault injection inside a rank: the real signals, sleeps and errors of the ``[recover] fault_plan``
(its grammar: ``policy.fault_plan``), fired at the points the trainer reaches."""

import contextlib
import math
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
        mine = [f for f in plan_faults if (f.replica, f.rank) == (replica, rank)]
        self.faults = [f for f in mine if f.action not in ("slow", "flip") and f.incarnation == incarnation]
        self.slow = [f for f in plan_faults if f.action == "slow" and f.replica == replica]
        self._lasting: set[Fault] = set()  # the slow and repeated flip faults reported (each once)
        self.flips = [f for f in mine if f.action == "flip" and (f.repeat or f.incarnation == incarnation)]
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
                if f not in self._lasting:
                    self._lasting.add(f)
                    self.on_fire(f)
        return factor

    def flip(self, step: int, index: int, count: int, grads: list[torch.Tensor]) -> None:
        """Fires this rank's flips of the ``index``-th of ``count`` microbatches of ``step`` on its gradient
        (``grads``, this rank's shards, after the backward and before the step's sum); a repeated flip is
        reported at its first microbatch, and fires on every one after."""
        for f in list(self.flips):
            if f.repeat:
                if f.step is None or f.step > step:  # the grammar requires a step: None never fires
                    continue
                if f not in self._lasting:  # reported once, as a slow fault is
                    self._lasting.add(f)
                    self.on_fire(f)
            else:
                if (f.step, min(f.microbatch, count - 1)) != (step, index):
                    continue
                self.flips.remove(f)  # fires once
                self.on_fire(f)
            flip_bit(grads, f.bit)

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


def flip_bit(grads: list[torch.Tensor], bit: int | None) -> None:
    """Flips ``bit`` (None: the dtype's top mantissa bit) of the largest-magnitude element of the first gradient
    holding a nonzero one, in place: a zero would stay below the exact grid's resolution, the largest surely moves
    the microbatch's contribution. The top mantissa bit moves it by at most half its size and keeps it finite; an
    exponent bit may make it huge (off the exact grid) or tiny. An all-zero gradient has nothing to flip."""
    g = next((g for g in grads if g.numel() and bool(g.ne(0).any())), None)
    if g is None:
        return
    info = torch.finfo(g.dtype)
    top = round(-math.log2(info.eps)) - 1  # float32 22, bfloat16 6, float16 9
    b = top if bit is None else bit
    if b >= info.bits:
        raise FaultPlanError(f"flip bit={b}: a {g.dtype} gradient element has {info.bits} bits (0..{info.bits - 1})")
    ints = g.view(-1).view({16: torch.int16, 32: torch.int32, 64: torch.int64}[info.bits])
    i = int(g.view(-1).abs().argmax())
    ints[i : i + 1].bitwise_xor_(1 << b if b < info.bits - 1 else -(1 << b))  # the sign bit, in two's complement


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
