"""The data command line: prepare, index, verify and check a job's dataset folder.

python -m titan_recover.data prepare OUT --tokenizer DIR (--files F ... | --dataset NAME | --synthetic N)
python -m titan_recover.data index DIR --tokenizer DIR     # adopt datatrove / Megatron files
python -m titan_recover.data verify DIR                    # every shard's sha256
python -m titan_recover.data check JOB [--section.key value]   # the job's data, as a launch checks it
(JOB: --job.config_file X.toml on TorchTitan 0.2, --module titan_recover.recipes --config NAME on 0.3)
python -m titan_recover.data tokenizer OUT                 # regenerate the shipped tokenizer
"""

import argparse
import sys
from collections.abc import Sequence

from titan_recover.control.keys import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK
from titan_recover.data import prepare, tokens
from titan_recover.data.addressing import check_data
from titan_recover.data.tokens import DataError


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
    idx.add_argument(
        "--dtype", choices=sorted(tokens.DTYPES), help="datatrove token width (default: from the vocabulary)"
    )
    ver = sub.add_parser("verify", help="check every shard's sha256 against the manifest")
    ver.add_argument("folder")
    sub.add_parser(
        "check",
        help="check a job's data as the launcher does: --job.config_file X.toml (TorchTitan 0.2) or "
        "--module titan_recover.recipes --config NAME (0.3), then [--section.key value ...]",
        add_help=False,
    )
    tok = sub.add_parser("tokenizer", help="regenerate the shipped synthetic tokenizer")
    tok.add_argument("out")
    return p


def _describe(m: tokens.Manifest) -> str:
    return (
        f"{m.num_tokens:,} tokens, {m.num_documents:,} documents in {len(m.shards)} {m.layout} shards "
        f"({m.dtype}, vocabulary {m.vocab_size:,}, largest id {m.max_token_id:,})"
    )


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
                m = prepare.prepare_synthetic(
                    args.out, args.tokenizer, args.synthetic, args.shards, args.seed, **kwargs
                )
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
                return EXIT_FAILED
            print(f"{args.folder}: every shard matches {tokens.MANIFEST}")
        else:
            from titan_recover.data.synthetic import train_tokenizer

            train_tokenizer(args.out)
            print(f"wrote tokenizer to {args.out}")
    except (DataError, ValueError) as e:  # ConfigError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return EXIT_OK
