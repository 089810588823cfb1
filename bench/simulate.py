"""The goodput simulator, calibrated on this machine and extrapolated to large clusters.

1. Calibration: the costs measured by ``bench.ckpt_restart`` (step time, checkpoint
   save, restart, detection, rejoin, transfer) go into ``titan_recover.tools.goodput``; it
   replays the same kills and predicts each run's training time (first to last step).
   ``sim_calibration_error`` is the largest relative error over those runs.
2. The paper's setting (512 GPUs, 256 lost spread over the run, 234 GPU-hours): the
   effective-throughput ratio and the tokens by 234 GPU-hours, with the two curves.
3. Sweeps: the ratio against cluster size (512 to 16,384 GPUs) and per-GPU failure rate
   (Poisson, mean of 5 draws), each baseline at its Young/Daly checkpoint interval.
4. Recovery latency against scale: the measured latency and restart time at R = 2, 4, 8
   (``bench/recovery_latency.py``), fitted linearly in R and extrapolated.
5. Hot spares: the paper's setting with 0, 1, 2 spare groups (on top of the 512 GPUs, paid
   from the same 234 GPU-hours, so the run and its failures' spread are shorter). A spare's
   admission costs the downtime measured with spares (``spares.json``,
   ``spare_rejoin_downtime_s``) or, until that exists, the calibration's detection +
   transfer + one step (``spare_cost_source``: ``derived``).
6. Stragglers: one group of the paper's cluster 2x and 4x slower for the whole run, under
   each quota policy (equal, by speed, the fractional bound): the failure-free step and the
   paper setting's throughput.

    .venv/bin/python -m bench.simulate     -> bench/results/goodput.json (needs ckpt_restart.json)
"""

import dataclasses
import json
import statistics
from pathlib import Path

from bench.common import RESULTS, ROOT, write_result
from titan_recover.tools import goodput as g

SIZES = (512, 1024, 2048, 4096, 8192, 16384)
RATES = (1e-5, 3e-5, 1e-4, 3e-4)  # failures per GPU-hour (1e-4: one per 10,000 GPU-hours)
SWEEP_HOURS = 24.0
SWEEP_REPAIR_S = 3600.0  # a failed node is swapped for a spare within the hour
SWEEP_SEEDS = 5  # independent failure draws per point
FLASHRECOVERY = {"devices": 4800, "restore_s": 150.0}
SPARES = (0, 1, 2)
SLOWDOWNS = (2, 4)
POLICIES: tuple[g.Policy, ...] = ("balanced", "speed", "ideal")


def calibration(measured: dict) -> dict:
    runs, setup = measured["runs"], measured["setup"]
    recover, baselines = runs[0], runs[1:]
    costs = g.Costs(
        step_s=recover["step_s"],
        ckpt_save_s=statistics.median(b["ckpt_save_s"] for b in baselines),
        restart_s=statistics.median(r for b in baselines for r in b["restart_s"]),
        detect_s=statistics.median(recover["detect_s"]),
        rejoin_s=statistics.median(recover["rejoin_s"]),
        transfer_s=statistics.median(recover["transfer_s"]),
        repair_s=0.0,  # a killed process restarts at once on the same machine
    )
    cluster = g.Cluster(
        gpus=setup["replica_groups"],
        group_gpus=setup["ranks_per_group"],
        microbatches=setup["microbatches"],
        tokens_per_step=setup["tokens_per_step"],
    )
    horizon = g.Horizon(steps=setup["steps"])
    rows = []
    for run in runs:
        failures = [g.Failure(step=s) for s in run["kill_steps"]]  # where this run's kills fired
        if run["ckpt_every"] is None:
            sim = g.simulate_recover(cluster, costs, failures, horizon)
        else:
            sim = g.simulate_restart(cluster, costs, failures, horizon, run["ckpt_every"])
        measured_s = run["train_s"]
        rows.append(
            {
                "system": run["system"],
                "measured_s": measured_s,
                "predicted_s": sim.wall_s,
                "error": abs(sim.wall_s - measured_s) / measured_s,
            }
        )
    best = min(rows[1:], key=lambda r: r["measured_s"])
    predicted_best = min(r["predicted_s"] for r in rows[1:])
    return {
        "costs": costs.__dict__,
        "runs": rows,
        "measured_train_ratio": best["measured_s"] / rows[0]["measured_s"],
        "predicted_train_ratio": predicted_best / rows[0]["predicted_s"],
        "sim_calibration_error": max(r["error"] for r in rows),
    }


def paper() -> dict:
    main = g.paper_setting(curves=True)
    per_events = {events: g.paper_setting(events=events)["throughput_ratio"] for events in (2, 4, 8, 16, 32)}
    per_restart = {
        restart: g.paper_setting(dataclasses.replace(g.PAPER_COSTS, restart_s=restart))["throughput_ratio"]
        for restart in (30.0, 60.0, 120.0, 300.0, 600.0)
    }
    return {
        "costs": g.PAPER_COSTS.__dict__,
        "cluster": g.PAPER_CLUSTER.__dict__,
        "events": 4,
        "result": main,
        "ratio_by_failure_events": per_events,
        "ratio_by_restart_s": per_restart,
    }


def paper_spares(results: Path, calibrated: dict) -> dict:
    """The paper setting with hot spares. The spare's cost is measured on this machine, as
    the other costs the calibration uses; the paper's own detection and transfer still
    bound a spare's downtime from below (``spare_downtime_floor_s``)."""
    path = results / "spares.json"
    measured = json.loads(path.read_text()).get("spare_rejoin_downtime_s") if path.exists() else None
    admit = (
        float(measured)
        if measured is not None
        else (calibrated["detect_s"] + calibrated["transfer_s"] + calibrated["step_s"])
    )
    costs = dataclasses.replace(g.PAPER_COSTS, spare_admit_s=admit)
    return {
        "spare_cost_source": "measured" if measured is not None else "derived",
        "spare_admit_s": admit,
        "spare_downtime_floor_s": max(admit, costs.detect_s + costs.transfer_s),
        "by_spares": {n: g.paper_setting(costs, spares=n) for n in SPARES},
    }


def paper_stragglers() -> dict:
    """One straggling group in the paper setting: its failure-free step and titan_recover's
    throughput over the run, by quota policy (the baseline's quotas stay equal)."""
    cluster, costs = g.PAPER_CLUSTER, g.PAPER_COSTS
    out: dict = {
        "groups": 1,
        "nominal_step_s": g.step_time(cluster, costs, cluster.groups),
        "nominal_tokens_per_s": g.paper_setting()["recover"]["tokens_per_s"],
        "by_slowdown": {},
    }
    for slowdown in SLOWDOWNS:
        straggler = g.Straggler(slowdown)
        runs = {p: g.paper_setting(stragglers=[straggler], policy=p) for p in POLICIES}
        tokens = {p: r["recover"]["tokens_per_s"] for p, r in runs.items()}
        out["by_slowdown"][slowdown] = {
            "step_s": {p: g.step_time(cluster, costs, cluster.groups, [1 / slowdown], p) for p in POLICIES},
            "tokens_per_s": tokens,
            "throughput_ratio": {p: r["throughput_ratio"] for p, r in runs.items()},
            "speed_over_balanced": tokens["speed"] / tokens["balanced"],
            "speed_over_ideal": tokens["speed"] / tokens["ideal"],
        }
    return out


def sweep() -> list[dict]:
    rows = []
    costs = dataclasses.replace(g.PAPER_COSTS, repair_s=SWEEP_REPAIR_S)
    for gpus in SIZES:
        cluster = g.Cluster(
            gpus,
            g.PAPER_CLUSTER.group_gpus,
            g.MICROBATCHES_PER_GROUP * gpus // g.PAPER_CLUSTER.group_gpus,
            g.PAPER_CLUSTER.tokens_per_step,
        )
        horizon = g.Horizon(wall_s=SWEEP_HOURS * g.HOUR)
        for rate in RATES:
            k = g.young_daly_steps(costs, g.mtbf_s(cluster, [], horizon, rate))
            ratios, failures = [], []
            for seed in range(SWEEP_SEEDS):  # independent failure draws; their spread is reported
                drawn = g.poisson_failures(cluster, rate, horizon.wall_s, seed=seed)
                ratios.append(g.compare(cluster, costs, drawn, horizon, k)["throughput_ratio"])
                failures.append(len(drawn))
            rows.append(
                {
                    "gpus": gpus,
                    "rate_per_gpu_hour": rate,
                    "ckpt_every": k,
                    "failures": failures,
                    "throughput_ratio": statistics.fmean(ratios),
                    "min": min(ratios),
                    "max": max(ratios),
                }
            )
    return rows


def latency_scale(results: Path) -> dict:
    """Fits measured recovery latency and restart time against R and extrapolates."""
    kill = json.loads((results / "recovery_latency.json").read_text())["median"]["latency_s"]["kill"]
    rejoin = json.loads((results / "recovery_latency_rejoin.json").read_text())["median"]["restart_s"]["kill"]
    out: dict = {"measured": {"latency_s": kill, "restart_s": rejoin}}
    for name, data in (("latency_s", kill), ("restart_s", rejoin)):
        xs = [float(r) for r in data]
        a, b = g.fit_line(xs, list(data.values()))
        out[f"{name}_fit"] = {"a": a, "b_per_group": b}
    per_group = g.PAPER_CLUSTER.group_gpus
    out["gpus_per_group"] = per_group  # how a measured R maps to devices
    out["extrapolated"] = []
    for devices in (512, 1024, FLASHRECOVERY["devices"], 16384):
        groups = devices // per_group
        row = {"devices": devices, "groups": groups}
        for name in ("latency_s", "restart_s"):
            row[name] = out[f"{name}_fit"]["a"] + out[f"{name}_fit"]["b_per_group"] * groups
        out["extrapolated"].append(row)
    out["flashrecovery"] = FLASHRECOVERY
    return out


SPOT_TRACE = Path(__file__).parent / "traces" / "aws-p3-trace.csv"
# one trace node (a p3.2xlarge in the trace) stands for a node of 8 GPUs, one replica group; 32 live at most
SPOT_CLUSTER = g.Cluster(gpus=32 * 8, group_gpus=8, microbatches=256, tokens_per_step=4 * 2**20)


def spot_trace() -> dict:
    """The whole spot trace (11.4 hours, 177 nodes) at the paper setting's costs for the four systems; the
    checkpoint-and-restart baseline at its best interval on this trace (searched up to twice Young/Daly's for
    the trace's mean time between losses), restarting on every change (the issue's baseline) and, better for
    it, on its own nodes' losses only."""
    events = g.read_capacity_trace(SPOT_TRACE.read_text())
    costs = g.PAPER_COSTS
    losses = sum(e.kind == "remove" for e in events)
    daly = g.young_daly_steps(costs, events[-1].time_s / losses)

    def restart(grow: bool) -> dict:
        runs = (
            g.simulate_capacity("restart", events, SPOT_CLUSTER, costs, ckpt_every=k, grow=grow)
            for k in range(1, 2 * daly + 1)
        )
        return max(runs, key=lambda r: r["tokens_per_hour"])

    systems = {s: g.simulate_capacity(s, events, SPOT_CLUSTER, costs) for s in ("elastic", "fixed", "membership")}
    systems |= {"restart": restart(grow=True), "restart_on_losses": restart(grow=False)}
    elastic = systems["elastic"]["tokens_per_hour"]
    return {
        "trace": f"{SPOT_TRACE.relative_to(ROOT)}: {len(events)} events, {losses} losses, {events[-1].time_s:.0f} s",
        "cluster": dataclasses.asdict(SPOT_CLUSTER),
        "costs": dataclasses.asdict(costs),
        "costs_source": "the paper setting's (titan_recover.tools.goodput.PAPER_COSTS), as scenario 2 of goodput.json",
        "notice_s": 25.0,
        "young_daly_steps": daly,
        "systems": systems,
        "tokens_per_hour_vs_elastic": {name: r["tokens_per_hour"] / elastic for name, r in systems.items()},
    }


def run(results: Path = RESULTS) -> dict:
    measured = json.loads((results / "ckpt_restart.json").read_text())
    cal = calibration(measured)
    pap = paper()
    return {
        "calibration": cal,
        "paper_setting": pap,
        "sweep": sweep(),
        "latency_scale": latency_scale(results),
        "paper_spares": paper_spares(results, cal["costs"]),
        "paper_stragglers": paper_stragglers(),
        "spot_trace": spot_trace(),
        "sim_calibration_error": cal["sim_calibration_error"],
        "sim_paper_setting_ratio": pap["result"]["throughput_ratio"],
        "sim_paper_tokens_ratio_at_234_gpu_hours": pap["result"]["tokens_ratio_at_gpu_hours"],
    }


def main() -> None:
    result = run()
    path = write_result("goodput", result)
    for r in result["calibration"]["runs"]:
        print(
            f"calibration {r['system']:20s} measured {r['measured_s']:6.1f} s  predicted {r['predicted_s']:6.1f} s  "
            f"error {r['error']:.1%}"
        )
    print(
        f"paper setting: {result['sim_paper_setting_ratio']:.2f}x effective throughput, "
        f"{result['sim_paper_tokens_ratio_at_234_gpu_hours']:.2f}x tokens at 234 GPU-hours"
    )
    spares = result["paper_spares"]
    print(
        f"  spare admission: {spares['spare_admit_s']:.2f} s ({spares['spare_cost_source']}), "
        f"{spares['spare_downtime_floor_s']:.2f} s at least in the paper's costs"
    )
    for n, r in spares["by_spares"].items():
        print(
            f"  {n} spares: titan_recover {r['recover']['tokens_per_s']:.0f} tokens/s, {r['throughput_ratio']:.2f}x, "
            f"{r['tokens_ratio_at_gpu_hours']:.2f}x tokens at 234 GPU-hours"
        )
    for slowdown, r in result["paper_stragglers"]["by_slowdown"].items():
        print(
            f"  one group {slowdown}x slower: failure-free step "
            + ", ".join(f"{p} {t:.2f} s" for p, t in r["step_s"].items())
            + f"; paper run tokens/s speed/balanced {r['speed_over_balanced']:.2f}x,"
            + f" speed/ideal {r['speed_over_ideal']:.2f}x"
        )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
