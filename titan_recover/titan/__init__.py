"""Every contact with TorchTitan, behind one interface.

The rest of titan_recover takes TorchTitan's names from here and never imports ``torchtitan``
itself. Each TorchTitan line is one module beside this one, defining every name of ``INTERFACE``
(``v0_2``: TorchTitan 0.2.x, TOML configs; ``v0_3``: 0.3.x, Python configs): this module loads the
installed line's on first use of a name of ``INTERFACE`` (TorchTitan's import takes seconds), so
``titan.cpu_shim`` and ``titan.jobs`` import without it. A new line is one new module.

The interface:
    Trainer, JobConfig, BaseDataLoader, Tokenizer(path), IGNORE_INDEX   TorchTitan's own
    run(trainer_factory)          the line's entry point, building the job's trainer
    load_config(argv)             the job config from the command line, ``[recover]`` checked (ConfigError)
    check_model(job_config)       the job's model exists (ConfigError naming the key otherwise)
    clip_grad_norm(trainer)       the step's gradient clipping, over the trainer's model parts
    guard_checkpointer(trainer, saves, loads, failed)
                                  the trainer's checkpointer saves only while ``saves()``, loads only if ``loads``;
                                  a save the disk does not take is reported to ``failed(step, why)``, not raised;
                                  ``trainer.checkpointer.save_whole(step)`` saves the whole state at ``step``
                                  whatever the interval (the run stops in order there)
    newest_checkpoint(folder)     the step of the newest complete DCP checkpoint in ``folder`` (None: none)
    count_tokens(trainer, labels) a computed microbatch's tokens, in the counters TorchTitan does not keep itself
    expert_counts(trainer)        each MoE layer's tokens-per-expert buffer that the optimizer step's load
                                  balancing turns into its expert bias (none when the model's optimizers do not
                                  balance)
    model_inputs(trainer, inputs, labels)
                                  one microbatch as the trainer's ``forward_backward_step`` takes it
    dump_folder, assets_path, model_name, model_vocab_size, dataset, profiler, config_file (job_config)
                                  where the line keeps those settings
    ASSETS_KEY                    the tokenizer folder's setting, as errors name it
    comm_setting(job_config, key)  a key of TorchTitan's ``[comm]`` section (``train_timeout_seconds``: its own
                                  collectives' timeout once training runs; ``trace_buf_size``: its flight
                                  recorder) and its default (None: no such key)
    metric_logger(job_config, parallel_dims, log_dir)
                                  TorchTitan's TensorBoard/W&B loggers as the job asks, writing to ``log_dir``
    text_datasets()               TorchTitan's named text datasets
"""

import gc
import importlib
from importlib import metadata
from typing import Any

LINES = {"0.2": "v0_2", "0.3": "v0_3"}
"""TorchTitan lines (major.minor) and their modules."""

INTERFACE = (
    "Trainer",
    "JobConfig",
    "BaseDataLoader",
    "Tokenizer",
    "IGNORE_INDEX",
    "run",
    "load_config",
    "check_model",
    "clip_grad_norm",
    "guard_checkpointer",
    "newest_checkpoint",
    "count_tokens",
    "expert_counts",
    "model_inputs",
    "dump_folder",
    "assets_path",
    "model_name",
    "model_vocab_size",
    "dataset",
    "profiler",
    "config_file",
    "text_datasets",
    "ASSETS_KEY",
    "metric_logger",
    "comm_setting",
)


def installed_line() -> str:
    """The installed TorchTitan's line; ImportError naming what to install when no module serves it."""
    try:
        version = metadata.version("torchtitan")
    except metadata.PackageNotFoundError:
        raise ImportError("TorchTitan is not installed: run ./run_train.sh, which makes the environment") from None
    line = ".".join(version.split(".")[:2])
    if line not in LINES:
        raise ImportError(
            f"TorchTitan {version} is installed; titan_recover has modules for TorchTitan "
            f"{', '.join(s + '.x' for s in LINES)} (TORCHTITAN=0.2.2 or 0.3.0 ./run_train.sh makes either)"
        )
    return line


def __getattr__(name: str) -> Any:
    """The installed line's ``name`` (and ``LINE``), its module imported on first use."""
    if name == "LINE":  # from the package's metadata: TorchTitan itself is not imported
        return installed_line()
    if name not in INTERFACE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    line = installed_line()
    collecting = gc.isenabled()
    gc.disable()  # TorchTitan's import makes millions of objects that live all run: collecting them costs ~15% of it
    try:
        module = importlib.import_module(f"{__name__}.{LINES[line]}")
    finally:
        if collecting:
            gc.enable()
    globals().update({"LINE": line, **{n: getattr(module, n) for n in INTERFACE}})
    return globals()[name]


__all__ = ["LINE", *INTERFACE]
