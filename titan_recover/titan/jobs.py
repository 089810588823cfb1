"""How the installed TorchTitan line spells a shipped job on the launcher's command line: the
self-test's runs, the tests' and the benchmarks' all start from here.

Reads the installed line from the package metadata, not by importing TorchTitan (seconds)."""

from importlib import metadata
from pathlib import Path

TRAIN_CONFIGS = Path(__file__).resolve().parents[2] / "train_configs"
"""The shipped TOML configs (TorchTitan 0.2), beside the package in a checkout."""

LINE = ".".join(metadata.version("torchtitan").split(".")[:2])
"""The installed TorchTitan line (0.2: TOML configs; 0.3: titan_recover.recipes)."""

FLAGS = {
    "0.2": {
        "dump_folder": "--job.dump_folder",
        "dataset": "--training.dataset",
        "dataset_path": "--training.dataset_path",
        "assets": "--model.hf_assets_path",
        "profiler": "--profiling",
    },
    "0.3": {
        "dump_folder": "--dump_folder",
        "dataset": "--dataloader.dataset",
        "dataset_path": "--dataloader.dataset_path",
        "assets": "--hf_assets_path",
        "profiler": "--profiler",
    },
}[LINE]
"""The settings that moved between lines, as the installed line spells them (``profiler``: the section)."""

# CPU runs are float32 (bfloat16 is emulated on CPUs without AVX-512-BF16/AMX, ~13x slower)
PRECISION = ["--training.mixed_precision_param", "float32"]
# the tests' job, small enough for many multi-process runs on a 2-core CI machine (TorchTitan 0.2 spelling)
TINY_SIZES = [
    "--training.seq_len",
    "64",
    "--training.steps",
    "6",
    "--lr_scheduler.warmup_steps",
    "2",
    "--metrics.log_freq",
    "1",
    "--recover.warm",  # each run starts no second set of ranks; tests of warm incarnations turn them on
    "off",
]
TINY = ["--model.flavor", "tiny", *TINY_SIZES]


def config_args(name: str) -> list[str]:
    """The shipped config ``name``: ``train_configs/<name>.toml`` on 0.2, the recipe ``name`` on 0.3."""
    if LINE == "0.2":
        path = TRAIN_CONFIGS / f"{name}.toml"
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: run from a checkout of titan_recover (its train_configs/)")
        return ["--job.config_file", str(path)]
    return ["--module", "titan_recover.recipes", "--config", name]


def job(dump: str | Path, tiny: bool = False, config: str = "llama3_debug_cpu") -> list[str]:
    """The launcher's arguments for the shipped ``config`` (with ``tiny``, its tests' tiny size) writing
    to ``dump``, as the installed TorchTitan line spells them."""
    if LINE == "0.2":
        return [*config_args(config), FLAGS["dump_folder"], str(dump), *(TINY if tiny else [])]
    recipe = "llama3_tiny_cpu" if tiny and config == "llama3_debug_cpu" else config  # 0.3's tiny llama3 is a recipe
    return [*config_args(recipe), FLAGS["dump_folder"], str(dump), *(TINY_SIZES if tiny else [])]
