"""What TorchTitan 0.2 and 0.3 share, for both lines' modules: importing this binds TorchTitan's
device type (inside ``cpu_shim.cpu_device()``: TorchTitan binds it at import) before anything else
of TorchTitan is imported."""

# the import order matters here (see the module docstring): not sorted
# isort: skip_file
import dataclasses
import logging
import sys
from typing import Any, Callable

import torch

from titan_recover.titan import cpu_shim
from titan_recover.config import ConfigError, validate

if (
    "torchtitan.tools.utils" in sys.modules
    and cpu_shim.needed()
    and sys.modules["torchtitan.tools.utils"].device_type != "cpu"
):
    raise RuntimeError(
        "torchtitan was imported before titan_recover on a machine without an accelerator, so it "
        "bound CUDA; import titan_recover.titan.common (or use a name of titan_recover.titan, e.g. its Trainer) "
        "before torchtitan"
    )

with cpu_shim.cpu_device():
    import torchtitan.tools.utils  # noqa: F401  binds the device type for every torchtitan module

from torchtitan.components.metrics import BaseLogger, LoggerContainer, TensorBoardLogger  # noqa: E402
from torchtitan.config import ConfigManager  # noqa: E402
from torchtitan.distributed import utils as dist_utils  # noqa: E402
from torchtitan.hf_datasets.text_datasets import DATASETS  # noqa: E402

log = logging.getLogger(__name__)


def load_config(argv: list[str], no_section: str) -> Any:
    """The job config from ``argv`` with ``recover`` checked (``config.validate``); ``ConfigError``
    names the bad key, and says ``no_section`` (the line's fix) when the config has no such section."""
    try:
        job_config = ConfigManager().parse_args(argv)
    except SystemExit:
        raise
    except (ValueError, ImportError) as e:  # an unknown field, bad TOML, an unknown config function or module
        raise ConfigError(str(e)) from e
    if not hasattr(job_config, "recover"):
        raise ConfigError(f"the job config has no recover section: {no_section}")
    validate(job_config)
    return job_config


def clip_grad_norm(trainer: Any) -> torch.Tensor:
    """The gradient norm over the trainer's model parts, clipped at ``training.max_norm``."""
    return dist_utils.clip_grad_norm_(
        [p for m in trainer.model_parts for p in m.parameters()],
        trainer.job_config.training.max_norm,
        foreach=True,
        pp_mesh=trainer.parallel_dims.get_optional_mesh("pp"),
        ep_enabled=trainer.parallel_dims.ep_enabled,
    )


def comm_setting(job_config: Any, key: str) -> tuple[float, float] | None:
    """TorchTitan's ``comm.<key>`` and its default, from the config dataclass's field (0.3's is slotted: no
    class attribute holds it); None where the job has no such key."""
    comm: Any = getattr(job_config, "comm", None)
    default = (
        next((f.default for f in dataclasses.fields(comm) if f.name == key), None)
        if dataclasses.is_dataclass(comm)
        else None
    )
    if not isinstance(default, (int, float)):
        return None
    return float(getattr(comm, key)), float(default)


def text_datasets() -> dict[str, Any]:
    """TorchTitan's text datasets by name (each a ``DatasetConfig``: path, loader, text processor)."""
    return DATASETS


class FlushingTensorBoard(TensorBoardLogger):
    """TorchTitan's TensorBoard logger, written out at every log step: a replica group can be
    SIGKILLed at any moment, and what its incarnation logged must be on disk by then."""

    def log(self, metrics: dict[str, Any], step: int) -> None:
        super().log(metrics, step)
        self.writer.flush()


def metric_logger(metrics: Any, log_dir: str, logs_here: bool, wandb: Callable[[str], BaseLogger]) -> BaseLogger:
    """TorchTitan's TensorBoard and W&B loggers as ``metrics`` (the job's metrics section) asks,
    writing to ``log_dir``, on the rank that logs (``logs_here``); ``wandb`` makes the line's W&B logger."""
    loggers = LoggerContainer()
    if not (logs_here or metrics.save_for_all_ranks):
        return loggers
    if metrics.enable_wandb:
        try:
            loggers.add_logger(wandb(log_dir))
        except Exception as e:  # as TorchTitan's own builder: the run goes on without W&B, saying why
            log.error(
                f"no W&B logging: {type(e).__name__}: {e} (log in with `wandb login`, set WANDB_API_KEY, "
                "or WANDB_MODE=offline to write the run to disk)"
            )
    if metrics.enable_tensorboard:
        loggers.add_logger(FlushingTensorBoard(log_dir))
    return loggers
