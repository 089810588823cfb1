"""TorchTitan's Trainer plus what both modes log, so their trajectories can be compared.

Stock HSDP (``stock.StockTrainer``) and titan_recover (``recover.RecoverTrainer``) each log
one ``step`` event per committed step with the same fields (microbatch ids, data digest,
loss, ...), fire the fault plan's faults at the same points and end with a ``rank_memory``
event. ``group_rank`` is a rank's index inside its replica group, ``replica`` the group.
"""

import resource
import time
from typing import Any, Callable

import torch

from titan_recover import titan
from titan_recover.config import Recover, num_microbatches, reports_data
from titan_recover.control.keys import incarnation
from titan_recover.control.protocol import FaultRecord, StepRecord
from titan_recover.data.dataloader import AddressableDataLoader, build_addressable_dataloader
from titan_recover.observability.events import EventLog
from titan_recover.policy import steps
from titan_recover.policy.fault_plan import Fault
from titan_recover.rank.injector import FaultInjector


class BaseTrainer(titan.Trainer):
    step: int  # TorchTitan's Trainer keeps it: the step in progress (0 before the first)

    def __init__(self, job_config: titan.JobConfig, rc: Recover, replica: int, group_rank: int) -> None:
        self.rc = rc
        self.events = EventLog(titan.dump_folder(job_config))
        self.incarnation = incarnation()
        self.replica, self.group_rank = replica, group_rank
        self.reports_data = reports_data(group_rank, job_config.parallelism)
        self.ft_buffer_bytes = 0  # the replicate all-reduce's one extra gradient copy (none in stock mode)
        super().__init__(job_config)
        self.num_microbatches = num_microbatches(job_config)
        self.injector = FaultInjector(
            rc.fault_plan, replica, group_rank, self._on_fault, self.incarnation, self._epoch_view()
        )
        self.global_tokens = float(self.dataloader.valid_tokens_per_step())
        # a device tensor, as TorchTitan's loss takes it: a CUDA graph replays with it as an input
        self.valid_tokens = torch.tensor(self.global_tokens, device=self.device)

    def build_dataloader(
        self, job_config: titan.JobConfig, *, dp_world_size: int, dp_rank: int, tokenizer: Any, **_: Any
    ) -> AddressableDataLoader:
        """The trainer's data (TorchTitan 0.3 asks the trainer; 0.2 the model's TrainSpec, ``train_spec``)."""
        return build_addressable_dataloader(dp_world_size, dp_rank, tokenizer, job_config)

    def _epoch_view(self) -> Callable[[], int] | None:
        """What a ``sleep ... until=epoch`` fault watches (stock mode has no epochs)."""
        return None

    def _fault_record(self, fault: Fault) -> FaultRecord:
        return FaultRecord(self.replica, self.group_rank, self.incarnation, self.step, fault.phase)

    def _on_fault(self, fault: Fault) -> None:
        self.events.emit(
            "fault_injected",
            action=fault.action,
            **{k: v for k, v in self._fault_record(fault).to_json().items() if k != "time"},
        )

    def _step_record(
        self,
        summary: steps.StepSummary,
        epoch: int,
        members: list[int],
        grad_norm: float | None,
        commit_round_s: float | None = None,
    ) -> StepRecord:
        """What the event log says about a committed step (the same in both modes)."""
        return StepRecord(
            step=self.step,
            epoch=epoch,
            members=members,
            microbatches=list(summary.microbatches),
            data_digest=summary.data_digest,
            loss=summary.loss,
            grad_norm=grad_norm,
            time=time.time(),
            data_epochs=self.dataloader.epochs_started(self.step),
            quotas={str(r): n for r, n in summary.quotas.items()},
            seconds_per_microbatch={str(r): t for r, t in summary.seconds_per_microbatch.items()},
            samples=self.dataloader.windows,
            commit_round_s=commit_round_s,
        )

    def train(self) -> None:
        super().train()
        self.events.emit(
            "rank_memory",
            replica=self.replica,
            rank=self.group_rank,
            max_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            ft_buffer_mb=self.ft_buffer_bytes / 2**20,
            ntokens_seen=self.ntokens_seen,
        )
