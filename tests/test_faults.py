"""Tests for titan_recover.policy.fault_plan: the fault-plan grammar and where faults fire.

The injector calls ``on_fire`` before it SIGKILLs its own process, so an
``on_fire`` that raises stops the kill and tells the test where it fired.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from titan_recover.policy.fault_plan import PHASES, Fault, FaultPlanError, parse_fault_plan
from titan_recover.rank.injector import FaultInjector, flip_bit

ROOT = Path(__file__).resolve().parents[1]

# --- parse_fault_plan ----------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize("plan", ["none", "", "   ", "None", " NONE "])
def test_no_fault(plan: str) -> None:
    assert parse_fault_plan(plan) == ()


@pytest.mark.unit
def test_defaults() -> None:
    (f,) = parse_fault_plan("kill replica=1 step=10")
    assert f == Fault(action="kill", replica=1, step=10, rank=0, phase="backward", microbatch=1)


@pytest.mark.unit
def test_all_keys() -> None:
    (f,) = parse_fault_plan("kill replica=2 rank=3 step=7 phase=forward microbatch=0")
    assert f == Fault(action="kill", replica=2, step=7, rank=3, phase="forward", microbatch=0)


@pytest.mark.unit
def test_multiple_entries_with_semicolons_and_whitespace() -> None:
    faults = parse_fault_plan(
        "kill replica=1 rank=1 step=10 phase=backward ;  kill  replica=0 "
        "step=3 phase=allreduce;kill replica=2 step=4 phase=optimizer"
    )
    assert faults == (
        Fault("kill", replica=1, step=10, rank=1, phase="backward"),
        Fault("kill", replica=0, step=3, phase="allreduce"),
        Fault("kill", replica=2, step=4, phase="optimizer"),
    )


@pytest.mark.unit
@pytest.mark.parametrize("phase", PHASES)
def test_every_phase_parses(phase: str) -> None:
    assert parse_fault_plan(f"kill replica=0 step=1 phase={phase}")[0].phase == phase


@pytest.mark.unit
@pytest.mark.parametrize(
    "plan, fragments",
    [
        ("explode replica=1 step=2", ["unknown action", "'explode'"]),
        ("kill replica=1 step=2 color=red", ["unknown key", "'color'"]),
        ("kill replica=1 step=2 phase=sideways", ["unknown phase", "'sideways'"]),
        ("kill replica=one step=2", ["replica must be an integer", "'one'"]),
        ("kill replica=1 step=2.5", ["step must be an integer", "'2.5'"]),
        ("kill replica=1 step=2 rank=x", ["rank must be an integer", "'x'"]),
        ("kill replica=1 step=2 microbatch=?", ["microbatch must be an integer", "'?'"]),
        ("kill replica=1 step=0", ["step out of range", "0"]),
        ("kill replica=-1 step=2", ["replica out of range", "-1"]),
        ("kill replica=1 step=2 rank=-2", ["rank out of range", "-2"]),
        ("kill step=2", ["replica= is required", "'kill step=2'"]),
        ("kill replica=1 phase=forward", ["step= is required", "'kill replica=1 phase=forward'"]),
        ("kill replica=1 step=2;", ["empty entry"]),
        ("kill replica=1 step=2;; kill replica=0 step=1", ["empty entry"]),
        ("; kill replica=1 step=2", ["empty entry"]),
        ("kill replica=1 step", ["expected key=value", "'step'"]),
        ("kill replica=1 step=", ["expected key=value", "'step='"]),
        ("kill replica=1 step=2 ; kill replica=0 step=3 forward", ["expected key=value", "'forward'"]),
        ("kill replica=1 step=2; boom replica=0 step=1", ["unknown action", "'boom'"]),
    ],
)
def test_errors_name_the_bad_token(plan: str, fragments: list[str]) -> None:
    with pytest.raises(FaultPlanError) as info:
        parse_fault_plan(plan)
    for fragment in fragments:
        assert fragment in str(info.value), (plan, str(info.value))


@pytest.mark.unit
def test_a_flip_names_its_microbatch_and_bit_or_repeats_from_its_step_in_every_incarnation() -> None:
    [once] = parse_fault_plan("flip replica=1 rank=1 step=2 microbatch=0")
    assert (once.action, once.step, once.microbatch, once.bit, once.repeat) == ("flip", 2, 0, None, False)
    [bad] = parse_fault_plan("flip replica=1 step=2 repeat=true bit=30")
    assert (bad.repeat, bad.bit, bad.incarnation) == (True, 30, 0)


@pytest.mark.unit
@pytest.mark.parametrize(
    "plan, fragment",
    [
        ("flip replica=1 step=2 phase=backward", "flip fires after a microbatch's backward and takes no phase="),
        ("flip replica=1 step=+2", "flip takes an absolute step="),
        (
            "flip replica=1 step=2 repeat=true microbatch=1",
            "every microbatch from step= on, in every incarnation: not microbatch",
        ),
        ("flip replica=1 step=2 repeat=true attempt=1", "not attempt"),
        ("flip replica=1 step=2 repeat=yes", "repeat= takes true or false, got 'yes'"),
        ("flip replica=1 step=2 bit=64", "bit out of range: 64"),
        ("kill replica=1 step=2 bit=3", "bit= only goes with flip"),
        ("sleep replica=1 step=2 seconds=1 repeat=true", "repeat= only goes with flip"),
        ("flip replica=1", "step= is required"),
    ],
)
def test_a_bad_flip_is_refused_naming_why(plan: str, fragment: str) -> None:
    with pytest.raises(FaultPlanError, match=re.escape(fragment)):
        parse_fault_plan(plan)


@pytest.mark.unit
@pytest.mark.parametrize("dtype, top", [(torch.float32, 22), (torch.bfloat16, 6), (torch.float16, 9)])
def test_a_flip_moves_the_largest_element_by_at_most_half_and_keeps_it_finite(dtype: torch.dtype, top: int) -> None:
    """The default bit, the top mantissa bit, of the largest-magnitude element of the first nonzero gradient."""
    zero, grad = torch.zeros(4, dtype=dtype), torch.tensor([0.25, -3.0, 1.0], dtype=dtype)
    before = grad.clone()
    flip_bit([zero, grad], None)
    assert torch.equal(zero, torch.zeros(4, dtype=dtype)) and torch.equal(grad[[0, 2]], before[[0, 2]])
    assert float(grad[1]) != -3.0 and 0.5 <= float(grad[1]) / -3.0 <= 1.5 and torch.isfinite(grad).all()
    flip_bit([zero, grad], None)  # the same bit again: the element back
    assert torch.equal(grad, before)
    flip_bit([grad], top + 1)  # the lowest exponent bit: the element halved or doubled
    assert float(grad[1]) / -3.0 in (0.5, 2.0)


@pytest.mark.unit
def test_a_flip_of_an_exponent_or_the_sign_bit_and_a_bit_past_the_dtype() -> None:
    grad = torch.tensor([1e-3, 0.0], dtype=torch.float32)
    flip_bit([grad], 30)  # the top exponent bit of a small value: huge, still finite
    assert 1e30 < float(grad[0]) < float("inf")
    grad = torch.tensor([2.0], dtype=torch.float32)
    flip_bit([grad], 31)
    assert float(grad[0]) == -2.0
    flip_bit([torch.zeros(3)], 5)  # an all-zero gradient: nothing to flip
    with pytest.raises(FaultPlanError, match="a torch.bfloat16 gradient element has 16 bits"):
        flip_bit([torch.ones(2, dtype=torch.bfloat16)], 20)


@pytest.mark.unit
def test_a_flip_fires_once_on_its_microbatch_and_a_repeated_one_on_every_microbatch_from_its_step() -> None:
    fired: list[Fault] = []
    once = FaultInjector("flip replica=1 step=2 microbatch=1", 1, 0, fired.append)
    grads = [torch.tensor([1.0, -4.0])]
    once.flip(1, 1, 3, grads)  # another step
    once.flip(2, 0, 3, grads)  # another microbatch
    assert torch.equal(grads[0], torch.tensor([1.0, -4.0])) and not fired
    once.flip(2, 1, 3, grads)
    assert float(grads[0][1]) == -6.0 and len(fired) == 1  # -4 = -1.0 x 2**2; the top mantissa bit makes it -1.5
    once.flip(2, 1, 3, grads)
    assert float(grads[0][1]) == -6.0 and len(fired) == 1  # once
    assert FaultInjector("flip replica=1 step=2", 1, 0, fired.append, incarnation=1).flips == []
    fired.clear()
    bad = FaultInjector("flip replica=1 step=2 repeat=true", 1, 0, fired.append, incarnation=3)
    flips = 0
    for step, index in [(1, 0), (2, 0), (2, 1), (3, 0)]:
        grads = [torch.tensor([1.0, -4.0])]
        bad.flip(step, index, 2, grads)
        flips += float(grads[0][1]) != -4.0
    assert flips == 3 and len(fired) == 1  # every microbatch from step 2 on, reported once
    assert FaultInjector("flip replica=1 step=2", 0, 0, fired.append).flips == []  # another group's


@pytest.mark.unit
def test_fault_plan_error_is_a_value_error() -> None:
    assert issubclass(FaultPlanError, ValueError)


# --- FaultInjector -------------------------------------------------------------


class Fired(Exception):
    def __init__(self, fault: Fault) -> None:
        super().__init__(f"fired {fault}")
        self.fault = fault


def raise_fired(fault: Fault) -> None:
    raise Fired(fault)


def injector(plan: str, replica: int = 1, rank: int = 0) -> FaultInjector:
    return FaultInjector(plan, replica=replica, rank=rank, on_fire=raise_fired)


@pytest.mark.unit
def test_injector_keeps_only_its_own_faults() -> None:
    plan = (
        "kill replica=1 rank=1 step=1; kill replica=1 step=2; kill replica=0 rank=1 step=3; "
        "kill replica=1 rank=1 step=4 phase=allreduce"
    )
    assert [f.step for f in FaultInjector(plan, 1, 1, raise_fired).faults] == [1, 4]
    assert [f.step for f in FaultInjector(plan, 1, 0, raise_fired).faults] == [2]
    assert [f.step for f in FaultInjector(plan, 0, 1, raise_fired).faults] == [3]
    assert FaultInjector(plan, 0, 0, raise_fired).faults == []
    assert FaultInjector("none", 0, 0, raise_fired).faults == []


@pytest.mark.unit
def test_injector_rejects_a_bad_plan() -> None:
    with pytest.raises(FaultPlanError):
        FaultInjector("kill step=1", 0, 0, raise_fired)


@pytest.mark.unit
def test_at_fires_only_at_its_step_and_phase() -> None:
    inj = injector("kill replica=1 step=3 phase=allreduce; kill replica=1 step=5 phase=optimizer")
    for step in range(1, 8):
        for phase in ("allreduce", "optimizer"):
            if (step, phase) in ((3, "allreduce"), (5, "optimizer")):
                with pytest.raises(Fired) as info:
                    inj.at(step, phase)
                assert (info.value.fault.step, info.value.fault.phase) == (step, phase)
            else:
                inj.at(step, phase)  # must not fire


@pytest.mark.unit
def test_a_relative_step_counts_from_the_incarnations_first_step() -> None:
    """``step=+2``: the second step this incarnation computes, however late its restart made it a member."""
    (fault,) = parse_fault_plan("kill replica=1 step=+2 attempt=1 phase=allreduce")
    assert (fault.step, fault.relative, fault.at_step(None), fault.at_step(17)) == (2, True, None, 18)
    assert parse_fault_plan("kill replica=1 step=2")[0].at_step(17) == 2  # absolute: whatever the first step
    inj = FaultInjector("kill replica=1 step=+2 attempt=1 phase=allreduce", 1, 0, raise_fired, incarnation=1)
    inj.at(17, "join")  # its state arrives for step 17: its first step
    inj.at(17, "allreduce")  # must not fire
    with pytest.raises(Fired):
        inj.at(18, "allreduce")


@pytest.mark.unit
def test_at_ignores_other_ranks_faults() -> None:
    inj = injector("kill replica=1 rank=1 step=3 phase=allreduce", replica=1, rank=0)
    inj.at(3, "allreduce")


class Block(torch.nn.Module):
    def __init__(self, name: str, log: list[str]) -> None:
        super().__init__()
        self.name, self.log = name, log
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.log.append(self.name)
        return torch.tanh(self.lin(x))


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.log: list[str] = []
        self.layers = torch.nn.ModuleList(Block(f"b{i}", self.log) for i in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    def block(self, i: int) -> Block:
        """Layer ``i``, typed."""
        layer = self.layers[i]
        assert isinstance(layer, Block)
        return layer


@pytest.fixture
def model() -> Tiny:
    torch.manual_seed(0)
    return Tiny()


def x() -> torch.Tensor:
    return torch.ones(2, 4)


@pytest.mark.unit
def test_forward_fault_fires_in_the_middle_block_of_its_microbatch(model: Tiny) -> None:
    inj = injector("kill replica=1 step=2 phase=forward microbatch=1")
    with pytest.raises(Fired) as info:
        with inj.microbatch(model, step=2, index=1, count=3):
            model(x())
    assert info.value.fault.phase == "forward"
    # the hook runs after the middle block's forward, before the last block's
    assert model.log == ["b0", "b1"]


@pytest.mark.unit
def test_backward_fault_fires_during_backward_not_forward(model: Tiny) -> None:
    inj = injector("kill replica=1 step=2 phase=backward microbatch=0")
    with inj.microbatch(model, step=2, index=0, count=2):
        loss = model(x()).sum()  # forward completes
        assert model.log == ["b0", "b1", "b2"]
        with pytest.raises(Fired) as info:
            loss.backward()
    assert info.value.fault.phase == "backward"
    # it fired at the middle block's output: the last block's grads exist, the first's do not
    assert model.block(2).lin.weight.grad is not None
    assert model.block(0).lin.weight.grad is None


@pytest.mark.unit
def test_default_microbatch_is_one(model: Tiny) -> None:
    inj = injector("kill replica=1 step=4 phase=forward")
    with inj.microbatch(model, step=4, index=0, count=4):
        model(x())
    with pytest.raises(Fired):
        with inj.microbatch(model, step=4, index=1, count=4):
            model(x())


@pytest.mark.unit
@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_microbatch_beyond_count_clamps_to_last(model: Tiny, phase: str) -> None:
    inj = injector(f"kill replica=1 step=3 phase={phase} microbatch=5")
    with inj.microbatch(model, step=3, index=0, count=2):
        model(x()).sum().backward()  # index 0 of 2: not the clamped one
    with pytest.raises(Fired):
        with inj.microbatch(model, step=3, index=1, count=2):
            model(x()).sum().backward()


@pytest.mark.unit
def test_single_microbatch_clamps_default_to_zero(model: Tiny) -> None:
    inj = injector("kill replica=1 step=1 phase=forward")
    with pytest.raises(Fired):
        with inj.microbatch(model, step=1, index=0, count=1):
            model(x())


@pytest.mark.unit
@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_nothing_fires_for_other_microbatches_steps_or_phases(model: Tiny, phase: str) -> None:
    inj = injector(f"kill replica=1 step=3 phase={phase} microbatch=2; kill replica=1 step=3 phase=allreduce")
    for step, index in [(3, 0), (3, 1), (3, 3), (2, 2), (4, 2)]:
        with inj.microbatch(model, step=step, index=index, count=4):
            model(x()).sum().backward()
    with pytest.raises(Fired):
        with inj.microbatch(model, step=3, index=2, count=4):
            model(x()).sum().backward()


@pytest.mark.unit
@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_hooks_are_removed_after_the_microbatch(model: Tiny, phase: str) -> None:
    inj = injector(f"kill replica=1 step=2 phase={phase} microbatch=0")
    with pytest.raises(Fired):
        with inj.microbatch(model, step=2, index=0, count=1):
            model(x()).sum().backward()
    for layer in model.layers:
        assert len(layer._forward_hooks) == 0
    model.zero_grad()
    model(x()).sum().backward()  # a second forward/backward outside the context does not fire
    assert model.block(0).lin.weight.grad is not None


@pytest.mark.unit
def test_hooks_removed_after_a_normal_exit(model: Tiny) -> None:
    inj = injector("kill replica=1 step=2 phase=backward microbatch=0")
    with inj.microbatch(model, step=2, index=0, count=1):
        assert len(model.layers[1]._forward_hooks) == 1
        model(x())  # forward only: the backward fault did not fire
    assert len(model.layers[1]._forward_hooks) == 0
    model(x()).sum().backward()


class GroupedExperts(torch.nn.Module):
    """Named as TorchTitan's experts are (both lines): what ``phase=experts`` finds."""

    def __init__(self, name: str, log: list[str]) -> None:
        super().__init__()
        self.name, self.log = name, log

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.log.append(self.name)
        return x


class Moe(torch.nn.Module):
    def __init__(self, experts: int) -> None:
        super().__init__()
        self.log: list[str] = []
        self.layers = torch.nn.ModuleList(GroupedExperts(f"e{i}", self.log) for i in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.unit
def test_an_experts_fault_fires_as_the_middle_moe_layers_experts_are_called() -> None:
    model = Moe(experts=3)
    model.layers[1].__class__ = type("FSDPGroupedExperts", (GroupedExperts,), {})  # as fully_shard renames it
    model.layers[1].register_forward_pre_hook(lambda *_: model.log.append("dispatched"))  # as EP's own hook
    inj = injector("kill replica=1 step=2 phase=experts microbatch=0")
    with inj.microbatch(model, step=1, index=0, count=1):
        model(x())  # another step: nothing fires
    model.log.clear()
    with pytest.raises(Fired) as info:
        with inj.microbatch(model, step=2, index=0, count=1):
            model(x())
    assert info.value.fault.phase == "experts"
    assert model.log == ["e0", "dispatched"]  # after the tokens went out, before the experts ran
    assert len(model.layers[1]._forward_pre_hooks) == 1  # the injector's own hook is gone


@pytest.mark.unit
def test_an_experts_fault_in_a_model_without_experts_names_the_problem(model: Tiny) -> None:
    inj = injector("kill replica=1 step=2 phase=experts")
    with pytest.raises(FaultPlanError, match="phase=experts needs a mixture-of-experts layer"):
        with inj.microbatch(model, step=2, index=1, count=2):
            model(x())


@pytest.mark.unit
def test_model_without_layers_hooks_the_model_itself() -> None:
    lin = torch.nn.Linear(3, 3)
    inj = injector("kill replica=1 step=1 phase=forward microbatch=0")
    with pytest.raises(Fired):
        with inj.microbatch(lin, step=1, index=0, count=1):
            lin(torch.ones(1, 3))
    assert len(lin._forward_hooks) == 0


@pytest.mark.unit
def test_module_dict_layers_use_the_middle_value() -> None:
    log: list[str] = []
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleDict({str(i): Block(f"b{i}", log) for i in range(5)})
    inj = injector("kill replica=1 step=1 phase=forward microbatch=0")
    with pytest.raises(Fired):
        with inj.microbatch(model, step=1, index=0, count=1):
            h = torch.ones(1, 4)
            for layer in model.layers.values():
                h = layer(h)
    assert log == ["b0", "b1", "b2"]


# --- stop / sleep actions, join / donate phases, incarnations --------------------


@pytest.mark.unit
def test_stop_parses() -> None:
    (f,) = parse_fault_plan("stop replica=1 rank=1 step=4 phase=allreduce")
    assert f == Fault(action="stop", replica=1, step=4, rank=1, phase="allreduce")
    assert f.seconds == 0.0


@pytest.mark.unit
def test_sleep_parses_seconds_as_float() -> None:
    (f,) = parse_fault_plan("sleep replica=0 step=3 phase=optimizer seconds=2.5")
    assert f == Fault(action="sleep", replica=0, step=3, phase="optimizer", seconds=2.5)
    (g,) = parse_fault_plan("sleep replica=0 step=3 seconds=1")
    assert g.seconds == 1.0 and isinstance(g.seconds, float)


@pytest.mark.unit
@pytest.mark.parametrize("phase, step", [("join", None), ("donate", None), ("join", 4), ("donate", 7)])
def test_transfer_phases_make_step_optional(phase: str, step: int | None) -> None:
    plan = f"kill replica=1 phase={phase}" + (f" step={step}" if step is not None else "")
    (f,) = parse_fault_plan(plan)
    assert f.phase == phase
    assert f.step == step


@pytest.mark.unit
@pytest.mark.parametrize("phase", ["forward", "backward", "allreduce", "optimizer"])
def test_other_phases_still_require_step(phase: str) -> None:
    with pytest.raises(FaultPlanError, match="step= is required"):
        parse_fault_plan(f"kill replica=1 phase={phase}")


@pytest.mark.unit
def test_incarnation_defaults() -> None:
    kill, donate, join = parse_fault_plan(
        "kill replica=1 step=2; kill replica=0 phase=donate; kill replica=1 phase=join"
    )
    assert kill.incarnation == 0
    assert donate.incarnation == 0
    assert join.incarnation == 1  # a join only happens in a restarted group


@pytest.mark.unit
def test_explicit_incarnation() -> None:
    a, b, c = parse_fault_plan(
        "kill replica=1 step=2 attempt=2; stop replica=1 phase=join attempt=3; kill replica=0 phase=donate attempt=1"
    )
    assert (a.incarnation, b.incarnation, c.incarnation) == (2, 3, 1)


@pytest.mark.unit
@pytest.mark.parametrize(
    "plan, fragments",
    [
        ("sleep replica=1 step=2", ["seconds= is required", "'sleep replica=1 step=2'"]),
        ("sleep replica=1 phase=join", ["seconds= is required"]),
        ("sleep replica=1 step=2 seconds=0", ["seconds must be finite and > 0", "'0'"]),
        ("sleep replica=1 step=2 seconds=-1.5", ["seconds must be finite and > 0", "'-1.5'"]),
        ("sleep replica=1 step=2 seconds=inf", ["seconds must be finite and > 0", "'inf'"]),
        ("sleep replica=1 step=2 seconds=nan", ["seconds must be finite and > 0", "'nan'"]),
        ("sleep replica=1 step=2 seconds=abc", ["seconds must be a number", "'abc'"]),
        ("sleep replica=1 step=2 seconds=", ["expected key=value", "'seconds='"]),
        ("kill replica=1 step=2 seconds=1", ["seconds= only goes with sleep", "'kill replica=1 step=2 seconds=1'"]),
        ("stop replica=1 step=2 seconds=0.5", ["seconds= only goes with sleep", "'stop replica=1 step=2 seconds=0.5'"]),
        ("sleep replica=1 step=2 seconds=1 until=step", ["until= takes only 'epoch'", "'step'"]),
        ("kill replica=1 step=2 until=epoch", ["until= only goes with sleep", "'kill replica=1 step=2 until=epoch'"]),
        ("sleep replica=1 step=2 until=epoch", ["seconds= is required"]),
        ("kill replica=1 step=2 attempt=-1", ["attempt out of range", "-1"]),
        ("kill replica=1 step=2 attempt=x", ["attempt must be an integer", "'x'"]),
        ("kill replica=1 phase=donate step=0", ["step out of range", "0"]),
        ("pause replica=1 step=2", ["unknown action", "'pause'"]),
        ("kill replica=1 step=+0", ["step out of range", "0"]),
        ("kill replica=1 step=+x", ["step must be an integer", "'x'"]),
        ("slow replica=1 step=+2 factor=2", ["slow takes an absolute step="]),
    ],
)
def test_new_grammar_errors_name_the_problem(plan: str, fragments: list[str]) -> None:
    with pytest.raises(FaultPlanError) as info:
        parse_fault_plan(plan)
    for fragment in fragments:
        assert fragment in str(info.value), (plan, str(info.value))


@pytest.mark.unit
def test_injector_keeps_only_faults_of_its_incarnation() -> None:
    plan = (
        "kill replica=1 step=2 phase=allreduce; kill replica=1 step=3 phase=allreduce attempt=1; "
        "kill replica=1 phase=join; kill replica=1 phase=donate attempt=2; kill replica=0 step=5 attempt=1"
    )
    assert [(f.step, f.phase) for f in FaultInjector(plan, 1, 0, raise_fired).faults] == [(2, "allreduce")]
    assert [(f.step, f.phase) for f in FaultInjector(plan, 1, 0, raise_fired, incarnation=1).faults] == [
        (3, "allreduce"),
        (None, "join"),
    ]
    assert [(f.step, f.phase) for f in FaultInjector(plan, 1, 0, raise_fired, incarnation=2).faults] == [
        (None, "donate")
    ]
    assert FaultInjector(plan, 1, 0, raise_fired, incarnation=3).faults == []
    assert [f.step for f in FaultInjector(plan, 0, 0, raise_fired, incarnation=1).faults] == [5]


@pytest.mark.unit
def test_other_incarnations_faults_do_not_fire() -> None:
    inj = injector("kill replica=1 step=2 phase=allreduce attempt=1; kill replica=1 phase=join")
    inj.at(2, "allreduce")  # incarnation 0: neither is ours
    inj.at(2, "join")


@pytest.mark.unit
def test_each_fault_fires_once() -> None:
    inj = injector("kill replica=1 step=3 phase=allreduce")
    with pytest.raises(Fired):
        inj.at(3, "allreduce")
    assert inj.faults == []
    inj.at(3, "allreduce")  # a retry of the same step in a newer epoch: nothing


@pytest.mark.unit
def test_step_none_matches_any_step_of_its_phase() -> None:
    fired: list[Fault] = []
    inj = FaultInjector("sleep replica=1 phase=donate seconds=0.001", 1, 0, on_fire=fired.append)
    for step in (1, 5, 99):
        inj.at(step, "join")
        inj.at(step, "allreduce")
    assert fired == []
    inj.at(37, "donate")
    assert [f.phase for f in fired] == ["donate"]
    inj.at(38, "donate")  # fired once
    assert len(fired) == 1


@pytest.mark.unit
def test_step_none_join_fault_fires_at_any_step() -> None:
    inj = FaultInjector("kill replica=2 rank=1 phase=join", 2, 1, raise_fired, incarnation=1)
    with pytest.raises(Fired) as info:
        inj.at(12345, "join")
    assert info.value.fault.step is None


@pytest.mark.unit
def test_fault_with_a_step_at_a_transfer_phase_fires_only_at_that_step() -> None:
    inj = injector("kill replica=1 step=4 phase=donate")
    inj.at(3, "donate")
    inj.at(5, "donate")
    with pytest.raises(Fired):
        inj.at(4, "donate")


@pytest.mark.unit
def test_sleep_sleeps_calls_on_fire_and_carries_on() -> None:
    fired: list[Fault] = []
    inj = FaultInjector("sleep replica=1 step=2 phase=optimizer seconds=0.05", 1, 0, on_fire=fired.append)
    t0 = time.perf_counter()
    inj.at(2, "optimizer")
    elapsed = time.perf_counter() - t0
    assert elapsed >= 0.05
    assert elapsed < 5.0
    assert fired == [Fault("sleep", replica=1, step=2, phase="optimizer", seconds=0.05)]
    t0 = time.perf_counter()
    inj.at(2, "optimizer")  # once only: no second sleep
    assert time.perf_counter() - t0 < 0.05
    assert len(fired) == 1


@pytest.mark.unit
def test_sleep_until_epoch_wakes_when_the_epoch_moves_and_is_bounded_by_seconds() -> None:
    (f,) = parse_fault_plan("sleep replica=1 step=2 phase=optimizer seconds=30 until=epoch")
    assert f.until == "epoch" and f.seconds == 30.0
    t0 = time.perf_counter()
    epochs = iter([4] * 10 + [5] * 10)  # the epoch moves after ten looks (~0.2 s)
    FaultInjector(
        "sleep replica=1 step=2 phase=optimizer seconds=30 until=epoch",
        1,
        0,
        on_fire=lambda f: None,
        epoch=lambda: next(epochs),
    ).at(2, "optimizer")
    assert time.perf_counter() - t0 < 5.0  # woke at the new epoch, not after 30 s
    t0 = time.perf_counter()
    FaultInjector(
        "sleep replica=1 step=2 phase=optimizer seconds=0.1 until=epoch", 1, 0, on_fire=lambda f: None, epoch=lambda: 4
    ).at(2, "optimizer")
    assert 0.1 <= time.perf_counter() - t0 < 5.0  # no new epoch: seconds bounds it
    t0 = time.perf_counter()
    FaultInjector("sleep replica=1 step=2 phase=optimizer seconds=0.1 until=epoch", 1, 0, on_fire=lambda f: None).at(
        2, "optimizer"
    )
    assert time.perf_counter() - t0 >= 0.1  # stock mode has no epochs: the whole sleep


@pytest.mark.unit
def test_sleep_in_forward_slows_the_microbatch_but_it_completes(model: Tiny) -> None:
    fired: list[Fault] = []
    inj = FaultInjector("sleep replica=1 step=2 phase=forward microbatch=0 seconds=0.05", 1, 0, on_fire=fired.append)
    t0 = time.perf_counter()
    with inj.microbatch(model, step=2, index=0, count=1):
        out = model(x())
    assert time.perf_counter() - t0 >= 0.05
    assert out.shape == (2, 4)
    assert model.log == ["b0", "b1", "b2"]
    assert len(fired) == 1 and fired[0].phase == "forward"


# kill and stop signal the process itself, so they run in a child python

CHILD = """
import sys
from titan_recover.rank.injector import FaultInjector
inj = FaultInjector(sys.argv[1], replica=1, rank=0, incarnation=int(sys.argv[2]),
                    on_fire=lambda f: print("fired", f.action, flush=True))
inj.at(3, sys.argv[3])
print("survived", flush=True)
"""


def spawn(plan: str, phase: str, incarnation: int = 0) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, plan, str(incarnation), phase],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_kill_sends_sigkill_to_its_own_process() -> None:
    proc = spawn("kill replica=1 step=3 phase=allreduce", "allreduce")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, (out, err)
    assert "fired kill" in out
    assert "survived" not in out


def test_kill_at_join_of_a_restarted_group_sends_sigkill() -> None:
    proc = spawn("kill replica=1 phase=join", "join", incarnation=1)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, (out, err)
    assert "survived" not in out


def test_child_not_matching_survives() -> None:
    """The harness itself: a fault of another incarnation does nothing."""
    proc = spawn("kill replica=1 phase=join", "join", incarnation=0)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, (out, err)
    assert "survived" in out and "fired" not in out


def test_stop_sends_sigstop_to_its_own_process() -> None:
    proc = spawn("stop replica=1 step=3 phase=optimizer", "optimizer")
    try:
        deadline = time.monotonic() + 60
        while True:
            pid, status = os.waitpid(proc.pid, os.WUNTRACED | os.WNOHANG)
            if pid:
                break
            assert time.monotonic() < deadline, "the child neither stopped nor exited"
            time.sleep(0.01)
        assert os.WIFSTOPPED(status), status
        assert os.WSTOPSIG(status) == signal.SIGSTOP
    finally:
        proc.kill()
        out, err = proc.communicate(timeout=30)
    assert "fired stop" in out
    assert "survived" not in out
    assert proc.returncode == -signal.SIGKILL


# --- slow: a persistent straggler ---------------------------------------------------


@pytest.mark.unit
def test_slow_parses_and_needs_a_factor_above_one() -> None:
    (f,) = parse_fault_plan("slow replica=1 factor=2.5 step=3")
    assert (f.action, f.replica, f.factor, f.step) == ("slow", 1, 2.5, 3)
    assert parse_fault_plan("slow replica=0 factor=4")[0].step is None  # from the first step
    for plan, fragment in [
        ("slow replica=1", "factor= is required"),
        ("slow replica=1 factor=1", "factor must be finite and > 1"),
        ("slow replica=1 factor=inf", "factor must be finite"),
        ("slow replica=1 factor=2 rank=1", "not rank"),
        ("slow replica=1 factor=2 phase=forward", "not phase"),
        ("kill replica=1 step=2 factor=2", "factor= only goes with slow"),
    ]:
        with pytest.raises(FaultPlanError, match=fragment):
            parse_fault_plan(plan)


@pytest.mark.unit
def test_slow_slows_every_rank_and_incarnation_of_its_replica_from_its_step() -> None:
    fired: list[Fault] = []
    plan = "slow replica=1 factor=3 step=2; slow replica=0 factor=2"
    for rank, incarnation in [(0, 0), (1, 0), (0, 2)]:
        inj = FaultInjector(plan, replica=1, rank=rank, on_fire=fired.append, incarnation=incarnation)
        assert inj.slow_factor(1) == 1.0
        assert [inj.slow_factor(s) for s in (2, 3, 50)] == [3.0, 3.0, 3.0]
    assert len(fired) == 3  # reported once per process, at its first slowed microbatch
    assert FaultInjector(plan, replica=2, rank=0, on_fire=fired.append).slow_factor(5) == 1.0


@pytest.mark.unit
def test_slow_is_not_a_one_shot_fault() -> None:
    inj = FaultInjector("slow replica=0 factor=2", replica=0, rank=0, on_fire=lambda f: None)
    assert inj.faults == []  # never fired or removed by at()/microbatch()
    inj.at(1, "backward")
    assert inj.slow_factor(1) == 2.0
