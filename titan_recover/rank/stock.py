"""Stock TorchTitan HSDP (``[recover] enable = false``): the baseline titan_recover is measured against.

TorchTitan's own ``train_step``, untouched, plus two things: the step event both modes
log (one small all-reduce of the step tally), and the fault plan's forward/backward
faults, which checkpoint-and-restart baselines use.
"""

import os
from typing import Iterator

import torch
import torch.distributed as dist

from titan_recover import titan
from titan_recover.config import group_coordinates, validate
from titan_recover.data import addressing
from titan_recover.policy import steps
from titan_recover.rank.trainer import BaseTrainer

Batch = tuple[dict[str, torch.Tensor], torch.Tensor]


class StockTrainer(BaseTrainer):
    def __init__(self, job_config: titan.JobConfig) -> None:
        replica, group_rank = group_coordinates(int(os.environ["RANK"]), job_config.parallelism)
        super().__init__(job_config, validate(job_config), replica, group_rank)
        # this step's microbatches in the order TorchTitan computes them: (id, data digest, label tokens)
        self._pieces: list[tuple[int, int, int]] = []
        self._computed = 0  # of them
        self._tally = steps.new_tally(self.num_microbatches)

    def train_step(self, data_iterator: Iterator[Batch]) -> None:
        self._pieces, self._computed, self._tally = [], 0, steps.new_tally(self.num_microbatches)
        ids = iter(self.dataloader.failure_free_ids)

        def tallied() -> Iterator[Batch]:
            for input_dict, labels in data_iterator:  # digests of the CPU copies, before TorchTitan moves them
                self._pieces.append(
                    (
                        next(ids),
                        addressing.piece_digest(input_dict["input"], labels),
                        int((labels != titan.IGNORE_INDEX).sum()),
                    )
                )
                yield input_dict, labels

        super().train_step(tallied())
        tally = self._tally.to(self.device)  # on GPUs the world's group is NCCL
        dist.all_reduce(tally)
        summary = steps.summarize(tally, self.parallel_dims.dp_shard, int(self.global_tokens))
        if dist.get_rank() == 0:
            members = list(range(self.parallel_dims.dp_replicate))
            self.events.step(self._step_record(summary, 0, members, None).to_json())

    def forward_backward_step(
        self, *, input_dict: dict[str, torch.Tensor], labels: torch.Tensor, global_valid_tokens: torch.Tensor
    ) -> torch.Tensor:
        """TorchTitan's, with this microbatch's faults armed and its loss tallied."""
        index, self._computed = self._computed, self._computed + 1
        with self.injector.microbatch(self.model_parts[0], self.step, index, self.gradient_accumulation_steps):
            loss = super().forward_backward_step(
                input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens
            )
        if self.reports_data:
            steps.tally_microbatch(self._tally, *self._pieces[index], loss.detach())
        return loss
