"""What every benchmark shares: paths, one launcher run, results files."""

import json
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

from titan_recover.events import read_events

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "train_configs" / "llama3_debug_cpu.toml"
RESULTS = ROOT / "bench" / "results"
# every benchmark names its precision: CPU runs are float32 (bfloat16 is emulated on CPUs without
# AVX-512-BF16/AMX, ~13x slower), and results record it
PRECISION = ["--training.mixed_precision_param", "float32"]
# the tests' job, small enough for many multi-process runs on a 2-core CI machine (TorchTitan 0.2 spelling)
TINY_SIZES = ["--training.seq_len", "64", "--training.steps", "6", "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1"]
TINY = ["--model.flavor", "tiny", *TINY_SIZES]
LINE = ".".join(metadata.version("torchtitan").split(".")[:2])
"""The installed TorchTitan line (0.2: TOML configs; 0.3: titan_recover.recipes): ``job`` spells a job as it does."""


FLAGS = {
    "0.2": {"dump_folder": "--job.dump_folder", "dataset": "--training.dataset", "dataset_path": "--training.dataset_path",
            "assets": "--model.hf_assets_path", "profiler": "--profiling"},
    "0.3": {"dump_folder": "--dump_folder", "dataset": "--dataloader.dataset", "dataset_path": "--dataloader.dataset_path",
            "assets": "--hf_assets_path", "profiler": "--profiler"},
}[LINE]
"""The settings that moved between lines, as the installed line spells them (``profiler``: the section)."""


def config_args(name: str) -> list[str]:
    """The shipped config ``name``: ``train_configs/<name>.toml`` on 0.2, the recipe ``name`` on 0.3."""
    if LINE == "0.2":
        return ["--job.config_file", str(ROOT / "train_configs" / f"{name}.toml")]
    return ["--module", "titan_recover.recipes", "--config", name]


def job(dump: str | Path, tiny: bool = False, config: str = "llama3_debug_cpu") -> list[str]:
    """The launcher's arguments for the shipped ``config`` (with ``tiny``, its tests' tiny size) writing
    to ``dump``, as the installed TorchTitan line spells them."""
    if LINE == "0.2":
        return [*config_args(config), FLAGS["dump_folder"], str(dump), *(TINY if tiny else [])]
    recipe = "llama3_tiny_cpu" if tiny and config == "llama3_debug_cpu" else config  # 0.3's tiny llama3 is a recipe
    return [*config_args(recipe), FLAGS["dump_folder"], str(dump), *(TINY_SIZES if tiny else [])]


def launch(args: list[str], what: str, config: str = "llama3_debug_cpu") -> tuple[list[dict], float]:
    """Runs ``titan_recover.launch`` with the shipped ``config`` plus ``args`` in a fresh dump
    folder; returns its events and the wall time of the whole command. A failed run
    raises with the tail of its output."""
    with tempfile.TemporaryDirectory() as dump:
        cmd = [sys.executable, "-m", "titan_recover.launch", *job(dump, config=config), *args]
        start = time.monotonic()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        wall = time.monotonic() - start
        if proc.returncode != 0:
            raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
        return list(read_events(str(Path(dump) / "recover_events.jsonl"))), wall


def of(events: list[dict], kind: str) -> list[dict]:
    return [e for e in events if e["event"] == kind]


def step_gaps(steps: list[dict]) -> dict[int, float]:
    """Step number -> seconds since the previous step's event, for consecutive steps only."""
    return {b["step"]: b["time"] - a["time"] for a, b in zip(steps, steps[1:]) if b["step"] == a["step"] + 1}


def write_result(name: str, result: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path
