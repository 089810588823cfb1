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


def test_two_runs_that_committed_nothing_do_not_pass(tmp_path: Path, capsys) -> None:
    """A check that cannot fail when nothing ran is no check: the self-test relies on this."""
    died = tmp_path / "died.jsonl"
    died.write_text(json.dumps({"event": "failure", "replica": 0}) + "\n")
    assert main([str(died), str(died)]) == 1
    out = capsys.readouterr().out
    assert "MISMATCH no step committed in both runs" in out and "0 steps compared" in out and "DIFFERENT" in out


def digest(n: int, replica: int, value: str) -> dict:
    return {"event": "param_digest", "step": n, "replica": replica, "digest": value}


def test_exact_fails_on_one_ulp_of_loss_and_on_any_parameter_digest(tmp_path: Path, capsys) -> None:
    import math

    ref = [*REF, digest(1, 0, "d1"), digest(1, 1, "d1"), digest(2, 0, "d2")]
    same = [step(1, 8.0), digest(1, 0, "d1"), digest(1, 2, "d1"), step(2, 7.0, "cd"), digest(2, 1, "d2")]
    c = compare_runs(ref, same, 0.0, exact=True)
    assert c.problems == [] and c.digest_steps == 2
    off = [
        step(1, 8.0),
        step(2, math.nextafter(7.0, 8.0), "cd"),
        digest(1, 0, "d1"),
        digest(1, 1, "dX"),
        digest(2, 0, "d2"),
    ]
    text = " | ".join(compare_runs(ref, off, 1e-3, exact=True).problems)
    assert "step 2: loss 0x1.c000000000001p+2 != 0x1.c000000000000p+2" in text  # within any rel_tol, still refused
    assert "step 1: parameter digests ['d1', 'dX'] != ['d1']" in text
    assert compare_runs(ref, off, 1e-3).problems == []  # without --exact both pass
    nodigests = compare_runs(REF, REF, 0.0, exact=True).problems
    assert nodigests == ["no step has parameter digests in both runs: run both with recover.digest_interval 1"]
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps(e) + "\n" for e in ref))
    b.write_text("".join(json.dumps(e) + "\n" for e in off))
    assert main(["--exact", str(a), str(a)]) == 0
    assert "the same bits" in capsys.readouterr().out
    assert main(["--exact", str(a), str(b)]) == 1
    assert "MISMATCH step 2: loss" in capsys.readouterr().out
