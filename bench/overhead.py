"""Failure-free overhead of titan_recover against stock TorchTitan HSDP, side by side.

Alternates runs of the same config with ``[recover] enable = false`` (stock HSDP, one
torchrun world) and ``enable = true`` (R torchrun replica groups + coordinator), and
reports step-time and peak-RSS ratios (recover / stock) with min/median/max over pairs.
Steady-state step time = median gap between consecutive step events, first steps skipped.

    .venv/bin/python -m bench.overhead [--quick] [--pairs 3] [--steps 20] [extra --section.key value ...]
                                                       -> bench/results/overhead.json
"""

import argparse
import statistics

from bench.common import PRECISION, launch, step_gaps, write_result
from titan_recover.observability.events import of_kind

WARMUP_STEPS = 3


def measure(mode: str, steps: int, extra: list[str]) -> dict:
    """Median step time, max RSS of any rank and FT buffer of one run."""
    flag = "--recover.enable" if mode == "recover" else "--recover.no-enable"
    events, _ = launch(
        ["--training.steps", str(steps), "--recover.fault_plan", "none", flag, *PRECISION, *extra], f"{mode} run"
    )
    mem = of_kind(events, "rank_memory")
    return {
        "step_s": statistics.median(step_gaps(of_kind(events, "step")[WARMUP_STEPS:]).values()),
        "max_rss_mb": max(e["max_rss_mb"] for e in mem),
        "ft_buffer_mb": max(e["ft_buffer_mb"] for e in mem),
    }


def spread(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def run(pairs: int, steps: int, extra: list[str]) -> dict:
    rows = []
    for i in range(pairs):
        stock, recover = measure("stock", steps, extra), measure("recover", steps, extra)
        rows.append({"stock": stock, "recover": recover})
        print(
            f"pair {i + 1}: step time stock {stock['step_s']:.3f}s recover {recover['step_s']:.3f}s "
            f"(ratio {recover['step_s'] / stock['step_s']:.3f}); peak RSS stock {stock['max_rss_mb']:.0f} MiB "
            f"recover {recover['max_rss_mb']:.0f} MiB; FT buffer {recover['ft_buffer_mb']:.1f} MiB",
            flush=True,
        )
    step = spread([r["recover"]["step_s"] / r["stock"]["step_s"] for r in rows])
    rss = spread([r["recover"]["max_rss_mb"] / r["stock"]["max_rss_mb"] for r in rows])
    return {
        "setup": {
            "config": "train_configs/llama3_debug_cpu.toml",
            "pairs": pairs,
            "steps": steps,
            "extra": extra,
            "precision": PRECISION[-1],
        },
        "pairs": rows,
        "step_time_ratio": step,
        "peak_rss_ratio": rss,
        "overhead_step_time_ratio": step["median"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 pair of 12 steps")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    args, extra = parser.parse_known_args()
    pairs, steps = (1, 12) if args.quick else (args.pairs, args.steps)
    result = run(pairs, steps, extra)
    for name in ("step_time_ratio", "peak_rss_ratio"):
        r = result[name]
        print(f"{name} recover/stock: min {r['min']:.3f} median {r['median']:.3f} max {r['max']:.3f}")
    print(f"wrote {write_result('overhead', result)}")


if __name__ == "__main__":
    main()
