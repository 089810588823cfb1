"""The fault-aware dataloader: microbatches addressable by (step, microbatch id, shard).

Any replica can compute any microbatch and gets identical tokens, so a lost
microbatch can be reissued to a survivor. Stock TorchTitan (``[recover] enable =
false``) iterates the same addresses in failure-free order through torchdata's
``StatefulDataLoader``, so both modes consume the same samples per step.

Each rank opens the job's dataset folder with ``addressing.open_dataset`` (checked against the
job's tokenizer and model; a violation is a ``DataError`` naming the file).
"""

from typing import Any, Iterator

import torch
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from titan_recover import titan
from titan_recover.config import num_microbatches
from titan_recover.data import addressing, order
from titan_recover.data.addressing import model_vocab_size, open_dataset
from titan_recover.data.tokens import TokenDataset
from titan_recover.policy import workload


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


class AddressableDataLoader(titan.BaseDataLoader):
    def __init__(
        self,
        dataset: TokenDataset,
        *,
        num_microbatches: int,
        shards: int,
        shard: int,
        local_batch: int,
        seq_len: int,
        seed: int,
        vocab_size: int,
        failure_free_ids: tuple[int, ...],
    ) -> None:
        self.dataset = dataset
        self.num_microbatches = num_microbatches
        self.shards = shards
        self.shard = shard
        self.local_batch = local_batch
        self.seq_len = seq_len
        self.seed = seed
        self.vocab_size = vocab_size
        self.windows = dataset.num_windows(seq_len)
        self.failure_free_ids = failure_free_ids
        self._loader = StatefulDataLoader(_FailureFreeOrder(self, failure_free_ids), batch_size=None, shuffle=False)

    def load(self, step: int, microbatch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels) of this shard's part of microbatch ``microbatch`` of ``step``."""
        samples = addressing.sample_indices(
            step,
            microbatch,
            self.shard,
            num_microbatches=self.num_microbatches,
            shards=self.shards,
            local_batch=self.local_batch,
        )
        return addressing.load_samples(
            self.dataset, samples, seq_len=self.seq_len, seed=self.seed, vocab_size=self.vocab_size
        )

    def samples_per_step(self) -> int:
        return self.num_microbatches * self.shards * self.local_batch

    def epochs_started(self, step: int) -> list[int]:
        """Data epochs whose first sample is read in ``step`` (the corpus ran out and starts over)."""
        return order.epochs_started((step - 1) * self.samples_per_step(), self.samples_per_step(), self.windows)

    def valid_tokens_per_step(self) -> int:
        """Label tokens of one step over all microbatches and shards: packed windows have no padding."""
        return self.samples_per_step() * self.seq_len

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        return iter(self._loader)

    def state_dict(self) -> dict[str, Any]:
        return self._loader.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._loader.load_state_dict(state_dict)


def build_addressable_dataloader(
    dp_world_size: int, dp_rank: int, tokenizer: Any, job_config: Any
) -> AddressableDataLoader:
    """TrainSpec ``build_dataloader_fn``: rank ``dp_rank`` of ``dp_world_size`` data-parallel ranks
    (replica-major, as TorchTitan's batch mesh orders them)."""
    shards = job_config.parallelism.data_parallel_shard_degree
    replicas = dp_world_size // shards
    replica, shard = divmod(dp_rank, shards)
    m = num_microbatches(job_config)
    ids = workload.assign(job_config.recover.policy, range(replicas), m)[replica]
    return AddressableDataLoader(
        open_dataset(job_config, tokenizer.get_vocab_size()),
        num_microbatches=m,
        shards=shards,
        shard=shard,
        local_batch=job_config.training.local_batch_size,
        seq_len=job_config.training.seq_len,
        seed=job_config.recover.data_seed,
        vocab_size=model_vocab_size(job_config),
        failure_free_ids=ids,
    )
