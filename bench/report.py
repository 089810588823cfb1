"""The benchmark report: headline numbers, a summary table and PNG plots from bench/results.

.venv/bin/python -m bench.report [results_dir]   -> summary.json, summary.md, *.png there
"""

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no screen
import matplotlib.pyplot as plt  # noqa: E402

from bench.common import RESULTS  # noqa: E402

# headline key -> (scenario file, how to read it)
HEADLINES = {
    "overhead_step_time_ratio": ("overhead", "step time recover / stock, no failures (median of pairs)"),
    "torchft_max_rel_loss_dev": ("fidelity", "torchft: max per-step relative loss deviation from its failure-free run"),
    "recover_max_rel_loss_dev": ("fidelity", "titan_recover: same, same kill"),
    "ckpt_restart_effective_throughput_ratio": (
        "ckpt_restart",
        "tokens/s titan_recover / best-K checkpoint-and-restart, 3 kills",
    ),
    "sim_calibration_error": ("goodput", "simulator vs measured training time, worst run of scenario 3"),
    "sim_paper_setting_ratio": ("goodput", "simulated effective throughput ratio, 512 GPUs with 256 lost"),
    "data_prepare_tokens_per_s": ("data", "tokens/s of the prepare command on every core of this machine"),
    "data_read_vs_needed_ratio": (
        "data",
        "one rank's microbatches/s at seq 8192 / what one H100 of an 8B run consumes",
    ),
    "data_rss_growth_ratio": ("data", "a reading rank's peak RSS at 1B tokens / at 1M tokens"),
    "spare_rejoin_downtime_s": ("spares", "failure to full membership with a hot spare, worst of R = 2, 4, 8"),
    "restart_rejoin_downtime_s": ("spares", "the same by restarting the failed group, no spare"),
    "warm_rejoin_downtime_s": ("warm", "failure to the group back from its warm incarnation, default job (median)"),
    "cold_rejoin_downtime_s": ("warm", "the same restarting cold, importing anew, same bench run (median)"),
    "snapshot_default_step_time_ratio": (
        "host_memory",
        "failure-free step time with snapshots every 10 steps (the default) / off, default job (median of rounds)",
    ),
    "host_memory_resume_s": ("host_memory", "every replica group lost -> first step committed, resumed from memory"),
    "host_memory_dcp_restart_s": (
        "host_memory",
        "the same kill with snapshots off: FATAL, then the same command from the DCP checkpoint (same K)",
    ),
    "stall_s_notice": ("leave", "survivor's stall when a node leaves on notice (SIGTERM), two launchers (median)"),
    "stall_s_lost": ("leave", "the same when that node is lost whole (SIGKILL, no notice), same bench run (median)"),
    "spot_steps_vs_elastic": ("spot", "a spot-trace window replayed: each system's steps per trace hour / elastic's"),
    "spot_exact_every_step": ("spot", "the same replay: every parameter digest equal to the exact twin's, all steps"),
    "spot_membership_max_rel_loss_dev": ("spot", "the same: max relative loss drift, the batch following the members"),
    "sim_spot_vs_elastic": ("spot", "simulated whole trace, 32 nodes of 8 GPUs: tokens per hour / elastic's"),
    "sim_spot_elastic_options_vs_membership": (
        "spot_options",
        "simulated whole spot trace: elastic with one change each, tokens per hour / the membership-following run's",
    ),
    "spare_failure_free_step_ratio": ("spares", "failure-free step time with a waiting spare / without, worst R"),
    "straggler_speed_vs_ideal": (
        "stragglers",
        "step time with the speed policy / ideal, one of 2 groups F times slower (F: ratio)",
    ),
    "straggler_balanced_vs_ideal": ("stragglers", "the same with the balanced policy"),
    "coordinator_failover_s": ("failover", "etcd: coordinator leader SIGKILLed -> next committed step, R = 2"),
    "node_failover_s": ("failover", "etcd: the leader's node (launcher tree) SIGKILLed -> next committed step, R = 2"),
    "dcp_restart_s": (
        "failover",
        "the same job in stock TorchTitan: a rank SIGKILLed -> the DCP-restarted job's first step",
    ),
    "etcd_step_time_ratio": (
        "failover",
        "failure-free step time, control_store etcd / TCPStore (3 etcd members on the same 2 cores)",
    ),
}


def load(results: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(results.glob("*.json")) if p.stem != "summary"}


def headline(scenarios: dict[str, dict]) -> dict:
    """Each headline's value and, where its scenario file gives one (``<key>_caveat``), its caveat beside it."""
    out: dict[str, object] = {}
    for key, (scenario, _) in HEADLINES.items():
        out[key] = scenarios.get(scenario, {}).get(key)
        if caveat := scenarios.get(scenario, {}).get(f"{key}_caveat"):
            out[f"{key}_caveat"] = caveat
    return out


def _fmt(value: object) -> str:
    if value is None:
        return "not run"
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, dict):
        return ", ".join(f"{k}: {_fmt(v)}" for k, v in value.items())
    return str(value)


def table(scenarios: dict[str, dict]) -> str:
    rows = ["| metric | value | meaning |", "|---|---|---|"]
    values = headline(scenarios)
    for key, (_, meaning) in HEADLINES.items():
        caveat = values.get(f"{key}_caveat")
        rows.append(f"| `{key}` | {_fmt(values[key])}{f' (caveat: {caveat})' if caveat else ''} | {meaning} |")
    return "\n".join(rows)


def _save(fig: plt.Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_ckpt_restart(data: dict, calibration: dict | None, out: Path) -> Path:
    runs = data["runs"]
    names = [r["system"] for r in runs]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    xs = range(len(runs))
    ax.bar([x - 0.2 for x in xs], [r["train_s"] for r in runs], 0.4, label="measured")
    if calibration:
        ax.bar([x + 0.2 for x in xs], [r["predicted_s"] for r in calibration["runs"]], 0.4, label="simulated")
    ax.set_xticks(list(xs), names, rotation=15)
    ax.set_ylabel(f"seconds for {data['setup']['steps']} steps")
    ax.set_title(f"{len(data['setup']['kills'])} kills: training time (lower is better)")
    ax.legend()
    return _save(fig, out / "ckpt_restart.png")


def plot_paper(goodput: dict, out: Path) -> Path:
    curves = goodput["paper_setting"]["result"]["curves"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for name, label in (("recover", "titan_recover"), ("restart", "checkpoint-and-restart")):
        t, tokens, gpu_h = zip(*curves[name])
        left.plot([x / 60 for x in t], [y / 1e9 for y in tokens], label=label)
        right.plot(gpu_h, [y / 1e9 for y in tokens], label=label)
    left.set_xlabel("wall time (min)")
    right.set_xlabel("GPU-hours")
    right.axvline(234, color="grey", linestyle=":")
    for ax in (left, right):
        ax.set_ylabel("tokens committed (billions)")
        ax.legend()
    fig.suptitle("simulated: 512 GPUs, 256 lost in 4 failures spread over the run")
    return _save(fig, out / "goodput_paper.png")


def plot_sweep(goodput: dict, out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6, 3.8))
    rates = sorted({r["rate_per_gpu_hour"] for r in goodput["sweep"]})
    for rate in rates:
        rows = [r for r in goodput["sweep"] if r["rate_per_gpu_hour"] == rate]
        ys = [r["throughput_ratio"] for r in rows]
        err = [[y - r["min"] for y, r in zip(ys, rows)], [r["max"] - y for y, r in zip(ys, rows)]]
        ax.errorbar([r["gpus"] for r in rows], ys, yerr=err, marker="o", capsize=3, label=f"{rate:g} /GPU-h")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("effective throughput ratio")
    ax.set_title("simulated, 24 h, Young/Daly K (mean, min-max of 5 draws)", fontsize=9)
    ax.legend(title="failure rate")
    return _save(fig, out / "goodput_sweep.png")


def plot_latency(goodput: dict, out: Path) -> Path:
    scale = goodput["latency_scale"]
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for name, label in (("latency_s", "survivors regrouped"), ("restart_s", "failed group rejoined")):
        measured = scale["measured"][name]
        per_group = scale["gpus_per_group"]
        ax.plot(
            [int(r) * per_group for r in measured],
            list(measured.values()),
            "o",
            label=f"{label} (measured, x{per_group} GPUs/group)",
        )
        ext = scale["extrapolated"]
        ax.plot([e["devices"] for e in ext], [e[name] for e in ext], "--", label=f"{label} (linear fit)")
    fr = scale["flashrecovery"]
    ax.plot([fr["devices"]], [fr["restore_s"]], "k*", markersize=12, label="FlashRecovery (reported)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("devices")
    ax.set_ylabel("seconds")
    ax.legend(fontsize=7)
    return _save(fig, out / "recovery_latency.png")


def plot_fidelity(data: dict, out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for system in ("torchft", "recover"):
        dev = data.get(f"{system}_rel_loss_dev")
        if dev:
            ax.plot(range(1, len(dev) + 1), dev, marker=".", label=system)
    ax.set_xlabel("step")
    ax.set_ylabel("relative loss deviation from failure-free")
    ax.set_title("same kill, each against its own failure-free run")
    ax.legend()
    return _save(fig, out / "fidelity.png")


def plots(scenarios: dict[str, dict], out: Path) -> list[Path]:
    made = []
    goodput = scenarios.get("goodput")
    if "ckpt_restart" in scenarios:
        made.append(plot_ckpt_restart(scenarios["ckpt_restart"], goodput and goodput["calibration"], out))
    if goodput:
        made += [plot_paper(goodput, out), plot_sweep(goodput, out), plot_latency(goodput, out)]
    if "fidelity" in scenarios:
        made.append(plot_fidelity(scenarios["fidelity"], out))
    return made


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.report", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "results", nargs="?", type=Path, default=RESULTS, help="the scenarios' <scenario>.json (default: bench/results)"
    )
    results = parser.parse_args(argv).results
    scenarios = load(results)
    (results / "summary.json").write_text(json.dumps(headline(scenarios), indent=2) + "\n")
    md = table(scenarios)
    (results / "summary.md").write_text(md + "\n")
    made = plots(scenarios, results)
    print(md)
    print("plots: " + ", ".join(str(p) for p in made))


if __name__ == "__main__":
    main(sys.argv[1:])
