"""Real runs on prepared data: a second model family on a multi-shard folder whose corpus runs out
mid-run (data epochs), killed and rejoined; and a token that goes bad under a running job."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import SINGLES, Run, assert_all_rejoined, assert_same_trajectory, run_job, write_jsonl

from titan_recover.data import order, prepare
from titan_recover.data.addressing import sample_indices
from titan_recover.data.synthetic import TOKENIZER_DIR, synthetic_corpus
from titan_recover.data.tokens import TokenDataset
from titan_recover.titan.jobs import FLAGS

M = 4
QWEN3 = "qwen3_debug_cpu"
DATA = [FLAGS["dataset"], "docs", FLAGS["dataset_path"]]
# the survivor waits for the admission (as test_rejoin)
SLEEP = "sleep replica=0 step=3 phase=optimizer seconds=120 until=epoch"


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """~2,700 tokens from jsonl in 3 shards: 40-odd samples of 65 tokens, 16 read per step."""
    tmp = tmp_path_factory.mktemp("small_corpus")
    write_jsonl(tmp / "docs.jsonl", list(synthetic_corpus(32, seed=4)))
    tasks = prepare.file_tasks([str(tmp / "docs.jsonl")], task_bytes=(tmp / "docs.jsonl").stat().st_size // 3 + 1)
    prepare.prepare(str(tmp / "data"), tasks, TOKENIZER_DIR, {"files": "docs"}, workers=2, progress=False)
    return tmp / "data"


@pytest.fixture(scope="module")
def qwen3_reference(tmp_path_factory: pytest.TempPathFactory, small_corpus: Path) -> Run:
    run = run_job(
        tmp_path_factory.mktemp("qwen3_ref"), *DATA, str(small_corpus), "--recover.fault_plan", "none", config=QWEN3
    )
    assert run.returncode == 0, run.output[-3000:]
    return run


def test_qwen3_on_prepared_shards_kill_rejoin_keeps_trajectory_across_data_epochs(
    tmp_path: Path, small_corpus: Path, qwen3_reference: Run
) -> None:
    windows = TokenDataset(str(small_corpus)).num_windows(64)
    assert len(TokenDataset(str(small_corpus)).manifest.shards) == 3 and 16 * 6 > 2 * windows
    expected = [(t, e) for t in range(1, 7) for e in order.epochs_started((t - 1) * 16, 16, windows)]
    assert [(e["step"], e["epoch"]) for e in qwen3_reference.of("data_epoch")] == expected
    assert "data epoch 1 begins at step" in qwen3_reference.output

    run = run_job(
        tmp_path,
        *DATA,
        str(small_corpus),
        "--recover.fault_plan",
        f"kill replica=1 rank=1 step=2 phase=backward; {SLEEP}",
        config=QWEN3,
    )
    assert run.returncode == 0, run.output[-3000:]
    assert "qwen3" in run.output
    assert_same_trajectory(qwen3_reference, run, rel_tol=1e-3, num_microbatches=M)
    assert [(e["step"], e["epoch"]) for e in run.of("data_epoch")] == expected
    assert [f["replica"] for f in run.of("failure")] == [1]
    assert any(e["replica"] == 1 for e in run.of("rejoined"))
    assert_all_rejoined(run, replicas=2, last_step=6)


def test_token_changed_under_the_run_is_a_data_error_not_a_replica_failure(tmp_path: Path) -> None:
    folder = tmp_path / "data"
    prepare.prepare_synthetic(str(folder), TOKENIZER_DIR, 20_000, 2, 0, workers=1, progress=False)
    dataset = TokenDataset(str(folder))
    windows = dataset.num_windows(64)
    # the first sample of step 2, microbatch 0 (single-rank groups: a data error is no group's): its window's
    # shard and offset
    sample = sample_indices(2, 0, 0, num_microbatches=M, shards=1, local_batch=2)[0]
    w = order.window_of(sample, windows, 0)[1]
    per_shard = [(s.tokens - 1) // 64 for s in dataset.manifest.shards]
    shard, local = (0, w) if w < per_shard[0] else (1, w - per_shard[0])
    path = dataset.path(dataset.manifest.shards[shard])
    tokens = np.fromfile(path, dtype="<u2")
    tokens[local * 64 + 5] = 4000  # the model has 2048 embedding rows; the manifest still says < 2048
    tokens.tofile(path)

    run = run_job(
        tmp_path / "run",
        *SINGLES,
        FLAGS["dataset_path"],
        str(folder),
        "--recover.fault_plan",
        "none",
        "--recover.max_restarts",
        "3",
    )
    assert run.returncode != 0
    assert f"DataError: {path}: token id 4000 at token offset {local * 64 + 5}" in run.output
    (fatal,) = run.of("fatal")
    assert fatal["error"].startswith("DataError:") and path in fatal["error"]
    assert not run.of("failure") and "restart 1 of" not in run.output  # nobody blamed, nothing restarted
    assert sorted(run.steps()) == [1]
