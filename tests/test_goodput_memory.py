"""The goodput simulator's host-memory snapshots and rack losses: hand-computed timelines, placements, the rack
trace, the bench's cost scaling (pure, milliseconds)."""

import dataclasses
import math

import pytest

from bench import sim_memory
from titan_recover.tools import goodput as g

pytestmark = pytest.mark.unit

CLUSTER = g.Cluster(gpus=2, group_gpus=1, microbatches=4, tokens_per_step=100)
COSTS = g.Costs(step_s=1.0, ckpt_save_s=0.5, restart_s=10.0, detect_s=1.0, rejoin_s=3.0, transfer_s=0.2, repair_s=0.0)
TEN = g.Horizon(steps=10)
EVERY_STEP = g.Snapshots(interval=1, step_s=0.0, resume_s=4.0)


def test_every_group_lost_resumes_from_memory_for_exactly_the_modelled_cost() -> None:
    kill = [g.Failure(step=8, groups=2)]
    # from the checkpoint: steps 1-7 with a save at 5 (7.5 s), killed half-way through 8 (8.0 s), restart
    # 10 s, steps 6-10 again with a save at 10 (23.5 s): checkpoint-and-restart's own timeline
    dcp = g.simulate_recover(CLUSTER, COSTS, kill, TEN, ckpt_every=5)
    base = g.simulate_restart(CLUSTER, COSTS, kill, TEN, ckpt_every=5)
    assert dcp.wall_s == base.wall_s == pytest.approx(23.5)
    assert (dcp.resumes, dcp.redone_steps) == ({"memory": 0, "checkpoint": 1}, 2)
    # from memory: resumed 4 s after the loss from step 7's snapshot (12.0 s), steps 8-10 and the save: 15.5 s;
    # less by the restart's 10 - 4 s and steps 6 and 7 not computed again
    mem = g.simulate_recover(CLUSTER, COSTS, kill, TEN, ckpt_every=5, snapshots=EVERY_STEP)
    assert mem.wall_s == pytest.approx(15.5)
    assert dcp.wall_s - mem.wall_s == pytest.approx((10.0 - 4.0) + 2 * COSTS.step_s)
    assert (mem.resumes, mem.redone_steps, mem.steps) == ({"memory": 1, "checkpoint": 0}, 0, 10)


def test_a_snapshot_interval_sets_the_steps_computed_again_and_its_cost_every_step_that_takes_one() -> None:
    every_three = g.Snapshots(interval=3, step_s=0.25, resume_s=4.0)
    assert g.simulate_recover(CLUSTER, COSTS, [], TEN, snapshots=every_three).wall_s == pytest.approx(10 + 3 * 0.25)
    # steps 1-7 with snapshots at 3 and 6 (7.5 s), killed half-way through 8 (8.0 s), back to step 6 at 12.0 s,
    # steps 7-10 with a snapshot at 9 (16.25 s)
    mem = g.simulate_recover(CLUSTER, COSTS, [g.Failure(step=8, groups=2)], TEN, snapshots=every_three)
    assert (mem.wall_s, mem.redone_steps) == (pytest.approx(16.25), 1)


def test_memory_lost_with_the_rack_falls_back_to_the_checkpoint() -> None:
    kill = [g.Failure(step=8, groups=2, memory_kept=False)]
    rec = g.simulate_recover(CLUSTER, COSTS, kill, TEN, ckpt_every=5, snapshots=EVERY_STEP)
    assert rec.resumes == {"memory": 0, "checkpoint": 1}
    assert rec.wall_s == pytest.approx(23.5)
    # and with no checkpoint to go back to, the run stops there
    assert g.simulate_recover(CLUSTER, COSTS, kill, TEN, snapshots=EVERY_STEP).steps == 7


def test_without_a_backstop_every_group_lost_stops_the_run() -> None:
    rec = g.simulate_recover(CLUSTER, COSTS, [g.Failure(step=8, groups=2)], TEN)
    assert (rec.steps, rec.resumes) == (7, {"memory": 0, "checkpoint": 0})


def test_the_start_again_waits_for_hardware_and_stops_without_any() -> None:
    # both groups lost at 7.5 s, their hardware back after 20 s: the resume's 4 s overlap the wait (as
    # checkpoint-and-restart's restart does), then steps 8-10 from step 7's snapshot
    slow = dataclasses.replace(COSTS, repair_s=20.0)
    rec = g.simulate_recover(CLUSTER, slow, [g.Failure(time_s=7.5, groups=2)], TEN, snapshots=EVERY_STEP)
    assert (rec.wall_s, rec.steps, rec.resumes["memory"]) == (pytest.approx(7.5 + 20.0 + 3.0), 10, 1)
    lost_for_good = dataclasses.replace(COSTS, repair_s=math.inf)
    both = g.simulate_recover(CLUSTER, lost_for_good, [g.Failure(time_s=7.5, groups=2)], TEN, snapshots=EVERY_STEP)
    assert (both.steps, both.resumes["memory"]) == (7, 0)  # nothing left to resume on: it stops


def test_a_failure_in_a_save_loses_no_work_and_the_survivors_regroup() -> None:
    save = dataclasses.replace(COSTS, ckpt_save_s=2.0)
    # steps 1-5 (5 s), the save until 7 s; one group lost at 6 s: the survivor regroups until 7 s, step 6 alone
    # (4 microbatches, 2 s), its partner (asked at 9 s) admitted (0.2 s), steps 7-10 together, the save at 10
    rec = g.simulate_recover(CLUSTER, save, [g.Failure(time_s=6.0)], TEN, ckpt_every=5)
    assert (rec.steps, rec.redone_steps) == (10, 0)
    assert rec.wall_s == pytest.approx(7.0 + 2.0 + 0.2 + 4 * 1.0 + 2.0)


@pytest.mark.parametrize(
    ("placement", "groups_hit", "kept"), [("groups", 1, True), ("aligned", 4, False), ("spread", 4, True)]
)
def test_a_rack_loss_by_placement(placement: g.Placement, groups_hit: int, kept: bool) -> None:
    racks = g.rack_placement(groups=4, parts=4, rack_nodes=4, placement=placement)
    assert len(racks) == 4 and sorted(x for r in racks for x in r) == [(i, p) for i in range(4) for p in range(4)]
    for rack in range(4):
        lost = g.rack_loss(racks, rack, 1.0)
        assert (lost.groups, lost.memory_kept) == (groups_hit, kept)


def test_spread_copies_sit_on_as_many_racks_as_there_are_groups() -> None:
    racks = g.rack_placement(groups=2, parts=4, rack_nodes=2, placement="spread")
    where = {p: {i for i, r in enumerate(racks) for _, q in r if q == p} for p in range(4)}
    assert all(len(on) == 2 for on in where.values())
    assert g.rack_placement(groups=2, parts=4, rack_nodes=2, placement="aligned")[0] == {(0, 0), (1, 0)}


def test_the_rack_trace_is_seeded_and_bounded() -> None:
    racks = g.rack_placement(groups=8, parts=8, rack_nodes=8, placement="spread")
    trace = g.rack_failures(racks, rate_per_rack_hour=1.0, horizon_s=10 * g.HOUR, seed=3, most=20)
    assert trace == g.rack_failures(racks, 1.0, 10 * g.HOUR, seed=3, most=20)
    assert trace != g.rack_failures(racks, 1.0, 10 * g.HOUR, seed=4, most=20)
    assert len(trace) == 20  # 80 expected in 10 hours: the bound
    assert all(f.groups == 8 and f.memory_kept for f in trace)
    times = [f.time_s for f in trace if f.time_s is not None]
    assert len(times) == 20 and times == sorted(times) and times[-1] < 10 * g.HOUR
    assert len(g.rack_failures(racks, 1.0, 0.1 * g.HOUR, seed=3, most=1000)) < 20
    with pytest.raises(ValueError, match="rack_nodes"):
        g.rack_placement(groups=8, parts=8, rack_nodes=0, placement="spread")


def test_capacity_snapshots_cost_a_step_and_a_run_left_without_members_is_counted() -> None:
    cluster = g.Cluster(gpus=1, group_gpus=1, microbatches=1, tokens_per_step=1)
    costs = dataclasses.replace(COSTS, step_s=10.0, rejoin_s=0.0)
    events = g.read_capacity_trace("0,add,a\n100000,remove,a\n100000,add,b\n200000,remove,b\n")
    plain = g.simulate_capacity("fixed", events, cluster, costs)
    snap = g.simulate_capacity("fixed", events, cluster, costs, snapshots=g.Snapshots(2, 10.0, 1.0))
    assert plain["steps"] > snap["steps"]
    assert plain["no_members"] == 1  # a's loss left no member
    with pytest.raises(ValueError, match="titan_recover"):
        g.simulate_capacity("membership", events, cluster, costs, snapshots=g.Snapshots(2, 10.0, 1.0))


def test_the_bench_scales_host_memory_figures_to_the_costs() -> None:
    measured = {
        "rounds": [{"0": {"median_step_s": 2.0}}, {"0": {"median_step_s": 1.0}}, {"0": {"median_step_s": 3.0}}],
        "snapshot_default_step_extra_s": 0.5,
        "snapshot_copy_s_median": 0.02,
        "resume_memory_vs_dcp_ratio": 0.25,
    }
    out = sim_memory.snapshot_costs(measured, g.PAPER_COSTS)
    assert out["models"]["measured"] == g.Snapshots(10, 0.25 * g.PAPER_COSTS.step_s, 0.25 * 300.0)
    assert out["models"]["copy"].step_s == pytest.approx(0.01 * g.PAPER_COSTS.step_s)
