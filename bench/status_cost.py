"""What the status page costs the coordinator that serves it.

1. Live: the default job (float32 on this CPU) with ``--recover.status_port``; the coordinator's
   CPU time (all its threads, from /proc) in alternating windows with nobody reading the page and
   with a browser's refresh every second (``status.json``, plus ``/metrics`` as a 1 s scrape),
   side by side in one run. Also the sizes of ``/``, ``status.json`` and ``/metrics``.
2. At scale: one refresh (tail of the log, fold, snapshot, JSON) against synthetic event logs of
   1k, 10k and 100k steps with a failure and a rejoin every 500 steps, timed in this process.

    python -m bench.status_cost [--windows 2] [--window-s 12]
"""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.common import PRECISION, ROOT, job, write_result
from titan_recover.control import transport
from titan_recover.observability.events import Tail, event_files
from titan_recover.observability.run_status import RunHistory
from titan_recover.observability.status_server import StatusSource

CLK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """utime + stime of every thread of ``pid``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK


def coordinator_pid(launcher: int) -> int | None:
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if parent == launcher and b"titan_recover.coordinator" in cmdline:
            return int(pid)
    return None


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as answer:
        return answer.read()


def live(windows: int, window_s: float) -> dict:
    port = transport.free_port()
    url = f"http://127.0.0.1:{port}/"
    steps = int((2 * windows * window_s + 60) / 0.9)  # long enough for every window, at ~1 s a step
    with tempfile.TemporaryDirectory() as dump:
        cmd = [
            sys.executable,
            "-m",
            "titan_recover.launch",
            *job(dump),
            *PRECISION,
            "--recover.fault_plan",
            "none",
            "--training.steps",
            str(steps),
            "--recover.status_port",
            str(port),
        ]
        proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        try:
            pid = None
            while pid is None and proc.poll() is None:
                pid = coordinator_pid(proc.pid)
                time.sleep(0.5)
            if pid is None:
                raise RuntimeError(f"the launcher (pid {proc.pid}) exited before its coordinator was found")
            while proc.poll() is None:  # the first steps: the ranks built the model and trained a little
                events = [e for p in event_files(dump) for e in map(json.loads, Path(p).read_text().splitlines())]
                if sum(e["event"] == "step" for e in events) >= 3:
                    break
                time.sleep(1)
            idle, polled, requests = [], [], 0
            for _ in range(windows):  # never read yet, then read: the server refreshes only while it is read
                start, t0 = cpu_s(pid), time.monotonic()
                time.sleep(window_s)
                idle.append((cpu_s(pid) - start) / (time.monotonic() - t0))
            sizes = {
                "page_bytes": len(get(url)),
                "status_json_bytes": len(get(url + "status.json")),
                "metrics_bytes": len(get(url + "metrics")),
            }
            for _ in range(windows):
                start, t0 = cpu_s(pid), time.monotonic()
                while time.monotonic() - t0 < window_s:
                    get(url + "status.json")
                    get(url + "metrics")
                    requests += 1
                    time.sleep(max(0.0, 1.0 - (time.monotonic() - t0) % 1.0))
                polled.append((cpu_s(pid) - start) / (time.monotonic() - t0))
            step = json.loads(get(url + "status.json"))["run"]["step"]
        finally:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher, its coordinator and its groups
            proc.wait()
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {
        **sizes,
        "coordinator_cores_idle": [round(x, 4) for x in idle],
        "coordinator_cores_polled": [round(x, 4) for x in polled],
        "extra_cpu_ms_per_s": round(1000 * (mean(polled) - mean(idle)), 2),
        "polled_refreshes": requests,
        "steps_when_measured": step,
        "coordinator_cpu_ratio": round(mean(polled) / mean(idle), 3),
    }


def synthetic_log(folder: str, steps: int) -> None:
    t = 1_000.0
    with open(os.path.join(folder, "recover_events.jsonl"), "w") as f:
        f.write(
            json.dumps(
                {
                    "event": "run_config",
                    "run": "bench",
                    "replicas": 8,
                    "replica_ids": 8,
                    "steps": steps,
                    "tokens_per_step": 65536,
                    "precision": "bfloat16",
                    "time": t,
                }
            )
            + "\n"
        )
        members = list(range(8))
        for n in range(1, steps + 1):
            t += 1.0
            if n % 500 == 250:
                f.write(
                    json.dumps({"event": "failure", "replica": 3, "step": n, "cause": "rank 5 was killed", "time": t})
                    + "\n"
                )
                f.write(
                    json.dumps(
                        {"event": "recovered", "step": n, "members": [0, 1, 2, 4, 5, 6, 7], "latency_s": 0.4, "time": t}
                    )
                    + "\n"
                )
                members = [0, 1, 2, 4, 5, 6, 7]
            if n % 500 == 270:
                f.write(json.dumps({"event": "admitted", "replica": 3, "attempt": 1, "step": n, "time": t}) + "\n")
                f.write(
                    json.dumps(
                        {
                            "event": "rejoined",
                            "replica": 3,
                            "step": n,
                            "bytes": 2**30,
                            "transfer_s": 2.0,
                            "downtime_s": 20.0,
                            "time": t,
                        }
                    )
                    + "\n"
                )
                members = list(range(8))
            f.write(
                json.dumps(
                    {
                        "event": "step",
                        "step": n,
                        "epoch": 0,
                        "members": members,
                        "loss": 10 / n,
                        "time": t,
                        "quotas": {str(r): 4 for r in members},
                        "microbatches": list(range(32)),
                    }
                )
                + "\n"
            )


def at_scale(sizes: list[int]) -> dict:
    out = {}
    for steps in sizes:
        with tempfile.TemporaryDirectory() as folder:
            synthetic_log(folder, steps)
            source = StatusSource(Tail(lambda: event_files(folder)), RunHistory())
            t0 = time.perf_counter()
            source.refresh()  # the first: reads the whole log
            first = time.perf_counter() - t0
            t0 = time.perf_counter()
            for _ in range(5):
                body = json.dumps(source.refresh())  # each later one: nothing new to read, a snapshot and its JSON
            later = (time.perf_counter() - t0) / 5
            out[str(steps)] = {
                "first_refresh_s": round(first, 3),
                "refresh_ms": round(1000 * later, 2),
                "status_json_bytes": len(body),
            }
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--window-s", type=float, default=12.0)
    args = parser.parse_args()
    socket.setdefaulttimeout(10)
    result = {
        "precision": "float32 (default job, CPU)",
        "live": live(args.windows, args.window_s),
        "at_scale": at_scale([1_000, 10_000, 100_000]),
    }
    print(json.dumps(result, indent=2))
    print(f"wrote {write_result('status', result)}")


if __name__ == "__main__":
    main()
