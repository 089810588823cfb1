"""TorchTitan's fault-tolerance trainer (``FTTrainer``, torchft) on CPU, instrumented for ``bench/fidelity.py``.

One torchrun job per replica group, with a torchft Lighthouse running::

    TORCHFT_LIGHTHOUSE=http://127.0.0.1:PORT python -m torch.distributed.run --standalone \\
        --nproc_per_node 1 bench/torchft_train.py --job.config_file train_configs/llama3_debug_cpu.toml \\
        --model.name llama3_recover_torchft --parallelism.data_parallel_replicate_degree 1 \\
        --fault_tolerance.enable --fault_tolerance.replica_id 1 --fault_tolerance.group_size 2 \\
        --fault_tolerance.process_group gloo --recover.fault_plan "kill replica=1 rank=0 step=8 phase=backward"

torchft's algorithm is left as it is (quorum, managed gloo process group, should_commit).
This module only:

- points TorchTitan at the CPU (``titan_recover.titan.common``, the adapter's, imported before torchtitan);
- registers ``llama3_recover_torchft``: ``llama3_recover`` (llama3 + titan_recover's
  addressable data) with FSDP applied even to a one-rank group, because TorchTitan hands
  gradients to torchft through FSDP's all-reduce hook (on a one-rank mesh FSDP only copies);
- logs one ``ft_step`` event per rank and step to ``{dump_folder}/recover_events.jsonl``:
  loss (sum of this rank's microbatch losses), whether torchft committed the step, the
  number of participating replica groups, the microbatch ids and token digests it read;
- fires ``[recover] fault_plan`` with titan_recover's own ``FaultInjector``, so the SIGKILL
  lands at the same point as in titan_recover (inside the middle transformer block);
- holds every group before its first step until all groups' torchft managers are up, so
  the first quorum has every group (else the first to start trains alone for a while).
"""

# the import order matters here (see the module docstring): not sorted
# isort: skip_file
import dataclasses
import os
import time
from pathlib import Path
from typing import Any, Iterator

from titan_recover.titan import common, cpu_shim  # noqa: F401  the adapter's common binds TorchTitan's device type first

import torch
from torch.distributed.device_mesh import init_device_mesh
from torchtitan.config import TORCH_DTYPE_MAP, JobConfig
from torchtitan.experiments.ft.train import FTTrainer
from torchtitan.models.llama3.infra.parallelize import apply_fsdp
from torchtitan.protocols.train_spec import get_train_spec, register_train_spec
from torchtitan.tools.utils import device_type
from torchtitan.train import main

import titan_recover.train_spec  # noqa: F401  registers llama3_recover
from titan_recover.data import addressing
from titan_recover.observability.events import EventLog
from titan_recover.policy.fault_plan import Fault
from titan_recover.rank.injector import FaultInjector

SPEC = "llama3_recover_torchft"
STARTUP_TIMEOUT_S = 600.0
_BASE = get_train_spec("llama3_recover")


def _parallelize(model: torch.nn.Module, parallel_dims: Any, job_config: Any) -> torch.nn.Module:
    """llama3_recover's parallelize, plus FSDP on a one-rank mesh when the group has one rank."""
    model = _BASE.parallelize_fn(model, parallel_dims, job_config)
    if not parallel_dims.fsdp_enabled:
        tr = job_config.training
        apply_fsdp(
            model,
            init_device_mesh(device_type, (1,), mesh_dim_names=("fsdp",)),
            param_dtype=TORCH_DTYPE_MAP[tr.mixed_precision_param],
            reduce_dtype=TORCH_DTYPE_MAP[tr.mixed_precision_reduce],
            pp_enabled=False,
            reshard_after_forward_policy=job_config.parallelism.fsdp_reshard_after_forward,
        )
        cpu_shim.force_sum_reduction(model)
    return model


register_train_spec(SPEC, dataclasses.replace(_BASE, parallelize_fn=_parallelize))


class _Reading:
    """Wraps the data iterator: records the token digest of every microbatch read."""

    def __init__(self, it: Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]], digests: list[str]) -> None:
        self.it, self.digests = it, digests

    def __iter__(self) -> "_Reading":
        return self

    def __next__(self) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        input_dict, labels = next(self.it)
        self.digests.append(f"{addressing.piece_digest(input_dict['input'], labels):010x}")
        return input_dict, labels


class LoggedFTTrainer(FTTrainer):
    """``FTTrainer`` with a per-step event log, fault injection and a start barrier."""

    def __init__(self, job_config: JobConfig) -> None:
        super().__init__(job_config)
        ft = job_config.fault_tolerance
        self.replica, self.rank = ft.replica_id, int(os.environ["RANK"])
        self.bench_log = EventLog(job_config.job.dump_folder)
        self.injector = FaultInjector(job_config.recover.fault_plan, self.replica, self.rank, self._on_fault)
        self._losses: list[float] = []
        self._digests: list[str] = []

    def _on_fault(self, fault: Fault) -> None:
        self.bench_log.emit(
            "fault_injected",
            action=fault.action,
            replica=self.replica,
            rank=self.rank,
            step=self.step,
            phase=fault.phase,
        )

    def _wait_for_groups(self) -> None:
        """Start barrier over files in the dump folder: every rank of every group is built."""
        folder = Path(self.job_config.job.dump_folder)
        (folder / f"torchft_ready_{self.replica}_{self.rank}").touch()
        expected = self.job_config.fault_tolerance.group_size * int(os.environ["WORLD_SIZE"])
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while len(list(folder.glob("torchft_ready_*"))) < expected:
            if time.monotonic() > deadline:
                raise TimeoutError(f"not all {expected} torchft ranks started within {STARTUP_TIMEOUT_S}s")
            time.sleep(0.05)

    def train(self) -> None:
        self._wait_for_groups()
        super().train()

    def forward_backward_step(
        self, *, input_dict: dict[str, torch.Tensor], labels: torch.Tensor, global_valid_tokens: torch.Tensor
    ) -> torch.Tensor:
        index = len(self._losses)
        with self.injector.microbatch(self.model_parts[0], self.step, index, self.gradient_accumulation_steps):
            loss = super().forward_backward_step(
                input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens
            )
        self._losses.append(loss.item())
        return loss

    def train_step(self, data_iterator: Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]) -> None:
        manager = self.ft_manager.manager
        committed_before = manager.current_step()
        self._losses, self._digests = [], []
        super().train_step(_Reading(data_iterator, self._digests))
        self.bench_log.emit(
            "ft_step",
            step=self.step,
            replica=self.replica,
            rank=self.rank,
            committed=manager.current_step() > committed_before,
            participants=manager.num_participants(),
            loss=sum(self._losses),
            microbatches=list(self.dataloader.failure_free_ids),
            shard=self.dataloader.shard,
            digests=self._digests,
        )


if __name__ == "__main__":
    main(LoggedFTTrainer)
