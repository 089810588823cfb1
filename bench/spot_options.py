"""What three changes to titan_recover elastic would gain on the spot trace, in the simulator.

``bench.simulate``'s whole-trace replay (``spot_trace``: Bamboo's p3 trace, one node = one 8-GPU group,
32 at most, M = 256, the paper setting's costs, 25 s notices) has the batch that follows the membership
(torchft) 3% ahead of elastic titan_recover, which has no crash there (every removal noticed). Each row
here is elastic with one change, its tokens per hour against the membership-following run's:

- ``leave_last``: a noticed group leaves at the last step boundary before its removal (the one after which
  the next step would not end in time), not the first after its notice (``leave="last"``);
- ``no_join_pause``: survivors do not pause while a joiner receives its state (``transfer_s`` 0);
- ``m_x2``, ``m_x4``: finer microbatches, M x 2 and x 4 with the same global batch (each microbatch half or
  a quarter of the tokens and time), so ceil(M / live) rounds less;
- ``fractional``: fractional quotas (M / live microbatches a group, ``policy="ideal"``): the limit of finer
  microbatches, a bound;

and the three changes together. Pure logic, about a second.

    .venv/bin/python -m bench.spot_options     -> bench/results/spot_options.json
"""

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bench.common import ROOT, write_result
from bench.simulate import SPOT_CLUSTER, SPOT_TRACE
from titan_recover.tools import goodput as g

NOTICE_S = 25.0  # as spot_trace's


@dataclass(frozen=True)
class Variant:
    """One row: elastic titan_recover on ``cluster`` and ``costs`` with ``simulate_capacity``'s options."""

    change: str
    cluster: g.Cluster
    costs: g.Costs
    leave: g.LeaveAt = "first"
    policy: g.Policy = "balanced"


def variants(cluster: g.Cluster, costs: g.Costs) -> dict[str, Variant]:
    m, no_pause = cluster.microbatches, dataclasses.replace(costs, transfer_s=0.0)

    def finer(k: int) -> g.Cluster:
        return dataclasses.replace(cluster, microbatches=m * k)

    return {
        "elastic": Variant(
            "as simulated (integer quotas, a pause per admission, leaves after the notice)", cluster, costs
        ),
        "leave_last": Variant("(a) leaves at the last step boundary that fits the notice", cluster, costs, "last"),
        "no_join_pause": Variant("(b) no pause for a joiner", cluster, no_pause),
        "m_x2": Variant(f"(c) finer microbatches: M = {m * 2}, the same global batch", finer(2), costs),
        "m_x4": Variant(f"(c) finer microbatches: M = {m * 4}, the same global batch", finer(4), costs),
        "all_three": Variant(f"(a), (b) and (c) with M = {m * 4}", finer(4), no_pause, "last"),
        "fractional": Variant(
            "fractional quotas (M / live a group: the limit of finer microbatches)", cluster, costs, policy="ideal"
        ),
        "fractional_no_pause": Variant(
            "fractional quotas and no pause for a joiner", cluster, no_pause, policy="ideal"
        ),
    }


def compare(events: Sequence[g.TraceEvent], cluster: g.Cluster, costs: g.Costs, notice_s: float) -> dict[str, Any]:
    """The membership-following run and each elastic variant on the same trace: tokens per hour and their ratio
    to the membership-following run's."""
    membership = g.simulate_capacity("membership", events, cluster, costs)
    base = membership["tokens_per_hour"]
    rows: dict[str, dict[str, Any]] = {}
    for name, v in variants(cluster, costs).items():
        run = g.simulate_capacity("elastic", events, v.cluster, v.costs, notice_s, leave=v.leave, policy=v.policy)
        rows[name] = {
            "change": v.change,
            "tokens_per_hour": run["tokens_per_hour"],
            "vs_membership": run["tokens_per_hour"] / base,
            **{k: run[k] for k in ("steps", "leaves", "crashes", "joins", "redone_fraction")},
        }
    return {"membership": membership, "rows": rows}


def run() -> dict[str, Any]:
    events = g.read_capacity_trace(SPOT_TRACE.read_text())
    costs = g.PAPER_COSTS
    out = compare(events, SPOT_CLUSTER, costs, NOTICE_S)
    return {
        "trace": f"{SPOT_TRACE.relative_to(ROOT)}: {len(events)} events, {events[-1].time_s:.0f} s",
        "cluster": dataclasses.asdict(SPOT_CLUSTER),
        "costs": dataclasses.asdict(costs),
        "notice_s": NOTICE_S,
        **out,
        "sim_spot_elastic_options_vs_membership": {name: r["vs_membership"] for name, r in out["rows"].items()},
    }


def table(result: dict[str, Any]) -> str:
    """The side-by-side table, Markdown."""
    m = result["membership"]
    lines = [
        "| elastic titan_recover with | tokens per hour | / membership's | steps | leaves, crashes, joins |",
        "|---|---|---|---|---|",
        f"| (the batch follows the membership) | {m['tokens_per_hour'] / 1e9:.3f} G | 1.000 | {m['steps']:,} | - |",
    ]
    for r in result["rows"].values():
        lines.append(
            f"| {r['change']} | {r['tokens_per_hour'] / 1e9:.3f} G | {r['vs_membership']:.3f} | {r['steps']:,} "
            f"| {r['leaves']}, {r['crashes']}, {r['joins']} |"
        )
    return "\n".join(lines)


def main() -> None:
    result = run()
    path = write_result("spot_options", result)
    print(table(result))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
