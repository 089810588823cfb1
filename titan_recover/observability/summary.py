"""The end-of-run summary, read back from the event logs of every node in the dump folder."""

import os
from typing import Any

from titan_recover.observability import host_memory, logs, phases
from titan_recover.observability.events import EVENTS_FILE, read_log


def _missing(logged: list[int], last_step: int | None) -> list[int]:
    """Steps between the first logged and the run's last that no file holds: every step is
    committed in turn and logged, so these were logged in a file that is not here."""
    if not logged:
        return []
    have = set(logged)
    return [n for n in range(logged[0], max(logged[-1], last_step or 0) + 1) if n not in have]


def summarize_events(*paths: str, last_step: int | None = None) -> dict[str, Any]:
    """The summary of these event files (``events.event_files``); ``last_step``: the step the
    run ended at, when known (it finished), to tell the steps missing at the end."""
    log = read_log(*paths)
    events = log.events
    steps = sorted((e for e in events if e["event"] == "step"), key=lambda e: e["step"])  # files merge by time, roughly
    recovered = [e for e in events if e["event"] == "recovered"]
    out: dict[str, Any] = {
        "steps": len(steps),
        "microbatches_per_step": sorted({len(e["microbatches"]) for e in steps}),
        "failures": [{k: e[k] for k in ("replica", "step", "cause")} for e in events if e["event"] == "failure"],
        "recovery_latency_s": [round(e["latency_s"], 3) for e in recovered],
        "recoveries": phases.recoveries(events),
        "final_members": steps[-1]["members"] if steps else [],
        "final_loss": steps[-1]["loss"] if steps else None,
        "fatal": [e["error"] for e in events if e["event"] == "fatal"],
        "left": [{k: e.get(k) for k in ("replica", "step", "notice_s")} for e in events if e["event"] == "left"],
        "rejoined": [
            {k: e.get(k) for k in ("replica", "step", "downtime_s", "transfer_s", "bytes", "replaces")}
            for e in events
            if e["event"] == "rejoined"
        ],
        "digest_steps": sorted({e["step"] for e in events if e["event"] == "param_digest"}),
        "digest_mismatches": [e for e in events if e["event"] == "param_digest_mismatch"],
        "sdc_checks": sum(e["event"] == "sdc_checked" for e in events),
        "sdc_mismatches": [
            {k: e.get(k) for k in ("step", "microbatch", "groups", "outcome", "outvoted")}
            for e in events
            if e["event"] == "sdc_mismatch"
        ],
        "quarantined": [
            {k: e.get(k) for k in ("replica", "step", "with")} for e in events if e["event"] == "quarantined"
        ],
        "leaders": [{k: e.get(k) for k in ("pid", "host", "step")} for e in events if e["event"] == "leader"],
        "files": log.files,
        "skipped": log.skipped,
        "duplicates": [e["step"] for e in log.duplicates],
        "missing_steps": _missing([e["step"] for e in steps], last_step),
        "events_delayed": sum(e.get("delayed", 0) for e in events if e["event"] == "events_delayed"),
        "events_dropped": sum(e.get("dropped", 0) for e in events if e["event"] == "events_delayed"),
        "events_late_s": max((e.get("seconds", 0.0) for e in events if e["event"] == "events_delayed"), default=0.0),
        "checkpoints_failed": sorted({e["step"] for e in events if e["event"] == "checkpoint_failed"}),
        "state_lost": [e["step"] for e in events if e["event"] == "state_lost"],
        "resumed": _resumes(events),
        "snapshot_peaks": host_memory.peaks_of(events),
        "replacements": _replacements(events),
    }
    if len(steps) >= 2:
        span = steps[-1]["time"] - steps[0]["time"]
        out["step_time_s"] = span / (len(steps) - 1)
    return out


REPLACEMENT_OUTCOMES = {
    "replacement_joined": "joined",
    "replacement_left": "left at once",
    "replacement_cancelled": "cancelled",
    "replacement_failed": "failed",
}


def _replacements(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each replacement request of the run (``[recover] replace``) and what became of it (its last word)."""
    found: dict[int, dict[str, Any]] = {}
    for e in events:
        if e["event"] == "replacement_requested" or e["event"] in REPLACEMENT_OUTCOMES:
            request = found.setdefault(e["request"], {"request": e["request"], "replicas": e["replicas"]})
            request["job"] = e.get("job") or request.get("job")
            if e["event"] in REPLACEMENT_OUTCOMES:
                why = e.get("reason") or e.get("error") or ""
                took = f"replica group(s) {e['replicas']}" if e["event"] == "replacement_joined" else ""
                request["outcome"] = REPLACEMENT_OUTCOMES[e["event"]] + (f": {why or took}" if why or took else "")
            else:
                request["replicas"] = e["replicas"]
    return [found[n] for n in sorted(found)]


def _resumes(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each resume from host memory: the step it went back to, the steps computed again, and the seconds from
    the loss to the first step committed after it (None: the run ended before one)."""
    out = []
    for e in events:
        if e["event"] == "resuming":
            out.append(
                {"from_step": e["step"], "lost_step": e["lost_step"], "recomputed": e["recomputed"], "seconds": None}
            )
        elif e["event"] == "resumed" and out:
            out[-1]["seconds"] = e["seconds"]
    return out


def spare_note(rejoined: dict[str, Any]) -> str:
    """How a hot spare's admission reads: the failed group it stood in for."""
    return "" if rejoined["replaces"] is None else f" (spare, for replica {rejoined['replaces']})"


def _files(s: dict[str, Any]) -> list[str]:
    """What was read, and what it may lack: one named node's file alone is a multi-node run's
    dump folder that the other nodes do not share."""
    names = [os.path.basename(p) for p in s["files"]]
    lines = [f"  event files          : {', '.join(names)}"]
    if len(names) == 1 and names[0] != EVENTS_FILE:
        node = names[0].removeprefix("recover_events.").removesuffix(".jsonl")
        folder = os.path.dirname(s["files"][0]) or "."
        lines.append(
            f"    only node {node}'s event file is in {folder}: the other nodes' events, and steps "
            "logged by a coordinator on another node, are not counted here "
            "(give every node the same shared dump_folder to see them)"
        )
    if s["missing_steps"]:
        lines.append(
            f"  MISSING              : steps {logs.ranges(s['missing_steps'])} are in none of these files "
            "(logged by a coordinator on another node, whose event file is not in this folder, or never "
            "written: the dump folder could not take them, as the coordinator said on stderr)"
        )
    if s["duplicates"]:
        lines.append(
            f"  duplicate lines      : {len(s['duplicates'])} (step {logs.ranges(sorted(set(s['duplicates'])))} "
            "logged again, by a coordinator leader as it lost its lease; counted once)"
        )
    if s["skipped"]:
        lines.append(f"  unreadable lines     : {len(s['skipped'])} skipped, the first {s['skipped'][0]}")
    return lines


def last_leader_file(files: list[str]) -> str | None:
    """The event file of the node whose coordinator candidate led last (on etcd each node's candidate logs to its
    node's file, ``events.NODE_ENV``), which prints the run's summary since the first node may be gone; None where
    no candidate led (the TCPStore's one coordinator)."""
    last: tuple[float, str] | None = None
    for path in files:
        for e in read_log(path).events:
            if e["event"] == "leader" and (last is None or e["time"] >= last[0]):
                last = (e["time"], path)
    return None if last is None else last[1]


def format_summary(s: dict[str, Any], tokens_per_step: int) -> str:
    lines = [
        "titan_recover summary",
        *_files(s),
        (
            f"  steps in these files : {s['steps']} of {s['steps'] + len(s['missing_steps'])} committed; "
            "the figures below are of these"
            if s["missing_steps"]
            else f"  steps committed      : {s['steps']}"
        ),
        f"  microbatches per step: {s['microbatches_per_step']}",
        f"  failures             : {len(s['failures'])}",
    ]
    lines += [f"    replica {f['replica']} at step {f['step']}: {f['cause']}" for f in s["failures"]]
    if s["recovery_latency_s"]:
        lines.append(f"  recovery latency (s) : {s['recovery_latency_s']}")
    if s["recoveries"]:
        lines.append("  recovery phases      : seconds from each fault (docs/observability.md#recovery-phases)")
        for r in s["recoveries"]:
            how = "" if r["warm"] is None else " (restarted warm)" if r["warm"] else " (restarted cold)"
            lines.append(f"    replica {r['replica']} at step {r['step']}{how}: {phases.timeline(r)}")
    if s["left"]:
        lines.append(f"  left on notice       : {len(s['left'])}")
        lines += [
            f"    replica {e['replica']} before step {e['step']}"
            + ("" if e["notice_s"] is None else f", {e['notice_s']:.1f}s after the notice")
            for e in s["left"]
        ]
    if s.get("state_lost"):
        lines.append(f"  every group lost     : in step(s) {s['state_lost']}")
        lines += [
            f"    resumed from memory at step {r['from_step']} ({r['recomputed']} step(s) computed again), "
            + ("no step committed after it" if r["seconds"] is None else f"back {r['seconds']:.1f}s after the loss")
            for r in s["resumed"]
        ]
    if s.get("snapshot_peaks"):
        lines.append("  snapshot memory      : the peak of each node's host-memory snapshot folder")
        lines += [f"    node {node}: {host_memory.mib(peak)}" for node, peak in s["snapshot_peaks"].items()]
    if s.get("replacements"):
        lines.append(f"  replacement requests : {len(s['replacements'])}")
        lines += [
            f"    request {r['request']}"
            + (f" (job {r['job']})" if r.get("job") else "")
            + f" for replica group(s) {r['replicas']}: {r.get('outcome', 'open')}"
            for r in s["replacements"]
        ]
    lines.append(f"  rejoined             : {len(s['rejoined'])}")
    lines += [
        f"    replica {r['replica']}{spare_note(r)} at step {r['step']}: down {r['downtime_s']:.1f}s, "
        f"state {r['bytes'] / 2**20:.1f} MiB in {r['transfer_s']:.3f}s"
        for r in s["rejoined"]
    ]
    if s["digest_steps"]:
        verdict = "MISMATCH" if s["digest_mismatches"] else "equal across replicas"
        lines.append(f"  param digests        : {verdict} at steps {s['digest_steps']}")
    if s.get("sdc_checks") or s.get("sdc_mismatches"):
        lines.append(f"  SDC checks           : {s['sdc_checks']} steps checked, {len(s['sdc_mismatches'])} mismatches")
        lines += [
            f"    step {m['step']} microbatch {m['microbatch']}, groups {m['groups']}: {m['outcome']}"
            + (f", replica(s) {m['outvoted']} outvoted" if m["outvoted"] else "")
            for m in s["sdc_mismatches"]
        ]
    for q in s.get("quarantined", []):
        lines.append(
            f"  QUARANTINED          : replica {q['replica']} at step {q['step']} "
            + (
                f"(on replica {q['with']}'s node: replace it)"
                if q.get("with") is not None
                else "(check or replace its devices)"
            )
        )
    if "step_time_s" in s:
        lines.append(f"  mean step time (s)   : {s['step_time_s']:.3f}")
        lines.append(f"  tokens/s             : {tokens_per_step / s['step_time_s']:.0f}")
    if s["final_loss"] is not None:
        lines.append(f"  final loss           : {s['final_loss']:.4f}")
    if len(s.get("leaders", [])) > 1:  # coordinator fail-over on etcd
        lines.append(f"  coordinator leaders  : {len(s['leaders'])}")
        lines += [f"    pid {e['pid']} on {e['host']} from step {e['step']}" for e in s["leaders"][1:]]
    if s.get("events_delayed") or s.get("events_dropped"):
        lines.append(
            f"  event log            : {s['events_delayed']} events written late (up to {s['events_late_s']:.0f}s), "
            f"{s['events_dropped']} dropped, while the dump folder could not take them"
        )
    if s.get("checkpoints_failed"):
        lines.append(
            f"  checkpoints failed   : steps {logs.ranges(s['checkpoints_failed'])} (the disk did not take them; "
            "a resume starts from the last complete one)"
        )
    lines.append(f"  final members        : {s['final_members']}")
    lines += [f"  FATAL: {err}" for err in s["fatal"]]
    return "\n".join(lines)
