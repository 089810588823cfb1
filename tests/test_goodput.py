"""The goodput simulator: hand-computed timelines, Young/Daly, the CLI (pure, milliseconds)."""

import dataclasses
import json
import math

import pytest

from titan_recover import goodput as g

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
    rec = g.simulate_recover(CLUSTER, dataclasses.replace(COSTS, repair_s=math.inf), [g.Failure(time_s=0.5, groups=2)], TEN)
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
    assert all(0 < f.time_s < 100 * g.HOUR for f in failures)


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
    assert g.main(["--gpus", "64", "--failure-rate", "1e-3", "--hours", "2", "--repair-s", "600",
                   "--json", str(out)]) == 0
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
