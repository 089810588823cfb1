"""Host-memory snapshots: the files of one shard, written off the step's path, verified on load.

Every ``recover.snapshot_interval`` committed steps a rank copies its committed state (what a state
transfer carries, ``rank.transfer``) into a file in a node-local folder that outlives the rank (a tmpfs),
so that when every replica group dies at once the restarted ranks resume from memory, not from a DCP
checkpoint. Shard k of every replica holds the same bits after a commit: its files live in
``root/shard<k>``, whichever replica wrote them.

A file (integers little-endian)::

    magic (8 B) | format version (u32) | header bytes (u64) | blake2b-256 of the header (32 B) | header | payload

The header is JSON (never pickle): the caller's (``transfer.meta``: counters, LR schedulers,
hyperparameters) plus ``step``, the manifest ``tensors``, ``payload_checksum`` (``transfer.checksum``) and
``payload_bytes``; the payload is the tensors' bytes in manifest order (``transfer.pack``). A file is
written under a temp name, locked (``flock``) while its writer lives, and renamed whole to its final
name, so a rank that dies mid-copy never leaves a file taken for whole.
"""

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import queue
import re
import secrets
import shutil
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, NamedTuple

import torch

from titan_recover.policy.stop_budget import amount
from titan_recover.rank import transfer
from titan_recover.rank.transfer import MAX_HEADER_BYTES

log = logging.getLogger(__name__)

MAGIC = b"TRSNAP\r\n"  # the line ending catches a copy through a text-mode tool
VERSION = 1
PREFIX = struct.Struct("<8sIQ32s")  # magic, version, header bytes, header digest
DIGEST_BYTES = 32
NAME = re.compile(r"step(\d{1,19})\.snapshot")
TEMP = re.compile(r"\.(?:step\d{1,19}\.snapshot|save-probe)\.[0-9a-f]+\.tmp")  # a file's, or a rate probe's
CLAIM = re.compile(r"\.step(\d{1,19})\.snapshot\.claim")
IO_CHUNK = 1 << 30  # bytes per read or write call: Linux moves at most ~2 GiB per call
WRITE_GRACE_S = 60.0  # a write's bound: this plus its bytes at WRITE_FLOOR_BYTES_S (a tmpfs is far faster)
WRITE_FLOOR_BYTES_S = 100e6
JOIN_S = 10.0  # an idle writer's thread stops at once
PROBE_BYTES = 64 << 20  # the most a save-rate probe writes
PROBE_CHUNK = 4 << 20
PROBE_TIMEOUT_S = 10.0
SNAPSHOT = transfer.Source(
    "the snapshot",
    "holds",
    "was it written by a run of this model, optimizer and parallelism? (another run's files in recover.snapshot_dir?)",
)


class SnapshotError(RuntimeError):
    """A snapshot missing, incomplete or corrupt, or one that cannot be written."""


def shard_dir(root: str, group_rank: int) -> str:
    """The folder of shard ``group_rank``'s files; every replica's rank of that group rank writes there."""
    return os.path.join(root, f"shard{group_rank}")


def file_name(step: int) -> str:
    return f"step{step:012d}.snapshot"


def claim_name(step: int) -> str:
    return f".{file_name(step)}.claim"


def complete_steps(names: Iterable[str]) -> list[int]:
    """Steps of the complete files among a folder's ``names``, newest first."""
    return sorted((int(m.group(1)) for m in map(NAME.fullmatch, names) if m), reverse=True)


def inventory(root: str, group_rank: int) -> list[int]:
    """Steps of this shard's complete files by their names (not read, not verified), newest first."""
    try:
        return complete_steps(os.listdir(shard_dir(root, group_rank)))
    except FileNotFoundError:
        return []


def newest_complete(root: str, shards: int) -> int | None:
    """The newest step of which every shard ``0 .. shards-1`` has a complete file (by name: ``load`` verifies),
    None if none: every rank of a group, reading one folder, picks the same step."""
    common = set(inventory(root, 0))
    for k in range(1, shards):
        common &= set(inventory(root, k))
    return max(common, default=None)


def claim(root: str, group_rank: int, step: int) -> bool:
    """Whether this process is the first to claim shard ``group_rank``'s file of ``step`` (an exclusive create,
    which NFS keeps too): one writer per shard where several replicas hold the same bits."""
    folder = shard_dir(root, group_rank)
    try:
        os.makedirs(folder, exist_ok=True)
        os.close(os.open(os.path.join(folder, claim_name(step)), os.O_WRONLY | os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return False
    except OSError as e:
        raise SnapshotError(f"snapshot folder {folder} cannot be used: {e}") from e
    return True


def remove_stale_temps(folder: str) -> list[str]:
    """Removes the temp files in ``folder`` whose writer is gone: their lock is free (a lock outlives
    no process, and pids say nothing across containers). The removed names."""
    removed = []
    for name in os.listdir(folder):
        if not TEMP.fullmatch(name):
            continue
        path = os.path.join(folder, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:  # renamed or removed meanwhile
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a live writer's
            continue
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                removed.append(name)
        finally:
            os.close(fd)
    if removed:
        log.info(f"removed {len(removed)} temp files in {folder} their writers left: {removed}")
    return removed


class Probe(NamedTuple):
    """The rate of a save into a folder as ``save_rate`` measured it."""

    rate: float  # bytes/s
    finished: bool  # False: still at work at the probe's bound, so ``rate`` is an upper bound


def save_rate(folder: str, nbytes: int, timeout_s: float = PROBE_TIMEOUT_S) -> Probe:
    """The rate at which a durable save into ``folder`` takes its bytes, measured on ``nbytes`` of random bytes (a
    compressing filesystem does not shrink them): their checksum, as a file's header holds it (on the CPU, and on
    a slow one slower than a disk), and their write into a locked temp file, fsynced, then removed. Timed on a
    thread of its own, so that storage that hangs holds the caller ``timeout_s`` at most; the thread removes its
    file once the write returns (a process that dies first leaves a temp a writer's sweep removes).
    ``SnapshotError`` where the folder cannot be written."""
    if nbytes < 1:
        raise ValueError(f"a save-rate probe takes at least one byte, not {nbytes}")
    done = threading.Event()
    outcome: list[float | OSError] = []

    def probe() -> None:
        try:
            outcome.append(timed_save(folder, nbytes))
        except OSError as e:
            outcome.append(e)
        finally:
            done.set()

    start = time.perf_counter()
    threading.Thread(target=probe, name="save-rate-probe", daemon=True).start()
    if not done.wait(timeout_s):
        return Probe(nbytes / (time.perf_counter() - start), finished=False)
    [seconds] = outcome
    if isinstance(seconds, OSError):
        raise SnapshotError(f"folder {folder} cannot be written: {seconds}") from seconds
    return Probe(nbytes / max(seconds, 1e-9), finished=True)


def timed_save(folder: str, nbytes: int) -> float:
    """Seconds to checksum ``nbytes`` and to create, write and fsync a temp file of them in ``folder``; the file
    is removed after."""
    os.makedirs(folder, exist_ok=True)
    chunk = torch.frombuffer(bytearray(os.urandom(min(nbytes, PROBE_CHUNK))), dtype=torch.uint8)
    payload = chunk.repeat(-(-nbytes // chunk.numel()))[:nbytes]
    path = os.path.join(folder, f".save-probe.{secrets.token_hex(6)}.tmp")
    start = time.perf_counter()
    transfer.checksum(payload)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a sweep of stale temps skips it while it is written
        write_all(fd, payload.numpy().data)
        os.fsync(fd)
        return time.perf_counter() - start
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)


def write_all(fd: int, data: memoryview) -> None:
    offset = 0
    while offset < len(data):
        offset += os.write(fd, data[offset : offset + IO_CHUNK])


def read_exact(f: Any, into: memoryview, path: str) -> None:
    offset = 0
    while offset < len(into):
        n = f.readinto(into[offset : offset + IO_CHUNK])
        if not n:
            raise SnapshotError(f"snapshot {path} ended {len(into) - offset} B early while read: it was truncated")
        offset += n


def fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bound_s(payload_bytes: int) -> float:
    return WRITE_GRACE_S + payload_bytes / WRITE_FLOOR_BYTES_S


@dataclass
class Job:
    step: int
    header: dict[str, Any]
    manifest: list[list[Any]]
    payload: torch.Tensor
    copy_s: float
    done: threading.Event = field(default_factory=threading.Event)
    error: SnapshotError | None = None


class SnapshotWriter:
    """Writes this shard's snapshots on one background thread, one in flight at a time.

    ``write`` returns once the state is copied (the caller's tensors change at the next optimizer
    step); the file is written meanwhile. A failed write is raised by the next ``wait``, ``write`` or ``close``.
    """

    def __init__(self, root: str, group_rank: int, keep: int, durable: bool = False) -> None:
        """``durable``: each file is on disk (fsync) before its name appears, for a folder that has to outlive
        the node (the state saved at a stop), not only the process (a tmpfs)."""
        if keep < 1:
            raise ValueError(f"a snapshot writer keeps at least one snapshot, not {keep}")
        self.root, self.group_rank, self.keep, self.durable = root, group_rank, keep, durable
        self.folder = shard_dir(root, group_rank)
        try:
            os.makedirs(self.folder, exist_ok=True)
            remove_stale_temps(self.folder)
        except OSError as e:
            raise SnapshotError(f"snapshot folder {self.folder} cannot be used: {e}") from e
        self.last_bytes = 0
        self.last_copy_s = 0.0
        self.last_write_s = 0.0
        self._buffer: torch.Tensor | None = None  # the last payload, reused once its write is done
        self._job: Job | None = None
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"snapshot-shard{group_rank}", daemon=True)
        self._thread.start()

    def write(self, step: int, header: dict[str, Any], tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Copies ``tensors`` for step ``step`` and hands the file's write to the thread."""
        self.wait()
        if header.get("step", step) != step:
            raise ValueError(f"a snapshot of step {step} was given a header of step {header['step']}")
        json.dumps(header)  # a header JSON cannot hold fails here, not on the thread
        start = time.perf_counter()
        self._buffer = transfer.pack(tensors, torch.device("cpu"), out=self._buffer)
        job = Job(step, header, transfer.manifest(tensors), self._buffer, time.perf_counter() - start)
        self._job = job
        self._jobs.put(job)

    def wait(self) -> None:
        """Returns once the write in flight is done; raises its failure."""
        job = self._job
        if job is None:
            return
        bound = write_bound_s(job.payload.numel())
        if not job.done.wait(bound):
            raise SnapshotError(
                f"the snapshot of step {job.step} ({job.payload.numel():,} B) to {self.folder} has not been written "
                f"after {bound:.0f} s: is recover.snapshot_dir on a slow disk rather than a tmpfs?"
            )
        self._job = None
        if job.error is not None:
            raise job.error

    def close(self) -> None:
        """Waits for the write in flight, then stops the thread."""
        try:
            self.wait()
        finally:
            self._jobs.put(None)
            self._thread.join(JOIN_S)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                self._write(job)
            except SnapshotError as e:
                job.error = e
            except Exception as e:  # the trainer learns of it at its next wait
                job.error = SnapshotError(f"the snapshot of step {job.step} to {self.folder} failed: {e!r}")
            finally:
                job.done.set()

    def _write(self, job: Job) -> None:
        start = time.perf_counter()
        payload = job.payload
        header = {
            **job.header,
            "step": job.step,
            "tensors": job.manifest,
            "payload_checksum": transfer.checksum(payload),
            "payload_bytes": payload.numel(),
        }
        raw = json.dumps(header).encode()
        if len(raw) > MAX_HEADER_BYTES:
            raise SnapshotError(f"a snapshot header of {len(raw):,} B is over the {MAX_HEADER_BYTES:,} B bound")
        digest = hashlib.blake2b(raw, digest_size=DIGEST_BYTES).digest()
        final = os.path.join(self.folder, file_name(job.step))
        temp = os.path.join(self.folder, f".{file_name(job.step)}.{secrets.token_hex(6)}.tmp")
        fd = -1
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)  # held until closed, past the rename: stale-temp sweeps skip it
            write_all(fd, memoryview(PREFIX.pack(MAGIC, VERSION, len(raw), digest) + raw))
            write_all(fd, payload.numpy().data)
            if self.durable:  # else the file has to outlive the process, not the node (a tmpfs does not outlive it)
                os.fsync(fd)
            os.replace(temp, final)
            if self.durable:  # the rename itself, which lives in the folder
                fsync_dir(self.folder)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(temp)
            size = PREFIX.size + len(raw) + payload.numel()
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise SnapshotError(
                    f"snapshot folder {self.folder} is full: the snapshot of step {job.step} ({size:,} B) does not "
                    "fit. Set recover.snapshot_dir to a folder with room (a bigger tmpfs), or "
                    "recover.snapshot_interval = 0 to turn snapshots off"
                ) from e
            raise SnapshotError(f"writing snapshot {final} ({size:,} B) failed: {e}") from e
        finally:
            if fd >= 0:
                os.close(fd)
        self._prune(job.step)
        self.last_bytes = payload.numel()
        self.last_copy_s = job.copy_s
        self.last_write_s = time.perf_counter() - start

    def _prune(self, step: int) -> None:
        """Removes the complete files older than the newest ``keep`` up to ``step``. Newer ones are not
        this write's to judge: every replica of the shard writes here, each at its own pace."""
        names = os.listdir(self.folder)
        older = [s for s in complete_steps(names) if s <= step]
        claims = [m for m in map(CLAIM.fullmatch, names) if m and int(m.group(1)) < step]
        for name in [file_name(old) for old in older[self.keep :]] + [m.group(0) for m in claims]:
            with contextlib.suppress(FileNotFoundError):  # another replica's writer pruned it first
                os.unlink(os.path.join(self.folder, name))


def load(root: str, group_rank: int, step: int) -> tuple[dict[str, Any], torch.Tensor]:
    """Reads and verifies shard ``group_rank``'s file of ``step``: (header, uint8 payload on the CPU)."""
    path = os.path.join(shard_dir(root, group_rank), file_name(step))
    try:
        f = open(path, "rb", buffering=0)
    except FileNotFoundError as e:
        raise SnapshotError(f"snapshot {path} is missing") from e
    except OSError as e:
        raise SnapshotError(f"snapshot {path} cannot be read: {e}") from e
    with f:
        try:
            return read_snapshot(f, path, step)
        except OSError as e:
            raise SnapshotError(f"snapshot {path} cannot be read: {e}") from e


def read_snapshot(f: Any, path: str, step: int) -> tuple[dict[str, Any], torch.Tensor]:
    size = os.fstat(f.fileno()).st_size
    if size < PREFIX.size:
        raise SnapshotError(f"snapshot {path} is {size} B, shorter than its {PREFIX.size} B prefix: it was truncated")
    prefix = bytearray(PREFIX.size)
    read_exact(f, memoryview(prefix), path)
    magic, version, header_len, digest = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise SnapshotError(f"snapshot {path} is not a titan_recover snapshot: it starts with {magic!r}, not {MAGIC!r}")
    if version != VERSION:
        raise SnapshotError(f"snapshot {path} has format version {version}; this titan_recover reads {VERSION}")
    if not 0 < header_len <= MAX_HEADER_BYTES:
        raise SnapshotError(
            f"snapshot {path} says its header is {header_len:,} B, outside 1 to {MAX_HEADER_BYTES:,} B: it is corrupt"
        )
    if size < PREFIX.size + header_len:
        raise SnapshotError(
            f"snapshot {path} is {size:,} B, shorter than its {header_len:,} B header: it was truncated"
        )
    raw = bytearray(header_len)
    read_exact(f, memoryview(raw), path)
    if hashlib.blake2b(raw, digest_size=DIGEST_BYTES).digest() != digest:
        raise SnapshotError(f"snapshot {path}'s header does not match its blake2b digest: the header is corrupt")
    try:
        header = json.loads(raw.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SnapshotError(f"snapshot {path}'s header is not JSON: {e}") from e
    if not isinstance(header, dict):
        raise SnapshotError(f"snapshot {path}'s header is not a JSON object: {header!r:.80}")
    for key, kind in (("step", int), ("payload_bytes", int), ("payload_checksum", int), ("tensors", list)):
        value = header.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise SnapshotError(f"snapshot {path}'s header has no valid {key!r}: {value!r:.80}")
    if header["step"] != step:
        raise SnapshotError(f"snapshot {path} holds step {header['step']}, its name says {step}")
    payload_len = header["payload_bytes"]
    expected = PREFIX.size + header_len + payload_len
    if payload_len < 0:
        raise SnapshotError(f"snapshot {path}'s header says its payload is {payload_len} B: it is corrupt")
    if size < expected:
        raise SnapshotError(
            f"snapshot {path} is {size:,} B, shorter than the {expected:,} B its header says: it was truncated"
        )
    if size > expected:
        raise SnapshotError(f"snapshot {path} has {size - expected:,} B past the payload its header says: corrupt")
    payload = torch.empty(payload_len, dtype=torch.uint8)
    read_exact(f, payload.numpy().data, path)
    found = transfer.checksum(payload)
    if found != header["payload_checksum"]:
        raise SnapshotError(
            f"snapshot {path}'s payload is corrupt: its checksum is {found}, its header says "
            f"{header['payload_checksum']} ({payload_len:,} B)"
        )
    return header, payload


def apply(header: dict[str, Any], payload: torch.Tensor, model_parts: list[torch.nn.Module], optimizers: Any) -> None:
    """Fills this rank's tensors from a loaded snapshot, as a state transfer does; a ``TransferError``
    where the snapshot's manifest is not this rank's, with nothing applied. The LR schedulers and
    hyperparameters are ``transfer.restore``'s."""
    tensors = transfer.accept(header.get("tensors"), payload.numel(), model_parts, optimizers, SNAPSHOT)
    transfer.fill(payload, tensors)


def room_needed(payload_bytes: int, keep: int, ranks_on_node: int, shards_on_node: int) -> int:
    """Bytes a node's snapshots take at most. The ranks of every group on a node write each shard's files
    under the same names, so per shard: ``keep`` complete files, one temp per writer, and one complete file
    more: a writer's new file before it prunes (it has no temp then), or, where several writers share the
    shard and ``keep`` is 1, the file a writer one snapshot behind renames after another pruned it (with every
    temp at once). With one group per node that is ``keep + 1`` copies per rank."""
    writers = max(1, ranks_on_node // shards_on_node)  # the groups on this node: each one's part holds the same shards
    lagging = 1 if keep == 1 and writers > 1 else 0
    return (keep + writers + lagging) * shards_on_node * payload_bytes


def held_bytes(root: str) -> int:
    """Bytes of the files under ``root``: what a new run's snapshots replace there."""
    total = 0
    for folder, _, names in os.walk(root):
        for name in names:
            with contextlib.suppress(OSError):  # removed meanwhile
                total += os.lstat(os.path.join(folder, name)).st_size
    return total


def check_room(root: str, needed: int) -> None:
    """Refuses (``SnapshotError``) a ``root`` whose filesystem cannot hold ``needed`` bytes of snapshots."""
    try:
        os.makedirs(root, exist_ok=True)
        free = shutil.disk_usage(root).free
    except OSError as e:
        raise SnapshotError(f"snapshot folder {root} cannot be used: {e}") from e
    held = held_bytes(root)
    if needed > free + held:
        raise SnapshotError(
            f"snapshot folder {root} has room for {amount(free + held)} ({amount(free)} free, {amount(held)} in old "
            f"snapshots); this node's snapshots need {amount(needed)}. Set recover.snapshot_dir to a bigger tmpfs "
            "(grow one with `mount -o remount,size=... /dev/shm`, or a container's --shm-size), or "
            "recover.snapshot_interval = 0 to turn snapshots off. An 8B model's replica group needs about 96 GB "
            "per copy in fp32 with AdamW (12 bytes per parameter: the weights and two moments)"
        )
