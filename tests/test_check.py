"""``python -m titan_recover.launch --check`` (``./run_train.sh --check``): what a run would do on this node, or each
problem that would stop it, naming the key to change; nothing started. In this process (``launcher_in_process``:
``subprocess.Popen`` raises, so a check that started a process would fail), bar one smoke test of the entry point."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import doc_commands
import pytest
from launcher_in_process import ROOT, run_main

from titan_recover.control import keys
from titan_recover.launch import check
from titan_recover.titan.jobs import TRAIN_CONFIGS

SHIPPED = sorted(TRAIN_CONFIGS.glob("*.toml"))
GPU_8B = [p for p in SHIPPED if p.name.startswith("llama3_8b")]
TOKENIZER_8B = "model.hf_assets_path: no tokenizer at ./assets/hf/Llama-3.1-8B"
pytestmark = pytest.mark.toml("the shipped TOML configs")


def run_check(capfd: pytest.CaptureFixture[str], *argv: str, env: dict[str, str | None] | None = None):
    return run_main(check.main, [check.FLAG, *argv], capfd, env)


def problems(stdout: str) -> list[str]:
    return re.findall(r"^  - (.*)$", stdout, re.MULTILINE)


@pytest.mark.unit
@pytest.mark.parametrize("config", SHIPPED, ids=lambda p: p.stem)
def test_each_shipped_config_gets_its_verdict(config: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """The CPU configs would run here (exit 0); the 8B ones stop, each problem naming its key: no tokenizer, no data
    (with the command that prepares the run's tokens)."""
    done = run_check(capfd, "--job.config_file", str(config))
    out = done.stdout
    for label in ("replica groups", "microbatches", "quotas", "this node", "control store", "GPUs seen", "timeouts"):
        assert re.search(rf"^  {label} +: ", out, re.MULTILINE), f"no {label!r} line:\n{out}"
    assert "M = global_batch_size / (local_batch_size x data_parallel_shard_degree) = " in out
    if config not in GPU_8B:
        assert done.returncode == 0 and problems(out) == [], out
        assert "verdict: the launcher would start this run (exit 0)" in out
        return
    assert done.returncode == 2, out
    assert re.search(r"= (64 / \(1 x 8\)|32 / \(1 x 4\)) = 8 per step", out), out
    tokenizer, data = problems(out)
    assert tokenizer.startswith(TOKENIZER_8B)
    budget = {"llama3_8b_hsdp_gpu": 530_000_000, "llama3_8b_hsdp_tp_gpu": 265_000_000}[config.stem]
    assert data.startswith("training.dataset_path: './data/c4_llama3' does not exist")
    assert (
        "python -m titan_recover.data prepare ./data/c4_llama3 --dataset c4 --tokenizer ./assets/hf/Llama-3.1-8B "
        f"--max-tokens {budget}" in data
    )
    assert "verdict: the launcher would stop before starting anything (exit 2)" in out


@pytest.mark.unit
def test_a_broken_job_and_node_name_each_key_to_change(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """A job whose data folder is missing, on a node that runs one group of two without a coordinator address or
    secret: every problem is listed, not only the first, and each names what to change."""
    broken = tmp_path / "broken.toml"
    toml = (TRAIN_CONFIGS / "llama3_debug_cpu.toml").read_text()
    broken.write_text(
        toml.replace('dataset = "synthetic"', 'dataset = "c4"').replace("./data/synthetic", str(tmp_path))
    )
    env = {keys.REPLICAS_ENV: "0", keys.SECRET_ENV: None, keys.COORDINATOR_ENV: None}
    done = run_check(capfd, "--job.config_file", str(broken), "--training.dataset_path", str(tmp_path / "no"), env=env)
    assert done.returncode == 2, done.stdout
    bind, secret, data = problems(done.stdout)
    assert "set [recover] coordinator_bind to this node's address" in bind
    assert f"set {keys.SECRET_ENV} to the same value for each node's launcher" in secret
    assert data.startswith(f"training.dataset_path: '{tmp_path / 'no'}' does not exist")
    assert "--max-tokens 1000000" in data  # the run's 30 x 16 samples of 129 tokens, rounded up
    assert f"replica groups [0] of 0..1 ({keys.REPLICAS_ENV}" not in done.stdout  # it is set: no "unset" note
    assert "replica groups [0] of 0..1, 2 ranks of each here: 2 ranks" in done.stdout


@pytest.mark.unit
def test_a_config_that_does_not_load_is_one_problem_naming_its_key(capfd: pytest.CaptureFixture[str]) -> None:
    done = run_check(capfd, "--job.config_file", str(TRAIN_CONFIGS / "llama3_debug_cpu.toml"), "--training.steps", "0")
    assert done.returncode == 2
    assert problems(done.stdout) == ["training.steps must be an integer >= 1, got 0"]


def test_the_launchers_check_flag_is_the_check() -> None:
    """In a real process: ``python -m titan_recover.launch --check`` runs the check (its exit code, no traceback).
    The manual's checked commands know the flag (``doc_commands.CHECK``)."""
    assert doc_commands.CHECK == check.FLAG
    done = subprocess.run(
        [sys.executable, "-m", "titan_recover.launch", "--job.config_file", str(GPU_8B[0]), check.FLAG],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and f"  - {TOKENIZER_8B}" in done.stdout, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and "coordinator at" not in done.stdout


@pytest.mark.unit
def test_a_torch_outside_the_range_is_the_only_problem_the_check_can_name(
    capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """As the launcher, the check stops at a torch it does not support, before TorchTitan's import."""
    import torch

    monkeypatch.setattr(torch, "__version__", "2.15.0a0+git1234")
    done = run_check(capfd, "--job.config_file", str(TRAIN_CONFIGS / "llama3_debug_cpu.toml"))
    assert done.returncode == 2
    (problem,) = problems(done.stdout)
    assert problem.startswith("torch 2.15.0a0+git1234 (") and "2.11 <= torch < 2.15" in problem
