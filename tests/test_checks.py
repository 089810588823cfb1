"""The checkers, run by the test command (its fast tier too): ruff's lint and format, and mypy, over
``titan_recover/``, ``bench/`` and ``tests/`` as pyproject.toml configures them. Each failure prints the
checker's own report, naming file and line."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
TREES = ["titan_recover", "bench", "tests"]


def check(*args: str) -> None:
    out = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"python -m {' '.join(args)}:\n{out.stdout[-6000:]}{out.stderr[-2000:]}"


def test_ruff_lint() -> None:
    check("ruff", "check", *TREES)


def test_ruff_format() -> None:
    """Run ``.venv/bin/ruff format titan_recover bench tests`` to fix."""
    check("ruff", "format", "--check", *TREES)


def test_mypy() -> None:
    check("mypy")  # its files, and every setting, from pyproject.toml
