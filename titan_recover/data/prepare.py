"""Tokenize a corpus once, in parallel, into a dataset folder that ``tokens.TokenDataset`` reads.

The input is cut into tasks (byte ranges of jsonl files, row groups of parquet files,
groups of text files, shards of a TorchTitan HF dataset, or synthetic shards); a pool of
worker processes tokenizes them with the job's tokenizer (BOS and EOS around every
document, as TorchTitan's HF text datasets do) and writes one datatrove shard per task.
A finished task leaves a ``NNNNN.ds.done.json`` record, so a rerun after an interruption
redoes only the unfinished tasks, and a rerun of a finished folder does nothing. A record
holds the fingerprint of everything its shard depends on (a cut shard: ``max_tokens`` too)
and is trusted only while its shard still has the size it lists; the manifest is written
last. Nothing is capped silently: every input token is prepared, or exactly ``max_tokens``
when asked (the shard that crosses it is cut, later ones dropped).
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import json
import multiprocessing
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Iterator

import numpy as np

from titan_recover.data import tokens
from titan_recover.data.tokens import DataError, Manifest, Shard

TASK_BYTES = 64 << 20  # input bytes per task (one output shard each)
ENCODE_BATCH = 1024  # documents per tokenizer call
STALL_S = 600.0  # no token written by any worker for this long, while a task is awaited: give up with a message
SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".txt": "text"}


@dataclass(frozen=True)
class Task:
    """One unit of work, JSON-able: its record tells a rerun whether it is done."""

    index: int
    kind: str  # synthetic | jsonl | parquet | text | hf
    args: tuple

    def to_json(self) -> dict:
        return {"index": self.index, "kind": self.kind, "args": list(self.args)}


@dataclass(frozen=True)
class Encoder:
    """What a worker needs to tokenize like TorchTitan's ``HuggingFaceTokenizer.encode(add_bos, add_eos)``."""

    tokenizer_file: str
    bos: tuple[int, ...]
    eos: tuple[int, ...]
    dtype: str
    text_key: str

    @classmethod
    def for_tokenizer(cls, tokenizer_dir: str, text_key: str = "text") -> tuple[Encoder, int]:
        """The encoder and the vocabulary size, from TorchTitan's own tokenizer wrapper."""
        from titan_recover import titan

        tok = titan.Tokenizer(tokenizer_dir)
        vocab = tok.get_vocab_size()
        bos = (tok.bos_id,) if tok.bos_id is not None and not tok.hf_adds_bos else ()
        eos = (tok.eos_id,) if tok.eos_id is not None and not tok.hf_adds_eos else ()
        path = os.path.join(tokenizer_dir, "tokenizer.json")
        return cls(path, bos, eos, tokens.dtype_for_vocab(vocab), text_key), vocab


# --------------------------------------------------------------------------------------
# Tasks: the input cut into pieces
# --------------------------------------------------------------------------------------


def _expand(paths: list[str]) -> list[str]:
    """Files named, globbed, or of a known type inside a named folder, in a fixed order."""
    files: list[str] = []
    for p in paths:
        if os.path.isdir(p):
            inside = glob.glob(os.path.join(glob.escape(p), "**", "*"), recursive=True)
            files += sorted(f for f in inside if os.path.isfile(f) and os.path.splitext(f)[1] in SUFFIXES)
        else:
            files += sorted(glob.glob(p)) or [p]
    for f in files:
        if not os.path.isfile(f):
            raise DataError(f"{f}: no such input file")
        if os.path.splitext(f)[1] not in SUFFIXES:
            raise DataError(f"{f}: unknown input type; read are {', '.join(SUFFIXES)}")
    if not files:
        raise DataError(f"no input files in {paths}")
    return files


def file_tasks(paths: list[str], task_bytes: int = TASK_BYTES) -> list[Task]:
    """jsonl files by byte range, parquet by row groups, text files grouped, ~task_bytes each."""
    import pyarrow.parquet as pq

    out: list[Task] = []
    texts: list[str] = []
    text_bytes = 0
    for path in _expand(paths):
        kind, size = SUFFIXES[os.path.splitext(path)[1]], os.path.getsize(path)
        path = os.path.abspath(path)
        if kind == "jsonl":
            out += [Task(0, kind, (path, s, min(s + task_bytes, size))) for s in range(0, max(size, 1), task_bytes)]
        elif kind == "parquet":
            meta = pq.ParquetFile(path).metadata
            group: list[int] = []
            group_bytes = 0
            for g in range(meta.num_row_groups):
                group.append(g)
                group_bytes += meta.row_group(g).total_byte_size
                if group_bytes >= task_bytes:
                    out.append(Task(0, kind, (path, tuple(group))))
                    group, group_bytes = [], 0
            if group:
                out.append(Task(0, kind, (path, tuple(group))))
        else:
            texts.append(path)
            text_bytes += size
            if text_bytes >= task_bytes:
                out.append(Task(0, kind, tuple(texts)))
                texts, text_bytes = [], 0
    if texts:
        out.append(Task(0, "text", tuple(texts)))
    return [Task(i, t.kind, t.args) for i, t in enumerate(out)]


def prepare_synthetic(
    folder: str, tokenizer_dir: str, num_tokens: int, shards: int, seed: int = 0, **kwargs: Any
) -> Manifest:
    """``prepare`` of exactly ``num_tokens`` synthetic tokens in ``shards`` shards."""
    return prepare(
        folder,
        synthetic_tasks(num_tokens, shards, seed),
        tokenizer_dir,
        {"synthetic": num_tokens, "shards": shards, "seed": seed},
        **kwargs,
    )


def synthetic_tasks(num_tokens: int, shards: int, seed: int) -> list[Task]:
    """Exactly ``num_tokens`` of the synthetic corpus in ``shards`` shards of their own seeds."""
    if num_tokens <= 0 or shards <= 0:
        raise DataError(f"synthetic tokens and shards must be positive, got {num_tokens}, {shards}")
    base, extra = divmod(num_tokens, shards)
    return [Task(i, "synthetic", (seed * 1_000_003 + i, base + (i < extra))) for i in range(shards)]


def _hf_config(name: str) -> Any:
    from titan_recover import titan

    datasets = titan.text_datasets()
    if name not in datasets:
        raise DataError(f"dataset {name!r} is not one of TorchTitan's text datasets {sorted(datasets)}")
    return datasets[name]


def _streaming_shards(ds: Any) -> int | None:
    """Files of a streaming (iterable) HF dataset; None for a map-style one."""
    return getattr(ds, "num_shards", None) or getattr(ds, "n_shards", None)


def hf_tasks(name: str, dataset_path: str | None, rows_per_task: int = 100_000) -> list[Task]:
    """One task per file of a streaming dataset, or per ``rows_per_task`` rows of a local one."""
    cfg = _hf_config(name)
    ds = cfg.loader(dataset_path or cfg.path)
    n = _streaming_shards(ds) or max(1, -(-len(ds) // rows_per_task))
    return [Task(i, "hf", (name, dataset_path, i, n)) for i in range(n)]


def _texts(task: Task, text_key: str) -> Iterator[str]:
    """The documents of one task, in a fixed order."""
    if task.kind == "synthetic":
        from titan_recover.data.synthetic import synthetic_documents

        yield from synthetic_documents(task.args[0])
    elif task.kind == "jsonl":
        path, start, end = task.args
        with open(path, "rb") as f:
            if start:
                f.seek(start - 1)
                f.readline()  # the line that started before ``start`` belongs to the previous task
            while f.tell() < end and (line := f.readline()):
                if line.strip():
                    yield _field(json.loads(line), text_key, path)
    elif task.kind == "parquet":
        import pyarrow.parquet as pq

        path, groups = task.args
        pf = pq.ParquetFile(path)
        for g in groups:
            for text in pf.read_row_group(g, columns=[text_key]).column(text_key).to_pylist():
                yield _field({text_key: text}, text_key, path)
    elif task.kind == "text":
        for path in task.args:
            with open(path, encoding="utf-8") as f:
                yield f.read()
    elif task.kind == "hf":
        name, dataset_path, i, n = task.args
        cfg = _hf_config(name)
        ds = cfg.loader(dataset_path or cfg.path)
        part = (
            ds.shard(num_shards=n, index=i)
            if _streaming_shards(ds)
            else ds.shard(num_shards=n, index=i, contiguous=True)
        )
        for sample in part:
            yield cfg.sample_processor(sample)
    else:
        raise DataError(f"unknown task kind {task.kind!r}")


def _field(record: Any, key: str, path: str) -> str:
    if not isinstance(record, dict) or not isinstance(record.get(key), str):
        raise DataError(f"{path}: a record has no string field {key!r} (choose it with --text-key)")
    return record[key]


# --------------------------------------------------------------------------------------
# Workers
# --------------------------------------------------------------------------------------

_progress: Any = None  # tokens written by all workers (a shared counter)


def _init_worker(counter: Any) -> None:
    global _progress
    _progress = counter
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the pool is the parallelism


def _record_path(folder: str, index: int) -> str:
    return os.path.join(folder, f"{index:05d}.ds.done.json")


def _cut_fingerprint(fingerprint: dict, max_tokens: int | None) -> dict:
    """The fingerprint of a shard cut at ``max_tokens``: where it is cut depends on that setting."""
    return {**fingerprint, "max_tokens": max_tokens}


def _write_record(folder: str, task: Task, fingerprint: dict, shard: Shard) -> None:
    tokens.write_json(
        _record_path(folder, task.index), {"task": task.to_json(), "fingerprint": fingerprint, "shard": asdict(shard)}
    )


def _read_record(folder: str, task: Task, fingerprint: dict, max_tokens: int | None) -> Shard | None:
    """The finished shard of ``task`` if a previous run completed exactly this task: whole, or cut
    as a run with this ``max_tokens`` cuts it, and its file still of the size the record lists."""
    try:
        with open(_record_path(folder, task.index)) as f:
            rec = json.load(f)
        trusted = (fingerprint, _cut_fingerprint(fingerprint, max_tokens)) if max_tokens is not None else (fingerprint,)
        if rec["task"] != task.to_json() or rec["fingerprint"] not in trusted:
            return None
        shard = Shard(**rec["shard"])
        if (
            os.path.getsize(os.path.join(folder, shard.file))
            != shard.tokens * tokens.DTYPES[fingerprint["dtype"]].itemsize
        ):
            return None
        return shard
    except (OSError, ValueError, KeyError, TypeError):
        return None


def run_task(folder: str, task: Task, encoder: Encoder, fingerprint: dict, quota: int | None = None) -> Shard:
    """Tokenizes one task into ``NNNNN.ds`` (at most ``quota`` tokens), then writes its record."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(encoder.tokenizer_file)
    writer = tokens.ShardWriter(os.path.join(folder, f"{task.index:05d}.ds"), encoder.dtype)
    try:
        docs = _texts(task, encoder.text_key)
        while quota is None or writer.tokens < quota:
            batch = [d for _, d in zip(range(ENCODE_BATCH), docs)]
            if not batch:
                break
            before = writer.tokens
            for enc in tokenizer.encode_batch(batch):
                ids = [*encoder.bos, *enc.ids, *encoder.eos]
                if quota is not None:
                    ids = ids[: quota - writer.tokens]
                writer.add(ids)
                if quota is not None and writer.tokens >= quota:
                    break
            if _progress is not None:
                with _progress.get_lock():
                    _progress.value += writer.tokens - before
        shard = writer.close()
    except BaseException:
        writer.abandon()
        raise
    _write_record(folder, task, fingerprint, shard)
    return shard


def _run_job(job: tuple) -> Shard:
    return run_task(*job)


# --------------------------------------------------------------------------------------
# The whole preparation
# --------------------------------------------------------------------------------------


def _remove_partial(folder: str) -> None:
    """Half-written shards and records of interrupted or stopped workers (never in a record or
    the manifest); called under the folder's lock, so no other preparation is writing them."""
    for pattern in ("*.ds.tmp*", f"{tokens.ATOMIC_PREFIX}*"):
        for path in glob.glob(os.path.join(glob.escape(folder), pattern)):
            os.remove(path)


def _await(results: Any, task: Task, counter: Any, bar: Any) -> Shard:
    """The next task's shard; a ``DataError`` after ``STALL_S`` without a token from any worker
    (a worker that died, e.g. of memory, takes its task with it and the pool never answers)."""
    last, stalled_since = counter.value, time.monotonic()
    while True:
        try:
            return results.next(timeout=0.5)
        except multiprocessing.TimeoutError:
            bar.set_postfix(tokens=f"{counter.value:,}", refresh=True)
            if counter.value != last:
                last, stalled_since = counter.value, time.monotonic()
            elif time.monotonic() - stalled_since > STALL_S:
                raise DataError(
                    f"no token written for {STALL_S:.0f} s while waiting for task {task.to_json()}: a worker died "
                    "(out of memory?) or its input stalls; a rerun resumes from the finished shards"
                ) from None


def _cut(folder: str, task: Task, shard: Shard, keep: int, fingerprint: dict) -> Shard:
    """Shortens a finished shard to its first ``keep`` tokens (the one that crosses max_tokens); ``fingerprint``
    is its cut one. Its whole-shard record goes first, so a crash midway leaves no record, and the task is redone."""
    path, dtype = os.path.join(folder, shard.file), fingerprint["dtype"]
    with contextlib.suppress(FileNotFoundError):
        os.remove(_record_path(folder, task.index))
    os.truncate(path, keep * tokens.DTYPES[dtype].itemsize)
    ends = np.fromfile(f"{path}.index", dtype="<u8")
    ends = np.append(ends[ends < keep], np.uint64(keep))
    tokens.atomic_write(f"{path}.index", ends.astype("<u8").tobytes())
    cut = tokens.scan_shard(path, shard.file, dtype, int(ends.size))
    _write_record(folder, task, fingerprint, cut)
    return cut


def prepare(
    folder: str,
    tasks: list[Task],
    tokenizer_dir: str,
    source: dict,
    *,
    max_tokens: int | None = None,
    workers: int | None = None,
    text_key: str = "text",
    progress: bool = True,
) -> Manifest:
    """Tokenizes ``tasks`` into ``folder`` (idempotent, resumable) and writes its manifest."""
    from tqdm import tqdm

    if max_tokens is not None and max_tokens <= 0:
        raise DataError(f"--max-tokens must be positive, got {max_tokens}")
    os.makedirs(folder, exist_ok=True)
    identity = tokens.tokenizer_identity(tokenizer_dir)
    request = {**source, "max_tokens": max_tokens, "text_key": text_key}
    with open(os.path.join(folder, ".prepare.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent preparations of one folder take turns
        with contextlib.suppress(DataError):
            current = tokens.read_manifest(folder)
            if current.source == request and current.tokenizer_sha256 == identity:
                return current  # already prepared: nothing to do
        encoder, vocab = Encoder.for_tokenizer(tokenizer_dir, text_key)
        fingerprint = {
            "tokenizer_sha256": identity,
            "dtype": encoder.dtype,
            "bos": list(encoder.bos),
            "eos": list(encoder.eos),
            "text_key": text_key,
            "source": source,
        }
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(folder, tokens.MANIFEST))  # stale: never describes new shards
        _remove_partial(folder)
        done = {t.index: s for t in tasks if (s := _read_record(folder, t, fingerprint, max_tokens)) is not None}
        todo = [t for t in tasks if t.index not in done]
        quotas = {t.index: t.args[1] if t.kind == "synthetic" else None for t in tasks}
        workers = max(1, min(workers or os.cpu_count() or 1, len(todo) or 1))
        ctx = multiprocessing.get_context("fork")
        counter = ctx.Value("q", 0)
        start = time.monotonic()
        bar = tqdm(
            total=len(tasks),
            initial=len(done),
            unit="shard",
            desc=f"prepare {folder}",
            disable=not progress,
            mininterval=0.1 if sys.stderr.isatty() else 10,
        )
        shards: list[Shard] = []
        total = 0
        try:
            with ctx.Pool(workers, initializer=_init_worker, initargs=(counter,)) as pool:
                results = pool.imap(_run_job, [(folder, t, encoder, fingerprint, quotas[t.index]) for t in todo])
                for task in tasks:
                    if task.index in done:
                        shard = done[task.index]
                    else:
                        shard = _await(results, task, counter, bar)
                        bar.update(1)
                        bar.set_postfix(
                            tokens=f"{counter.value:,}",
                            tok_per_s=f"{counter.value / max(1e-9, time.monotonic() - start):,.0f}",
                        )
                    if max_tokens is not None and total + shard.tokens >= max_tokens:
                        if total + shard.tokens > max_tokens:
                            shard = _cut(
                                folder, task, shard, max_tokens - total, _cut_fingerprint(fingerprint, max_tokens)
                            )
                        shards.append(shard)
                        total = max_tokens
                        pool.terminate()
                        break
                    if shard.tokens:
                        shards.append(shard)
                    total += shard.tokens
        finally:  # the pool has stopped its workers: nobody writes any more
            bar.close()
            _remove_partial(folder)  # half shards of workers stopped at max_tokens, or dead
        if max_tokens is not None and total < max_tokens:
            raise DataError(f"the input holds {total:,} tokens, fewer than --max-tokens {max_tokens:,}")
        if not shards:
            raise DataError(f"the input of {folder} holds no documents")
        manifest = Manifest("datatrove", encoder.dtype, identity, vocab, tuple(shards), request)
        tokens.write_json(os.path.join(folder, tokens.MANIFEST), manifest.to_json())
        return manifest
