"""The fault-aware dataloader: microbatches addressable by (step, microbatch id, shard).

Any replica can compute any microbatch and gets identical tokens, so a lost
microbatch can be reissued to a survivor. Stock TorchTitan (``[recover] enable =
false``) iterates the same addresses in failure-free order through torchdata's
``StatefulDataLoader``, so both modes consume the same samples per step.
"""

import os
from typing import Any, Iterator

import torch
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchtitan.components.dataloader import BaseDataLoader

from titan_recover import data, workload
from titan_recover.config import num_microbatches

SYNTHETIC = "synthetic"
SYNTHETIC_TOKENS = 2_000_000
DEFAULT_DATA_DIR = "data"


class _FailureFreeOrder(Dataset):
    """Item p is this dp rank's p-th microbatch of a failure-free run."""

    def __init__(self, loader: "AddressableDataLoader", ids: tuple[int, ...]) -> None:
        self.loader, self.ids = loader, ids

    def __len__(self) -> int:
        return 2**62  # endless: TorchTitan stops at training.steps

    def __getitem__(self, p: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        step, slot = divmod(p, len(self.ids))
        inputs, labels = self.loader.load(step + 1, self.ids[slot])
        return {"input": inputs}, labels


class AddressableDataLoader(BaseDataLoader):
    def __init__(
        self,
        token_file: data.TokenFile,
        *,
        num_microbatches: int,
        shards: int,
        shard: int,
        local_batch: int,
        seq_len: int,
        failure_free_ids: tuple[int, ...],
    ) -> None:
        self.token_file = token_file
        self.num_microbatches = num_microbatches
        self.shards = shards
        self.shard = shard
        self.local_batch = local_batch
        self.seq_len = seq_len
        self.failure_free_ids = failure_free_ids
        self._loader = StatefulDataLoader(
            _FailureFreeOrder(self, failure_free_ids), batch_size=None, shuffle=False
        )

    def load(self, step: int, microbatch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels) of this shard's part of microbatch ``microbatch`` of ``step``."""
        return data.load_microbatch(
            self.token_file,
            step,
            microbatch,
            self.shard,
            num_microbatches=self.num_microbatches,
            shards=self.shards,
            local_batch=self.local_batch,
            seq_len=self.seq_len,
        )

    def valid_tokens_per_step(self) -> int:
        """Label tokens of one step over all microbatches and shards: packed windows have no padding."""
        return self.num_microbatches * self.shards * self.local_batch * self.seq_len

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        return iter(self._loader)

    def state_dict(self) -> dict[str, Any]:
        return self._loader.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._loader.load_state_dict(state_dict)


def token_file_for(job_config: Any) -> str:
    """Prepares (once, idempotently) and returns the token file the job reads."""
    tr = job_config.training
    if tr.dataset == SYNTHETIC:
        path = tr.dataset_path or os.path.join(DEFAULT_DATA_DIR, "synthetic_tokens.bin")
        return data.prepare_token_file(path, SYNTHETIC_TOKENS, job_config.model.hf_assets_path)
    path = os.path.join(DEFAULT_DATA_DIR, f"{tr.dataset}_tokens.bin")
    return data.prepare_from_hf(tr.dataset, tr.dataset_path, path, SYNTHETIC_TOKENS, job_config.model.hf_assets_path)


def build_addressable_dataloader(
    dp_world_size: int, dp_rank: int, tokenizer: object, job_config: Any
) -> AddressableDataLoader:
    """TrainSpec ``build_dataloader_fn``: rank ``dp_rank`` of ``dp_world_size`` data-parallel ranks
    (replica-major, as TorchTitan's batch mesh orders them)."""
    shards = job_config.parallelism.data_parallel_shard_degree
    replicas = dp_world_size // shards
    replica, shard = divmod(dp_rank, shards)
    m = num_microbatches(job_config)
    ids = workload.assign(job_config.recover.policy, range(replicas), m)[replica]
    return AddressableDataLoader(
        data.TokenFile(token_file_for(job_config)),
        num_microbatches=m,
        shards=shards,
        shard=shard,
        local_batch=job_config.training.local_batch_size,
        seq_len=job_config.training.seq_len,
        failure_free_ids=ids,
    )
