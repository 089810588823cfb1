"""The spot replay: the capacity trace read and turned into replica groups, and which node starts, gets its
notice or is killed, and when (pure, milliseconds)."""

import re
import threading
from dataclasses import replace

import pytest

from bench import spot_options
from bench.spot import TRACE, Action, Replay, headlines, schedule
from titan_recover.tools.goodput import (
    CapacitySystem,
    Cluster,
    Costs,
    TraceEvent,
    group_changes,
    read_capacity_trace,
    simulate_capacity,
)

pytestmark = pytest.mark.unit

# trace seconds -> groups: 2 at the start, 3 at minute 2, 4 at 3, 3 at 5, 2 at 6, 1 at 7, 3 at 8, 2 at 12
CHANGES = [(0.0, 2), (120.0, 3), (180.0, 4), (300.0, 3), (360.0, 2), (420.0, 1), (480.0, 3), (720.0, 2)]
PLAN = Replay(start_min=1, minutes=10, compress=6, notice_s=24, hard_every=3)


def test_joins_take_the_lowest_free_id_and_a_fall_removes_the_newest_with_a_notice_first() -> None:
    first, actions = schedule(CHANGES, PLAN, cap=4, notices=True)
    assert first == 2  # the count at minute 1
    # at = (trace s - 60) / 6; a notice 24 / 6 = 4 s before its removal; the third removal has none
    assert actions == [
        Action(10.0, "start", 2),
        Action(20.0, "start", 3),
        Action(36.0, "notice", 3),
        Action(40.0, "kill", 3),
        Action(46.0, "notice", 2),
        Action(50.0, "kill", 2),
        Action(60.0, "kill", 1),
        Action(70.0, "start", 1),
        Action(70.0, "start", 2),
    ]  # minute 12 is past the window's end (minute 11)


def test_a_fixed_r_uses_no_more_groups_than_it_started_with_and_every_removal_is_a_crash() -> None:
    first, actions = schedule(CHANGES, PLAN, cap=2, notices=False)
    assert first == 2
    assert actions == [Action(60.0, "kill", 1), Action(70.0, "start", 1)]


def test_node_a_is_never_removed_and_a_window_before_the_trace_is_refused() -> None:
    _, actions = schedule([(0.0, 3), (60.0, 0)], Replay(start_min=0, minutes=2, compress=1), 4, notices=False)
    assert [a.replica for a in actions if a.kind == "kill"] == [2, 1]  # down to one group: replica 0's
    with pytest.raises(ValueError, match="starts after minute 0"):
        schedule([(60.0, 2)], Replay(start_min=0), 4, notices=True)


def test_the_trace_reads_in_order_and_refuses_a_malformed_line_naming_it() -> None:
    text = "0,add,n1\n0,add,n2\r\n60000,remove,n1\n\n120000,add,n3\n"
    assert read_capacity_trace(text) == [
        TraceEvent(0.0, "add", "n1"),
        TraceEvent(0.0, "add", "n2"),
        TraceEvent(60.0, "remove", "n1"),
        TraceEvent(120.0, "add", "n3"),
    ]
    for bad, why in (
        ("0,add", "line 1 ('0,add'): expected time_ms,add|remove,node; got 2 fields"),
        ("-5,add,n1", "the time '-5' is not a whole number"),
        ("0,join,n1", "expected add or remove and a node name, got 'join'"),
        ("0,add,n1\n0,add,n1", "line 2 ('0,add,n1'): node 'n1' is already live"),
        ("0,remove,n1", "node 'n1' is not live"),
        ("60000,add,n1\n0,add,n2", "line 2 ('0,add,n2'): time goes backwards"),
    ):
        with pytest.raises(ValueError, match=re.escape(why)):
            read_capacity_trace(bad)


def test_groups_change_after_a_whole_time_stamp_clamped_and_only_where_they_change() -> None:
    events = read_capacity_trace(
        "0,add,a\n0,add,b\n0,add,c\n0,add,d\n60000,add,e\n60000,remove,a\n120000,add,f\n120000,add,g\n"
        "180000,remove,b\n180000,remove,c\n180000,remove,d\n180000,remove,e\n"
    )
    # live 4, 4 (one in, one out: no change), 6, 2 -> groups of 2 nodes: 2, 2, 3, 1; at most 2, at least 1
    assert group_changes(events, 2, 4) == [(0.0, 2), (120.0, 3), (180.0, 1)]
    assert group_changes(events, 2, 2, 1) == [(0.0, 2), (180.0, 1)]
    assert group_changes(events, 4, 4) == [(0.0, 1), (180.0, 0)]
    with pytest.raises(ValueError, match="nodes_per_group must be >= 1"):
        group_changes(events, 0, 4)


def test_the_shipped_trace_is_bamboos_p3_trace() -> None:
    events = read_capacity_trace(TRACE.read_text())
    live, most = 0, 0
    for e in events:
        live += 1 if e.kind == "add" else -1
        most = max(most, live)
    assert (len(events), sum(e.kind == "add" for e in events), most) == (344, 177, 32)
    assert events[-1].time_s / 3600 == pytest.approx(11.4, abs=0.05)


# two 1-GPU groups, M = 2 (1 s a step with both, 2 s alone); node b lost at 10.5 s, c arrives at 20 s
SMALL = Cluster(gpus=2, group_gpus=1, microbatches=2, tokens_per_step=100)
COSTS = Costs(step_s=1.0, ckpt_save_s=0.5, restart_s=3.0, detect_s=1.0, rejoin_s=2.0, transfer_s=0.5)
TRACE_TEXT = "0,add,a\n0,add,b\n10500,remove,b\n20000,add,c\n30000,add,end\n"


def simulated(system: str, **kwargs: object) -> dict:
    return simulate_capacity(system, read_capacity_trace(TRACE_TEXT), SMALL, COSTS, **kwargs)  # type: ignore[arg-type]


def test_elastic_leaves_at_the_boundary_after_the_notice_and_admits_the_new_node() -> None:
    # b's notice at 8.5 s: it leaves at 9 s (9 steps); a alone 9-21 s (6 steps); c started at the 21 s boundary,
    # ready at 23 s after one more step, admitted with a 0.5 s transfer; 23.5-29.5 s: 6 steps
    out = simulated("elastic", notice_s=2.0)
    assert (out["steps"], out["leaves"], out["crashes"], out["joins"], out["redone_steps"]) == (22, 1, 0, 1, 0.0)


def test_a_fixed_r_pays_the_detection_and_redoes_the_lost_share() -> None:
    # b dies half-way through step 11: its half-done microbatch is redone after 1 s of detection (11.5 s);
    # the 1.5 microbatches left take a 2 s step; alone to 21.5 s; c starts into the free slot there, ready at
    # 23.5 s, admitted at 24 s; 6 steps to 30 s
    out = simulated("fixed", notice_s=2.0)
    assert (out["steps"], out["leaves"], out["crashes"], out["joins"]) == (22, 0, 1, 1)
    assert out["redone_steps"] == pytest.approx(0.25) and out["redone_fraction"] == pytest.approx(0.25 / 22.25)


def test_checkpoint_and_restart_loses_the_steps_since_its_checkpoint_and_restarts_for_arrivals_too() -> None:
    # K = 4: saved at step 8 (9.0 s), killed in step 10 at 10.5 s (step 9 lost), restarted at 13.5 s on a;
    # stopped at 20 s after step 11 for c (a checkpoint, 0.5 s, then the restart: 23.5 s); 5 steps by 30 s
    out = simulated("restart", ckpt_every=4)
    assert (out["steps"], out["redone_steps"], out["restarts"]) == (16, 1.0, 2)
    alone = simulated("restart", ckpt_every=4, grow=False)  # c never used: a alone from 13.5 s
    assert (alone["steps"], alone["restarts"]) == (15, 1)


def test_a_batch_that_follows_the_membership_discards_the_step_and_shrinks() -> None:
    # 10 steps of both; step 11 discarded at 10.5 s, found at 11.5 s; a alone (half the tokens) until c, ready at
    # 22 s, is admitted at the 22.5 s boundary (23 s); 7 steps of both to 30 s
    out = simulated("membership")
    assert (out["steps"], out["redone_steps"], out["global_batch_groups"]) == (28, 0.5, [1, 2])
    assert out["tokens"] == (10 * 2 + 11 + 7 * 2) * 50


SYSTEMS: tuple[CapacitySystem, ...] = ("elastic", "fixed", "membership", "restart")


def each(text: str, cluster: Cluster = SMALL, **kwargs: object) -> dict[str, dict]:
    """Every system over one trace (checkpoint-and-restart every 4 steps, on every change and on its losses)."""
    events, out = read_capacity_trace(text), {}
    for system in SYSTEMS:
        for grow in (True, False) if system == "restart" else (True,):
            out[f"{system}{'' if grow else '_on_losses'}"] = simulate_capacity(
                system,
                events,
                cluster,
                COSTS,
                ckpt_every=4,
                grow=grow,
                **kwargs,  # type: ignore[arg-type]
            )
    return out


def test_a_trace_whose_first_node_arrives_late_runs_from_its_first_line() -> None:
    # the same trace 5 s later: every system the same (the clock starts at the trace's first line)
    assert each("5000,add,a\n5000,add,b\n15500,remove,b\n25000,add,c\n35000,add,end\n") == each(TRACE_TEXT)
    assert simulated("fixed")["steps"] == 22 and simulated("restart", ckpt_every=4, grow=False)["steps"] == 15


def test_groups_at_most_is_the_most_groups_that_trained_at_once() -> None:
    # three nodes on a cluster of 32 groups: elastic's cap is 32, but 3 groups trained at most
    wide = Cluster(gpus=32, group_gpus=1, microbatches=96, tokens_per_step=100)
    out = each("0,add,a\n0,add,b\n0,add,c\n30000,add,end\n", wide)
    assert (out["elastic"]["groups_at_most"], out["fixed"]["groups_at_most"]) == (3, 3)


def test_elastic_returns_when_the_only_node_is_under_notice_and_no_member_is_left() -> None:
    # a alone (2 s a step) leaves at the 6 s boundary, its notice at 5 s; b arrives at 10 s already under its
    # notice (both go at 30 s): neither is started (neither could be admitted), nothing trains until 40 s
    events = read_capacity_trace("0,add,a\n10000,add,b\n30000,remove,a\n30000,remove,b\n40000,add,end\n")
    out: list[dict] = []
    worker = threading.Thread(
        target=lambda: out.append(simulate_capacity("elastic", events, SMALL, COSTS)), daemon=True
    )
    worker.start()
    worker.join(timeout=20)
    assert out, "simulate_capacity('elastic') did not return within 20 s: a loop of goodput._titan stopped advancing"
    assert (out[0]["steps"], out[0]["leaves"], out[0]["crashes"], out[0]["joins"]) == (3, 1, 0, 0)


def test_a_node_added_again_after_its_removal_is_live_in_both_lives() -> None:
    # the same trace with the second life under a new name: every system the same
    again = each("0,add,a\n10000,remove,a\n20000,add,a\n30000,add,end\n", notice_s=2.0)
    assert again == each("0,add,a\n10000,remove,a\n20000,add,b\n30000,add,end\n", notice_s=2.0)
    # elastic: a trains 0-8 s (4 steps of 2 s; its notice at 8 s), again 22-30 s once started (4 steps)
    assert again["elastic"]["steps"] == 8


def test_leaving_at_the_last_boundary_trains_through_the_notice() -> None:
    # b's notice at 8.5 s: the step 9-10 s still ends before its removal (10.5 s), so it leaves at 10 s (10 steps);
    # a alone 10-22 s (6 steps), c (started at 20 s) admitted at 22 s with a 0.5 s transfer: 22.5-29.5 s, 7 steps
    out = simulated("elastic", notice_s=2.0, leave="last")
    assert (out["steps"], out["leaves"], out["crashes"], out["joins"]) == (23, 1, 0, 1)


def test_a_leave_that_lengthens_the_step_takes_the_next_noticed_member_with_it() -> None:
    # 3 groups, M = 3: 1 s a step, 2 s on two, 3 s alone; b goes at 10.4 s, c at 11.5 s, both noticed by 9 s.
    # At 10 s b cannot finish a 1 s step; without it the step takes 2 s, which c cannot finish: both leave
    # there (c staying would crash at 11.5 s); a alone 10-16 s: 2 steps
    three = Cluster(gpus=3, group_gpus=1, microbatches=3, tokens_per_step=100)
    events = read_capacity_trace("0,add,a\n0,add,b\n0,add,c\n10400,remove,b\n11500,remove,c\n16000,add,end\n")
    out = simulate_capacity("elastic", events, three, COSTS, notice_s=5.0, leave="last")
    assert (out["steps"], out["leaves"], out["crashes"]) == (12, 2, 0)


def test_fractional_quotas_drop_the_rounding_of_a_split_that_does_not_divide() -> None:
    # 4 groups, M = 8 (0.5 s a microbatch): on 3 nodes each computes ceil(8 / 3) = 3 (1.5 s a step), or 8 / 3
    # fractionally (1.33 s): 8 or 9 steps in 12.5 s
    four = Cluster(gpus=4, group_gpus=1, microbatches=8, tokens_per_step=100)
    events = read_capacity_trace("0,add,a\n0,add,b\n0,add,c\n12500,add,end\n")
    steps = {p: simulate_capacity("elastic", events, four, COSTS, policy=p)["steps"] for p in ("balanced", "ideal")}
    assert steps == {"balanced": 8, "ideal": 9}


def test_the_options_table_sets_each_elastic_variant_against_the_membership_run() -> None:
    out = spot_options.compare(read_capacity_trace(TRACE_TEXT), SMALL, COSTS, notice_s=2.0)
    base = simulated("membership")["tokens_per_hour"]
    last = simulated("elastic", notice_s=2.0, leave="last")
    assert out["rows"]["leave_last"]["vs_membership"] == last["tokens_per_hour"] / base
    assert out["rows"]["leave_last"]["steps"] == 23 and out["rows"]["elastic"]["steps"] == 22
    finer = simulate_capacity("elastic", read_capacity_trace(TRACE_TEXT), replace(SMALL, microbatches=8), COSTS, 2.0)
    assert out["rows"]["m_x4"]["steps"] == finer["steps"]
    assert spot_options.table(out).count("\n") == 2 + len(out["rows"])


def test_the_replays_step_ratios_carry_their_caveat_where_the_groups_outnumber_the_cores() -> None:
    rows = {"elastic": {"steps_per_trace_hour": 100.0}, "fixed": {"steps_per_trace_hour": 103.4}}
    two = headlines(rows, max_groups=4, cores=2)
    assert two["spot_steps_vs_elastic"] == {"fixed": pytest.approx(1.034)}
    assert two["spot_steps_vs_elastic_caveat"].startswith("on 2 cores, up to 4 single-rank groups: more groups add")
    assert headlines(rows, max_groups=4, cores=16)["spot_steps_vs_elastic_caveat"] is None
