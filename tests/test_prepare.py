"""The preparation command (real processes, real SIGKILL), and the launcher's data checks."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, run_data_cli, write_jsonl, write_standin_tokenizer
from launcher_in_process import launch_argv

from titan_recover.control import keys
from titan_recover.data import prepare
from titan_recover.data.synthetic import TOKENIZER_DIR, synthetic_corpus
from titan_recover.data.tokens import DataError, TokenDataset
from titan_recover.titan.jobs import FLAGS, config_args, job


def all_tokens(folder: str) -> np.ndarray:
    ds = TokenDataset(folder)
    return np.concatenate([np.fromfile(ds.path(s), dtype=ds.dtype) for s in ds.manifest.shards])


def encode(docs: list[str]) -> np.ndarray:
    from titan_recover import titan

    tok = titan.Tokenizer(TOKENIZER_DIR)
    return np.concatenate([tok.encode(d, add_bos=True, add_eos=True) for d in docs])


@pytest.fixture(scope="module")
def docs() -> list[str]:
    return list(synthetic_corpus(300, seed=21))


def test_jsonl_parquet_and_text_inputs_every_document_once_in_order(tmp_path: Path, docs: list[str]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    write_jsonl(tmp_path / "a.jsonl", docs[:100])
    pq.write_table(pa.table({"text": docs[100:200]}), tmp_path / "b.parquet", row_group_size=10)
    texts = tmp_path / "texts"
    texts.mkdir()
    for i, d in enumerate(docs[200:]):
        (texts / f"{i:03d}.txt").write_text(d)
    tasks = prepare.file_tasks([str(tmp_path / "a.jsonl"), str(tmp_path / "b.parquet"), str(texts)], task_bytes=8_000)
    assert {t.kind for t in tasks} == {"jsonl", "parquet", "text"} and len(tasks) > 6
    m = prepare.prepare(str(tmp_path / "out"), tasks, TOKENIZER_DIR, {"files": "abc"}, workers=2, progress=False)
    assert m.num_documents == 300 and len(m.shards) == len(tasks)
    np.testing.assert_array_equal(all_tokens(str(tmp_path / "out")), encode(docs))


def test_prepare_command_is_idempotent_and_caps_exactly(tmp_path: Path, docs: list[str]) -> None:
    write_jsonl(tmp_path / "in.jsonl", docs)
    out = tmp_path / "out"
    r = run_data_cli(
        "prepare",
        str(out),
        "--tokenizer",
        TOKENIZER_DIR,
        "--files",
        str(tmp_path / "in.jsonl"),
        "--task-mb",
        "0.02",
        "--workers",
        "2",
    )
    assert r.returncode == 0, r.stderr
    assert "prepare" in r.stderr and "shard" in r.stderr  # the progress bar
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["num_tokens"] == encode(docs).size and len(manifest["shards"]) > 3
    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    r = run_data_cli(
        "prepare",
        str(out),
        "--tokenizer",
        TOKENIZER_DIR,
        "--files",
        str(tmp_path / "in.jsonl"),
        "--task-mb",
        "0.02",
        "--workers",
        "2",
    )
    assert r.returncode == 0 and {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps  # nothing redone

    total = manifest["num_tokens"]
    cap = total // 2 + 7  # inside a shard
    m = prepare.prepare(
        str(tmp_path / "cap"),
        prepare.file_tasks([str(tmp_path / "in.jsonl")], 20_000),
        TOKENIZER_DIR,
        {"files": "in"},
        max_tokens=cap,
        workers=2,
        progress=False,
    )
    assert m.num_tokens == cap
    np.testing.assert_array_equal(all_tokens(str(tmp_path / "cap")), encode(docs)[:cap])
    assert tokens_verify_clean(str(tmp_path / "cap"))
    with pytest.raises(DataError, match=f"holds {total:,} tokens, fewer than --max-tokens"):
        prepare.prepare(
            str(tmp_path / "big"),
            prepare.file_tasks([str(tmp_path / "in.jsonl")], 20_000),
            TOKENIZER_DIR,
            {"files": "in"},
            max_tokens=total + 1,
            workers=2,
            progress=False,
        )
    assert not (tmp_path / "big" / "manifest.json").exists()


def tokens_verify_clean(folder: str) -> bool:
    from titan_recover.data.tokens import verify

    return verify(folder) == []


def test_prepare_resumes_after_sigkill(tmp_path: Path, docs: list[str]) -> None:
    write_jsonl(tmp_path / "in.jsonl", docs * 4)
    args = ["--tokenizer", TOKENIZER_DIR, "--files", str(tmp_path / "in.jsonl"), "--task-mb", "0.01", "--workers", "1"]
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "titan_recover.data", "prepare", str(out), *args],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while len(list(out.glob("*.done.json"))) < 3:
        assert proc.poll() is None and time.monotonic() < deadline, "prepare ended before it could be interrupted"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out / "manifest.json").exists()
    finished = {p.name: p.stat().st_mtime_ns for p in out.glob("*.done.json")}
    (out / ".tmp.killed_inside_atomic_write").write_bytes(b"half a record")  # as a kill there leaves it
    r = run_data_cli("prepare", str(out), *args)
    assert r.returncode == 0, r.stderr
    assert all((out / name).stat().st_mtime_ns == t for name, t in finished.items())  # finished tasks were kept
    np.testing.assert_array_equal(all_tokens(str(out)), encode(docs * 4))
    assert tokens_verify_clean(str(out)) and not list(out.glob("*.tmp*"))


def test_torchtitan_hf_dataset_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, docs: list[str]) -> None:
    from datasets import load_dataset

    from titan_recover import titan

    write_jsonl(tmp_path / "local.jsonl", docs)
    cache = str(tmp_path / "hf_cache")
    datasets = titan.text_datasets()
    monkeypatch.setitem(
        datasets,
        "titan_recover_local",
        dataclasses.replace(
            next(iter(datasets.values())),
            path=str(tmp_path / "local.jsonl"),
            loader=lambda p: load_dataset("json", data_files=p, split="train", cache_dir=cache),
            sample_processor=lambda sample: sample["text"],
        ),
    )
    tasks = prepare.hf_tasks("titan_recover_local", None, rows_per_task=70)
    assert len(tasks) == 5
    prepare.prepare(
        str(tmp_path / "out"), tasks, TOKENIZER_DIR, {"dataset": "titan_recover_local"}, workers=2, progress=False
    )
    np.testing.assert_array_equal(all_tokens(str(tmp_path / "out")), encode(docs))
    with pytest.raises(DataError, match="not one of TorchTitan's text datasets"):
        prepare.hf_tasks("no_such_dataset", None)


# ------------------------------------------------------------------ launcher checks (exit 2, nothing starts)


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    out = tmp_path / "data"
    prepare.prepare_synthetic(str(out), TOKENIZER_DIR, 20_000, 2, 0, workers=1, progress=False)
    return out


def refused(tmp_path: Path, capfd: pytest.CaptureFixture[str], *overrides: str) -> str:
    """The tests' tiny job launched in-process (``launcher_in_process``) without the tests' secret, as
    ``run_job`` launches it: exit 2, nothing started, no event logged; its output."""
    dump = tmp_path / "run"
    proc = launch_argv([*job(dump, tiny=True), *overrides], capfd, env={keys.SECRET_ENV: None})
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-2000:]
    assert not (dump / "recover_events.jsonl").exists()
    return output


def test_launcher_refuses_a_truncated_shard(tmp_path: Path, folder: Path, capfd: pytest.CaptureFixture[str]) -> None:
    os.truncate(folder / "00001.ds", 1234)
    output = refused(tmp_path, capfd, FLAGS["dataset_path"], str(folder))
    assert f"error: {folder / '00001.ds'}: 1234 bytes, but manifest.json lists" in output
    assert "torchrun" not in output


def test_launcher_refuses_another_tokenizer(tmp_path: Path, folder: Path, capfd: pytest.CaptureFixture[str]) -> None:
    tok = write_standin_tokenizer(tmp_path / "tok", 2048)
    output = refused(tmp_path, capfd, FLAGS["dataset_path"], str(folder), FLAGS["assets"], str(tok))
    assert f"error: {folder / 'manifest.json'}: tokenized with another tokenizer" in output


def test_8b_config_data_path_prepares_and_loads(tmp_path: Path) -> None:
    """The 8B GPU configs' data path with a 128k-class vocabulary (a stand-in tokenizer: the real one
    needs a download): prepared, checked against llama3 8B's 128,256-row embedding, first microbatch loaded."""
    tok = write_standin_tokenizer(tmp_path / "tok", 128_000)
    write_jsonl(
        tmp_path / "c4.jsonl",
        [f"w{127_999} " + " ".join(f"w{3 + (i * 7919 + j) % 127_990}" for j in range(3000)) for i in range(12)],
    )
    r = run_data_cli("prepare", str(tmp_path / "c4"), "--tokenizer", str(tok), "--files", str(tmp_path / "c4.jsonl"))
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "c4" / "manifest.json").read_text())["dtype"] == "uint32"
    config = [
        *config_args("llama3_8b_hsdp_gpu"),
        FLAGS["assets"],
        str(tok),
        FLAGS["dataset_path"],
        str(tmp_path / "c4"),
    ]
    r = run_data_cli("check", *config)
    assert r.returncode == 0, r.stderr
    assert "36,036 tokens in 1 datatrove shards (uint32, ids < 128,000)" in r.stdout
    assert "samples of 8193 tokens" in r.stdout


def test_a_worker_killed_mid_task_ends_prepare_with_a_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, docs: list[str]
) -> None:
    """multiprocessing's pool replaces a dead worker but never answers for its task: the stall deadline does."""
    write_jsonl(tmp_path / "in.jsonl", docs * 40)
    monkeypatch.setattr(prepare, "STALL_S", 2.0)

    def kill_worker() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            children = [int(p) for p in os.listdir("/proc") if p.isdigit() and _parent(int(p)) == os.getpid()]
            workers = [c for c in children if any(f.endswith(".ds.tmp") for f in _open_files(c))]  # mid-shard
            if workers:
                os.kill(workers[0], signal.SIGKILL)
                return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_worker)
    killer.start()
    start = time.monotonic()
    with pytest.raises(DataError, match=r"no token written for 2 s while waiting for task .* a worker died"):
        prepare.prepare(
            str(tmp_path / "out"),
            prepare.file_tasks([str(tmp_path / "in.jsonl")], 1 << 30),
            TOKENIZER_DIR,
            {"files": "in"},
            workers=1,
            progress=False,
        )
    killer.join()
    assert time.monotonic() - start < 60
    assert not list((tmp_path / "out").glob("*.tmp*"))  # the dead worker's half shard was removed


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def _open_files(pid: int) -> list[str]:
    files = []
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            files.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
    except OSError:  # gone, or the fd closed meanwhile
        pass
    return files


# ------------------------------------------------------------------ records a rerun trusts


def _synthetic(out: Path, max_tokens: int | None) -> prepare.Manifest:
    return prepare.prepare_synthetic(
        str(out), TOKENIZER_DIR, 6_000, 3, 0, max_tokens=max_tokens, workers=1, progress=False
    )


def _assert_same_as_fresh(out: Path, fresh: Path, max_tokens: int | None) -> None:
    _synthetic(fresh, max_tokens)
    np.testing.assert_array_equal(all_tokens(str(out)), all_tokens(str(fresh)))
    assert tokens_verify_clean(str(out))


def test_rerun_with_another_max_tokens_redoes_the_cut_shard(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert _synthetic(out, 3_500).num_tokens == 3_500  # shard 1 (tokens 2,000..3,999) cut at 1,500
    cut = (out / "00001.ds").stat().st_mtime_ns
    assert _synthetic(out, 3_500).num_tokens == 3_500 and (out / "00001.ds").stat().st_mtime_ns == cut  # nothing redone
    os.remove(out / "manifest.json")  # the same settings again, past the manifest: the cut shard's record is kept
    assert _synthetic(out, 3_500).num_tokens == 3_500 and (out / "00001.ds").stat().st_mtime_ns == cut
    for other in (3_900, None):
        m = _synthetic(out, other)
        assert m.num_tokens == (other or 6_000)
        _assert_same_as_fresh(out, tmp_path / f"fresh{other}", other)


def test_a_crash_while_cutting_a_shard_leaves_no_record_that_lies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"

    def crash(*args: object) -> None:
        raise KeyboardInterrupt("killed after the shard was truncated")

    with monkeypatch.context() as m:
        m.setattr(prepare.tokens, "scan_shard", crash)  # _cut's step after the truncation
        with pytest.raises(KeyboardInterrupt):
            _synthetic(out, 3_500)
    assert (out / "00001.ds").stat().st_size == 2 * 1_500  # truncated
    assert _synthetic(out, None).num_tokens == 6_000
    _assert_same_as_fresh(out, tmp_path / "fresh", None)


def test_a_record_whose_shard_changed_is_not_trusted(tmp_path: Path) -> None:
    out = tmp_path / "out"
    _synthetic(out, None)
    os.truncate(out / "00001.ds", 2 * 700)  # the record of task 1 now describes a shard that is not there
    assert _synthetic(out, 5_000).num_tokens == 5_000
    _assert_same_as_fresh(out, tmp_path / "fresh", 5_000)
