"""A launcher's snapshot folder: where the ranks it starts keep copies of their committed state in the node's memory.

Each launcher makes one folder under ``recover.snapshot_dir`` (a tmpfs, /dev/shm by default), named for the run and
its own pid, hands it to every rank it starts (``keys.SNAPSHOT_DIR_ENV``) and removes it when it exits. The folder
outlives the ranks, so when every replica group dies at once their next incarnations find the copies there
(``rank.snapshot`` writes and reads them). A SIGKILLed launcher cannot remove its own folder, and on tmpfs it would
hold memory until reboot: the next launcher on the node removes every folder whose launcher is gone.
"""

import logging
import os
import re
import shutil

from titan_recover.node.channel import shm_dir
from titan_recover.node.procs import pid_alive

log = logging.getLogger(__name__)

PREFIX = "titan_recover-snapshots-"
FOLDER = re.compile(r"titan_recover-snapshots-([0-9a-f]+)-(\d+)")
"""titan_recover-snapshots-<the run's public id>-<launcher pid>; never a channel file's name (``channel.CHANNEL_FILE``
has the agent's pid right after ``titan_recover-``)."""

MOUNTS = "/proc/mounts"


def root(configured: str) -> str:
    """Where the folders live: ``recover.snapshot_dir``, or "" for the channel files' tmpfs (``shm_dir``)."""
    return configured or shm_dir()


def make_folder(under: str, public_id: str) -> str:
    """This launcher's folder under ``under`` for the run ``public_id``, new and empty, readable by its user only.
    One left by a dead process of the same pid (pids are reused) is removed first: it is nobody's."""
    path = os.path.join(under, f"{PREFIX}{public_id}-{os.getpid()}")
    if os.path.islink(path):
        os.unlink(path)
    elif os.path.lexists(path):
        log.info(f"removed {path}, left by a process gone before this one took its pid: {free_folder(path):,} bytes")
    os.mkdir(path, 0o700)
    os.chmod(path, 0o700)  # the umask may have narrowed it
    return path


def folder_bytes(path: str) -> int:
    """Bytes of the files under ``path`` (0 where it is gone): what removing it frees."""
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:  # removed meanwhile
                continue
    return total


def free_folder(path: str) -> int:
    """Removes ``path`` and everything under it, whatever is left; the bytes its files held."""
    size = folder_bytes(path)
    shutil.rmtree(path, ignore_errors=True)
    return size


def sweep_orphans(under: str) -> list[tuple[str, int]]:
    """Removes the snapshot folders under ``under`` whose launcher is gone (the pid in the name is not alive);
    each removed one's name and the bytes it held. Another user's, or one removed meanwhile, is left out."""
    try:
        names = os.listdir(under)
    except OSError:  # no such folder: nothing of ours is there
        return []
    removed = []
    for name in names:
        match = FOLDER.fullmatch(name)
        path = os.path.join(under, name)
        if match is None or pid_alive(int(match.group(2))) or os.path.islink(path) or not os.path.isdir(path):
            continue
        size = free_folder(path)
        if not os.path.lexists(path):
            removed.append((name, size))
    return removed


def filesystem(path: str, mounts: str = MOUNTS) -> str:
    """The type of the filesystem ``path`` is on ("tmpfs"), from the longest mount point above it; "" where unknown."""
    target, best, kind = os.path.realpath(path), "", ""
    try:
        with open(mounts) as f:
            lines = f.read().splitlines()
    except OSError:  # no /proc: not Linux
        return ""
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[1])  # \040 is a space
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind
