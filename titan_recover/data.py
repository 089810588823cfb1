"""Microbatch addressing, and the data command line.

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

    python -m titan_recover.data prepare OUT --tokenizer DIR (--files F ... | --dataset NAME | --synthetic N)
    python -m titan_recover.data index DIR --tokenizer DIR     # adopt datatrove / Megatron files
    python -m titan_recover.data verify DIR                    # every shard's sha256
    python -m titan_recover.data check JOB [--section.key value]   # the job's data, as a launch checks it
    (JOB: --job.config_file X.toml on TorchTitan 0.2, --module titan_recover.recipes --config NAME on 0.3)
    python -m titan_recover.data tokenizer OUT                 # regenerate the shipped tokenizer
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from titan_recover import config, order, prepare, tokens
from titan_recover.tokens import DataError, TokenDataset

SYNTHETIC = "synthetic"
SYNTHETIC_TOKENS = 2_000_000
SYNTHETIC_SHARDS = 4
DEFAULT_SYNTHETIC_DIR = os.path.join("data", "synthetic")


def sample_indices(step: int, microbatch: int, shard: int, *, num_microbatches: int,
                   shards: int, local_batch: int) -> range:
    """Global sample indices of one shard's slice of one microbatch of one step.

    ``(((step - 1) * M + microbatch) * S + shard) * b + j`` for ``j < b``: a pure function,
    so any process (including a replacement after a failure) can load exactly the
    samples another rank would have loaded, and no two pieces ever share a sample.
    """
    for name, value in (("num_microbatches", num_microbatches), ("shards", shards),
                        ("local_batch", local_batch)):
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


def load_samples(dataset: TokenDataset, samples: Sequence[int], *, seq_len: int, seed: int,
                 vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
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


def open_dataset(job_config: Any, tokenizer_vocab: int) -> TokenDataset:
    """The job's dataset folder, checked against its tokenizer and model (synthetic: prepared if absent)."""
    from titan_recover import titan

    (name, path), tokenizer_dir = titan.dataset(job_config), titan.assets_path(job_config)
    if name == SYNTHETIC:
        folder = path or DEFAULT_SYNTHETIC_DIR
        if not os.path.exists(os.path.join(folder, tokens.MANIFEST)):
            prepare.prepare_synthetic(folder, tokenizer_dir, SYNTHETIC_TOKENS, SYNTHETIC_SHARDS)
    elif not path:
        raise DataError(
            f"dataset {name!r} needs a dataset_path: a folder prepared with "
            f"`python -m titan_recover.data prepare DIR --dataset {name} --tokenizer {tokenizer_dir}`"
        )
    else:
        folder = path
    dataset = TokenDataset(folder)
    dataset.check_tokenizer(tokenizer_dir, tokenizer_vocab, titan.ASSETS_KEY)
    model, flavor = titan.model_name(job_config)
    dataset.check_vocab(model_vocab_size(job_config), f"model {model} flavor {flavor}")
    dataset.num_windows(job_config.training.seq_len)  # at least one window of seq_len + 1 tokens
    return dataset


def check_tokenizer_folder(path: str, key: str) -> None:
    """A ``DataError`` naming the setting ``key`` unless ``path`` holds a ``tokenizer.json`` (what titan_recover tokenizes with).

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

    check_tokenizer_folder(titan.assets_path(job_config), titan.ASSETS_KEY)  # the model is registered: titan.check_model ran
    tokenizer = titan.Tokenizer(titan.assets_path(job_config))
    dataset = open_dataset(job_config, tokenizer.get_vocab_size())
    tr, shards = job_config.training, job_config.parallelism.data_parallel_shard_degree
    m = config.num_microbatches(job_config)
    first = sample_indices(1, 0, 0, num_microbatches=m, shards=shards, local_batch=tr.local_batch_size)
    load_samples(dataset, first, seq_len=tr.seq_len, seed=job_config.recover.data_seed,
                 vocab_size=model_vocab_size(job_config))
    windows, per_step, mf = dataset.num_windows(tr.seq_len), m * shards * tr.local_batch_size, dataset.manifest
    return (
        f"data: {dataset.folder}: {mf.num_tokens:,} tokens in {len(mf.shards)} {mf.layout} shards ({mf.dtype}, "
        f"ids < {mf.max_token_id + 1:,}); {windows:,} samples of {tr.seq_len + 1} tokens, "
        f"read once every {windows / per_step:,.1f} steps"
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m titan_recover.data", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="tokenize a corpus into a dataset folder (parallel, resumable)")
    prep.add_argument("out", help="dataset folder to write (training.dataset_path)")
    prep.add_argument("--tokenizer", required=True, help="the job's tokenizer folder (model.hf_assets_path)")
    src = prep.add_mutually_exclusive_group(required=True)
    src.add_argument("--files", nargs="+", help="jsonl/json lines, parquet or txt files, folders or globs")
    src.add_argument("--dataset", help="a TorchTitan HF text dataset name (e.g. c4)")
    src.add_argument("--synthetic", type=int, metavar="TOKENS", help="this many tokens of the synthetic corpus")
    prep.add_argument("--dataset-path", help="local copy of --dataset (TorchTitan's training.dataset_path)")
    prep.add_argument("--max-tokens", type=int, help="prepare exactly this many tokens (default: all of the input)")
    prep.add_argument("--workers", type=int, help="worker processes (default: every core)")
    prep.add_argument("--text-key", default="text", help="field holding the text in jsonl/parquet records")
    prep.add_argument("--task-mb", type=float, default=prepare.TASK_BYTES / 2**20, help="input MB per output shard")
    prep.add_argument("--shards", type=int, default=4, help="--synthetic: number of shards")
    prep.add_argument("--seed", type=int, default=0, help="--synthetic: corpus seed")
    idx = sub.add_parser("index", help="write manifest.json for datatrove (.ds) or Megatron (.bin/.idx) files")
    idx.add_argument("folder")
    idx.add_argument("--tokenizer", required=True, help="the tokenizer the files were made with")
    idx.add_argument("--dtype", choices=sorted(tokens.DTYPES), help="datatrove token width (default: from the vocabulary)")
    ver = sub.add_parser("verify", help="check every shard's sha256 against the manifest")
    ver.add_argument("folder")
    sub.add_parser("check", help="check a job's data as the launcher does: --job.config_file X.toml (TorchTitan 0.2) or "
                   "--module titan_recover.recipes --config NAME (0.3), then [--section.key value ...]",
                   add_help=False)
    tok = sub.add_parser("tokenizer", help="regenerate the shipped synthetic tokenizer")
    tok.add_argument("out")
    return p


def _describe(m: tokens.Manifest) -> str:
    return (f"{m.num_tokens:,} tokens, {m.num_documents:,} documents in {len(m.shards)} {m.layout} shards "
            f"({m.dtype}, vocabulary {m.vocab_size:,}, largest id {m.max_token_id:,})")


def _check(argv: Sequence[str]) -> str:
    from titan_recover import titan

    job_config = titan.load_config(list(argv))
    titan.check_model(job_config)
    return check_data(job_config)


def main(argv: Sequence[str]) -> int:
    args, rest = _parser().parse_known_args(argv)
    if rest and args.command != "check":
        _parser().error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        if args.command == "check":
            print(_check(rest))
        elif args.command == "prepare":
            kwargs = {"max_tokens": args.max_tokens, "workers": args.workers, "text_key": args.text_key}
            if args.synthetic is not None:
                m = prepare.prepare_synthetic(args.out, args.tokenizer, args.synthetic, args.shards, args.seed, **kwargs)
            elif args.files:
                tasks = prepare.file_tasks(args.files, max(1, int(args.task_mb * 2**20)))
                m = prepare.prepare(args.out, tasks, args.tokenizer, {"files": sorted(args.files)}, **kwargs)
            else:
                tasks = prepare.hf_tasks(args.dataset, args.dataset_path)
                source = {"dataset": args.dataset, "dataset_path": args.dataset_path}
                m = prepare.prepare(args.out, tasks, args.tokenizer, source, **kwargs)
            print(f"{args.out}: {_describe(m)}")
        elif args.command == "index":
            vocab = prepare.Encoder.for_tokenizer(args.tokenizer)[1]
            m = tokens.index_folder(args.folder, args.tokenizer, vocab, args.dtype)
            print(f"{args.folder}: wrote {tokens.MANIFEST}: {_describe(m)}")
        elif args.command == "verify":
            problems = tokens.verify(args.folder)
            for line in problems:
                print(f"error: {line}", file=sys.stderr)
            if problems:
                return 1
            print(f"{args.folder}: every shard matches {tokens.MANIFEST}")
        else:
            from titan_recover.synthetic import train_tokenizer

            train_tokenizer(args.out)
            print(f"wrote tokenizer to {args.out}")
    except (DataError, ValueError) as e:  # ConfigError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
