"""The goodput simulator: hand-computed timelines, Young/Daly, spares, stragglers, the CLI,
the bench's spare cost (pure, milliseconds)."""

import dataclasses
import json
import math
from pathlib import Path

import pytest

from bench import simulate
from titan_recover.tools import goodput as g

pytestmark = pytest.mark.unit

CLUSTER = g.Cluster(gpus=2, group_gpus=1, microbatches=4, tokens_per_step=100)
COSTS = g.Costs(step_s=1.0, ckpt_save_s=0.5, restart_s=10.0, detect_s=1.0, rejoin_s=3.0, transfer_s=0.2, repair_s=0.0)
TEN = g.Horizon(steps=10)


def test_without_failures_only_checkpoints_cost() -> None:
    rec = g.simulate_recover(CLUSTER, COSTS, [], TEN)
    base = g.simulate_restart(CLUSTER, COSTS, [], TEN, ckpt_every=5)
    assert (rec.wall_s, rec.steps, rec.tokens) == (10.0, 10, 1000.0)
    assert base.wall_s == pytest.approx(10.0 + 2 * 0.5)


def test_restart_loses_the_steps_since_the_checkpoint() -> None:
    # steps 1-5 + save: 5.5 s; 6, 7: 7.5 s; killed half-way through 8: 8.0 s; restart 10 s;
    # steps 6-10 again + save at 10: 23.5 s
    base = g.simulate_restart(CLUSTER, COSTS, [g.Failure(step=8)], TEN, ckpt_every=5)
    assert base.wall_s == pytest.approx(23.5)
    assert base.failures == 1


def test_recover_keeps_the_survivors_work_and_readmits() -> None:
    # steps 1-7: 7 s; step 8 fails at 7.5 s with 2 of 4 microbatches done, 1 of them the
    # dead group's: 3 left for the survivor after detection (8.5 s) at 0.5 s each: 10.0 s;
    # step 9 alone: 12.0 s; the restarted group (asked at 7.5 + 3 s) is admitted: 12.2 s;
    # step 10 with both: 13.2 s
    rec = g.simulate_recover(CLUSTER, COSTS, [g.Failure(step=8)], TEN)
    assert rec.wall_s == pytest.approx(13.2)


def test_failures_hit_in_order_and_step_triggers_refire_after_replay() -> None:
    kills = [g.Failure(step=s) for s in (4, 6, 9)]
    base = g.simulate_restart(CLUSTER, COSTS, kills, TEN, ckpt_every=3)
    rec = g.simulate_recover(CLUSTER, COSTS, kills, TEN)
    assert base.failures == rec.failures == 3
    assert rec.wall_s < base.wall_s


def test_groups_lost_for_good_slow_every_later_step() -> None:
    lost = dataclasses.replace(COSTS, repair_s=math.inf)
    rec = g.simulate_recover(CLUSTER, lost, [g.Failure(time_s=0.5)], TEN)
    # 0.5 s in: half the step done, the dead group's half redone: 3 microbatches alone after 1 s
    # of detection (3.0 s), then 9 steps of 4 microbatches alone (2 s each)
    assert rec.wall_s == pytest.approx(3.0 + 9 * 2.0)
    assert rec.gpu_hours == pytest.approx((0.5 * 2 + (rec.wall_s - 0.5) * 1) / 3600)


def test_everyone_dead_stops_the_recover_run() -> None:
    rec = g.simulate_recover(
        CLUSTER, dataclasses.replace(COSTS, repair_s=math.inf), [g.Failure(time_s=0.5, groups=2)], TEN
    )
    assert rec.steps == 0


def test_step_time_follows_the_microbatches_per_live_group() -> None:
    cluster = g.Cluster(gpus=4, group_gpus=1, microbatches=8, tokens_per_step=1)
    assert [g.step_time(cluster, COSTS, live) for live in (4, 3, 2, 1)] == [1.0, 1.5, 2.0, 4.0]


def test_young_daly_interval() -> None:
    # Daly's refinement of Young's sqrt(2 C M): C = 30 s, M = 1 h
    assert g.young_daly_interval_s(30, 3600) == pytest.approx(444.97, abs=0.05)
    assert g.young_daly_interval_s(100, 40) == 40  # checkpoints costlier than the MTBF
    assert g.young_daly_steps(g.Costs(10, 30, 0, 0, 0, 0), 3600) == 44


def test_poisson_failures_match_the_rate() -> None:
    cluster = g.Cluster(gpus=1000, group_gpus=8, microbatches=125, tokens_per_step=1)
    failures = g.poisson_failures(cluster, 1e-3, 100 * g.HOUR, seed=1)
    assert 80 < len(failures) < 120  # 100 expected
    assert all(f.time_s is not None and 0 < f.time_s < 100 * g.HOUR for f in failures)


def test_tokens_at_gpu_hours_interpolates() -> None:
    result = g.Result("x", 2.0, 2, 200.0, 2.0, 0, [(0.0, 0.0, 0.0), (1.0, 100.0, 1.0), (2.0, 200.0, 2.0)])
    assert result.tokens_at_gpu_hours(1.5) == pytest.approx(150.0)
    assert result.tokens_at_gpu_hours(5.0) == 200.0


def test_paper_setting_reports_both_ratios() -> None:
    out = g.paper_setting(events=4, curves=True)
    assert out["recover"]["failures"] == out["restart"]["failures"] == 4
    assert out["throughput_ratio"] > 1 and out["tokens_ratio_at_gpu_hours"] > 1
    assert out["curves"]["recover"][-1][2] == pytest.approx(g.PAPER_GPU_HOURS, rel=0.02)
    with pytest.raises(ValueError, match="do not split into 5 events"):
        g.paper_setting(events=5)


def test_fit_line() -> None:
    assert g.fit_line([2, 4, 8], [1.0, 2.0, 4.0]) == pytest.approx((0.0, 0.5))


def test_cli_writes_json(tmp_path, capsys) -> None:
    out = tmp_path / "sim.json"
    assert (
        g.main(["--gpus", "64", "--failure-rate", "1e-3", "--hours", "2", "--repair-s", "600", "--json", str(out)]) == 0
    )
    printed = capsys.readouterr().out
    assert "effective throughput ratio" in printed
    data = json.loads(out.read_text())
    assert data["recover"]["steps"] > 0 and data["ckpt_every"] >= 1


def test_cli_rejects_an_impossible_cluster() -> None:
    with pytest.raises(SystemExit, match="--microbatches >= 8 groups"):
        g.main(["--gpus", "64", "--microbatches", "4"])


def test_best_ckpt_every_beats_or_matches_every_other_interval() -> None:
    kills = [g.Failure(step=s) for s in (4, 9, 14)]
    horizon = g.Horizon(steps=20)
    best = g.best_ckpt_every(CLUSTER, COSTS, kills, horizon, upto=10)
    walls = {k: g.simulate_restart(CLUSTER, COSTS, kills, horizon, k).wall_s for k in range(1, 11)}
    assert walls[best] == min(walls.values())


SLOW_REJOIN = dataclasses.replace(COSTS, rejoin_s=10.0)  # a restarted group is back only after the run


def test_a_ready_spare_fills_the_place_at_the_next_step_boundary() -> None:
    with_spare = dataclasses.replace(CLUSTER, spares=1)
    # as in test_recover_keeps_the_survivors_work_and_readmits, step 8 ends at 10.0 s; the
    # spare asked at 7.5 + 1 s of detection, joins then (10.2 s): back to full 2.7 s after the
    # failure (detection, the rest of the step, the transfer); steps 9, 10 with both: 12.2 s
    assert g.simulate_recover(with_spare, SLOW_REJOIN, [g.Failure(step=8)], TEN).wall_s == pytest.approx(12.2)
    # without it, the survivor runs steps 9 and 10 alone (2 s each)
    assert g.simulate_recover(CLUSTER, SLOW_REJOIN, [g.Failure(step=8)], TEN).wall_s == pytest.approx(14.0)
    # a spare admitted 3 s after the failure (asks at 10.3 s) misses the boundary at 10.0 s
    late = dataclasses.replace(SLOW_REJOIN, spare_admit_s=3.0)
    assert g.simulate_recover(with_spare, late, [g.Failure(step=8)], TEN).wall_s == pytest.approx(13.2)


def test_spare_admission_defaults_to_detection() -> None:
    assert COSTS.spare_ask_s == COSTS.detect_s
    assert dataclasses.replace(COSTS, spare_admit_s=3.0).spare_ask_s == pytest.approx(2.8)


def test_two_failures_one_spare_the_second_waits_for_a_restart() -> None:
    kills = [g.Failure(step=4), g.Failure(step=5)]
    # step 4 fails at 3.5 s, ends alone at 6.0 s, the spare joins: 6.2 s; step 5 fails at 6.7 s
    # with no spare left, ends alone at 9.2 s; steps 6-8 alone: 15.2 s; the first failed group
    # (asked at 3.5 + 10 s) joins: 15.4 s; steps 9, 10 with both: 17.4 s
    one = g.simulate_recover(dataclasses.replace(CLUSTER, spares=1), SLOW_REJOIN, kills, TEN)
    assert one.wall_s == pytest.approx(17.4)
    # with two spares the second also joins at its step's end (9.4 s), then 5 steps with both
    two = g.simulate_recover(dataclasses.replace(CLUSTER, spares=2), SLOW_REJOIN, kills, TEN)
    assert two.wall_s == pytest.approx(14.4)


def test_a_restarted_group_becomes_the_next_spare() -> None:
    # step 4 fails at 3.5 s: the spare joins at 6.2 s; the failed group asks at 6.5 s, with no
    # place left it waits as a spare; step 8 fails at 9.7 s, ends alone at 12.2 s, the new
    # spare joins: 12.4 s; steps 9, 10 with both: 14.4 s
    kills = [g.Failure(step=4), g.Failure(step=8)]
    rec = g.simulate_recover(dataclasses.replace(CLUSTER, spares=1), COSTS, kills, TEN)
    assert rec.wall_s == pytest.approx(14.4)


def test_spares_cost_gpu_hours_and_add_no_throughput() -> None:
    spared = dataclasses.replace(CLUSTER, spares=2)
    rec = g.simulate_recover(spared, COSTS, [], TEN)
    base = g.simulate_restart(spared, COSTS, [], TEN, ckpt_every=5)
    assert (rec.wall_s, rec.tokens) == (10.0, 1000.0)
    assert rec.gpu_hours == pytest.approx(10.0 * 4 / 3600)
    assert base.gpu_hours == pytest.approx(11.0 * 4 / 3600)


def test_the_baseline_restarts_on_a_spare() -> None:
    lost = dataclasses.replace(COSTS, repair_s=math.inf)
    # as in test_restart_loses_the_steps_since_the_checkpoint, the restart ends at 18.0 s:
    # on both groups again (steps 6-10 + save: 23.5 s), or on the survivor alone (2 s a step)
    spared = g.simulate_restart(dataclasses.replace(CLUSTER, spares=1), lost, [g.Failure(step=8)], TEN, ckpt_every=5)
    alone = g.simulate_restart(CLUSTER, lost, [g.Failure(step=8)], TEN, ckpt_every=5)
    assert (spared.wall_s, alone.wall_s) == pytest.approx((23.5, 28.5))


def test_quotas_sum_to_m_by_largest_remainder() -> None:
    assert g.quotas(4, [0.5, 1.0], "speed") == [1, 3]  # 1.33, 2.67
    assert g.quotas(8, [0.5, 1.0, 1.0], "balanced") == [3, 3, 2]  # the straggler, first, gets the extra one
    assert g.quotas(9, [0.5, 1.0, 1.0, 1.0, 1.0], "speed") == [1, 2, 2, 2, 2]
    for m in range(5, 40):
        for slow in ([0.5], [0.25, 0.9], [0.3, 0.3, 0.7]):
            speeds = [*slow, 1.0, 1.0]
            assert sum(g.quotas(m, speeds, "speed")) == sum(g.quotas(m, speeds, "balanced")) == m


def test_speed_quotas_beat_equal_ones_and_meet_the_bound_when_m_divides() -> None:
    for groups, m in ((2, 4), (3, 7), (5, 9), (8, 64), (16, 100)):
        cluster = g.Cluster(gpus=groups, group_gpus=1, microbatches=m, tokens_per_step=1)
        for slow in ([0.5], [0.25], [0.5, 0.8]):
            times = {p: g.step_time(cluster, COSTS, groups, slow, p) for p in ("balanced", "speed", "ideal")}
            assert times["ideal"] <= times["speed"] + 1e-12 and times["speed"] <= times["balanced"] + 1e-12
    # M * speed / total speed whole for every group: 1, 2, 2, 2, 2 microbatches, all done at once
    cluster = g.Cluster(gpus=5, group_gpus=1, microbatches=9, tokens_per_step=1)
    assert g.step_time(cluster, COSTS, 5, [0.5], "speed") == pytest.approx(
        g.step_time(cluster, COSTS, 5, [0.5], "ideal")
    )


def test_straggler_step_times_in_the_paper_cluster() -> None:
    cluster, costs = g.PAPER_CLUSTER, g.PAPER_COSTS
    # 8 microbatches each at 1.25 s: the straggler at half speed takes 20 s; by speed it gets 4,
    # four fast groups 9; the bound is 512 microbatches over 63.5 groups' worth of speed
    assert g.step_time(cluster, costs, 64, [0.5], "balanced") == pytest.approx(20.0)
    assert g.step_time(cluster, costs, 64, [0.5], "speed") == pytest.approx(11.25)
    assert g.step_time(cluster, costs, 64, [0.5], "ideal") == pytest.approx(1.25 * 512 / 63.5)


def test_a_nominal_speed_straggler_changes_nothing() -> None:
    cluster = g.Cluster(gpus=3, group_gpus=1, microbatches=8, tokens_per_step=1)  # 3, 3, 2 microbatches
    for live in (3, 2, 1):
        assert g.step_time(cluster, COSTS, live, [1.0], "balanced") == g.step_time(cluster, COSTS, live)
        assert g.step_time(cluster, COSTS, live, [1.0], "speed") == g.step_time(cluster, COSTS, live)


def test_a_straggler_slows_the_steps_that_start_in_its_window() -> None:
    window = [g.Straggler(slowdown=2.0, start_s=2.0, end_s=6.0)]
    # balanced: steps 3, 4 take 2 s (2 microbatches at half speed), step 5 starts at 6.0 s, out
    balanced = g.simulate_recover(CLUSTER, COSTS, [], TEN, window, "balanced")
    assert balanced.wall_s == pytest.approx(12.0)
    # by speed: 1 and 3 microbatches, 1.5 s a step; steps 3, 4, 5 start in the window
    assert g.simulate_recover(CLUSTER, COSTS, [], TEN, window, "speed").wall_s == pytest.approx(11.5)
    # the baseline keeps equal quotas: 12.0 s plus two saves
    out = g.compare(CLUSTER, COSTS, [], TEN, 5, stragglers=window, policy="speed")
    assert out["restart"]["wall_s"] == pytest.approx(13.0)


def test_paper_setting_with_spares_and_a_straggler() -> None:
    spared = g.paper_setting(spares=2)
    assert spared["recover"]["failures"] == spared["restart"]["failures"] == 4
    assert spared["recover"]["gpu_hours"] == pytest.approx(g.PAPER_GPU_HOURS, rel=0.02)
    slow = [g.Straggler(4.0)]
    tokens = {
        p: g.paper_setting(stragglers=slow, policy=p)["recover"]["tokens_per_s"] for p in ("balanced", "speed", "ideal")
    }
    assert tokens["balanced"] < tokens["speed"] <= tokens["ideal"]


def test_cli_spares_and_stragglers(capsys) -> None:
    assert g.main(["--paper", "--spares", "1", "--slowdown", "2", "--policy", "speed", "--spare-admit-s", "12"]) == 0
    assert "effective throughput ratio" in capsys.readouterr().out


def test_the_paper_spares_take_the_measured_admission_cost_if_any(tmp_path: Path) -> None:
    calibrated = {"detect_s": 0.7, "transfer_s": 0.2, "step_s": 0.3}
    derived = simulate.paper_spares(tmp_path, calibrated)
    assert derived["spare_cost_source"] == "derived" and derived["spare_admit_s"] == pytest.approx(1.2)
    assert derived["spare_downtime_floor_s"] == 10.0  # the paper's own detection and transfer
    (tmp_path / "spares.json").write_text(json.dumps({"spare_rejoin_downtime_s": 14.5}))
    measured = simulate.paper_spares(tmp_path, calibrated)
    assert (measured["spare_cost_source"], measured["spare_admit_s"], measured["spare_downtime_floor_s"]) == (
        "measured",
        14.5,
        14.5,
    )
    assert sorted(measured["by_spares"]) == [0, 1, 2]
