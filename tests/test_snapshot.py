"""Tests for titan_recover.rank.snapshot: real files in tmp_path (and a real 1 MiB tmpfs for a full
folder), real small models and AdamW; every corruption a file can carry is refused by name."""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import json
import os
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from test_transfer import make_trainer

from titan_recover.rank import snapshot, transfer
from titan_recover.rank.snapshot import SnapshotError, SnapshotWriter
from titan_recover.rank.transfer import MAX_HEADER_BYTES, TransferError

pytestmark = pytest.mark.unit

LIBC = ctypes.CDLL(None, use_errno=True)


@pytest.fixture(autouse=True)
def _keep_rng() -> Iterator[None]:
    # apply sets this process's RNG state to the snapshot's
    state = torch.get_rng_state()
    yield
    torch.set_rng_state(state)


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real 1 MiB tmpfs (mount(2), no child process), unmounted after the test."""
    target = tmp_path / "tmpfs"
    target.mkdir()
    if LIBC.mount(b"tmpfs", str(target).encode(), b"tmpfs", 0, b"size=1m") != 0:
        pytest.skip(f"cannot mount a tmpfs here: {os.strerror(ctypes.get_errno())}")
    try:
        yield target
    finally:
        assert LIBC.umount2(str(target).encode(), 2) == 0, os.strerror(ctypes.get_errno())  # MNT_DETACH


def state_bytes(tensors: list[tuple[str, torch.Tensor]]) -> dict[str, bytes]:
    return {name: t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for name, t in tensors}


def write_one(root: Path, step: int, tensors: list[tuple[str, torch.Tensor]], group_rank: int = 0) -> Path:
    writer = SnapshotWriter(str(root), group_rank, keep=2)
    try:
        writer.write(step, {"step": step, "note": "x"}, tensors)
    finally:
        writer.close()
    return Path(snapshot.shard_dir(str(root), group_rank)) / snapshot.file_name(step)


def plain_tensors(n: int = 1000) -> list[tuple[str, torch.Tensor]]:
    torch.manual_seed(3)
    return [
        ("a", torch.randn(n)),
        ("b", torch.arange(7, dtype=torch.int64)),
        ("c", torch.tensor([1, 2, 3], dtype=torch.uint8)),
    ]


def layout(path: Path) -> tuple[int, int]:
    """(header offset, payload offset) of a written file."""
    _, _, header_len, _ = snapshot.PREFIX.unpack(path.read_bytes()[: snapshot.PREFIX.size])
    return snapshot.PREFIX.size, snapshot.PREFIX.size + header_len


def craft(path: Path, header: dict[str, Any], payload: bytes) -> None:
    """A file with a correct prefix and digest around ``header``: the header's own fields are under test."""
    raw = json.dumps(header).encode()
    digest = hashlib.blake2b(raw, digest_size=snapshot.DIGEST_BYTES).digest()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(snapshot.PREFIX.pack(snapshot.MAGIC, snapshot.VERSION, len(raw), digest) + raw + payload)


# --- round trip ------------------------------------------------------------------


def test_round_trip_is_bit_exact_into_a_fresh_trainer(tmp_path: Path) -> None:
    model, opts, scheds = make_trainer(seed=0, steps=3)
    torch.manual_seed(42)
    tensors = transfer.state_tensors([model], opts)
    before = state_bytes(tensors)
    header = transfer.meta({"step": 3, "base_epoch": 2, "ntokens_seen": 96}, opts, scheds)
    writer = SnapshotWriter(str(tmp_path), 1, keep=1)
    writer.write(3, header, tensors)
    writer.wait()
    assert writer.last_bytes == sum(t.numel() * t.element_size() for _, t in tensors)
    assert writer.last_copy_s >= 0 and writer.last_write_s > 0
    writer.close()
    assert snapshot.inventory(str(tmp_path), 1) == [3]
    assert snapshot.inventory(str(tmp_path), 0) == []

    loaded, payload = snapshot.load(str(tmp_path), 1, 3)
    assert (loaded["step"], loaded["base_epoch"], loaded["ntokens_seen"]) == (3, 2, 96)
    assert loaded["tensors"] == transfer.manifest(tensors)
    assert loaded["payload_bytes"] == payload.numel() == writer.last_bytes
    assert loaded["payload_checksum"] == transfer.checksum(transfer.pack(tensors))

    j_model, j_opts, j_scheds = make_trainer(seed=1, steps=0)  # a restarted rank: other init, no optimizer state
    torch.rand(10)  # the RNG moves on: apply must set it back
    snapshot.apply(loaded, payload, [j_model], j_opts)
    transfer.restore(loaded, j_opts, j_scheds)
    assert state_bytes(transfer.state_tensors([j_model], j_opts)) == before
    assert j_scheds.schedulers[0].state_dict() == scheds.schedulers[0].state_dict()


def test_write_copies_the_state_before_it_returns(tmp_path: Path) -> None:
    tensors = plain_tensors()
    expected = transfer.pack(tensors).clone()
    writer = SnapshotWriter(str(tmp_path), 0, keep=1)
    writer.write(5, {}, tensors)
    for _, t in tensors:
        t.zero_()  # the next optimizer step, while the file is written
    writer.close()
    _, payload = snapshot.load(str(tmp_path), 0, 5)
    assert torch.equal(payload, expected)


def test_a_second_write_reuses_the_buffer_and_holds_its_own_step(tmp_path: Path) -> None:
    tensors = plain_tensors()
    writer = SnapshotWriter(str(tmp_path), 0, keep=2)
    writer.write(1, {}, tensors)
    first = transfer.pack(tensors).clone()
    tensors[0][1].add_(1.0)
    writer.write(2, {}, tensors)
    writer.close()
    assert torch.equal(snapshot.load(str(tmp_path), 0, 1)[1], first)
    assert torch.equal(snapshot.load(str(tmp_path), 0, 2)[1], transfer.pack(tensors))


def test_write_refuses_a_header_of_another_step_or_not_json(tmp_path: Path) -> None:
    writer = SnapshotWriter(str(tmp_path), 0, keep=1)
    try:
        with pytest.raises(ValueError, match="step 4 was given a header of step 3"):
            writer.write(4, {"step": 3}, plain_tensors())
        with pytest.raises(TypeError):
            writer.write(4, {"bad": object()}, plain_tensors())
    finally:
        writer.close()
    assert snapshot.inventory(str(tmp_path), 0) == []


def test_keep_must_be_at_least_one(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least one"):
        SnapshotWriter(str(tmp_path), 0, keep=0)


def test_close_stops_the_thread(tmp_path: Path) -> None:
    writer = SnapshotWriter(str(tmp_path), 0, keep=1)
    writer.write(1, {}, plain_tensors())
    writer.close()
    assert not writer._thread.is_alive()


# --- inventory, temp files, pruning ----------------------------------------------


def test_inventory_lists_complete_names_only_newest_first(tmp_path: Path) -> None:
    folder = Path(snapshot.shard_dir(str(tmp_path), 2))
    assert folder == tmp_path / "shard2"
    assert snapshot.inventory(str(tmp_path), 2) == []  # no folder yet
    folder.mkdir()
    for name in (
        snapshot.file_name(10),
        snapshot.file_name(200),
        "step7.snapshot",  # unpadded: still a complete name
        f".{snapshot.file_name(300)}.0a1b.tmp",  # a writer's temp file
        f"{snapshot.file_name(400)}.tmp",
        "step.snapshot",
        "notes.txt",
    ):
        (folder / name).write_bytes(b"")
    assert snapshot.inventory(str(tmp_path), 2) == [200, 10, 7]


def test_a_new_writer_removes_dead_writers_temp_files_not_live_ones(tmp_path: Path) -> None:
    folder = tmp_path / "shard0"
    folder.mkdir()
    dead = folder / f".{snapshot.file_name(4)}.dead00.tmp"
    live = folder / f".{snapshot.file_name(4)}.11fe00.tmp"
    dead.write_bytes(b"half a file")
    live.write_bytes(b"being written")
    fd = os.open(live, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a live writer holds its temp file's lock
        SnapshotWriter(str(tmp_path), 0, keep=1).close()
        assert not dead.exists()
        assert live.exists()
    finally:
        os.close(fd)
    SnapshotWriter(str(tmp_path), 0, keep=1).close()  # its writer died: the lock went with it
    assert not live.exists()


def test_a_finished_write_leaves_no_temp_file(tmp_path: Path) -> None:
    write_one(tmp_path, 3, plain_tensors())
    assert os.listdir(tmp_path / "shard0") == [snapshot.file_name(3)]


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_pruning_keeps_exactly_keep_complete_files(tmp_path: Path, keep: int) -> None:
    tensors = plain_tensors(100)
    writer = SnapshotWriter(str(tmp_path), 0, keep=keep)
    for step in range(10, 70, 10):
        writer.write(step, {}, tensors)
        writer.wait()
        assert snapshot.inventory(str(tmp_path), 0) == list(range(step, 0, -10))[:keep]
    writer.close()
    assert sorted(os.listdir(tmp_path / "shard0")) == [snapshot.file_name(s) for s in range(70 - 10 * keep, 70, 10)]


def test_pruning_leaves_files_newer_than_the_step_written(tmp_path: Path) -> None:
    tensors = plain_tensors(100)
    write_one(tmp_path, 90, tensors)  # another replica's writer, ahead
    writer = SnapshotWriter(str(tmp_path), 0, keep=1)
    for step in (10, 20):
        writer.write(step, {}, tensors)
    writer.close()
    assert snapshot.inventory(str(tmp_path), 0) == [90, 20]


def test_newest_complete_is_the_newest_step_every_shard_has(tmp_path: Path) -> None:
    assert snapshot.newest_complete(str(tmp_path), 2) is None  # nothing saved
    for shard, steps in ((0, (4, 8, 12)), (1, (4, 8)), (2, (8, 12))):
        folder = tmp_path / f"shard{shard}"
        folder.mkdir()
        for step in steps:
            (folder / snapshot.file_name(step)).write_bytes(b"")
        (folder / f".{snapshot.file_name(16)}.0a1b.tmp").write_bytes(b"")  # a write cut short: not complete
    assert snapshot.newest_complete(str(tmp_path), 1) == 12
    assert snapshot.newest_complete(str(tmp_path), 2) == 8  # shard 1 has no 12
    assert snapshot.newest_complete(str(tmp_path), 3) == 8
    assert snapshot.newest_complete(str(tmp_path), 4) is None  # shard 3 has nothing


def test_one_claim_per_shard_and_step_and_a_write_prunes_older_claims(tmp_path: Path) -> None:
    assert snapshot.claim(str(tmp_path), 0, 4)
    assert not snapshot.claim(str(tmp_path), 0, 4)  # another replica of shard 0 wrote, or writes, step 4
    assert snapshot.claim(str(tmp_path), 1, 4) and snapshot.claim(str(tmp_path), 0, 8)
    writer = SnapshotWriter(str(tmp_path), 0, keep=1, durable=True)
    writer.write(8, {}, plain_tensors(100))
    writer.close()
    assert sorted(os.listdir(tmp_path / "shard0")) == [snapshot.claim_name(8), snapshot.file_name(8)]
    assert snapshot.claim(str(tmp_path), 0, 4)  # its claim went with the write of a newer step


def test_a_claim_in_a_folder_that_cannot_be_made_names_it(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(SnapshotError, match="cannot be used"):
        snapshot.claim(str(tmp_path / "file"), 0, 4)


# --- a full folder ---------------------------------------------------------------


def test_a_write_into_a_full_folder_fails_in_wait_naming_the_folder(tiny_tmpfs: Path) -> None:
    writer = SnapshotWriter(str(tiny_tmpfs), 0, keep=1)
    try:
        writer.write(1, {}, [("big", torch.ones(1 << 19))])  # 2 MiB into 1 MiB
        with pytest.raises(SnapshotError) as info:
            writer.wait()
        message = str(info.value)
        assert f"snapshot folder {tiny_tmpfs / 'shard0'} is full" in message
        assert "recover.snapshot_interval = 0" in message and "recover.snapshot_dir" in message
        assert os.listdir(tiny_tmpfs / "shard0") == []  # the temp file is gone: its room is free again
        assert snapshot.inventory(str(tiny_tmpfs), 0) == []
        writer.wait()  # the failure is raised once
        writer.write(2, {}, plain_tensors(100))  # a write that fits still works
        writer.wait()
        assert snapshot.inventory(str(tiny_tmpfs), 0) == [2]
    finally:
        writer.close()


def test_check_room_refuses_what_the_filesystem_cannot_hold(tiny_tmpfs: Path) -> None:
    root = str(tiny_tmpfs / "snapshots")
    snapshot.check_room(root, 512 << 10)
    with pytest.raises(SnapshotError) as info:
        snapshot.check_room(root, snapshot.room_needed(1 << 20, keep=1, ranks_on_node=2, shards_on_node=2))
    message = str(info.value)
    assert root in message and "need 4.2 MB" in message and "has room for 1.0 MB (1.0 MB free, 0 B in old" in message
    for fragment in ("recover.snapshot_dir", "mount -o remount,size=", "--shm-size", "recover.snapshot_interval = 0"):
        assert fragment in message
    assert "96 GB per copy in fp32 with AdamW" in message


def test_check_room_counts_what_the_folder_already_holds(tiny_tmpfs: Path) -> None:
    root = tiny_tmpfs / "snapshots"
    write_one(root, 1, [("x", torch.ones(150_000))])  # 600 kB of the 1 MiB: less than that is free now
    free = os.statvfs(root).f_bavail * os.statvfs(root).f_frsize
    assert free < 700_000
    snapshot.check_room(str(root), 900_000)  # its old snapshots make room for the new
    with pytest.raises(SnapshotError, match="in old snapshots"):
        snapshot.check_room(str(root), 2_000_000)


def test_room_needed_is_keep_plus_one_copies_per_rank_with_one_group_per_node() -> None:
    assert snapshot.room_needed(16 * 10**9, keep=1, ranks_on_node=8, shards_on_node=8) == 2 * 16 * 10**9 * 8
    assert snapshot.room_needed(100, keep=3, ranks_on_node=1, shards_on_node=1) == 400


@pytest.mark.parametrize(
    ("keep", "groups", "copies_per_shard"),
    [
        (1, 2, 4),  # 1 kept, 2 temps, and the file a lagging writer renames after the other pruned it
        (2, 2, 4),  # 2 kept and 2 temps: the files of one step share a name (not 3 copies per rank)
        (1, 3, 5),
        (3, 4, 7),
    ],
)
def test_groups_sharing_a_node_share_its_complete_files(keep: int, groups: int, copies_per_shard: int) -> None:
    shards = 2  # each group's part on the node
    needed = snapshot.room_needed(100, keep=keep, ranks_on_node=groups * shards, shards_on_node=shards)
    assert needed == copies_per_shard * shards * 100
    assert needed <= (keep + 1) * groups * shards * 100  # never above one copy set per rank


def test_a_durable_write_fsyncs_the_file_then_its_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[str] = []
    fsync = os.fsync

    def spy(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        fsync(fd)

    monkeypatch.setattr(snapshot.os, "fsync", spy)
    folder = tmp_path / "shard0"
    for durable in (False, True):
        writer = SnapshotWriter(str(tmp_path), 0, keep=1, durable=durable)
        writer.write(3, {}, plain_tensors(100))
        writer.close()
    [file, directory] = synced  # none for the write that need not outlive the node
    assert Path(file).parent == folder and Path(file).name.endswith(".tmp")  # renamed after its fsync
    assert directory == str(folder)


# --- the rate of a save into the stop folder ---------------------------------------------------


def test_save_rate_measures_a_durable_write_and_leaves_nothing(tmp_path: Path) -> None:
    folder = tmp_path / "stop" / "shard0"
    probe = snapshot.save_rate(str(folder), 8 << 20)
    assert probe.finished and probe.rate > 0
    assert os.listdir(folder) == []


def test_save_rate_is_bounded_and_its_file_is_removed_after(tmp_path: Path) -> None:
    probe = snapshot.save_rate(str(tmp_path), snapshot.PROBE_BYTES, timeout_s=1e-4)
    assert not probe.finished  # still writing at its bound: its rate is an upper bound
    assert probe.rate <= snapshot.PROBE_BYTES / 1e-4
    deadline = time.monotonic() + 60
    while os.listdir(tmp_path) and time.monotonic() < deadline:  # the thread finishes and removes its file
        time.sleep(0.05)
    assert os.listdir(tmp_path) == []


def test_save_rate_into_a_folder_that_cannot_be_made_names_it(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(SnapshotError, match=f"folder {tmp_path / 'file' / 'shard0'} cannot be written"):
        snapshot.save_rate(str(tmp_path / "file" / "shard0"), 1000)


def test_a_probe_left_by_a_dead_process_is_swept_like_a_temp(tmp_path: Path) -> None:
    folder = tmp_path / "shard0"
    folder.mkdir()
    left = folder / ".save-probe.0a1b2c.tmp"
    left.write_bytes(b"x" * 1000)
    SnapshotWriter(str(tmp_path), 0, keep=1).close()
    assert not left.exists()


# --- corrupt files ---------------------------------------------------------------


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def expect(path: Path, step: int, *fragments: str) -> None:
    with pytest.raises(SnapshotError) as info:
        snapshot.load(str(path.parent.parent), int(path.parent.name.removeprefix("shard")), step)
    message = str(info.value)
    assert str(path) in message, message
    for fragment in fragments:
        assert fragment in message, message


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_flipped_payload_byte_is_refused(tmp_path: Path, where: str) -> None:
    path = write_one(tmp_path, 4, plain_tensors())
    _, start = layout(path)
    size = path.stat().st_size
    flip(path, {"first": start, "middle": (start + size) // 2, "last": size - 1}[where])
    expect(path, 4, "payload is corrupt", "checksum")


@pytest.mark.parametrize("at", [0, 10, -1])
def test_a_flipped_header_byte_is_refused(tmp_path: Path, at: int) -> None:
    path = write_one(tmp_path, 4, plain_tensors())
    header_start, payload_start = layout(path)
    flip(path, header_start + at if at >= 0 else payload_start + at)
    expect(path, 4, "header does not match its blake2b digest")


def test_a_flipped_digest_byte_is_refused(tmp_path: Path) -> None:
    path = write_one(tmp_path, 4, plain_tensors())
    flip(path, snapshot.PREFIX.size - 1)
    expect(path, 4, "blake2b digest")


@pytest.mark.parametrize(
    "keep_bytes, fragments",
    [
        (0, ["shorter than its 52 B prefix", "truncated"]),
        (20, ["shorter than its 52 B prefix"]),
        (60, ["header", "truncated"]),
        (-1, ["shorter than the", "its header says", "truncated"]),
        (-4000, ["its header says", "truncated"]),
    ],
)
def test_a_truncated_file_is_refused(tmp_path: Path, keep_bytes: int, fragments: list[str]) -> None:
    path = write_one(tmp_path, 4, plain_tensors())
    data = path.read_bytes()
    path.write_bytes(data[:keep_bytes] if keep_bytes >= 0 else data[: len(data) + keep_bytes])
    expect(path, 4, *fragments)


def test_bytes_past_the_payload_are_refused(tmp_path: Path) -> None:
    path = write_one(tmp_path, 4, plain_tensors())
    with open(path, "ab") as f:
        f.write(b"\0" * 8)
    expect(path, 4, "8 B past the payload")


def test_a_wrong_magic_is_refused(tmp_path: Path) -> None:
    path = write_one(tmp_path, 4, plain_tensors())
    data = bytearray(path.read_bytes())
    data[:8] = b"PK\x03\x04zip!"
    path.write_bytes(bytes(data))
    expect(path, 4, "not a titan_recover snapshot", "PK")


def test_another_format_version_is_refused(tmp_path: Path) -> None:
    path = write_one(tmp_path, 4, plain_tensors())
    data = bytearray(path.read_bytes())
    data[8:12] = struct.pack("<I", snapshot.VERSION + 1)
    path.write_bytes(bytes(data))
    expect(path, 4, f"format version {snapshot.VERSION + 1}")


@pytest.mark.parametrize("header_len", [0, MAX_HEADER_BYTES + 1, 2**64 - 1])
def test_a_header_length_out_of_bounds_is_refused(tmp_path: Path, header_len: int) -> None:
    path = write_one(tmp_path, 4, plain_tensors())
    data = bytearray(path.read_bytes())
    data[12:20] = struct.pack("<Q", header_len)
    path.write_bytes(bytes(data))
    expect(path, 4, f"{header_len:,} B", "corrupt")


def test_a_missing_file_is_refused(tmp_path: Path) -> None:
    expect(tmp_path / "shard3" / snapshot.file_name(8), 8, "is missing")


def test_a_file_renamed_to_another_step_is_refused(tmp_path: Path) -> None:
    path = write_one(tmp_path, 4, plain_tensors())
    moved = path.with_name(snapshot.file_name(6))
    path.rename(moved)
    expect(moved, 6, "holds step 4, its name says 6")


GOOD: dict[str, Any] = {
    "step": 4,
    "tensors": [["a", "uint8", [3]]],
    "payload_checksum": transfer.checksum(torch.tensor([1, 2, 3], dtype=torch.uint8)),
    "payload_bytes": 3,
}


@pytest.mark.parametrize(
    "header, fragments",
    [
        ({**GOOD, "payload_bytes": -3}, ["payload is -3 B", "corrupt"]),
        ({**GOOD, "payload_bytes": 10**15}, ["shorter than the", "truncated"]),
        ({**GOOD, "payload_bytes": 2}, ["1 B past the payload"]),
        ({**GOOD, "payload_bytes": "3"}, ["'payload_bytes'"]),
        ({**GOOD, "payload_bytes": True}, ["'payload_bytes'"]),
        ({k: v for k, v in GOOD.items() if k != "payload_checksum"}, ["'payload_checksum'"]),
        ({**GOOD, "tensors": None}, ["'tensors'"]),
        ({**GOOD, "step": "4"}, ["'step'"]),
        ({**GOOD, "payload_checksum": GOOD["payload_checksum"] + 1}, ["checksum"]),
        ([GOOD], ["not a JSON object"]),
    ],
)
def test_a_header_with_bad_fields_is_refused(tmp_path: Path, header: Any, fragments: list[str]) -> None:
    path = tmp_path / "shard0" / snapshot.file_name(4)
    craft(path, GOOD, b"\x01\x02\x03")
    assert snapshot.load(str(tmp_path), 0, 4)[1].tolist() == [1, 2, 3]  # the crafted file itself is good
    craft(path, header, b"\x01\x02\x03")
    expect(path, 4, *fragments)


def test_a_header_that_is_not_json_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "shard0" / snapshot.file_name(4)
    raw = b"\xff{not json"
    digest = hashlib.blake2b(raw, digest_size=snapshot.DIGEST_BYTES).digest()
    path.parent.mkdir()
    path.write_bytes(snapshot.PREFIX.pack(snapshot.MAGIC, snapshot.VERSION, len(raw), digest) + raw)
    expect(path, 4, "header is not JSON")


# --- apply -----------------------------------------------------------------------


def test_apply_onto_another_model_raises_and_changes_nothing(tmp_path: Path) -> None:
    model, opts, scheds = make_trainer(hidden=8, steps=2)
    write_one(tmp_path, 2, transfer.state_tensors([model], opts))
    header, payload = snapshot.load(str(tmp_path), 0, 2)

    for other_steps in (0, 2):  # a fresh optimizer (its state would be created first) and a stepped one
        j_model, j_opts, _ = make_trainer(hidden=16, seed=1, steps=other_steps)
        before = state_bytes(transfer.state_tensors([j_model], j_opts))
        optim_state = len(j_opts.optimizers[0].state)
        with pytest.raises(TransferError, match="the snapshot's tensor") as info:
            snapshot.apply(header, payload, [j_model], j_opts)
        assert "[8, 4]" in str(info.value) and "[16, 4]" in str(info.value)
        assert state_bytes(transfer.state_tensors([j_model], j_opts)) == before
        assert len(j_opts.optimizers[0].state) == optim_state


def test_apply_refuses_a_payload_of_another_size(tmp_path: Path) -> None:
    model, opts, _ = make_trainer(steps=1)
    write_one(tmp_path, 1, transfer.state_tensors([model], opts))
    header, payload = snapshot.load(str(tmp_path), 0, 1)
    j_model, j_opts, _ = make_trainer(seed=1, steps=1)
    before = state_bytes(transfer.state_tensors([j_model], j_opts))
    with pytest.raises(TransferError, match="the snapshot holds .* bytes of state, this rank holds"):
        snapshot.apply(header, payload[:-1], [j_model], j_opts)
    assert state_bytes(transfer.state_tensors([j_model], j_opts)) == before


def test_apply_refuses_a_manifest_of_another_length(tmp_path: Path) -> None:
    model, opts, _ = make_trainer(steps=0)  # no optimizer state in the snapshot
    write_one(tmp_path, 1, transfer.state_tensors([model], opts))
    header, payload = snapshot.load(str(tmp_path), 0, 1)
    j_model, j_opts, _ = make_trainer(seed=1, steps=1)  # this rank's optimizer has state
    with pytest.raises(TransferError, match="the snapshot holds 5 tensors, this rank has 17"):
        snapshot.apply(header, payload, [j_model], j_opts)
