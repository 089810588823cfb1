"""The scheduler contract (docs/multi-node.md, "The scheduler contract") says what the code does: every exit
code the package defines is in its table with its number and nothing else is, every environment variable
the package names is there, and so is every signal a run's process handles. Schedulers act on these
numbers, so a code added, renumbered or dropped must change the page with it."""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "titan_recover"
PAGE = ROOT / "docs" / "multi-node.md"
HEADING = "## The scheduler contract"


def contract() -> str:
    """The contract's section of the page, from its heading to the next heading of its level."""
    text = PAGE.read_text()
    start = text.index(f"\n{HEADING}\n")
    end = text.find("\n## ", start + 1)
    return text[start:] if end == -1 else text[start:end]


def table(first_column: str) -> list[list[str]]:
    """The cells of each row of the section's table whose header starts ``| first_column |``."""
    lines = contract().splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_column} |"))
    rows = []
    for line in lines[header + 2 :]:  # past the header and its |---| line
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def constants(wanted: Callable[[str, object], bool]) -> dict[str, object]:
    """The package's module-level ``NAME = literal`` assignments that ``wanted(name, value)`` keeps."""
    found: dict[str, object] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
                for target in node.targets:
                    if isinstance(target, ast.Name) and wanted(target.id, node.value.value):
                        found[target.id] = node.value.value
    return found


def handled_signals() -> set[str]:
    """The signals a run's processes handle: ``signal.signal(signal.X, ...)`` and
    ``faulthandler.register(signal.X, ...)`` outside ``tools``."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        if path.relative_to(PACKAGE).parts[0] == "tools":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name)
                and (node.func.value.id, node.func.attr) in {("signal", "signal"), ("faulthandler", "register")}
                and node.args
                and isinstance(node.args[0], ast.Attribute)
            ):
                found.add(node.args[0].attr)
    return found


def test_the_exit_code_table_is_the_codes_the_package_defines() -> None:
    defined = constants(lambda name, value: name.startswith("EXIT_") and isinstance(value, int))
    assert len(defined) >= 6  # 0-5 today: the scan found them
    rows = table("exit code")
    documented = {row[1].strip("`"): int(row[0]) for row in rows}
    assert len(documented) == len(rows), "a name is in the table twice"
    assert sorted(documented.values()) == sorted(set(documented.values())), "a number is in the table twice"
    assert documented == defined
    assert all(len(row) == 4 and row[2] and row[3] for row in rows), "each code says what it means and what to do"


def variables() -> set[object]:
    """The ``TITAN_RECOVER_*`` environment variables the package names."""
    return set(constants(lambda name, value: isinstance(value, str) and value.startswith("TITAN_RECOVER_")).values())


def test_every_environment_variable_the_package_names_is_in_the_contract() -> None:
    section = contract()
    assert sorted(str(v) for v in variables() if f"`{v}`" not in section) == []


def test_every_titan_recover_variable_in_the_contract_exists() -> None:
    assert sorted(set(re.findall(r"TITAN_RECOVER_[A-Z_]+", contract())) - variables()) == []


def test_every_signal_a_run_handles_is_in_the_signal_table() -> None:
    handled = handled_signals()
    assert "SIGTERM" in handled  # the notice: the scan finds procs.on_notice
    documented = {row[0].strip("`") for row in table("signal")}
    assert sorted(handled - documented) == []
