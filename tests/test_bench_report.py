"""bench/: the simulator's calibration and the report generator on tiny, made-up results."""

import json
from pathlib import Path

import pytest

from bench import report, simulate


def _measured(step_s: float = 1.0) -> dict:
    """A scenario-3 result of the shape bench.ckpt_restart writes (numbers invented)."""
    recover = {
        "system": "titan_recover",
        "ckpt_every": None,
        "step_s": step_s,
        "train_s": 13.0,
        "detect_s": [0.5],
        "rejoin_s": [3.0],
        "transfer_s": [0.1],
        "kill_steps": [8],
    }
    base = {
        "system": "ckpt-restart K=5",
        "ckpt_every": 5,
        "step_s": step_s,
        "train_s": 25.0,
        "ckpt_save_s": 0.5,
        "restart_s": [10.0],
        "kill_steps": [8],
    }
    return {
        "setup": {
            "replica_groups": 2,
            "ranks_per_group": 1,
            "microbatches": 4,
            "tokens_per_step": 1024,
            "steps": 10,
            "kills": ["8"],
        },
        "runs": [recover, base],
        "ckpt_restart_effective_throughput_ratio": 1.8,
    }


def _write(results: Path) -> None:
    (results / "ckpt_restart.json").write_text(json.dumps(_measured()))
    latency = {"median": {"latency_s": {"kill": {"2": 0.7, "4": 0.6, "8": 0.9}}}}
    rejoin = {"median": {"restart_s": {"kill": {"2": 6.0, "4": 6.4, "8": 10.5}}}}
    (results / "recovery_latency.json").write_text(json.dumps(latency))
    (results / "recovery_latency_rejoin.json").write_text(json.dumps(rejoin))
    (results / "overhead.json").write_text(json.dumps({"overhead_step_time_ratio": 1.01}))


@pytest.mark.unit
def test_calibration_replays_the_measured_runs() -> None:
    cal = simulate.calibration(_measured())
    # hand-computed timelines as in test_goodput (detection 0.5 s here), against 13 s and 25 s measured
    assert [r["predicted_s"] for r in cal["runs"]] == pytest.approx([12.6, 23.5])
    assert [r["measured_s"] for r in cal["runs"]] == [13.0, 25.0]
    assert cal["sim_calibration_error"] == pytest.approx(1.5 / 25)
    assert cal["costs"]["restart_s"] == 10.0 and cal["costs"]["repair_s"] == 0.0


def test_report_writes_summary_table_and_plots(tmp_path: Path) -> None:
    _write(tmp_path)
    (tmp_path / "goodput.json").write_text(json.dumps(simulate.run(tmp_path)))
    report.main([str(tmp_path)])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["overhead_step_time_ratio"] == 1.01
    assert summary["torchft_max_rel_loss_dev"] is None  # scenario not run: said, not invented
    assert summary["sim_paper_setting_ratio"] > 1
    table = (tmp_path / "summary.md").read_text()
    assert "| `torchft_max_rel_loss_dev` | not run |" in table
    for png in ("ckpt_restart", "goodput_paper", "goodput_sweep", "recovery_latency"):
        assert (tmp_path / f"{png}.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.unit
def test_a_headline_with_a_caveat_shows_it_beside_its_value() -> None:
    caveat = "on 2 cores, more groups add contention, not compute"
    scenarios = {"spot": {"spot_steps_vs_elastic": {"fixed": 1.034}, "spot_steps_vs_elastic_caveat": caveat}}
    assert report.headline(scenarios)["spot_steps_vs_elastic_caveat"] == caveat
    assert f"| `spot_steps_vs_elastic` | fixed: 1.03 (caveat: {caveat}) |" in report.table(scenarios)
    assert "spot_steps_vs_elastic_caveat" not in report.headline({})
    assert "| `spot_steps_vs_elastic` | not run |" in report.table({})


@pytest.mark.unit
def test_an_ops_self_time_leaves_out_its_childrens_and_exact_modes_ops_are_told_apart() -> None:
    from bench.exact_ops import op_times

    def event(name: str, ts: int, dur: int, tid: int = 1, cat: str = "cpu_op") -> dict:
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}

    trace = {
        "traceEvents": [
            event("ProfilerStep#6", 0, 9000, cat="user_annotation"),
            event("aten::linear", 0, 3000),
            event("aten::t", 0, 500),
            event("aten::addmm", 500, 2000),  # linear: 3 - 0.5 - 2
            event("exact.add", 4000, 1500, cat="user_annotation"),
            event("aten::_foreach_mul", 4000, 1000),
            event("aten::empty", 4100, 200),
            event("aten::aminmax", 5000, 500),
            event("aten::addmm", 6000, 1000, tid=2),  # a second thread
        ]
    }
    assert op_times(trace) == {
        "step": 9.0,
        "scopes": {"exact.add": 1.5},
        "ops": {
            "aten::linear": 0.5,
            "aten::t": 0.5,
            "aten::addmm": 3.0,
            "aten::_foreach_mul": 0.8,
            "aten::empty": 0.2,
            "aten::aminmax": 0.5,
        },
        "exact": {"aten::_foreach_mul": 0.8, "aten::empty": 0.2, "aten::aminmax": 0.5},
    }
