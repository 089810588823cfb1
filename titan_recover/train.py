"""The training entry point: the trainer ``[recover] enable`` asks for, run by torchrun in every rank.

``rank.recover.RecoverTrainer`` (TorchTitan's Trainer with a fault-tolerant replicate dimension) or,
with ``enable = false``, ``rank.stock.StockTrainer`` (stock TorchTitan HSDP); a warm incarnation
(``node.warm``) checks the job and waits imported before it builds one.

    torchrun ... -m titan_recover.train --job.config_file X.toml   (TorchTitan 0.2; the launcher does this)
    torchrun ... -m titan_recover.train --module titan_recover.recipes --config NAME   (0.3)
"""

import gc
import logging
import os

from titan_recover.node import devices, procs

# before the seconds of imports below: a torchrun agent killed meanwhile takes this rank along
if __name__ == "__main__":
    procs.die_with_parent()
    gc.disable()  # the imports below make millions of objects that live all run: collecting them costs ~15% of them
    os.environ.update(devices.rank_env(os.environ))  # before CUDA or NCCL start: a rank-per-host rank's GPU and host id

from titan_recover import titan
from titan_recover.config import validate
from titan_recover.control.keys import EXIT_FAILED
from titan_recover.node import warm
from titan_recover.observability import logs
from titan_recover.rank.manager import ReplicaFenced
from titan_recover.rank.recover import RecoverTrainer
from titan_recover.rank.stock import StockTrainer

log = logging.getLogger(__name__)


def trainer(job_config: titan.JobConfig) -> titan.Trainer:
    """The trainer ``[recover] enable`` asks for: titan_recover's, or stock TorchTitan HSDP's."""
    return (RecoverTrainer if job_config.recover.enable else StockTrainer)(job_config)


def checked(job_config: titan.JobConfig) -> None:
    """What a warm rank does before it waits (``node.warm``): the job's checks, which import the model's modules."""
    validate(job_config)
    titan.check_model(job_config)


def main() -> None:
    """Runs the trainer. A rank that finds its group fenced out (its launcher, told too, restarts the group to
    rejoin; it may kill this rank first) ends with one line: nothing in it failed that a traceback would show."""
    try:
        titan.run(warm.stand_by(trainer, checked))
    except ReplicaFenced as e:
        log.error("%s: this rank ends, and its launcher restarts the group to rejoin", e)
        raise SystemExit(EXIT_FAILED) from None


if __name__ == "__main__":
    logs.setup("rank")
    gc.freeze()  # what the imports made is never collected, and later collections skip it
    gc.enable()
    procs.dumps_stacks()
    procs.leave(main)
