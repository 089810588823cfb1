"""Microbatch addressing: which tokens a (step, microbatch, shard) reads, the same in every process.

Recovery replays and re-assigns microbatches, so every sample is addressed by a pure
function: ``(step, microbatch, shard)`` -> global sample indices (``sample_indices``) ->
``(data epoch, window)`` of the corpus (``order.window_of``, a seeded permutation per
epoch) -> ``seq_len + 1`` tokens of a shard file (``tokens.TokenDataset``).
Whichever process loads a microbatch gets bit-identical tensors.

``open_dataset`` opens the job's dataset folder (``training.dataset = "synthetic"`` with
no folder there yet: the synthetic corpus is prepared into it first) and checks that its
manifest matches the job's tokenizer and model vocabulary and that every shard has its
listed size; a violation is a ``DataError`` naming the file. ``check_data`` does that and
loads the first microbatch, once, before the launcher starts anything.

The data command line is ``data.cli`` (``python -m titan_recover.data``).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from titan_recover import config
from titan_recover.data import order, prepare, tokens
from titan_recover.data.tokens import DataError, TokenDataset

SYNTHETIC = "synthetic"
SYNTHETIC_TOKENS = 2_000_000
SYNTHETIC_SHARDS = 4
DEFAULT_SYNTHETIC_DIR = os.path.join("data", "synthetic")


def sample_indices(
    step: int, microbatch: int, shard: int, *, num_microbatches: int, shards: int, local_batch: int
) -> range:
    """Global sample indices of one shard's slice of one microbatch of one step.

    ``(((step - 1) * M + microbatch) * S + shard) * b + j`` for ``j < b``: a pure function,
    so any process (including a replacement after a failure) can load exactly the
    samples another rank would have loaded, and no two pieces ever share a sample.
    """
    for name, value in (("num_microbatches", num_microbatches), ("shards", shards), ("local_batch", local_batch)):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if step < 1:
        raise ValueError(f"step must be >= 1 (TorchTitan steps are 1-based), got {step}")
    if not 0 <= microbatch < num_microbatches:
        raise ValueError(f"microbatch must be in [0, {num_microbatches}), got {microbatch}")
    if not 0 <= shard < shards:
        raise ValueError(f"shard must be in [0, {shards}), got {shard}")
    first = (((step - 1) * num_microbatches + microbatch) * shards + shard) * local_batch
    return range(first, first + local_batch)


def load_samples(
    dataset: TokenDataset, samples: Sequence[int], *, seq_len: int, seed: int, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, labels)``, int64 ``[len(samples), seq_len]``, labels shifted by one."""
    windows = dataset.num_windows(seq_len)
    rows = [dataset.window(order.window_of(s, windows, seed)[1], seq_len, vocab_size) for s in samples]
    batch = torch.from_numpy(np.stack(rows))
    return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()


def piece_digest(inputs: torch.Tensor, labels: torch.Tensor) -> int:
    """40-bit blake2b digest of one piece's int64 inputs then labels.

    40 bits keep sums of up to 2**13 digests below 2**53, i.e. exact in float64, so a
    step's order-independent digest can be all-reduced as a float sum.
    """
    h = hashlib.blake2b()
    for t in (inputs, labels):
        h.update(t.detach().to(device="cpu", dtype=torch.int64).contiguous().numpy().tobytes())
    return int.from_bytes(h.digest()[:5], "big")


def model_vocab_size(job_config: Any) -> int:
    """The embedding rows of the job's model; a ``DataError`` for a flavor the model lacks."""
    from titan_recover import titan

    try:
        return titan.model_vocab_size(job_config)
    except ValueError as e:
        raise DataError(str(e)) from None


def tokens_to_prepare(job_config: Any) -> int:
    """A ``prepare --max-tokens`` budget for the job: the tokens its steps read (``seq_len + 1`` per sample), 1%
    over for the windows lost at shard ends, rounded up to a million. A shorter corpus is read again, in a new
    order; a longer one costs tokenizing time before step 1."""
    tr = job_config.training
    read = tr.steps * tr.global_batch_size * (tr.seq_len + 1)
    return -(-read * 101 // (100 * 10**6)) * 10**6


def prepare_command(job_config: Any, folder: str) -> str:
    """The command that prepares the job's dataset into ``folder``, with the job's token budget."""
    from titan_recover import titan

    name, tokenizer_dir = titan.dataset(job_config)[0], titan.assets_path(job_config)
    source = f"--dataset {name}" if name in titan.text_datasets() else "--files YOUR_FILES"
    return (
        f"python -m titan_recover.data prepare {folder} {source} --tokenizer {tokenizer_dir} "
        f"--max-tokens {tokens_to_prepare(job_config)}"
    )


def dataset_folder(job_config: Any) -> str | None:
    """The job's dataset folder; None for the synthetic corpus not prepared yet (the run prepares it there
    first); a ``DataError`` naming the setting, and the command that prepares it, where there is none."""
    from titan_recover import titan
    from titan_recover.titan.jobs import FLAGS

    (name, path), key = titan.dataset(job_config), FLAGS["dataset_path"].lstrip("-")
    folder = path or (DEFAULT_SYNTHETIC_DIR if name == SYNTHETIC else "")
    if name == SYNTHETIC:
        return folder if os.path.exists(os.path.join(folder, tokens.MANIFEST)) else None
    if not folder or not os.path.exists(folder):
        what = f"{folder!r} does not exist" if folder else "unset"
        raise DataError(
            f"{key}: {what}, and dataset {name!r} is read from a prepared dataset folder: prepare it once with "
            f"`{prepare_command(job_config, folder or './data/' + name)}` (the run's tokens; docs/data.md)"
            + ("" if folder else f", and set {key} to that folder")
        )
    return folder


def open_dataset(job_config: Any, tokenizer_vocab: int) -> TokenDataset:
    """The job's dataset folder, checked against its tokenizer and model (synthetic: prepared if absent)."""
    from titan_recover import titan

    folder, tokenizer_dir = dataset_folder(job_config), titan.assets_path(job_config)
    if folder is None:
        folder = titan.dataset(job_config)[1] or DEFAULT_SYNTHETIC_DIR
        prepare.prepare_synthetic(folder, tokenizer_dir, SYNTHETIC_TOKENS, SYNTHETIC_SHARDS)
    dataset = TokenDataset(folder)
    dataset.check_tokenizer(tokenizer_dir, tokenizer_vocab, titan.ASSETS_KEY)
    model, flavor = titan.model_name(job_config)
    dataset.check_vocab(model_vocab_size(job_config), f"model {model} flavor {flavor}")
    dataset.num_windows(job_config.training.seq_len)  # at least one window of seq_len + 1 tokens
    return dataset


def check_tokenizer_folder(path: str, key: str) -> None:
    """A ``DataError`` naming the setting ``key`` unless ``path`` holds a ``tokenizer.json`` (what titan_recover
    tokenizes with).

    Checked before TorchTitan looks: its own errors for a missing folder blame a deprecated
    ``tokenizer_path`` or list files, and never name the key to fix.
    """
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        return
    where = "the folder has no tokenizer.json" if os.path.isdir(path) else "no such folder"
    if not os.path.isabs(path):
        where += f", relative to the working directory {os.getcwd()}"
    raise DataError(
        f"{key}: no tokenizer at {path} ({where}); set it to a folder with the model's "
        "tokenizer.json (for a Hugging Face model, download it with TorchTitan's scripts/download_hf_assets.py "
        "--assets tokenizer)"
    )


def check_data(job_config: Any) -> str:
    """Opens the job's dataset as every rank will and loads its first microbatch, so a bad folder
    stops the launcher before anything starts; returns a line describing the data."""
    from titan_recover import titan

    check_tokenizer_folder(
        titan.assets_path(job_config), titan.ASSETS_KEY
    )  # the model is registered: titan.check_model ran
    tokenizer = titan.Tokenizer(titan.assets_path(job_config))
    dataset = open_dataset(job_config, tokenizer.get_vocab_size())
    tr, shards = job_config.training, job_config.parallelism.data_parallel_shard_degree
    m = config.num_microbatches(job_config)
    first = sample_indices(1, 0, 0, num_microbatches=m, shards=shards, local_batch=tr.local_batch_size)
    load_samples(
        dataset, first, seq_len=tr.seq_len, seed=job_config.recover.data_seed, vocab_size=model_vocab_size(job_config)
    )
    windows, per_step, mf = dataset.num_windows(tr.seq_len), m * shards * tr.local_batch_size, dataset.manifest
    read = tr.steps * per_step / windows
    return (
        f"data: {dataset.folder}: {mf.num_tokens:,} tokens in {len(mf.shards)} {mf.layout} shards ({mf.dtype}, "
        f"ids < {mf.max_token_id + 1:,}); {windows:,} samples of {tr.seq_len + 1} tokens, "
        f"read once every {windows / per_step:,.1f} steps: the run's {tr.steps:,} steps read "
        + (f"{read:.1%} of it" if read < 1 else f"it {read:,.2f} times (a new order each time)")
    )
