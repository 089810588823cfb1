"""The data layer: preparation throughput, read rate against an 8B step's need, RSS against corpus size.

    .venv/bin/python -m bench.data [--quick]   -> bench/results/addressing.json

- prepare: ``titan_recover.data.prepare`` on jsonl of the synthetic corpus with the shipped tokenizer,
  with 1 worker and with every core, side by side; tokens/s, and the time 100B tokens would take
  on a 64-core host if the per-worker rate held (linear in cores).
- read: one rank's ``addressing.load_samples`` at seq_len 8192, local batch 1 (the 8B configs), over a
  uint32 corpus, in the permuted order every run reads, against the microbatches/s one GPU of an
  8B run consumes at TorchTitan's fastest published 8 x H100 figure (Llama 3.1 8B, FSDP +
  torch.compile + Float8: 8,532 tokens/s per GPU, docs/performance.md).
- rss: a fresh process per corpus size (1M, 100M, 1B tokens; ``--quick`` stops at 100M) opens the
  folder and reads the same number of microbatches; its peak RSS.
The corpora for read and rss are random token ids written with ``tokens.ShardWriter`` in 256M-token
shards (what is measured is the reader, not the text).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.common import ROOT, write_result
from titan_recover.data import addressing, prepare, tokens
from titan_recover.data.synthetic import TOKENIZER_DIR, synthetic_corpus

H100_8B_TOKENS_PER_S = 8_532  # per GPU: TorchTitan docs/performance.md, Llama 3.1 8B, 8 H100, FSDP+compile+Float8
SEQ_LEN = 8192
SHARD_TOKENS = 1 << 28


def write_random_corpus(folder: Path, num_tokens: int, vocab: int) -> None:
    """``num_tokens`` random ids in shards of ``SHARD_TOKENS``, with a manifest (the reader's input)."""
    folder.mkdir(parents=True, exist_ok=True)
    dtype = tokens.dtype_for_vocab(vocab)
    rng = np.random.default_rng(0)
    shards = []
    for i, start in enumerate(range(0, num_tokens, SHARD_TOKENS)):
        writer = tokens.ShardWriter(str(folder / f"{i:05d}.ds"), dtype)
        for s in range(start, min(num_tokens, start + SHARD_TOKENS), 1 << 22):  # 4M-token documents
            writer.add(rng.integers(0, vocab, min(1 << 22, num_tokens - s), dtype=np.int64))
        shards.append(writer.close())
    manifest = tokens.Manifest(
        "datatrove", dtype, tokens.tokenizer_identity(TOKENIZER_DIR), vocab, tuple(shards), {"random": num_tokens}
    )
    tokens.write_json(str(folder / tokens.MANIFEST), manifest.to_json())


def read_rate(folder: Path, count: int, vocab: int) -> float:
    """Microbatches/s of one rank (8 data shards, local batch 1, M = 8) reading steps in order."""
    dataset = tokens.TokenDataset(str(folder))
    start = time.perf_counter()
    for k in range(count):
        step, microbatch = divmod(k, 8)
        samples = addressing.sample_indices(step + 1, microbatch, 3, num_microbatches=8, shards=8, local_batch=1)
        addressing.load_samples(dataset, samples, seq_len=SEQ_LEN, seed=0, vocab_size=vocab)
    return count / (time.perf_counter() - start)


def _rss_child(folder: str, count: int) -> None:
    """In a fresh process: read ``count`` microbatches, print its peak RSS in MiB. VmHWM, not
    ``ru_maxrss``: Linux keeps ru_maxrss across execve, so it would count the parent's forked image."""
    read_rate(Path(folder), count, 1 << 17)
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    print(
        json.dumps(
            {
                key: int(status[field].split()[0]) / 1024
                for key, field in (("max_rss_mb", "VmHWM"), ("anon_mb", "RssAnon"), ("file_mb", "RssFile"))
            }
        )
    )


def prepare_rate(workdir: Path, workers: int, docs_file: Path) -> dict:
    out = workdir / f"prepared_{workers}"
    start = time.perf_counter()
    m = prepare.prepare(
        str(out),
        prepare.file_tasks([str(docs_file)], 1 << 20),
        TOKENIZER_DIR,
        {"files": "bench"},
        workers=workers,
        progress=False,
    )
    wall = time.perf_counter() - start
    return {"workers": workers, "tokens": m.num_tokens, "seconds": wall, "tokens_per_s": m.num_tokens / wall}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    sizes = [10**6, 10**8] if args.quick else [10**6, 10**8, 10**9]
    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        texts = list(synthetic_corpus(2_000, seed=1))
        docs_file = work / "docs.jsonl"
        with open(docs_file, "w") as f:
            for _ in range(8 if args.quick else 24):
                f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
        runs = [prepare_rate(work, 1, docs_file), prepare_rate(work, cores, docs_file)]
        per_worker = runs[0]["tokens_per_s"]
        print(f"prepare: 1 worker {per_worker:,.0f} tokens/s; {cores} workers {runs[1]['tokens_per_s']:,.0f} tokens/s")

        write_random_corpus(work / "read", 10**8, 128_256)
        count = 200 if args.quick else 1000
        rate = read_rate(work / "read", count, 128_256)
        needed = H100_8B_TOKENS_PER_S / SEQ_LEN
        print(f"read: {rate:,.0f} microbatches/s of {SEQ_LEN} tokens per rank; an 8B step on 8 H100 needs {needed:.2f}")

        rss = {}
        for size in sizes:
            folder = work / f"rss_{size}"
            write_random_corpus(folder, size, 128_256)
            out = subprocess.run(
                [sys.executable, "-m", "bench.data", "--rss-child", str(folder), str(count)],
                cwd=ROOT,
                capture_output=True,
                text=True,
                check=True,
            )
            rss[size] = json.loads(out.stdout.strip().splitlines()[-1])
            print(
                f"rss: {size:,} tokens -> peak {rss[size]['max_rss_mb']:.1f} MiB "
                f"(now {rss[size]['anon_mb']:.1f} anonymous, {rss[size]['file_mb']:.1f} file-backed)"
            )
    result = {
        "data_prepare_tokens_per_s": runs[1]["tokens_per_s"],
        "data_prepare_runs": runs,
        "data_prepare_100b_hours_on_64_cores": 100e9 / (per_worker * 64) / 3600,
        "data_prepare_note": "shipped 2048-token BPE on synthetic English jsonl; the 64-core figure assumes "
        "the 1-worker rate per core",
        "data_read_microbatches_per_s": rate,
        "data_needed_microbatches_per_s": needed,
        "data_read_vs_needed_ratio": rate / needed,
        "data_read_note": f"seq_len {SEQ_LEN}, local batch 1, uint32 ids, 10^8-token corpus in page cache; "
        f"need: {H100_8B_TOKENS_PER_S} tokens/s per H100 (TorchTitan, Llama 3.1 8B, Float8)",
        "data_rss_mb_by_tokens": {str(k): v for k, v in rss.items()},
        "data_rss_growth_ratio": rss[sizes[-1]]["max_rss_mb"] / rss[sizes[0]]["max_rss_mb"],
        "cpu_count": cores,
        "quick": args.quick,
    }
    print(f"wrote {write_result('data', result)}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rss-child"]:
        _rss_child(sys.argv[2], int(sys.argv[3]))
    else:
        main(sys.argv[1:])
