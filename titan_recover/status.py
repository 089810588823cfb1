"""The status page of a run, outside the run: serve it for a finished run's event log, or print a
live run's status in the terminal (a login node with no browser).

    python -m titan_recover.status --events outputs/llama3_debug_cpu [--port 8765] [--bind 127.0.0.1]
    python -m titan_recover.status --url http://127.0.0.1:8765 [--watch [--interval 2]]

``--events`` takes a dump folder (every node's event log in it) or one event file.
"""

import argparse
import json
import logging
import os
import sys
import time
import urllib.error
import urllib.request
from typing import Any

from titan_recover.control.keys import EXIT_BAD_INPUT, EXIT_OK
from titan_recover.observability import logs
from titan_recover.observability.events import Tail, event_files
from titan_recover.observability.run_status import RunHistory
from titan_recover.observability.status_server import StatusServer, StatusSource
from titan_recover.observability.summary import spare_note

CLEAR = "\x1b[H\x1b[2J"
log = logging.getLogger(__name__)


def _s(value: float | None, digits: int = 2) -> str:
    return "—" if value is None else f"{value:.{digits}f}s"


def format_status(s: dict[str, Any]) -> str:
    """The snapshot of ``/status.json`` as a terminal table."""
    run = s["run"]
    rate = "" if run["steps_per_s"] is None else f"  {run['steps_per_s']:.2f} steps/s"
    tokens = "" if run["tokens_per_s"] is None else f"  {run['tokens_per_s']:.0f} tokens/s"
    ago = "" if run["updated"] is None else f"  updated {run['now'] - run['updated']:.1f}s ago"
    leader = "" if not run["leader"] else f"  leader {run['leader']['host']}:{run['leader']['pid']}"
    lines = [
        f"run {run['id']}  {run['state'].upper()}  step {run['step']}/{run['steps'] or '?'}{rate}{tokens}"
        f"  {run['precision'] or ''}{leader}{ago}"
    ]
    if run["fatal"]:
        lines.append(f"FATAL: {run['fatal']}")
    if run.get("store_error"):
        lines.append(f"control store unreadable ({run['store_error']}): states from the event log only")
    lines.append(
        f"{'replica':>7}  {'state':<10}  {'inc':>3}  {'nodes':<16}  {'heartbeat':>9}  {'microbatches':>12}  down"
    )
    for g in s["groups"]:
        down = "" if g["down_since"] is None else f"{run['now'] - g['down_since']:.1f}s"
        lines.append(
            f"{g['replica']:>7}  {g['state']:<10}  {g['incarnation']:>3}  {','.join(g['nodes']) or '—':<16}  "
            f"{_s(g['heartbeat_age_s']):>9}  {g['microbatches']:>12}  {down}"
        )
    lines.append(f"failures: {s['counts']['failures']}")
    lines += [
        f"  replica {f['replica']} at step {f['step']}: {f['cause']} "
        f"(detected in {_s(f['detection_s'])}, recovered in {_s(f['recovery_s'], 3)})"
        for f in s["failures"][:5]
    ]
    if s["counts"]["leaves"]:
        lines.append(f"left on notice: {s['counts']['leaves']}")
        lines += [
            f"  replica {e['replica']} before step {e['step']}, {_s(e['notice_s'], 1)} after the notice"
            for e in s["leaves"][:5]
        ]
    lines.append(f"rejoins: {s['counts']['rejoins']}")
    lines += [
        f"  replica {r['replica']}{spare_note(r)} at step {r['step']}: down "
        f"{_s(r['downtime_s'], 1)}, {(r['bytes'] or 0) / 2**20:.1f} MiB in {_s(r['transfer_s'], 3)}"
        for r in s["rejoins"][:5]
    ]
    digests = s["digests"]
    if digests["steps"]:
        verdict = f"MISMATCH ({digests['mismatches']})" if digests["mismatches"] else "equal across replicas"
        lines.append(f"param digests: {verdict}, last checked at step {digests['last']}")
    sdc = s.get("sdc")
    if sdc and (sdc["checks"] or sdc["mismatches"]):
        lines.append(f"SDC checks: {sdc['checks']} steps checked, {sdc['mismatches']} mismatches")
        lines += [f"  QUARANTINED: replica {q['replica']} at step {q['step']}" for q in sdc["quarantined"]]
    return "\n".join(lines)


def fetch(url: str, timeout_s: float = 5.0) -> dict[str, Any]:
    """The run's ``/status.json``; OSError or ValueError saying what went wrong."""
    with urllib.request.urlopen(url.rstrip("/") + "/status.json", timeout=timeout_s) as answer:
        snapshot = json.loads(answer.read())
    if not isinstance(snapshot, dict) or not isinstance(snapshot.get("run"), dict):
        raise ValueError("the answer is not a titan_recover status (no run object)")
    return snapshot


def watch(url: str, interval_s: float, once: bool) -> int:
    while True:
        try:
            text = format_status(fetch(url))
            code = 0
        except (OSError, ValueError, KeyError, TypeError) as e:
            text, code = f"cannot read the status at {url}: {e}", 1
        if once:
            print(text, file=sys.stdout if code == 0 else sys.stderr)
            return code
        print(CLEAR + text + f"\n(every {interval_s:g}s; Ctrl-C to stop)", flush=True)
        time.sleep(interval_s)


def serve_events(path: str, bind: str, port: int) -> int:
    if os.path.isdir(path):
        files = event_files(path)
        tail = Tail(lambda: event_files(path))
    else:
        files = [path] if os.path.isfile(path) else []
        tail = Tail(lambda: [path])
    if not files:
        print(
            f"error: --events {path}: no event log there (a dump folder with recover_events*.jsonl, or one such file)",
            file=sys.stderr,
        )
        return EXIT_BAD_INPUT
    try:
        server = StatusServer(StatusSource(tail, RunHistory()), bind, port)
    except OSError as e:
        print(f"error: --bind {bind} --port {port}: cannot listen there ({e.strerror})", file=sys.stderr)
        return EXIT_BAD_INPUT
    log.info(f"status page of {path} at {server.address} (Prometheus: {server.address}metrics); Ctrl-C to stop")
    try:
        while True:
            time.sleep(3600)
    finally:
        server.close()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m titan_recover.status", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--events", help="serve the page of a run from its event log (a dump folder or one file)")
    what.add_argument("--url", help="print the status of the run whose page is served there")
    parser.add_argument("--bind", default="127.0.0.1", help="with --events: the address to listen on")
    parser.add_argument("--port", type=int, default=8765, help="with --events: the port to listen on")
    parser.add_argument("--watch", action="store_true", help="with --url: refresh the table until Ctrl-C")
    parser.add_argument("--interval", type=float, default=2.0, help="with --watch: seconds between refreshes")
    args = parser.parse_args(argv)
    logs.setup("status", __name__)
    try:
        if args.events is not None:
            return serve_events(args.events, args.bind, args.port)
        return watch(args.url, max(args.interval, 0.2), once=not args.watch)
    except KeyboardInterrupt:
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
