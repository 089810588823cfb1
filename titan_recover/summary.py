"""The end-of-run summary, read back from the event log."""

from typing import Any

from titan_recover.events import read_events


def summarize_events(path: str) -> dict[str, Any]:
    events = list(read_events(path))
    steps = [e for e in events if e["event"] == "step"]
    recovered = [e for e in events if e["event"] == "recovered"]
    out: dict[str, Any] = {
        "steps": len(steps),
        "microbatches_per_step": sorted({len(e["microbatches"]) for e in steps}),
        "failures": [
            {k: e[k] for k in ("replica", "step", "cause")} for e in events if e["event"] == "failure"
        ],
        "recovery_latency_s": [round(e["latency_s"], 3) for e in recovered],
        "final_members": steps[-1]["members"] if steps else [],
        "final_loss": steps[-1]["loss"] if steps else None,
        "fatal": [e["error"] for e in events if e["event"] == "fatal"],
        "rejoined": [
            {k: e.get(k) for k in ("replica", "step", "downtime_s", "transfer_s", "bytes", "replaces")}
            for e in events if e["event"] == "rejoined"
        ],
        "digest_steps": sorted({e["step"] for e in events if e["event"] == "param_digest"}),
        "digest_mismatches": [e for e in events if e["event"] == "param_digest_mismatch"],
        "leaders": [{k: e.get(k) for k in ("pid", "host", "step")} for e in events if e["event"] == "leader"],
    }
    if len(steps) >= 2:
        span = steps[-1]["time"] - steps[0]["time"]
        out["step_time_s"] = span / (len(steps) - 1)
    return out


def _spare(rejoined: dict[str, Any]) -> str:
    """How a hot spare's admission reads: the failed group it stood in for."""
    return "" if rejoined["replaces"] is None else f" (spare, for replica {rejoined['replaces']})"


def format_summary(s: dict[str, Any], tokens_per_step: int) -> str:
    lines = [
        "titan_recover summary",
        f"  steps committed      : {s['steps']}",
        f"  microbatches per step: {s['microbatches_per_step']}",
        f"  failures             : {len(s['failures'])}",
    ]
    lines += [f"    replica {f['replica']} at step {f['step']}: {f['cause']}" for f in s["failures"]]
    if s["recovery_latency_s"]:
        lines.append(f"  recovery latency (s) : {s['recovery_latency_s']}")
    lines.append(f"  rejoined             : {len(s['rejoined'])}")
    lines += [
        f"    replica {r['replica']}{_spare(r)} at step {r['step']}: down {r['downtime_s']:.1f}s, "
        f"state {r['bytes'] / 2**20:.1f} MiB in {r['transfer_s']:.3f}s"
        for r in s["rejoined"]
    ]
    if s["digest_steps"]:
        verdict = "MISMATCH" if s["digest_mismatches"] else "equal across replicas"
        lines.append(f"  param digests        : {verdict} at steps {s['digest_steps']}")
    if "step_time_s" in s:
        lines.append(f"  mean step time (s)   : {s['step_time_s']:.3f}")
        lines.append(f"  tokens/s             : {tokens_per_step / s['step_time_s']:.0f}")
    if s["final_loss"] is not None:
        lines.append(f"  final loss           : {s['final_loss']:.4f}")
    if len(s.get("leaders", [])) > 1:  # coordinator fail-over on etcd
        lines.append(f"  coordinator leaders  : {len(s['leaders'])}")
        lines += [f"    pid {e['pid']} on {e['host']} from step {e['step']}" for e in s["leaders"][1:]]
    lines.append(f"  final members        : {s['final_members']}")
    lines += [f"  FATAL: {err}" for err in s["fatal"]]
    return "\n".join(lines)
