"""The preflight's rules (``titan_recover.launch.preflight``), one test per rule, and the launcher refusing a
run on one of them before anything starts."""

from pathlib import Path

import pytest
from launcher_in_process import launch_argv

from titan_recover.config import Recover
from titan_recover.launch import preflight
from titan_recover.launch.preflight import OK, REFUSE, WARN, check
from titan_recover.titan.jobs import job

RC = Recover()  # heartbeat_timeout_s 5, collective_timeout_s 30: a survivor waits up to 35 s
TIMEOUT = (100.0, 100.0)  # TorchTitan's comm.train_timeout_seconds and its default
TRACE = (20000.0, 20000.0)  # ...its comm.trace_buf_size and its default
DEFAULT = {"train_timeout_seconds": TIMEOUT, "trace_buf_size": TRACE}


def finding(out: preflight.Preflight, rule: str) -> preflight.Finding:
    (found,) = [f for f in out.findings if f.rule == rule]
    return found


@pytest.mark.unit
@pytest.mark.parametrize(
    "version, level",
    [
        ((2, 21, 5), REFUSE),
        ((2, 25, 1), REFUSE),
        ((2, 26, 1), REFUSE),
        ((2, 26, 2), OK),
        ((2, 27, 7), OK),
        ((2, 28, 3), REFUSE),
        ((2, 28, 8), REFUSE),
        ((2, 28, 9), OK),
        ((2, 31, 2), OK),
        ((3, 0, 0), OK),
    ],
)
def test_nccl_releases_whose_abort_hangs_are_refused(version: tuple[int, int, int], level: str) -> None:
    f = finding(check(version, "nccl", {}, RC, DEFAULT), "nccl-version")
    assert f.level == level
    if level == REFUSE:
        assert "use NCCL 2.26.2 or newer outside 2.28.3-2.28.8" in f.text and f.source
    if version >= (2, 31, 2):
        assert "pytorch/pytorch#194679, does not apply" in f.text


@pytest.mark.unit
def test_a_cpu_run_checks_only_the_timeouts() -> None:
    out = check(None, "gloo", {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_DISTRIBUTED_DEBUG": "DETAIL"}, RC, DEFAULT)
    assert [f.rule for f in out.findings] == ["comm.train_timeout_seconds"] and not out.refusals and not out.env
    assert not out.flags


@pytest.mark.unit
@pytest.mark.parametrize(
    "value, level, env",
    [
        (None, OK, {"TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}),  # unset (torch's default: on): the ranks get 0
        ("0", OK, {}),
        ("false", OK, {}),
        ("1", REFUSE, {}),
        ("True", REFUSE, {}),
        ("maybe", REFUSE, {}),  # not a flag c10d reads as off
    ],
)
def test_dump_on_timeout_must_not_let_the_first_groups_monitor_kill_survivors(
    value: str | None, level: str, env: dict
) -> None:
    given = {} if value is None else {"TORCH_NCCL_DUMP_ON_TIMEOUT": value}
    out = check((2, 28, 9), "nccl", given, RC, DEFAULT)
    f = finding(out, "TORCH_NCCL_DUMP_ON_TIMEOUT")
    assert f.level == level and out.env == env
    if level == REFUSE:
        assert "aborts the process, so every survivor of a replicate failure would be killed" in f.text
        assert "ProcessGroupNCCL.cpp" in f.source and "HeartbeatMonitor::runLoop" in f.source
    # only where the replicate dimension is NCCL: a gloo replicate dimension never signals a dump
    assert not [g for g in check((2, 28, 9), "gloo", given, RC, DEFAULT).findings if g.rule == f.rule]


@pytest.mark.unit
def test_torchtitans_flight_recorder_is_turned_off_at_its_default_and_refused_when_set() -> None:
    """Above 0, TorchTitan sets TORCH_NCCL_DUMP_ON_TIMEOUT=1 itself, whatever the environment says."""
    left = check((2, 28, 9), "nccl", {}, RC, DEFAULT)
    assert left.flags == {"--comm.trace_buf_size": "0"} and not left.refusals
    assert "lowered from TorchTitan's default 20000 to 0" in finding(left, "comm.trace_buf_size").text
    mine = check((2, 28, 9), "nccl", {}, RC, {**DEFAULT, "trace_buf_size": (5000.0, 20000.0)})
    assert mine.flags == {} and [f.rule for f in mine.refusals] == ["comm.trace_buf_size"]
    assert "sets TORCH_NCCL_DUMP_ON_TIMEOUT=1" in mine.refusals[0].text and "or set 0" in mine.refusals[0].text
    off = check((2, 28, 9), "nccl", {}, RC, {**DEFAULT, "trace_buf_size": (0.0, 20000.0)})
    assert finding(off, "comm.trace_buf_size").level == OK and not off.flags
    assert not [f for f in check((2, 28, 9), "nccl", {}, RC, {}).findings if f.rule == "comm.trace_buf_size"]
    assert not check(None, "gloo", {}, RC, DEFAULT).flags  # gloo: TorchTitan keeps its recorder


@pytest.mark.unit
@pytest.mark.parametrize(
    "env, refused",
    [
        ({"TORCH_NCCL_DESYNC_DEBUG": "1"}, ["TORCH_NCCL_DESYNC_DEBUG"]),
        ({"TORCH_NCCL_DESYNC_DEBUG": "0"}, []),
        ({"TORCH_DISTRIBUTED_DEBUG": "detail"}, ["TORCH_DISTRIBUTED_DEBUG"]),
        ({"TORCH_DISTRIBUTED_DEBUG": "INFO"}, []),
        (
            {"TORCH_NCCL_DESYNC_DEBUG": "yes", "TORCH_DISTRIBUTED_DEBUG": "DETAIL"},
            ["TORCH_NCCL_DESYNC_DEBUG", "TORCH_DISTRIBUTED_DEBUG"],
        ),
    ],
)
def test_desync_debugging_is_refused_with_nccl_replicate_groups(env: dict[str, str], refused: list[str]) -> None:
    out = check((2, 28, 9), "nccl", env, RC, DEFAULT)
    assert [f.rule for f in out.refusals] == refused
    for f in out.refusals:
        assert "desync debugging in every NCCL group" in f.text and "ProcessGroupNCCL.cpp" in f.source
    assert not check((2, 28, 9), "gloo", env, RC, DEFAULT).refusals


@pytest.mark.unit
def test_nvls_and_a_disabled_watchdog_monitor_are_warned() -> None:
    out = check((2, 28, 9), "nccl", {"TORCH_NCCL_ENABLE_MONITORING": "0"}, RC, DEFAULT)
    assert finding(out, "NCCL_NVLS_ENABLE").level == WARN
    assert finding(out, "TORCH_NCCL_ENABLE_MONITORING").level == WARN
    calm = check((2, 28, 9), "nccl", {"NCCL_NVLS_ENABLE": "0"}, RC, DEFAULT)
    assert finding(calm, "NCCL_NVLS_ENABLE").level == OK
    assert not [f for f in calm.findings if f.rule == "TORCH_NCCL_ENABLE_MONITORING"]


@pytest.mark.unit
def test_the_in_group_timeout_outlasts_a_survivors_wait() -> None:
    ok = finding(check(None, "gloo", {}, RC, DEFAULT), "comm.train_timeout_seconds")
    assert ok.level == OK and "detect 5s < replicate collective 30s (a survivor waits up to 35s) < in-group" in ok.text
    long = Recover(collective_timeout_s=120.0)  # 125 s: TorchTitan's default 100 s is raised, not refused
    raised = check(None, "gloo", {}, long, DEFAULT)
    assert raised.flags == {"--comm.train_timeout_seconds": "250"} and not raised.refusals
    assert "raised from TorchTitan's default 100s to 250s" in raised.findings[0].text
    mine = check(None, "gloo", {}, long, {"train_timeout_seconds": (110.0, 100.0)})  # the user's: checked, not changed
    assert mine.flags == {} and mine.refusals[0].rule == "comm.train_timeout_seconds"
    assert "raise comm.train_timeout_seconds above 125" in mine.refusals[0].text
    assert finding(check(None, "gloo", {}, RC, {}), "comm.train_timeout_seconds").level == OK  # a line without it


@pytest.mark.unit
def test_the_override_turns_refusals_into_warnings_and_says_so() -> None:
    out = check((2, 25, 1), "nccl", {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1", preflight.OVERRIDE_ENV: "warn"}, RC, DEFAULT)
    assert not out.refusals
    warned = [f for f in out.findings if f.rule in ("nccl-version", "TORCH_NCCL_DUMP_ON_TIMEOUT")]
    assert len(warned) == 2
    assert all("turned into a warning by TITAN_RECOVER_PREFLIGHT=warn" in f.text for f in warned)


def test_the_launcher_refuses_a_too_short_in_group_timeout_before_anything_starts(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    done = launch_argv([*job(tmp_path, tiny=True), "--comm.train_timeout_seconds", "20"], capfd)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "the preflight refuses this run" in done.stderr and "comm.train_timeout_seconds: 20s" in done.stderr
    assert "set TITAN_RECOVER_PREFLIGHT=warn to run anyway" in done.stderr
    assert (
        "starting replica groups" not in done.stdout + done.stderr and "coordinator at" not in done.stdout
    )  # nothing started


@pytest.mark.unit
@pytest.mark.parametrize(
    "version, level",
    [
        ("2.10.1", REFUSE),
        ("2.11.0+cu130", OK),  # the H200's
        ("2.12.0", OK),
        ("2.13.0+cpu", OK),
        ("2.14.1", OK),
        ("2.15.0a0+git5228986", REFUSE),  # a container's pre-release of an unrun minor
        ("3.0.0", REFUSE),
        ("1.13.1", REFUSE),
        ("nightly", REFUSE),
    ],
)
def test_the_torch_release_is_checked_against_the_supported_range(version: str, level: str) -> None:
    found = preflight.torch_finding(version, "/site/torch", {})
    assert found.level == level and f"torch {version} (/site/torch)" in found.text
    assert "2.11 <= torch < 2.15" in found.text
    if level == REFUSE:
        assert (
            "./run_train.sh makes ./.venv with torch 2.13.0" in found.text
            and "TITAN_RECOVER_PREFLIGHT=warn" in found.text
        )
        warned = preflight.torch_finding(version, "/site/torch", {preflight.OVERRIDE_ENV: "warn"})
        assert warned.level == WARN and "turned into a warning" in warned.text


@pytest.mark.unit
def test_the_launcher_refuses_a_torch_outside_the_range_before_reading_the_job(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    monkeypatch.setattr(torch, "__version__", "2.10.0")
    done = launch_argv([*job(tmp_path, tiny=True), "--no.such_key", "1"], capfd)  # the job is never read
    assert done.returncode == 2, done.stderr[-2000:]
    (line,) = [x for x in done.stderr.splitlines() if x.startswith("error:")]
    assert "torch 2.10.0 (" in line and "outside the releases titan_recover supports, 2.11 <= torch < 2.15" in line
