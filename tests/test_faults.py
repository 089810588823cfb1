"""Tests for titan_recover.faults: the fault-plan grammar and where faults fire.

The injector calls ``on_fire`` before it SIGKILLs its own process, so an
``on_fire`` that raises stops the kill and tells the test where it fired.
"""

from __future__ import annotations

import pytest
import torch

from titan_recover.faults import PHASES, Fault, FaultInjector, FaultPlanError, parse_fault_plan

# --- parse_fault_plan ----------------------------------------------------------


@pytest.mark.parametrize("plan", ["none", "", "   ", "None", " NONE "])
def test_no_fault(plan: str) -> None:
    assert parse_fault_plan(plan) == ()


def test_defaults() -> None:
    (f,) = parse_fault_plan("kill replica=1 step=10")
    assert f == Fault(action="kill", replica=1, step=10, rank=0, phase="backward", microbatch=1)


def test_all_keys() -> None:
    (f,) = parse_fault_plan("kill replica=2 rank=3 step=7 phase=forward microbatch=0")
    assert f == Fault(action="kill", replica=2, step=7, rank=3, phase="forward", microbatch=0)


def test_multiple_entries_with_semicolons_and_whitespace() -> None:
    faults = parse_fault_plan(
        "kill replica=1 rank=1 step=10 phase=backward ;  kill  replica=0 step=3 phase=allreduce;kill replica=2 step=4 phase=optimizer"
    )
    assert faults == (
        Fault("kill", replica=1, step=10, rank=1, phase="backward"),
        Fault("kill", replica=0, step=3, phase="allreduce"),
        Fault("kill", replica=2, step=4, phase="optimizer"),
    )


@pytest.mark.parametrize("phase", PHASES)
def test_every_phase_parses(phase: str) -> None:
    assert parse_fault_plan(f"kill replica=0 step=1 phase={phase}")[0].phase == phase


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


def test_injector_rejects_a_bad_plan() -> None:
    with pytest.raises(FaultPlanError):
        FaultInjector("kill step=1", 0, 0, raise_fired)


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


@pytest.fixture
def model() -> Tiny:
    torch.manual_seed(0)
    return Tiny()


def x() -> torch.Tensor:
    return torch.ones(2, 4)


def test_forward_fault_fires_in_the_middle_block_of_its_microbatch(model: Tiny) -> None:
    inj = injector("kill replica=1 step=2 phase=forward microbatch=1")
    with pytest.raises(Fired) as info:
        with inj.microbatch(model, step=2, index=1, count=3):
            model(x())
    assert info.value.fault.phase == "forward"
    # the hook runs after the middle block's forward, before the last block's
    assert model.log == ["b0", "b1"]


def test_backward_fault_fires_during_backward_not_forward(model: Tiny) -> None:
    inj = injector("kill replica=1 step=2 phase=backward microbatch=0")
    with inj.microbatch(model, step=2, index=0, count=2):
        loss = model(x()).sum()  # forward completes
        assert model.log == ["b0", "b1", "b2"]
        with pytest.raises(Fired) as info:
            loss.backward()
    assert info.value.fault.phase == "backward"
    # it fired at the middle block's output: the last block's grads exist, the first's do not
    assert model.layers[2].lin.weight.grad is not None
    assert model.layers[0].lin.weight.grad is None


def test_default_microbatch_is_one(model: Tiny) -> None:
    inj = injector("kill replica=1 step=4 phase=forward")
    with inj.microbatch(model, step=4, index=0, count=4):
        model(x())
    with pytest.raises(Fired):
        with inj.microbatch(model, step=4, index=1, count=4):
            model(x())


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_microbatch_beyond_count_clamps_to_last(model: Tiny, phase: str) -> None:
    inj = injector(f"kill replica=1 step=3 phase={phase} microbatch=5")
    with inj.microbatch(model, step=3, index=0, count=2):
        model(x()).sum().backward()  # index 0 of 2: not the clamped one
    with pytest.raises(Fired):
        with inj.microbatch(model, step=3, index=1, count=2):
            model(x()).sum().backward()


def test_single_microbatch_clamps_default_to_zero(model: Tiny) -> None:
    inj = injector("kill replica=1 step=1 phase=forward")
    with pytest.raises(Fired):
        with inj.microbatch(model, step=1, index=0, count=1):
            model(x())


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_nothing_fires_for_other_microbatches_steps_or_phases(model: Tiny, phase: str) -> None:
    inj = injector(f"kill replica=1 step=3 phase={phase} microbatch=2; kill replica=1 step=3 phase=allreduce")
    for step, index in [(3, 0), (3, 1), (3, 3), (2, 2), (4, 2)]:
        with inj.microbatch(model, step=step, index=index, count=4):
            model(x()).sum().backward()
    with pytest.raises(Fired):
        with inj.microbatch(model, step=3, index=2, count=4):
            model(x()).sum().backward()


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
    assert model.layers[0].lin.weight.grad is not None


def test_hooks_removed_after_a_normal_exit(model: Tiny) -> None:
    inj = injector("kill replica=1 step=2 phase=backward microbatch=0")
    with inj.microbatch(model, step=2, index=0, count=1):
        assert len(model.layers[1]._forward_hooks) == 1
        model(x())  # forward only: the backward fault did not fire
    assert len(model.layers[1]._forward_hooks) == 0
    model(x()).sum().backward()


def test_model_without_layers_hooks_the_model_itself() -> None:
    lin = torch.nn.Linear(3, 3)
    inj = injector("kill replica=1 step=1 phase=forward microbatch=0")
    with pytest.raises(Fired):
        with inj.microbatch(lin, step=1, index=0, count=1):
            lin(torch.ones(1, 3))
    assert len(lin._forward_hooks) == 0


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
