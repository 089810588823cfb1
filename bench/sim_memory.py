"""Host-memory snapshots in the goodput simulator: the spot trace and a trace of whole racks lost, each with
and without snapshots, against checkpoint-and-restart.

Snapshot costs come from ``bench/results/host_memory.json`` (``bench.host_memory``, the default job on a
2-core CPU), as fractions of that run's figures applied to the paper setting's costs (10 s step, 300 s DCP
restart, ``goodput.PAPER_COSTS``):

- ``snapshot_interval`` 10, the default;
- a snapshot's step cost, two ways: ``measured``, the step after a snapshot was ``snapshot_default_step_extra_s``
  longer, over the failure-free median step (the file's write competing with training on 2 cores); ``copy``,
  only the copy into the host buffer (``snapshot_copy_s_median`` over that step), what is left where the
  write runs on host cores training does not use (not measured on a GPU);
- the resume from memory: ``resume_memory_vs_dcp_ratio`` (first step after every group was lost, from memory
  over from a DCP restart of the same job) times ``restart_s``.

1. The spot trace (``bench.simulate.spot_trace``: one node = one 8-GPU group): elastic and fixed titan_recover
   with and without snapshots against checkpoint-and-restart at its best interval. A spot loss takes its node's
   memory with it and the trace never leaves every group gone (``no_members``), so snapshots only cost there.
2. Racks: 512 GPUs as 8 replica groups of 8 nodes (one part each, 8 GPUs a node), racks of 8 nodes, each rack
   lost whole at random (``goodput.rack_failures``, several seeds, bounded), the rack back at once (its nodes
   replaced from a pool; memory on them gone). Three layouts (``goodput.rack_placement``): ``groups`` (a rack
   holds whole groups: a loss takes one group), ``aligned`` (a rack holds part p of every group: a loss takes
   every group and every copy of those shards) and ``spread`` (a rack holds a different part of each group:
   every group lost, a copy of every shard left on the other racks). Per layout and rate: checkpoint-and-
   restart, titan_recover with its DCP backstop, and with snapshots too, each at the DCP interval best for it
   on the first seed (``INTERVALS``); tokens per second over checkpoint-and-restart's, mean over the seeds.

Pure logic, about a minute on 2 cores.

    .venv/bin/python -m bench.sim_memory     -> bench/results/sim_memory.json (needs host_memory.json)
"""

import dataclasses
import json
import statistics
from pathlib import Path
from typing import Any

from bench.common import RESULTS, ROOT, write_result
from bench.simulate import SPOT_CLUSTER, SPOT_TRACE, spot_trace
from titan_recover.tools import goodput as g

SNAPSHOT_INTERVAL = 10  # [recover] snapshot_interval's default
RACK_CLUSTER = g.Cluster(gpus=512, group_gpus=64, microbatches=64, tokens_per_step=4 * 2**20)
PARTS = 8  # nodes per replica group (8 GPUs each)
RACK_NODES = 8
RACK_COSTS = dataclasses.replace(g.PAPER_COSTS, repair_s=0.0)  # the rack's nodes replaced at once
RACK_RATES = (1 / 48, 1 / 8)  # losses per rack-hour: with 8 racks, one every 6 hours and one an hour
RACK_HOURS = 48.0
RACK_SEEDS = 3
RACK_MOST = 200  # losses per trace at most
INTERVALS = (5, 10, 15, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640)  # DCP intervals searched, steps
PLACEMENTS: tuple[g.Placement, ...] = ("groups", "aligned", "spread")


def snapshot_costs(measured: dict[str, Any], costs: g.Costs) -> dict[str, Any]:
    """The two snapshot cost models (``measured``, ``copy``) scaled from ``host_memory.json`` to ``costs``."""
    off = statistics.median(r["0"]["median_step_s"] for r in measured["rounds"])
    resume_s = measured["resume_memory_vs_dcp_ratio"] * costs.restart_s
    fractions = {
        "measured": measured["snapshot_default_step_extra_s"] / off,
        "copy": measured["snapshot_copy_s_median"] / off,
    }
    return {
        "source": {
            "file": "bench/results/host_memory.json",
            "snapshot_default_step_extra_s": measured["snapshot_default_step_extra_s"],
            "snapshot_copy_s_median": measured["snapshot_copy_s_median"],
            "failure_free_median_step_s": off,
            "resume_memory_vs_dcp_ratio": measured["resume_memory_vs_dcp_ratio"],
        },
        "step_fraction": fractions,
        "models": {name: g.Snapshots(SNAPSHOT_INTERVAL, f * costs.step_s, resume_s) for name, f in fractions.items()},
    }


def spot(models: dict[str, g.Snapshots]) -> dict[str, Any]:
    """The whole spot trace: ``bench.simulate.spot_trace``'s systems, and titan_recover's with each snapshot
    cost; tokens per hour over checkpoint-and-restart's (restarting on every change, and on losses only)."""
    events = g.read_capacity_trace(SPOT_TRACE.read_text())
    base = spot_trace()
    systems = {name: base["systems"][name] for name in ("elastic", "fixed", "restart", "restart_on_losses")}
    for system in ("elastic", "fixed"):
        for cost, snaps in models.items():
            run = g.simulate_capacity(system, events, SPOT_CLUSTER, g.PAPER_COSTS, snapshots=snaps)
            systems[f"{system}_snapshots_{cost}"] = run
    return {
        "trace": base["trace"],
        "systems": systems,
        "vs_restart": {n: r["tokens_per_hour"] / systems["restart"]["tokens_per_hour"] for n, r in systems.items()},
        "vs_restart_on_losses": {
            n: r["tokens_per_hour"] / systems["restart_on_losses"]["tokens_per_hour"] for n, r in systems.items()
        },
    }


def _simulate(snapshots: g.Snapshots | None, restart: bool, failures: list[g.Failure], ckpt_every: int) -> g.Result:
    horizon = g.Horizon(wall_s=RACK_HOURS * g.HOUR)
    if restart:
        return g.simulate_restart(RACK_CLUSTER, RACK_COSTS, failures, horizon, ckpt_every)
    return g.simulate_recover(RACK_CLUSTER, RACK_COSTS, failures, horizon, ckpt_every=ckpt_every, snapshots=snapshots)


def racks(models: dict[str, g.Snapshots]) -> dict[str, Any]:
    """Each layout and rate: the systems on ``RACK_SEEDS`` rack traces, tokens per second over
    checkpoint-and-restart's (mean, min, max over the seeds) and what happened when every group was lost."""
    cluster, costs = RACK_CLUSTER, RACK_COSTS
    systems: dict[str, tuple[g.Snapshots | None, bool]] = {
        "restart": (None, True),
        "recover": (None, False),
        **{f"recover_snapshots_{name}": (snaps, False) for name, snaps in models.items()},
    }
    rows = []
    for placement in PLACEMENTS:
        layout = g.rack_placement(cluster.groups, PARTS, RACK_NODES, placement)
        for rate in RACK_RATES:
            traces = [g.rack_failures(layout, rate, RACK_HOURS * g.HOUR, seed, RACK_MOST) for seed in range(RACK_SEEDS)]
            runs = {}
            for name, (snaps, restart) in systems.items():
                k = max(INTERVALS, key=lambda k: _simulate(snaps, restart, traces[0], k).throughput)
                runs[name] = (k, [_simulate(snaps, restart, f, k) for f in traces])
            base = [r.throughput for r in runs["restart"][1]]
            rows.append(
                {
                    "placement": placement,
                    "rate_per_rack_hour": rate,
                    "losses": [len(f) for f in traces],
                    "every_group_lost": traces[0][0].groups == cluster.groups if traces[0] else None,
                    "memory_kept": traces[0][0].memory_kept if traces[0] else None,
                    "systems": {
                        name: {
                            "ckpt_every": k,
                            "tokens_per_s": statistics.fmean(r.throughput for r in results),
                            "vs_restart": statistics.fmean(r.throughput / b for r, b in zip(results, base)),
                            "vs_restart_min": min(r.throughput / b for r, b in zip(results, base)),
                            "vs_restart_max": max(r.throughput / b for r, b in zip(results, base)),
                            "redone_steps": statistics.fmean(r.redone_steps for r in results),
                            "resumes": {s: sum(r.resumes.get(s, 0) for r in results) for s in ("memory", "checkpoint")},
                        }
                        for name, (k, results) in runs.items()
                    },
                }
            )
    return {
        "cluster": dataclasses.asdict(cluster),
        "parts_per_group": PARTS,
        "rack_nodes": RACK_NODES,
        "racks": len(g.rack_placement(cluster.groups, PARTS, RACK_NODES, "groups")),
        "costs": dataclasses.asdict(costs),
        "hours": RACK_HOURS,
        "seeds": RACK_SEEDS,
        "most_losses": RACK_MOST,
        "intervals_searched": list(INTERVALS),
        "rows": rows,
    }


def run(results: Path = RESULTS) -> dict[str, Any]:
    snaps = snapshot_costs(json.loads((results / "host_memory.json").read_text()), g.PAPER_COSTS)
    models = snaps.pop("models")
    rack = racks(models)
    spotted = spot(models)
    return {
        "snapshots": {**snaps, "models": {n: dataclasses.asdict(s) for n, s in models.items()}},
        "spot": spotted,
        "racks": rack,
        "sim_memory_spot_vs_restart": spotted["vs_restart"],
        "sim_memory_racks_vs_restart": {
            f"{r['placement']} {r['rate_per_rack_hour']:.3g}/rack-h": {
                n: s["vs_restart"] for n, s in r["systems"].items()
            }
            for r in rack["rows"]
        },
    }


def table(result: dict[str, Any]) -> str:
    """Both traces side by side, Markdown: tokens per second over checkpoint-and-restart's."""
    spotted = result["spot"]["vs_restart"]
    names = ["recover", "recover_snapshots_measured", "recover_snapshots_copy"]
    lines = [
        "| trace | layout | titan_recover | + snapshots (measured cost) | + snapshots (copy only) |",
        "|---|---|---|---|---|",
        "| spot (elastic) | one node a group | "
        + " | ".join(f"{spotted[n]:.3f}" for n in ("elastic", "elastic_snapshots_measured", "elastic_snapshots_copy"))
        + " |",
        "| spot (fixed R) | one node a group | "
        + " | ".join(f"{spotted[n]:.3f}" for n in ("fixed", "fixed_snapshots_measured", "fixed_snapshots_copy"))
        + " |",
    ]
    for r in result["racks"]["rows"]:
        s = r["systems"]
        lines.append(
            f"| racks, {r['rate_per_rack_hour'] * result['racks']['racks'] * 24:.0f} losses/day "
            f"| {r['placement']} | " + " | ".join(f"{s[n]['vs_restart']:.3f}" for n in names) + " |"
        )
    return "\n".join(lines)


def main() -> None:
    result = run()
    path = write_result("sim_memory", result)
    print("tokens per second over checkpoint-and-restart's (spot: restarting on every change)")
    print(table(result))
    print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
