"""Where each recovery's time went: its phases, from the run's own events.

One vocabulary (``PHASES``), each phase the seconds from the fault to its end (so they only grow):

- ``detect``: the coordinator's verdict (``failure.detected``);
- ``abort``: the slowest survivor group's replicate collectives given up (``recovery_moments.torn_down``);
- ``reform``: the slowest survivor group's collectives of the new epoch formed (``recovery_moments.reformed``);
- ``first_good_step``: the slowest survivor group's first step committed in the new epoch (the in-step redo
  included; the ``recovery_moments`` event's time);
- ``restart``: the failed group's next incarnation started, or its warm one activated (``group_started``);
- ``admit``: that incarnation admitted, its model built (``admitted``);
- ``rejoin``: the first step committed with it back, its state received (``rejoined``).

The fault's time is the injected fault's own where the plan made it, else the failed group's last
heartbeat, else the detection (the ``failure`` event's ``clock`` says which). The self-test's probe
uses the first four names. A phase the run did not reach (a spare took over, the run ended first)
is None.
"""

from typing import Any

from titan_recover.observability.events import RECOVERY_PHASES

REJOIN_PHASES = ("restart", "admit", "rejoin")
PHASES = (*RECOVERY_PHASES, *REJOIN_PHASES)


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _first(events: list[dict[str, Any]], kind: str, after: float, **match: Any) -> dict[str, Any] | None:
    return next(
        (
            e
            for e in events
            if e["event"] == kind and e["time"] >= after and all(e.get(k) == v for k, v in match.items())
        ),
        None,
    )


def _survivors(events: list[dict[str, Any]], t0: float, epoch: float | None) -> list[dict[str, Any]]:
    """Each survivor group's first ``recovery_moments`` from the failure's epoch on (a fast rejoin may
    have moved the epoch again before a survivor's first commit)."""
    first: dict[Any, dict[str, Any]] = {}
    for e in events:
        if e["event"] == "recovery_moments" and epoch is not None and e["time"] >= t0:
            moved = _num(e.get("epoch"))
            if moved is not None and moved >= epoch:
                first.setdefault(e.get("replica"), e)
    return list(first.values())


def recoveries(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each failure's phases (``PHASES``: seconds from the fault, None where not reached), in the
    order of the faults: ``replica, step, clock, warm, phases``. Events without a time are left out;
    a field missing from an event (a log from an older titan_recover, a torn line) leaves its phase None."""
    events = sorted((e for e in events if _num(e.get("time")) is not None), key=lambda e: e["time"])
    out = []
    for failure in (e for e in events if e["event"] == "failure"):
        t0, replica, detected = failure["time"], failure.get("replica"), _num(failure.get("detected"))
        recovered = _first(events, "recovered", t0 if detected is None else detected)
        epoch = _num(recovered.get("epoch")) if recovered else None
        moments = _survivors(events, t0, epoch)
        started = _first(events, "group_started", t0, replica=replica)
        admitted = _first(events, "admitted", t0, replica=replica)
        rejoined = _first(events, "rejoined", t0, replica=replica)

        def since(t: float | None) -> float | None:
            return None if t is None else round(max(0.0, t - t0), 3)

        def slowest(key: str) -> float | None:
            times = [t for t in (_num(e.get(key)) for e in moments) if t is not None]
            return since(max(times)) if times else None

        phases = {
            "detect": since(detected),
            "abort": slowest("torn_down"),
            "reform": slowest("reformed"),
            "first_good_step": slowest("time"),
            "restart": since(started["time"]) if started else None,
            "admit": since(admitted["time"]) if admitted else None,
            "rejoin": since(rejoined["time"]) if rejoined else None,
        }
        warm = started.get("warm") if started else None
        out.append(
            {
                "replica": replica,
                "step": failure.get("step"),
                "clock": failure.get("clock"),
                "warm": warm if isinstance(warm, bool) else None,
                "phases": phases,
            }
        )
    return out


def timeline(recovery: dict[str, Any]) -> str:
    """One line: ``detect 0.05s > abort 0.31s > ...``, the phases reached."""
    return " > ".join(f"{name} {t:.2f}s" for name, t in recovery["phases"].items() if t is not None)
