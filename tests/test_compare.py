"""The trajectory check used by the e2e tests and `python -m titan_recover.compare`."""

import json
from pathlib import Path

import pytest

from titan_recover.compare import compare_runs, main

pytestmark = pytest.mark.unit


def step(n: int, loss: float, digest: str = "ab", microbatches: tuple[int, ...] = (0, 1, 2, 3)) -> dict:
    return {"event": "step", "step": n, "loss": loss, "data_digest": digest, "microbatches": list(microbatches)}


REF = [step(1, 8.0), step(2, 7.0, "cd")]


def test_identical_runs_agree() -> None:
    c = compare_runs(REF, [step(1, 8.0), {"event": "failure"}, step(2, 7.0 * (1 + 5e-4), "cd")], 1e-3)
    assert c.problems == [] and c.steps == 2 and 4e-4 < c.max_rel_loss_dev < 6e-4


def test_each_violation_is_named() -> None:
    c = compare_runs(REF, [step(1, 8.0, microbatches=(0, 1, 3)), step(2, 7.1, "ce"), step(2, 7.0, "cd")], 1e-3)
    text = " | ".join(c.problems)
    assert "step 2 committed twice" in text
    assert "step 1: microbatches [0, 1, 3]" in text
    c = compare_runs(REF, [step(1, 8.0), step(2, 7.1, "ce")], 1e-3)
    assert any("data_digest ce != cd" in p for p in c.problems)
    assert any("step 2: loss" in p for p in c.problems)
    assert "steps differ" in compare_runs(REF, [step(1, 8.0)], 1e-3).problems[0]


def test_cli_exit_codes(tmp_path: Path, capsys) -> None:
    ref, bad = tmp_path / "ref.jsonl", tmp_path / "bad.jsonl"
    ref.write_text("".join(json.dumps(e) + "\n" for e in REF))
    bad.write_text(json.dumps(step(1, 9.0)) + "\n")
    assert main([str(ref), str(ref)]) == 0
    assert main([str(ref), str(bad)]) == 1
    assert "DIFFERENT" in capsys.readouterr().out
