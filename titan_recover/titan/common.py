"""What TorchTitan 0.2 and 0.3 share, for both lines' modules: importing this binds TorchTitan's
device type (inside ``cpu_shim.cpu_device()``: TorchTitan binds it at import) before anything else
of TorchTitan is imported."""

# the import order matters here (see the module docstring): not sorted
# isort: skip_file
import dataclasses
import functools
import logging
import os
import re
import shutil
import sys
import threading
import time
from collections import deque
from typing import Any, Callable, TypeVar

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

from torch.utils.tensorboard import SummaryWriter  # noqa: E402
from torchtitan.components.metrics import BaseLogger, LoggerContainer, TensorBoardLogger  # noqa: E402
from torchtitan.config import ConfigManager  # noqa: E402
from torchtitan.distributed import utils as dist_utils  # noqa: E402
from torchtitan.hf_datasets.text_datasets import DATASETS  # noqa: E402

log = logging.getLogger(__name__)
T = TypeVar("T")
TB_PENDING = 10_000  # log steps TensorBoard's logger keeps while its folder cannot take them
REPORT_EVERY_S = 30.0  # ...and how often it says so (as the event log does)
TB_RETRY_S = 10.0  # ...and how often it tries a new event file meanwhile (each try is a file and a thread)


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


WRITER_FAILED = ("unexpected pos", "file write failed")
"""How torch.save's zip writer (``caffe2/serialize/inline_container.cc``) says the disk did not take a write:
a ``RuntimeError``, not an ``OSError`` (a full tmpfs gave ``unexpected pos 704 vs 598``)."""


def disk_failure(e: BaseException) -> bool:
    """Whether ``e`` is the disk refusing a write: an ``OSError``, or torch.save's writer saying so."""
    return isinstance(e, OSError) or (isinstance(e, RuntimeError) and any(m in str(e) for m in WRITER_FAILED))


CHECKPOINT = re.compile(r"step-(\d+)")


def newest_checkpoint(folder: str) -> int | None:
    """The step of the newest complete DCP checkpoint in ``folder``: a ``step-N`` folder with its ``.metadata``,
    as TorchTitan's own resume picks it. None if there is none (or no such folder)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return None
    found = [m for m in map(CHECKPOINT.fullmatch, names) if m]
    return max(
        (int(m.group(1)) for m in found if os.path.isfile(os.path.join(folder, m.group(0), ".metadata"))), default=None
    )


def save_or_report(save: Callable[[], T], step: int, checkpointer: Any, failed: Callable[[int, str], None]) -> T | None:
    """A DCP save that the disk does not take (full, failing, read-only, removed: ``disk_failure``) is
    reported through ``failed`` and left for the next interval; TorchTitan would stop the run, though none
    of the training state is lost with the checkpoint (the live replica groups hold it). The step's folder,
    left without its ``.metadata``, is removed to give the space back (a resume skips such a folder
    anyway). Other errors stop the run as before."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        return save()
    except (OSError, RuntimeError, CheckpointException) as e:
        failures = getattr(e, "failures", None) or {}  # DCP's: each rank's (exception, traceback)
        cause = next((failure[0] for failure in failures.values()), e)
        if not disk_failure(cause):
            raise
        why = f"{type(cause).__name__}: {cause}".splitlines()[0][:500]
    folder = getattr(checkpointer, "folder", "")  # TorchTitan's CheckpointManager (0.2 sets it only when enabled)
    partial = os.path.join(folder, f"step-{step}")
    if not os.path.exists(os.path.join(partial, ".metadata")) and int(os.environ.get("RANK", "0")) == 0:
        shutil.rmtree(partial, ignore_errors=True)
    log.error(
        f"the checkpoint of step {step} could not be written in {folder} ({why}): the training goes on, "
        "and the next checkpoint interval tries again"
    )
    failed(step, why)
    return None


def save_whole(manager: Any, save: Callable[[], Any], step: int) -> None:
    """A DCP save of the whole state at ``step`` by ``save`` (the guarded save of ``manager``, TorchTitan's
    CheckpointManager) whatever the interval, waited for: the run stops in order there and the same command
    resumes from it. TorchTitan's own last-step save keeps the model only by default
    (``last_save_model_only``): a resume from it would lose the optimizer. Nothing when checkpoints are off,
    or when the interval's save of ``step`` was just made."""
    if not manager.enable or step % manager.interval == 0:
        return
    interval, manager.interval = manager.interval, 1
    try:
        save()
    finally:
        manager.interval = interval
    if manager.save_future is not None:  # an async save: the process exits after this
        manager.save_future.result()


def surviving_profiler(build: Callable[[], T | None], what: str, write: str) -> T | None:
    """One of TorchTitan's profilers (``build``), whose ``write`` method (its torch profiler's
    ``on_trace_ready``, its memory profiler's ``step``) runs inside the training step: an ``OSError`` there
    (the folder full, read-only, failing, removed) is said on the rank's log, that trace lost and the next one
    tried, where TorchTitan would stop the rank. Traces are not kept in memory to write later (one is tens
    of MiB to GiBs). A profiler that cannot make its folder at all is left out (None) for this incarnation.
    A full disk under a torch trace raises nothing: Kineto logs ``Failed to write to log file!`` itself."""
    try:
        profiler = build()
    except OSError as e:
        _trace_lost(what, e, "no more of them from this incarnation")
        return None
    if profiler is not None:
        method = getattr(profiler, write)

        @functools.wraps(method)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            try:
                return method(*args, **kwargs)
            except OSError as e:
                _trace_lost(what, e, "the next one is tried")
                return None

        setattr(profiler, write, guarded)
    return profiler


def _trace_lost(what: str, error: OSError, then: str) -> None:
    log.warning(f"cannot write {what} ({type(error).__name__}: {error}): lost, {then}; the training goes on")


def text_datasets() -> dict[str, Any]:
    """TorchTitan's text datasets by name (each a ``DatasetConfig``: path, loader, text processor)."""
    return DATASETS


class FlushingTensorBoard(TensorBoardLogger):
    """TorchTitan's TensorBoard logger, written out at every log step (a replica group can be SIGKILLed at
    any moment, and what its incarnation logged must be on disk by then), and kept going through a dump
    folder that cannot take it (full, failing, read-only, removed): the log steps it could not write wait, up
    to ``TB_PENDING`` (the oldest dropped past it), and go into a new event file once they can (tried every
    ``TB_RETRY_S``). A step written just as the disk filled may then be in both files."""

    def __init__(self, log_dir: str) -> None:  # TorchTitan's makes its writer at once, which may fail here
        self.tag = None
        self.log_dir = log_dir
        self.writer: Any = None
        self.pending: deque[tuple[dict[str, Any], int]] = deque(maxlen=TB_PENDING)
        self._reported = 0.0
        self._retry_at = 0.0
        _quiet_writer_threads()
        self._write()

    def _write(self) -> None:
        if time.monotonic() < self._retry_at:
            return
        try:
            if self.writer is None:
                self.writer = SummaryWriter(self.log_dir, max_queue=1000)
            for metrics, step in self.pending:
                for k, v in metrics.items():
                    self.writer.add_scalar(k, v, step)
            self.writer.flush()
        except Exception as e:  # noqa: BLE001  tensorboard's writer thread re-raises what it met, wrapped or not
            self._drop_writer()
            now = time.monotonic()
            self._retry_at = now + TB_RETRY_S
            if now - self._reported >= REPORT_EVERY_S:
                self._reported = now
                log.warning(
                    f"cannot write TensorBoard's log in {self.log_dir}: {type(e).__name__}: {e}; "
                    f"{len(self.pending)} log steps kept in memory, written once it can be; the training goes on"
                )
            return
        self.pending.clear()

    def _drop_writer(self) -> None:
        writer, self.writer = self.writer, None
        if writer is not None:
            try:
                writer.close()
            except Exception:  # noqa: BLE001  it already failed
                pass

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.pending.append((dict(metrics), step))
        self._write()

    def close(self) -> None:
        """Writes what waits one last time; what still cannot be written is said and left."""
        self._retry_at = 0.0
        if self.pending:
            self._write()
        if self.pending:
            log.error(f"TensorBoard's last {len(self.pending)} log steps are lost: {self.log_dir} cannot take them")
        self._drop_writer()


def _quiet_writer_threads() -> None:
    """TensorBoard's writer thread re-raises the write that failed, and Python prints its traceback at every
    try; ``FlushingTensorBoard`` says it once per ``REPORT_EVERY_S`` instead. Other threads' errors print."""
    default = threading.excepthook
    if getattr(default, "quiets_tensorboard", False):
        return

    def hook(args: Any) -> None:
        if not (isinstance(args.exc_value, OSError) and type(args.thread).__name__ == "_AsyncWriterThread"):
            default(args)

    hook.quiets_tensorboard = True  # type: ignore[attr-defined]
    threading.excepthook = hook


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
