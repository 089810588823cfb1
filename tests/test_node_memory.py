"""A launcher's snapshot folder (``titan_recover.node.memory``) on real files: made, freed, and swept when its
launcher is gone (a real dead pid); and the launcher's use of it in a real run."""

from __future__ import annotations

import os
import re
import socket
import stat
import subprocess
import threading
from pathlib import Path

import pytest
from conftest import run_job

from titan_recover.control import keys
from titan_recover.node import memory
from titan_recover.node.channel import CHANNEL_FILE, Channel, remove_orphans, shm_dir

PUBLIC_ID = "0123456789abcdef"


def dead_pid() -> int:
    """The pid of a process that ran and was reaped: nobody's now (until the kernel hands it out again)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def fill(folder: Path, sizes: dict[str, int]) -> int:
    """Files of ``sizes`` bytes under ``folder`` (names may hold a subfolder); their total."""
    for name, size in sizes.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * size)
    return sum(sizes.values())


@pytest.mark.unit
def test_the_folder_is_new_private_and_named_for_the_run_and_this_launcher(tmp_path: Path) -> None:
    path = memory.make_folder(str(tmp_path), PUBLIC_ID)
    assert os.path.basename(path) == f"titan_recover-snapshots-{PUBLIC_ID}-{os.getpid()}"
    match = memory.FOLDER.fullmatch(os.path.basename(path))
    assert match is not None and match.groups() == (PUBLIC_ID, str(os.getpid()))
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700 and os.listdir(path) == []
    assert CHANNEL_FILE.fullmatch(os.path.basename(path)) is None  # the channel's sweep never takes it


@pytest.mark.unit
def test_the_folder_is_private_whatever_the_umask(tmp_path: Path) -> None:
    before = os.umask(0o077 ^ 0o777)  # a umask that leaves only group and other bits: mkdir alone gives 0o000
    try:
        path = memory.make_folder(str(tmp_path), PUBLIC_ID)
    finally:
        os.umask(before)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700


@pytest.mark.unit
def test_a_leftover_of_a_process_with_this_pid_is_replaced_by_an_empty_folder(tmp_path: Path) -> None:
    leftover = tmp_path / f"titan_recover-snapshots-{PUBLIC_ID}-{os.getpid()}"
    leftover.mkdir()
    fill(leftover, {"s0/step_10": 100})
    path = memory.make_folder(str(tmp_path), PUBLIC_ID)
    assert path == str(leftover) and os.listdir(path) == []


@pytest.mark.unit
def test_a_symlink_in_the_folders_place_is_not_followed(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    fill(elsewhere, {"keep": 5})
    under = tmp_path / "shm"
    under.mkdir()
    (under / f"titan_recover-snapshots-{PUBLIC_ID}-{os.getpid()}").symlink_to(elsewhere)
    path = memory.make_folder(str(under), PUBLIC_ID)
    assert not os.path.islink(path) and os.path.isdir(path)
    assert (elsewhere / "keep").read_bytes() == b"x" * 5


@pytest.mark.unit
def test_freeing_removes_everything_and_says_how_many_bytes(tmp_path: Path) -> None:
    path = memory.make_folder(str(tmp_path), PUBLIC_ID)
    written = fill(Path(path), {"a": 1000, "shard0/step_10.bin": 4096, "shard0/step_20.partial": 7})
    assert memory.folder_bytes(path) == written == 5103
    assert memory.free_folder(path) == written
    assert not os.path.lexists(path)
    assert memory.free_folder(path) == 0  # again: nothing left, no error


def test_the_folders_of_launchers_that_are_gone_are_swept_and_no_other(tmp_path: Path) -> None:
    """A SIGKILLed launcher cannot remove its folder; the next one on the node does: only folders whose pid is not
    alive, and only folders with the snapshot name (a live launcher's, a file of that name, others' files stay)."""
    gone = dead_pid()
    dead = tmp_path / f"titan_recover-snapshots-{PUBLIC_ID}-{gone}"
    dead.mkdir()
    freed = fill(dead, {"shard0/step_10": 300, "shard1/step_10": 200})
    live = Path(memory.make_folder(str(tmp_path), PUBLIC_ID))
    fill(live, {"shard0/step_10": 50})
    not_a_folder = tmp_path / f"titan_recover-snapshots-{PUBLIC_ID}-{dead_pid()}"
    not_a_folder.write_text("a file")
    other = tmp_path / f"titan_recover-snapshot-{PUBLIC_ID}-{gone}"
    other.mkdir()
    channel = Channel.create(1, 0, 2, directory=str(tmp_path))
    assert memory.sweep_orphans(str(tmp_path)) == [(dead.name, freed)]
    assert not dead.exists()
    assert live.is_dir() and memory.folder_bytes(str(live)) == 50
    assert not_a_folder.is_file() and other.is_dir() and os.path.exists(channel.path)
    assert remove_orphans(str(tmp_path)) == []  # the channel's sweep takes no snapshot folder either
    assert live.is_dir() and other.is_dir()
    assert memory.sweep_orphans(str(tmp_path)) == []
    channel.remove()


@pytest.mark.unit
def test_sweeping_a_folder_that_is_not_there_finds_nothing(tmp_path: Path) -> None:
    assert memory.sweep_orphans(str(tmp_path / "nowhere")) == []


@pytest.mark.unit
def test_the_root_is_the_configured_folder_or_the_channels_tmpfs(tmp_path: Path) -> None:
    assert memory.root(str(tmp_path)) == str(tmp_path)
    assert memory.root("") == shm_dir()


@pytest.mark.unit
def test_the_filesystem_is_the_longest_mount_point_above_the_path(tmp_path: Path) -> None:
    (tmp_path / "with space" / "deep").mkdir(parents=True)
    mounts = tmp_path / "mounts"
    mounts.write_text(
        "overlay / overlay rw 0 0\n"
        f"tmpfs {tmp_path}/with\\040space tmpfs rw,nosuid 0 0\n"
        f"ext4 {tmp_path}/with ext4 rw 0 0\n"
        "broken\n"
    )
    assert memory.filesystem(str(tmp_path / "with space" / "deep"), str(mounts)) == "tmpfs"
    assert memory.filesystem(str(tmp_path / "with space"), str(mounts)) == "tmpfs"
    assert memory.filesystem(str(tmp_path), str(mounts)) == "overlay"
    assert memory.filesystem(str(tmp_path), str(tmp_path / "no-mounts")) == ""


@pytest.mark.unit
@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="this host has no /dev/shm")
def test_dev_shm_is_tmpfs_where_the_host_has_it() -> None:
    assert memory.filesystem("/dev/shm") == "tmpfs"


# ------------------------------------------------------------------ the launcher, in a real run


def ranks_environ(under: Path) -> dict[tuple[str, str, str], tuple[str, str]]:
    """Each running rank (torchrun's worker: LOCAL_RANK set) whose snapshot folder is under ``under``, as
    (replica, incarnation, local rank): its folder and its node's rank count, read from /proc."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            raw = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:  # gone meanwhile
            continue
        env = dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)
        folder = env.get(keys.SNAPSHOT_DIR_ENV, "")
        if "LOCAL_RANK" in env and folder.startswith(f"{under}/"):
            rank = (env[keys.REPLICA_ENV], env.get(keys.INCARNATION_ENV, "0"), env["LOCAL_RANK"])
            found[rank] = (folder, env.get(keys.NODE_RANKS_ENV, ""))
    return found


def test_the_launcher_hands_every_incarnation_its_folder_and_frees_it_sweeping_a_dead_ones(tmp_path: Path) -> None:
    """A run of two groups of two ranks whose replica 1 is killed and restarted: the launcher removes a dead
    launcher's folder, makes its own, every rank of both incarnations gets it with the node's 4 ranks, and at the
    end the folder and what was written into it are gone, the log saying how many bytes that freed; the node's
    messages carried the folder's bytes, whose peak the event log and the summary give."""
    shm = tmp_path / "shm"
    orphan = shm / f"titan_recover-snapshots-{PUBLIC_ID}-{dead_pid()}"
    fill(orphan, {"shard0/step_10": 1234})
    seen: dict[tuple[str, str, str], tuple[str, str]] = {}
    written: list[str] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(0.2):
            seen.update(ranks_environ(shm))
            for folder, _ in seen.values():
                if folder not in written and os.path.isdir(folder):
                    Path(folder, "from_the_test").write_bytes(b"x" * 4321)
                    written.append(folder)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    plan = "kill replica=1 rank=1 step=2 phase=backward; sleep replica=0 step=3 phase=optimizer seconds=120 until=epoch"
    try:
        run = run_job(tmp_path / "dump", "--recover.snapshot_dir", str(shm), "--recover.fault_plan", plan)
    finally:
        stop.set()
        watcher.join(timeout=5)
    assert run.returncode == 0, run.output[-3000:]
    assert f"removed the snapshot folder {orphan.name} of a launcher that is gone from {shm}: 1,234 bytes" in run.output
    assert {rank[:2] for rank in seen} == {("0", "0"), ("1", "0"), ("1", "1")}, seen
    assert {local for (_, _, local) in seen} == {"0", "1"}
    (folder,) = {folder for folder, _ in seen.values()}
    assert {count for _, count in seen.values()} == {"4"}
    assert memory.FOLDER.fullmatch(os.path.basename(folder)) and os.path.dirname(folder) == str(shm)
    assert f"snapshots: every 10 committed steps, 1 kept per shard, in {folder}" in run.output
    freed = re.search(rf"removed this launcher's snapshot folder {re.escape(folder)}: ([\d,]+) bytes freed", run.output)
    assert freed is not None, run.output[-3000:]
    assert written == [folder] and int(freed.group(1).replace(",", "")) >= 4321  # the ranks may have written too
    # its node messages carried the folder's bytes: the coordinator logged the node's peak, the summary says it
    named = memory.FOLDER.fullmatch(os.path.basename(folder))
    assert named is not None
    node = f"{socket.gethostname()}:{named.group(2)}"  # the launcher's host and pid
    logged = [(e["node"], e["bytes"]) for e in run.events if e["event"] == "host_memory"]
    assert logged and {n for n, _ in logged} == {node} and max(b for _, b in logged) >= 4321, logged
    peak = max(b for _, b in logged)
    assert f"    node {node}: {peak / 2**20:.1f} MiB" in run.output, run.output[-3000:]
    assert os.listdir(shm) == []
