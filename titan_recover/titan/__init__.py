"""Every contact with TorchTitan, behind one interface.

The rest of titan_recover takes TorchTitan's names from here and never imports
``torchtitan`` itself; each TorchTitan line is one module beside this one (``v0_2``:
TorchTitan 0.2.x, configured by TOML), and this one picks the installed line's.
Importing it imports TorchTitan (seconds), so light modules import it inside functions.

The interface:
    Trainer, JobConfig, BaseDataLoader, Tokenizer, IGNORE_INDEX  TorchTitan's own
    run(trainer_factory)          the line's entry point, building the job's trainer
    load_config(argv)             the job config from the command line, ``[recover]`` checked (ConfigError)
    check_model(job_config)       the job's model exists (ConfigError naming the key otherwise)
    clip_grad_norm(trainer)       the step's gradient clipping, over the trainer's model parts
    guard_checkpointer(trainer, saves, loads)
                                  the trainer's checkpointer, saving only while ``saves()``
    FAMILIES, register_model(family, build_dataloader, flavors)
                                  ``<family>_recover``: the family's model with titan_recover's data
    model_flavors(name)           the flavors (model args) of a registered model
    text_datasets()               TorchTitan's named text datasets
"""

from importlib import metadata

SUPPORTED = ("0.2",)
"""The TorchTitan lines (major.minor) this package has a module for."""


def installed_line() -> str:
    """The installed TorchTitan's line; ImportError naming what to install when no module serves it."""
    try:
        version = metadata.version("torchtitan")
    except metadata.PackageNotFoundError:
        raise ImportError("TorchTitan is not installed: run ./run_train.sh, which makes the environment") from None
    line = ".".join(version.split(".")[:2])
    if line not in SUPPORTED:
        raise ImportError(f"TorchTitan {version} is installed; titan_recover supports TorchTitan "
                          f"{', '.join(s + '.x' for s in SUPPORTED)} (pip install torchtitan==0.2.2)")
    return line


LINE = installed_line()

from titan_recover.titan.v0_2 import (  # noqa: E402  the line's module, once the line is known
    FAMILIES,
    IGNORE_INDEX,
    BaseDataLoader,
    JobConfig,
    Tokenizer,
    Trainer,
    check_model,
    clip_grad_norm,
    guard_checkpointer,
    load_config,
    model_flavors,
    register_model,
    run,
    text_datasets,
)

__all__ = [
    "FAMILIES", "IGNORE_INDEX", "LINE", "BaseDataLoader", "JobConfig", "Tokenizer", "Trainer", "check_model",
    "clip_grad_norm", "guard_checkpointer", "load_config", "model_flavors", "register_model", "run", "text_datasets",
]
