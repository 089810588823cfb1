"""What a process holds: resident memory, threads, open file descriptors (Linux ``/proc``).

Logged after every failure by survivors and the coordinator, so a leak per failure
shows up as a trend in the event log, not as an out-of-memory days later.
"""

import os


def usage(pid: int | str = "self") -> dict[str, float]:
    """{"rss_mb", "threads", "fds"} of process ``pid`` (this one by default) now."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "Threads"):
                fields[key] = int(value.split()[0])
    return {
        "rss_mb": round(fields.get("VmRSS", 0) / 1024, 1),
        "threads": fields.get("Threads", 0),
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
    }
