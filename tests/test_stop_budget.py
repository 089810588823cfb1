"""Tests for titan_recover.policy.stop_budget: whether a shard's save at a stop fits the notice, and the lines
that say so with their numbers; the newest DCP checkpoint a stop falls back to (real folders); and the rank's
check at the notice."""

import functools
import math
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from titan_recover.policy import stop_budget
from titan_recover.policy.stop_budget import SaveFit

pytestmark = pytest.mark.unit

GB = 10**9
LLAMA3_8B_PARAMS = 8_030_261_248  # Llama 3.1 8B
STATE_BYTES_PER_PARAM = 12  # fp32 weights and AdamW's two moments: what a snapshot or a stop's save holds


def test_a_save_fits_when_its_bytes_at_the_rate_take_no_longer_than_the_budget() -> None:
    fit = SaveFit(state_bytes=6 * GB, rate=500e6, budget_s=12.0)
    assert fit.needed_s == 12.0 and fit.fits
    assert fit.fitting_bytes == 6 * GB
    assert fit.needed_rate == 500e6
    short = SaveFit(state_bytes=6 * GB + 1, rate=500e6, budget_s=12.0)
    assert not short.fits


def test_the_start_line_names_every_number_and_what_to_set() -> None:
    fit = SaveFit(state_bytes=12 * GB, rate=200e6, budget_s=12.0)
    line = stop_budget.at_start(fit)
    for fragment in (
        "would not fit recover.notice_budget_s",
        "12.0 GB at the 200.0 MB/s measured for a save into the stop folder (its checksum and fsynced write) takes "
        "about 60.0 s",  # the shard, the rate, the time
        "over the 12 s budget",
        "that time holds 2.4 GB at this rate",  # what fits
        "12.0 GB in 12.0 s needs 1.0 GB/s",  # the rate that would fit
        "falls back to the last complete checkpoint",
        "GraceTime",
        "terminationGracePeriodSeconds",
        "recover.notice_budget_s a few seconds under it",
        "[checkpoint] enable",
        "keep DCP checkpoints on",
        "the budget over 60 s plus a step",
    ):
        assert fragment in line, line


def test_the_notice_line_names_the_time_left_and_where_the_next_run_starts() -> None:
    fit = SaveFit(state_bytes=3 * GB, rate=100e6, budget_s=7.25)
    line = stop_budget.at_notice(fit, 41, stop_budget.fallback(40, None))
    for fragment in (
        "step 41's state will not fit the notice",
        "3.0 GB at the 100.0 MB/s measured for a save into the stop folder (its checksum and fsynced write) takes "
        "about 30.0 s",
        "over the 7.2 s at most left of recover.notice_budget_s",
        "that time holds 725.0 MB",
        "It is written anyway (a write cut short is never used)",
        "the next run starts from the DCP checkpoint of step 40",
    ):
        assert fragment in line, line


def test_no_time_left_holds_nothing_and_no_rate_fits() -> None:
    fit = SaveFit(state_bytes=GB, rate=1e9, budget_s=-0.5)
    assert not fit.fits and fit.fitting_bytes == 0 and math.isinf(fit.needed_rate)
    line = stop_budget.at_notice(fit, 3, stop_budget.fallback(None, None))
    assert "over the 0.000 s at most left" in line and "in 0.000 s cannot fit" in line, line
    assert "starts from scratch: there is no DCP checkpoint and no earlier stop's save" in line, line


@pytest.mark.parametrize(
    ("checkpoint", "stop", "text", "step"),
    [
        (None, None, "scratch", None),
        (40, None, "the DCP checkpoint of step 40", 40),
        (None, 4, "the state saved at an earlier stop, step 4", 4),
        (40, 4, "the DCP checkpoint of step 40", 40),  # the resume takes the newer, as here
        (40, 45, "the state saved at an earlier stop, step 45", 45),
        (40, 40, "the DCP checkpoint of step 40", 40),
    ],
)
def test_the_fallback_is_the_newer_of_the_checkpoint_and_an_earlier_stop(
    checkpoint: int | None, stop: int | None, text: str, step: int | None
) -> None:
    assert stop_budget.fallback(checkpoint, stop).startswith(text)
    assert stop_budget.fallback_step(checkpoint, stop) == step


def test_an_8b_group_in_a_30s_grace() -> None:
    """docs/host-memory.md's figures: an 8B group's state, one copy, over its 8 ranks, in a 30 s grace."""
    group = LLAMA3_8B_PARAMS * STATE_BYTES_PER_PARAM
    shard = group // 8
    assert round(group / GB, 1) == 96.4 and round(shard / GB, 1) == 12.0
    whole_grace = SaveFit(shard, rate=400e6, budget_s=30.0)
    assert not whole_grace.fits and round(whole_grace.needed_rate / 1e6) == 402  # per rank, 3.2 GB/s per node
    assert round(8 * whole_grace.needed_rate / GB, 1) == 3.2
    after_a_step = SaveFit(shard, rate=400e6, budget_s=15.0)  # a 25 s budget, a 10 s step reaching the boundary
    assert round(after_a_step.needed_rate / 1e6) == 803 and round(8 * after_a_step.needed_rate / GB, 1) == 6.4
    sixteen_bytes = SaveFit(LLAMA3_8B_PARAMS * 16 // 8, rate=400e6, budget_s=30.0)  # 128 GB per copy
    assert round(sixteen_bytes.needed_rate / 1e6) == 535
    nfs = SaveFit(shard, rate=1.25e9 / 8, budget_s=30.0)  # a node's 10 Gb/s link, shared by its 8 ranks
    assert round(nfs.needed_s) == 77 and round(nfs.fitting_bytes / GB, 2) == 4.69  # per rank
    assert round(8 * nfs.fitting_bytes / STATE_BYTES_PER_PARAM / 1e9, 1) == 3.1  # a 3.1B-parameter group fits


def test_a_short_time_keeps_its_digits() -> None:
    fit = SaveFit(state_bytes=4_500_000, rate=300e6, budget_s=12.0)
    assert "takes about 0.015 s, within" in fit.numbers("within the 12 s budget")


def test_amount_is_decimal() -> None:
    assert [stop_budget.amount(n) for n in (0, 999, 1000, 4_500_000, 96.4e9)] == [
        "0 B",
        "999 B",
        "1.0 kB",
        "4.5 MB",
        "96.4 GB",
    ]


def test_the_newest_checkpoint_is_the_newest_step_folder_with_its_metadata(tmp_path: Path) -> None:
    from titan_recover.titan.common import newest_checkpoint

    assert newest_checkpoint(str(tmp_path / "none")) is None
    for step, complete in ((5, True), (10, True), (15, False)):  # 15: a save cut short, without .metadata
        (tmp_path / f"step-{step}").mkdir()
        if complete:
            (tmp_path / f"step-{step}" / ".metadata").write_bytes(b"")
    (tmp_path / "stop").mkdir()
    (tmp_path / "step-20.tmp").mkdir()
    assert newest_checkpoint(str(tmp_path)) == 10


# --- the rank's check at the notice (its trainer's method, on a stand-in holding only what it reads) ---------


def notice_check(tmp_path: Path, noticed_s_ago: float | None, state: int) -> tuple[list[dict], list[str]]:
    """``RecoverTrainer._check_notice_budget`` for shard 0 of replica 1 at step 41: a save measured at 100 MB/s,
    a 12 s budget, a real checkpoint folder (step 40 complete, 45 cut short) and a real event log."""
    from titan_recover.observability.events import EventLog, events_path, read_events
    from titan_recover.rank import snapshot
    from titan_recover.rank.recover import RecoverTrainer

    folder = tmp_path / "checkpoint"
    for step in (40, 45):
        (folder / f"step-{step}").mkdir(parents=True)
    (folder / "step-40" / ".metadata").write_bytes(b"")
    said: list[str] = []
    trainer = SimpleNamespace(
        _stop_rate=snapshot.Probe(100e6, finished=True),
        manager=SimpleNamespace(noticed_at=None),
        _run_noticed_at=None if noticed_s_ago is None else time.time() - noticed_s_ago,
        rc=SimpleNamespace(notice_budget_s=12.0),
        checkpointer=SimpleNamespace(enable=True),
        stop_root=str(folder / "stop"),
        parallel_dims=SimpleNamespace(world_size=2),
        log=SimpleNamespace(warning=said.append),
        events=EventLog(str(tmp_path)),
        step=41,
        replica=1,
        group_rank=0,
    )
    trainer._emit_stop_short = functools.partial(RecoverTrainer._emit_stop_short, trainer)  # type: ignore[arg-type]
    RecoverTrainer._check_notice_budget(trainer, state)  # type: ignore[arg-type]
    trainer.events.close()
    path = events_path(str(tmp_path))
    return (read_events(path) if os.path.exists(path) else []), said


def test_at_the_notice_a_save_past_the_time_left_is_said_with_its_fallback(tmp_path: Path) -> None:
    events, said = notice_check(tmp_path, noticed_s_ago=9.0, state=500_000_000)  # 5 s needed, about 3 s left
    [line] = said
    assert "the save of step 41's state will not fit the notice" in line, line
    assert "takes about 5.0 s, over the 3.0 s at most left" in line, line
    assert "the next run starts from the DCP checkpoint of step 40" in line, line  # 45 has no .metadata
    [event] = events
    assert event["event"] == "stop_save_short" and event["at"] == "notice" and event["fallback_step"] == 40
    assert (event["step"], event["replica"], event["rank"], event["bytes"]) == (41, 1, 0, 500_000_000)
    assert event["needed_s"] == 5.0 and 2.5 < event["budget_s"] <= 3.0 and event["rate"] == 100_000_000


def test_at_the_notice_a_save_that_fits_the_time_left_is_not_said(tmp_path: Path) -> None:
    assert notice_check(tmp_path, noticed_s_ago=2.0, state=500_000_000) == ([], [])  # 5 s of about 10 s


def test_at_the_notice_without_its_time_the_whole_budget_is_the_bound(tmp_path: Path) -> None:
    assert notice_check(tmp_path, noticed_s_ago=None, state=1_100_000_000) == ([], [])  # 11 s of 12
    events, said = notice_check(tmp_path / "again", noticed_s_ago=None, state=1_300_000_000)  # 13 s of 12
    assert [e["budget_s"] for e in events] == [12.0] and "over the 12.0 s at most left" in said[0]
