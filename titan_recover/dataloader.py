"""The fault-aware dataloader: microbatches addressable by (step, microbatch id, shard).

Any replica can compute any microbatch and gets identical tokens, so a lost
microbatch can be reissued to a survivor. Stock TorchTitan (``[recover] enable =
false``) iterates the same addresses in failure-free order through torchdata's
``StatefulDataLoader``, so both modes consume the same samples per step.

``training.dataset_path`` is a dataset folder (``titan_recover.tokens``); with
``training.dataset = "synthetic"`` and no folder there yet, the synthetic corpus is
prepared into it on first use. Before anything trains, ``open_dataset`` checks that the
folder's manifest matches the job's tokenizer and model vocabulary and that every shard
has its listed size; a violation is a ``DataError`` naming the file.
"""

import importlib
import os
from typing import Any, Iterator

import torch
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchtitan.components.dataloader import BaseDataLoader

from titan_recover import data, order, prepare, tokens, workload
from titan_recover.config import num_microbatches
from titan_recover.tokens import DataError, TokenDataset

SYNTHETIC = "synthetic"
SYNTHETIC_TOKENS = 2_000_000
SYNTHETIC_SHARDS = 4
DEFAULT_SYNTHETIC_DIR = os.path.join("data", "synthetic")


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
        self._loader = StatefulDataLoader(
            _FailureFreeOrder(self, failure_free_ids), batch_size=None, shuffle=False
        )

    def load(self, step: int, microbatch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels) of this shard's part of microbatch ``microbatch`` of ``step``."""
        samples = data.sample_indices(step, microbatch, self.shard, num_microbatches=self.num_microbatches,
                                      shards=self.shards, local_batch=self.local_batch)
        return data.load_samples(self.dataset, samples, seq_len=self.seq_len, seed=self.seed,
                                 vocab_size=self.vocab_size)

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


def model_vocab_size(job_config: Any) -> int:
    """The embedding rows of the job's model (its TrainSpec's flavor)."""
    from torchtitan.protocols.train_spec import get_train_spec

    model = job_config.model
    args = get_train_spec(model.name).model_args
    if model.flavor not in args:
        raise DataError(f"model.flavor {model.flavor!r} is not a flavor of {model.name} ({sorted(args)})")
    return args[model.flavor].vocab_size


def open_dataset(job_config: Any, tokenizer_vocab: int) -> TokenDataset:
    """The job's dataset folder, checked against its tokenizer and model (synthetic: prepared if absent)."""
    tr, tokenizer_dir = job_config.training, job_config.model.hf_assets_path
    if tr.dataset == SYNTHETIC:
        folder = tr.dataset_path or DEFAULT_SYNTHETIC_DIR
        if not os.path.exists(os.path.join(folder, tokens.MANIFEST)):
            prepare.prepare_synthetic(folder, tokenizer_dir, SYNTHETIC_TOKENS, SYNTHETIC_SHARDS)
    elif not tr.dataset_path:
        raise DataError(
            f"training.dataset = {tr.dataset!r} needs training.dataset_path: a folder prepared with "
            f"`python -m titan_recover.data prepare DIR --dataset {tr.dataset} --tokenizer {tokenizer_dir}`"
        )
    else:
        folder = tr.dataset_path
    dataset = TokenDataset(folder)
    dataset.check_tokenizer(tokenizer_dir, tokenizer_vocab)
    dataset.check_vocab(model_vocab_size(job_config), f"model {job_config.model.name} flavor {job_config.model.flavor}")
    dataset.num_windows(tr.seq_len)  # at least one window of seq_len + 1 tokens
    return dataset


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


def check_tokenizer_folder(path: str) -> None:
    """A ``DataError`` unless ``path`` holds a ``tokenizer.json`` (what titan_recover tokenizes with).

    Checked before TorchTitan looks: its own errors for a missing folder blame a deprecated
    ``tokenizer_path`` or list files, and never name the key to fix.
    """
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        return
    where = "the folder has no tokenizer.json" if os.path.isdir(path) else "no such folder"
    if not os.path.isabs(path):
        where += f", relative to the working directory {os.getcwd()}"
    raise DataError(
        f"model.hf_assets_path: no tokenizer at {path} ({where}); set it to a folder with the model's "
        "tokenizer.json (for a Hugging Face model, download it with TorchTitan's scripts/download_hf_assets.py "
        "--assets tokenizer)"
    )


def check_data(job_config: Any) -> str:
    """Opens the job's dataset as every rank will and loads its first microbatch, so a bad folder
    stops the launcher before anything starts; returns a line describing the data."""
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    check_tokenizer_folder(job_config.model.hf_assets_path)
    if job_config.experimental.custom_import:  # registers the job's TrainSpec
        importlib.import_module(job_config.experimental.custom_import)
    tokenizer = HuggingFaceTokenizer(job_config.model.hf_assets_path)
    loader = build_addressable_dataloader(job_config.parallelism.data_parallel_shard_degree, 0, tokenizer, job_config)
    loader.load(1, 0)
    m, tr = loader.dataset.manifest, job_config.training
    return (
        f"data: {loader.dataset.folder}: {m.num_tokens:,} tokens in {len(m.shards)} {m.layout} shards ({m.dtype}, "
        f"ids < {m.max_token_id + 1:,}); {loader.windows:,} samples of {tr.seq_len + 1} tokens, "
        f"read once every {loader.windows / loader.samples_per_step():,.1f} steps"
    )
