"""Nothing the run writes beside the training stops the training: its dump folder on a real filesystem
(a small tmpfs the test mounts, removed after) that fills up mid-run and is freed again, or never is, and
one (ext4 on a loop device of the test's own) that the kernel makes read-only mid-run, as it does on a disk
error. Where the test cannot mount (not root, no loop device), it skips saying why. The pure queue of what
waits is unit-tested."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import ROOT, SINGLES, run_job

from titan_recover.control import transport
from titan_recover.observability.events import EVENTS_FILE, Backlog, EventLog, read_log
from titan_recover.titan.jobs import FLAGS


@pytest.mark.unit
def test_a_line_cut_by_a_full_disk_is_written_again_whole_never_twice() -> None:
    backlog = Backlog(max_bytes=100)
    backlog.since = time.time()
    backlog.add(b'{"event": "a"}\n')
    backlog.wrote(5)  # a prefix reached the file (not JSON: readers skip it): the line waits, whole
    assert list(backlog.lines) == [b'{"event": "a"}\n'] and backlog.delayed == 0
    backlog.wrote(len(b'{"event": "a"}'))  # all but the newline (the next line's write puts one first)
    assert not backlog.lines and backlog.delayed == 1 and backlog.nbytes == 0


@pytest.mark.unit
def test_past_its_bound_the_oldest_lines_are_dropped_and_counted() -> None:
    backlog = Backlog(max_bytes=30)
    backlog.since = time.time()
    for i in range(5):
        backlog.add(f'{{"event": "{i}"}}\n'.encode())  # 15 bytes each: two fit
    assert backlog.dropped == 3 and [line[11:12] for line in backlog.lines] == [b"3", b"4"]
    backlog.wrote(15)
    assert backlog.delayed == 1 and backlog.nbytes == 15


@pytest.mark.unit
@pytest.mark.parametrize("code", [errno.EIO, errno.ESTALE, errno.EROFS, errno.ENOSPC])
def test_any_io_error_of_the_event_log_takes_the_same_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    """A failing disk (EIO), an NFS handle gone stale (ESTALE: the file is opened again), a read-only folder,
    a full one: each write fails with the errno the kernel would give (no test here can make a real EIO or
    ESTALE), the events wait in order, and the first write that goes through writes them all."""
    events = EventLog(str(tmp_path))
    events.emit("step", step=1)
    real_write, failing = os.write, [True]

    def write(fd: int, data: bytes) -> int:
        if failing[0]:
            raise OSError(code, os.strerror(code))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)
    events.emit("step", step=2)
    events.emit("step", step=3)
    assert events.pending()["events"] == 2 and events.pending()["error"] == os.strerror(code)
    failing[0] = False
    events.emit("step", step=4)
    written = read_log(events.path).events
    assert [e.get("step") for e in written] == [1, 2, 3, 4, None]
    assert written[-1]["event"] == "events_delayed" and written[-1]["delayed"] == 3
    events.close()


# The folder is filled once the event log's last page has at most this much room left (events then wait within
# a step or two, wherever the file stood), and freed once events wait, or at the latest after step 12 (steps 13-16
# still run): neither depends on how fast the machine is, as a bound in time did.
SLACK_AT_MOST = 1024
FREED_BY_STEP = 12
FULL_FOR_AT_MOST_S = 180.0


def fill(folder: Path) -> Path:
    """Takes every free byte of ``folder``'s filesystem at once (``fallocate``, then what is left), as another
    job would."""
    filler = folder / "filler"
    with open(filler, "wb", buffering=0) as f:
        free = os.statvfs(folder)
        # all but a few blocks at once (a fallocate that does not fit takes nothing), then the rest block by block
        os.posix_fallocate(f.fileno(), 0, max(1, free.f_bavail - 64) * free.f_frsize)
        f.seek(0, os.SEEK_END)
        try:
            while True:
                f.write(b"\0" * free.f_frsize)
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
    return filler


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 64 MiB tmpfs of the test's own, unmounted after (also when the test fails)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem to fill needs root")
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_checkpoint_write_the_full_disk_refuses_is_reported_and_left_for_the_next_interval(small_disk: Path) -> None:
    """torch.save's zip writer tells a full disk as a RuntimeError (``unexpected pos ...``), not an OSError:
    the save is still the disk's failure, reported and its half-written step folder removed; any other
    error still stops the run."""
    import torch

    from titan_recover.titan.common import save_or_report

    folder = small_disk / "checkpoint"
    (folder / "step-3").mkdir(parents=True)
    fill(small_disk)
    said: list[tuple[int, str]] = []
    saved = save_or_report(
        lambda: torch.save(torch.zeros(400_000), folder / "step-3" / "shard.pt"),
        3,
        SimpleNamespace(folder=str(folder)),
        lambda step, why: said.append((step, why)),
    )
    assert saved is None and said and said[0][0] == 3, said
    assert said[0][1].startswith("RuntimeError") or said[0][1].startswith("OSError"), said
    assert not (folder / "step-3").exists()  # the space it held is given back

    def not_the_disk() -> None:
        raise RuntimeError("a shape mismatch in the state dict")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        save_or_report(not_the_disk, 6, SimpleNamespace(folder=str(folder)), lambda step, why: said.append((step, why)))


# A process whose event log fills its folder and never gets space back: it ends, saying what is lost.
NEVER_FREED = """
import logging, sys
from titan_recover.observability import logs
from titan_recover.observability.events import EventLog
logs.setup("test", "__main__")
events = EventLog(sys.argv[1])
for step in range(1, 2001):
    events.emit("step", step=step, pad="x" * 900)
events.close()
print("ended", events.pending()["events"], "pending", events.backlog.dropped, "dropped", flush=True)
"""


def test_an_event_log_on_a_disk_that_stays_full_ends_cleanly_and_says_what_is_lost(small_disk: Path) -> None:
    filler = fill(small_disk)
    filler.write_bytes(b"\0" * (63 * 2**20))  # 1 MiB left: about 1,100 of the 2,000 events fit
    done = subprocess.run(
        [sys.executable, "-c", NEVER_FREED, str(small_disk)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("cannot write the event log in") == 1, done.stderr[-3000:]  # once per 30 s
    assert "could not be written since" in done.stderr and "are lost with this process" in done.stderr
    pending = int(done.stdout.split()[1])
    written = read_log(str(small_disk / EVENTS_FILE))
    steps = [e["step"] for e in written.events]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) + pending == 2000, (len(steps), pending)
    assert len(written.skipped) <= 1  # at most the line the full disk cut


@pytest.mark.toml("TorchTitan 0.2's spelling of the metrics and checkpoint flags (0.3 names them in its recipes)")
def test_the_main_job_goes_on_while_its_dump_folder_is_full_and_writes_every_event_once_after(
    small_disk: Path,
) -> None:
    """The tests' tiny main job (2 single-rank groups, a kill at step 4 and a rejoin, digests every step: more
    events while the folder is full than the slack of the log's last page takes, replica 0 sleeping 25 s at
    step 12 so that the run is still going when the folder is freed) with TensorBoard and DCP checkpoints
    every 3 steps, its dump folder filled once step 2 is logged and the log's last page is nearly full, and
    freed once the coordinator's status page shows 3 events waiting, or after step 12:
    exit 0, every step in the event log once, the late events counted in the summary, the checkpoints the
    full disk refused reported and a later one complete (a resume's)."""
    dump = small_disk / "out"
    events = dump / EVENTS_FILE
    moments: dict[str, float] = {}
    port = transport.free_port()

    def page() -> tuple[int, int]:
        """The events the coordinator keeps and the run's step, as its status page says (0, 0 before it is up)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/status.json", timeout=5) as answer:
                run = json.load(answer)["run"]
            return int((run.get("event_log") or {}).get("events", 0)), int(run.get("step") or 0)
        except OSError:
            return 0, 0

    def another_job() -> None:
        deadline, page_bytes = time.monotonic() + 240, os.statvfs(small_disk).f_bsize
        while time.monotonic() < deadline and not (events.exists() and '"step": 2,' in events.read_text()):
            time.sleep(0.05)
        while time.monotonic() < deadline and -events.stat().st_size % page_bytes > SLACK_AT_MOST:
            time.sleep(0.005)
        filler = fill(small_disk)
        moments["filled"] = time.time()
        full_until = min(deadline, time.monotonic() + FULL_FOR_AT_MOST_S)
        while time.monotonic() < full_until:  # until the log's last page is full and events wait
            held, step = page()
            if held >= 3 or step >= FREED_BY_STEP:
                break
            time.sleep(0.2)
        moments["waited"] = time.time()
        filler.unlink()
        moments["freed"] = time.time()

    filling = threading.Thread(target=another_job, daemon=True)
    filling.start()
    run = run_job(
        dump,
        *SINGLES,
        "--training.steps",
        "16",
        "--recover.fault_plan",
        "kill replica=1 rank=0 step=4 phase=backward; sleep replica=0 step=12 phase=optimizer seconds=25",
        "--recover.digest_interval",
        "1",
        "--metrics.enable_tensorboard",
        "--metrics.log_freq",
        "1",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "3",
        "--recover.status_port",
        str(port),
        timeout=400,
        cut_lines=True,
    )
    filling.join(30)
    print(run.output[-4000:])
    assert run.returncode == 0, run.output[-4000:]
    assert "filled" in moments and "freed" in moments, moments
    assert sorted(run.steps()) == list(range(1, 17))  # each once (``steps`` refuses a step logged twice)
    during = [e for e in run.of("step") if moments["filled"] < e["time"] < moments["freed"]]
    assert during, "no step was committed while the folder was full"
    delayed = run.of("events_delayed")
    when = (moments, [(e["step"], round(e["time"], 1)) for e in run.of("step")], run.of("checkpoint_failed"))
    assert delayed and sum(e["delayed"] for e in delayed) > 0 and not sum(e["dropped"] for e in delayed), when
    assert "cannot write the event log in" in run.output
    assert "events written late" in run.output  # the summary's line
    failed = sorted({e["step"] for e in run.of("checkpoint_failed")})
    assert failed and "checkpoints failed" in run.output, when
    folders = list((dump / "checkpoint").glob("step-*"))
    assert folders and all((f / ".metadata").exists() for f in folders), folders  # nothing half-written left
    assert max(int(f.name.split("-")[1]) for f in folders) > max(failed), folders  # a later save went through


def test_an_event_log_whose_folder_is_removed_writes_again_into_a_new_one(small_disk: Path) -> None:
    """A clean-up job removes the dump folder mid-run: the lines written so far go with it (the operator's
    choice), and the next events are written into the folder and file made again, not into the removed
    file (where they would vanish)."""
    folder = small_disk / "out"
    events = EventLog(str(folder))
    events.emit("step", step=1)
    shutil.rmtree(folder)
    events.emit("step", step=2)
    events.emit("step", step=3)
    assert [e.get("step") for e in read_log(events.path).events] == [2, 3]
    events.close()


@dataclass
class FailingDisk:
    """An ext4 filesystem mounted with ``errors=remount-ro``: ``fail()`` makes the kernel take it read-only at
    once (ext4's ``trigger_fs_error``, the path a disk error takes), for good, open files and all."""

    mount: Path
    device: str

    def fail(self) -> None:
        Path(f"/sys/fs/ext4/{os.path.basename(self.device)}/trigger_fs_error").write_text("titan_recover test\n")


@pytest.fixture
def failing_disk(tmp_path: Path) -> Iterator[FailingDisk]:
    """A 256 MiB ext4 image on a loop device, unmounted and detached after (also when the test fails)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a loop device needs root")
    image, mount = tmp_path / "ext4.img", tmp_path / "disk"
    mount.mkdir()
    with open(image, "wb") as f:
        f.truncate(256 * 2**20)
    made = subprocess.run(["mkfs.ext4", "-q", str(image)], capture_output=True, text=True)
    attached = subprocess.run(["losetup", "-f", "--show", str(image)], capture_output=True, text=True)
    if made.returncode != 0 or attached.returncode != 0:
        pytest.skip(f"cannot make an ext4 loop device here: {(made.stderr + attached.stderr).strip()}")
    device = attached.stdout.strip()
    try:
        mounted = subprocess.run(
            ["mount", "-o", "errors=remount-ro", device, str(mount)], capture_output=True, text=True
        )
        if mounted.returncode != 0:
            pytest.skip(f"cannot mount {device}: {mounted.stderr.strip()}")
        if not Path(f"/sys/fs/ext4/{os.path.basename(device)}/trigger_fs_error").exists():
            pytest.skip("this kernel's ext4 has no trigger_fs_error to make the filesystem fail")
        yield FailingDisk(mount, device)
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)
        subprocess.run(["losetup", "-d", device], check=False)


@pytest.mark.toml("CI's time: run on 0.3.0 by hand (the same flags work there), not in its lines tier")
def test_the_main_job_finishes_on_a_dump_folder_made_read_only_for_good(failing_disk: FailingDisk) -> None:
    """TorchTitan's default ``global_batch_size = -1`` (M = R = 2) and the tests' tiny job with everything
    that writes beside the training on (TensorBoard, DCP checkpoints every 3 steps, a profiler trace every 2
    steps), its dump folder made read-only by the kernel once step 2 is logged, a kill at step 4 and replica 0
    held at step 6 until the restarted group is admitted (at most 120 s), so that it rejoins: exit 0, the event
    log ends cleanly where the folder failed (steps 1-k, each once), every process says what it could not
    write, and the summary says how many steps the record lacks."""
    dump = failing_disk.mount / "out"
    events = dump / EVENTS_FILE
    moments: dict[str, float] = {}

    def disk_error() -> None:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not (events.exists() and '"step": 2,' in events.read_text()):
            time.sleep(0.05)
        failing_disk.fail()
        moments["failed"] = time.time()

    failing = threading.Thread(target=disk_error, daemon=True)
    failing.start()
    profiling = FLAGS["profiler"]
    run = run_job(
        dump,
        *SINGLES,
        "--training.global_batch_size",
        "-1",
        "--recover.fault_plan",
        "kill replica=1 rank=0 step=4 phase=backward; sleep replica=0 step=6 phase=optimizer seconds=120 until=epoch",
        "--metrics.enable_tensorboard",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "3",
        f"{profiling}.enable_profiling",
        f"{profiling}.profile_freq",
        "2",
        f"{profiling}.profiler_warmup",
        "0",
        f"{profiling}.profiler_active",
        "1",
        timeout=400,
        cut_lines=True,
    )
    failing.join(30)
    print(run.output[-4000:])
    assert run.returncode == 0, run.output[-4000:]
    assert "failed" in moments, "the folder was never made read-only"
    assert "M = 2 microbatches per step, one per replica group" in run.output
    steps = sorted(run.steps())
    assert steps == list(range(1, len(steps) + 1)) and 2 <= len(steps) < 10, steps
    assert all(len(e["microbatches"]) == 2 for e in run.of("step"))
    assert f"steps in these files : {len(steps)} of 10 committed" in run.output
    assert "Read-only file system" in run.output
    assert "cannot write the event log in" in run.output and "are lost with this process" in run.output
    assert "cannot write a profiler trace" in run.output  # TorchTitan would stop the rank here
    assert "could not be written in" in run.output and "the next checkpoint interval tries again" in run.output
    assert "cannot write TensorBoard's log in" in run.output and "Exception in thread" not in run.output
    assert "replica 1 rejoined at step" in run.output  # its restart, with the dump folder read-only
    assert "still starting or waiting to rejoin when the run ended" not in run.output
