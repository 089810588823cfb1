"""Failure-free overhead of titan_recover against stock TorchTitan HSDP, side by side.

Alternates runs of the same config with ``[recover] enable = false`` (stock HSDP, one
torchrun world) and ``enable = true`` (R torchrun replica groups + coordinator), and
prints step-time and peak-RSS ratios (recover / stock) with min/median/max over pairs.
Steady-state step time = median gap between consecutive step events, first steps skipped.

    .venv/bin/python bench/overhead.py [--pairs 3] [--steps 20] [extra --section.key value ...]
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from titan_recover.events import read_events

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "train_configs" / "llama3_debug_cpu.toml"
WARMUP_STEPS = 3


def run(mode: str, steps: int, extra: list[str]) -> tuple[float, float, float]:
    """(median step time s, max RSS of any rank MiB, FT buffer MiB) of one run."""
    with tempfile.TemporaryDirectory() as dump:
        flag = "--recover.enable" if mode == "recover" else "--recover.no-enable"
        cmd = [sys.executable, "-m", "titan_recover.launch", "--job.config_file", str(CONFIG),
               "--job.dump_folder", dump, "--training.steps", str(steps), "--recover.fault_plan", "none",
               flag, *extra]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{mode} run failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
        events = list(read_events(str(Path(dump) / "recover_events.jsonl")))
    times = [e["time"] for e in events if e["event"] == "step"][WARMUP_STEPS:]
    gaps = [b - a for a, b in zip(times, times[1:])]
    mem = [e for e in events if e["event"] == "rank_memory"]
    return statistics.median(gaps), max(e["max_rss_mb"] for e in mem), max(e["ft_buffer_mb"] for e in mem)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    args, extra = parser.parse_known_args()
    rows = []
    for i in range(args.pairs):
        stock = run("stock", args.steps, extra)
        recover = run("recover", args.steps, extra)
        rows.append((stock, recover))
        print(f"pair {i + 1}: step time stock {stock[0]:.3f}s recover {recover[0]:.3f}s "
              f"(ratio {recover[0] / stock[0]:.3f}); peak RSS stock {stock[1]:.0f} MiB "
              f"recover {recover[1]:.0f} MiB; FT buffer {recover[2]:.1f} MiB", flush=True)
    for name, k in (("step time", 0), ("peak RSS", 1)):
        ratios = sorted(r[k] / s[k] for s, r in rows)
        print(f"{name} ratio recover/stock: min {ratios[0]:.3f} median {statistics.median(ratios):.3f} "
              f"max {ratios[-1]:.3f}")


if __name__ == "__main__":
    main()
