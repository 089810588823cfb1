"""The host-memory snapshot keys of ``[recover]`` (``snapshot_interval``, ``snapshot_keep``, ``snapshot_dir``): their
bounds and types, the node's own check of ``snapshot_dir`` (the launcher's preflight, not ``validate``), and what
``--check`` prints about them."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
from launcher_in_process import ROOT, error_lines, launch_argv, run_main

from titan_recover import titan
from titan_recover.config import ConfigError, Recover
from titan_recover.launch import check, preflight
from titan_recover.launch.preflight import REFUSE
from titan_recover.node import memory
from titan_recover.titan.jobs import TRAIN_CONFIGS, job


@pytest.fixture(autouse=True)
def _run_in_repo_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # the shipped configs name their folders relative to the repo root


def load(tmp_path: Path, *overrides: str):
    return titan.load_config([*job(tmp_path, tiny=True), *overrides])


@pytest.mark.unit
def test_the_defaults_snapshot_every_ten_steps_keeping_one_in_dev_shm() -> None:
    rc = Recover()
    assert (rc.snapshot_interval, rc.snapshot_keep, rc.snapshot_dir) == (10, 1, "")


@pytest.mark.unit
def test_the_lowest_values_load(tmp_path: Path) -> None:
    rc = load(tmp_path, "--recover.snapshot_interval", "0", "--recover.snapshot_keep", "1").recover
    assert (rc.snapshot_interval, rc.snapshot_keep) == (0, 1)
    rc = load(tmp_path, "--recover.snapshot_interval", "25", "--recover.snapshot_keep", "3").recover
    assert (rc.snapshot_interval, rc.snapshot_keep) == (25, 3)


@pytest.mark.unit
@pytest.mark.parametrize(
    "key, value, message",
    [
        ("snapshot_interval", "-1", "recover.snapshot_interval must be >= 0, got -1"),
        ("snapshot_keep", "0", "recover.snapshot_keep must be >= 1, got 0"),
        ("snapshot_keep", "-3", "recover.snapshot_keep must be >= 1, got -3"),
    ],
)
def test_a_value_below_the_bound_names_the_key(tmp_path: Path, key: str, value: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load(tmp_path, f"--recover.{key}", value)
    assert str(info.value) == message


@pytest.mark.unit
@pytest.mark.parametrize("key", ["snapshot_interval", "snapshot_keep"])
def test_a_word_for_a_count_on_the_command_line_is_refused_naming_the_key(
    tmp_path: Path, key: str, capfd: pytest.CaptureFixture[str]
) -> None:
    """TorchTitan's parser refuses it (exit 2) before titan_recover sees the value; its message names the flag."""
    done = launch_argv([*job(tmp_path, tiny=True), f"--recover.{key}", "x"], capfd)
    assert done.returncode == 2, done.stderr[-2000:]
    flag = key.replace("_", "-")
    assert re.search(rf"--recover\.({key}|{flag})", done.stderr), done.stderr[-2000:]
    assert "invalid literal for int()" in done.stderr and "Traceback" not in done.stderr
    assert "coordinator at" not in done.stdout + done.stderr


@pytest.mark.unit
@pytest.mark.toml("a TOML value of the wrong type")
@pytest.mark.filterwarnings("ignore:The field `recover")
@pytest.mark.parametrize("key, bad", [("snapshot_interval", "2.5"), ("snapshot_keep", '"two"'), ("snapshot_dir", "3")])
def test_a_value_of_the_wrong_type_in_toml_names_the_key(tmp_path: Path, key: str, bad: str) -> None:
    toml = (TRAIN_CONFIGS / "llama3_debug_cpu.toml").read_text()
    path = tmp_path / "job.toml"
    path.write_text(toml.replace("[recover]\n", f"[recover]\n{key} = {bad}\n", 1))
    kind = "str" if key == "snapshot_dir" else "int"
    with pytest.raises(ConfigError, match=rf"recover\.{key} must be of type {kind}"):
        titan.load_config(["--job.config_file", str(path)])


# ------------------------------------------------------------------ snapshot_dir, checked on the node


@pytest.mark.unit
def test_a_snapshot_dir_that_is_here_and_writable_passes(tmp_path: Path) -> None:
    assert preflight.snapshot_dir_finding(Recover(snapshot_dir=str(tmp_path))) is None
    assert preflight.snapshot_dir_finding(Recover()) is None  # "": /dev/shm or the temp dir, chosen where it works


@pytest.mark.unit
def test_a_missing_or_non_directory_snapshot_dir_is_refused_naming_the_key(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    found = preflight.snapshot_dir_finding(Recover(snapshot_dir=str(missing)))
    assert found is not None and found.level == REFUSE and found.rule == "recover.snapshot_dir"
    assert f"recover.snapshot_dir = '{missing}' is not a directory on this node" in found.text
    a_file = tmp_path / "file"
    a_file.write_text("")
    found = preflight.snapshot_dir_finding(Recover(snapshot_dir=str(a_file)))
    assert found is not None and "is not a directory on this node" in found.text
    assert preflight.snapshot_dir_finding(Recover(snapshot_dir=str(missing), snapshot_interval=0)) is None  # unused


@pytest.mark.unit
@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_a_snapshot_dir_this_user_cannot_write_is_refused(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    found = preflight.snapshot_dir_finding(Recover(snapshot_dir=str(locked)))
    assert found is not None and "is not writable by this user" in found.text


@pytest.mark.unit
def test_the_refusal_stays_one_under_the_override(tmp_path: Path) -> None:
    """``TITAN_RECOVER_PREFLIGHT=warn`` turns NCCL refusals into warnings, not this one: no folder, no run."""
    jc = load(tmp_path, "--recover.snapshot_dir", str(tmp_path / "nowhere"))
    out = preflight.on_this_node(jc, "gloo", {preflight.OVERRIDE_ENV: "warn"})
    assert [f.rule for f in out.refusals] == ["recover.snapshot_dir"]


@pytest.mark.unit
@pytest.mark.parametrize("override", [None, "warn"])
def test_the_launcher_refuses_a_missing_snapshot_dir_before_anything_starts(
    tmp_path: Path, override: str | None, capfd: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nowhere"
    env = {preflight.OVERRIDE_ENV: override}
    done = launch_argv([*job(tmp_path, tiny=True), "--recover.snapshot_dir", str(missing)], capfd, env)
    assert done.returncode == 2, done.stderr[-2000:]
    assert error_lines(done.stderr) == ["error: the preflight refuses this run:"], done.stderr[-2000:]
    assert f"recover.snapshot_dir = '{missing}' is not a directory on this node" in done.stderr
    assert "to run anyway" not in done.stderr  # the override would not help
    assert "starting replica groups" not in done.stdout + done.stderr and "coordinator at" not in done.stdout


# ------------------------------------------------------------------ --check


def check_lines(capfd: pytest.CaptureFixture[str], tmp_path: Path, *overrides: str):
    done = run_main(check.main, [check.FLAG, *job(tmp_path, tiny=True), *overrides], capfd)
    shown = dict(re.findall(r"^  (\w[\w ]*?) +: (.*)$", done.stdout, re.MULTILINE))
    return done, shown


@pytest.mark.unit
def test_the_check_prints_interval_keep_filesystem_and_room(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    done, shown = check_lines(capfd, tmp_path, "--recover.snapshot_interval", "7", "--recover.snapshot_keep", "2")
    assert done.returncode == 0, done.stdout
    line = shown["snapshots"]
    assert line.startswith("every 7 committed steps (recover.snapshot_interval), 2 kept per shard"), line
    under = memory.root("")
    kind = memory.filesystem(under)
    assert f"each launcher's folder under {under} ({kind or 'filesystem unknown'}" in line
    free = int(re.search(r"\), ([\d,]+) bytes \(", line).group(1).replace(",", ""))  # type: ignore[union-attr]
    assert (
        abs(free - shutil.disk_usage(under).free) < 2**30
    )  # the same filesystem's room, give or take what others wrote


@pytest.mark.unit
def test_the_check_says_when_the_folder_is_not_on_tmpfs(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    done, shown = check_lines(capfd, tmp_path, "--recover.snapshot_dir", str(tmp_path))
    assert done.returncode == 0, done.stdout
    kind = memory.filesystem(str(tmp_path))
    assert f"under {tmp_path} ({kind or 'filesystem unknown'}" in shown["snapshots"]
    assert ("not tmpfs: the copies would be written to disk" in shown["snapshots"]) == (kind != "tmpfs")


@pytest.mark.unit
def test_the_check_says_snapshots_are_off_and_names_a_missing_dir(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    done, shown = check_lines(capfd, tmp_path, "--recover.snapshot_interval", "0")
    assert done.returncode == 0 and shown["snapshots"].startswith("off (recover.snapshot_interval = 0)"), done.stdout
    missing = tmp_path / "nowhere"
    done, shown = check_lines(capfd, tmp_path, "--recover.snapshot_dir", str(missing))
    assert done.returncode == 2, done.stdout
    assert shown["snapshots"].endswith(f"{missing} is not a directory on this node")
    assert f"recover.snapshot_dir = '{missing}' is not a directory on this node" in done.stdout.split("problem(s)")[1]
