"""What every benchmark shares: paths, one launcher run, results files."""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from titan_recover.observability import phases
from titan_recover.observability.events import read_events
from titan_recover.titan.jobs import FLAGS, LINE, PRECISION, TINY, TINY_SIZES, config_args, job  # noqa: F401  (how each line spells a job)

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "train_configs" / "llama3_debug_cpu.toml"
RESULTS = Path(os.environ.get("BENCH_RESULTS") or ROOT / "bench" / "results")  # BENCH_RESULTS: elsewhere (a check)


def launch(
    args: list[str], what: str, config: str = "llama3_debug_cpu", dump: Path | None = None
) -> tuple[list[dict], float]:
    """Runs ``titan_recover.launch`` with the shipped ``config`` plus ``args`` in ``dump`` (a fresh
    temporary folder when None, removed after); returns its events and the wall time of the whole
    command. A failed run raises with the tail of its output."""
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) if dump is None else dump
        cmd = [sys.executable, "-m", "titan_recover.launch", *job(folder, config=config), *args]
        start = time.monotonic()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        wall = time.monotonic() - start
        if proc.returncode != 0:
            raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
        return list(read_events(str(folder / "recover_events.jsonl"))), wall


def step_gaps(steps: list[dict]) -> dict[int, float]:
    """Step number -> seconds since the previous step's event, for consecutive steps only."""
    return {b["step"]: b["time"] - a["time"] for a, b in zip(steps, steps[1:]) if b["step"] == a["step"] + 1}


def device() -> str:
    """What the runs train on: the GPU's name, or "cpu"."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def write_result(name: str, result: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


def recovery_phases(events: list[dict]) -> dict[str, float | None]:
    """The run's first failure's phases (``observability.phases``: seconds from the fault to the end of
    each, None where the run did not reach it), as the run's own summary splits it."""
    found = phases.recoveries(events)
    return found[0]["phases"] if found else dict.fromkeys(phases.PHASES)


def phase_medians(rows: list[dict]) -> dict[str, float]:
    """Each phase's median over ``rows`` (their ``phases``), for the phases any of them reached."""
    picked = [r["phases"] for r in rows]
    return {
        name: statistics.median(v for p in picked if (v := p[name]) is not None)
        for name in phases.PHASES
        if any(p[name] is not None for p in picked)
    }


def timeline(split: dict[str, Any]) -> str:
    """``phases.timeline`` of a bench row's ``phases``."""
    return phases.timeline({"phases": split})
