"""The package's layers, read from its source: imports (also those inside functions) point down only."""

import ast
import pathlib
import re
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.unit, pytest.mark.lines]

ROOT = pathlib.Path(__file__).resolve().parents[1] / "titan_recover"


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: pathlib.Path) -> set[str]:
    """Every module ``path`` imports, wherever the import statement stands."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


GRAPH = {module_name(p): imports(p) for p in ROOT.rglob("*.py")}
OURS = {m: {d for d in deps if d in GRAPH and d != m} for m, deps in GRAPH.items()}


def test_no_import_circles() -> None:
    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for d in OURS[todo.pop()]:
                if d not in seen:
                    seen.add(d)
                    todo.append(d)
        return seen

    assert [m for m in OURS if m in reach(m)] == []


LAYERS: dict[str, set[str]] = {
    # subpackage (or top-level module) -> the layers it may import; the package's layers, bottom up
    "control": set(),
    "policy": {"control"},
    "observability": {"control"},
    "config": {"control", "policy"},
    "node": {"control", "policy", "observability", "config"},
    "titan": {"config"},
    "data": {"control", "config", "policy", "titan"},
    "coordinator": {"control", "policy", "observability", "node", "config"},
    "rank": {"control", "policy", "observability", "node", "config", "data", "titan"},
    "launch": {"control", "policy", "observability", "node", "config", "data", "titan"},
    "tools": {"control", "node", "observability", "titan"},
    # the commands users and torchrun name (python -m titan_recover.X, custom_import, --module)
    "train": {"control", "policy", "observability", "node", "config", "data", "titan", "rank"},
    "train_spec": {"data", "titan"},
    "recipes": {"titan"},
    "status": {"control", "observability"},
    "drain": {"control", "observability"},
    "compare": {"control", "observability"},
    "selftest": {"control", "policy", "observability", "node", "config", "titan", "rank", "launch", "compare"},
}


def layer(module: str) -> str:
    """``titan_recover.rank.manager`` -> ``rank``; ``titan_recover.train`` -> ``train``."""
    return module.split(".")[1]


def test_every_module_has_a_layer() -> None:
    assert sorted({layer(m) for m in GRAPH if m != "titan_recover"} - set(LAYERS)) == []
    assert sorted(set(LAYERS) - {layer(m) for m in GRAPH if m != "titan_recover"}) == []


def test_each_layer_imports_only_what_the_table_allows() -> None:
    wrong = sorted(
        f"{m} imports {d}"
        for m, deps in OURS.items()
        if m != "titan_recover"
        for d in deps
        if d != "titan_recover" and layer(d) != layer(m) and layer(d) not in LAYERS[layer(m)]
    )
    assert wrong == []


def test_the_table_has_no_circles() -> None:
    """Each layer's allowed imports stand below it: the table itself is a partial order."""
    order: list[str] = []
    while len(order) < len(LAYERS):
        ready = [name for name, below in LAYERS.items() if name not in order and below <= set(order)]
        assert ready, f"a circle among {sorted(set(LAYERS) - set(order))}"
        order.extend(ready)


def documented_layers() -> dict[str, set[str]]:
    """``docs/architecture.md``'s layer table: each row's layer and the layers named before its first ``:``
    or ``;`` (outside parentheses)."""
    rows: dict[str, set[str]] = {}
    for line in (ROOT.parent / "docs" / "architecture.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and (name := re.fullmatch(r"`(\w+)(?:/|\.py)`", cells[0])):
            allowed = re.sub(r"\([^)]*\)", "", re.split(r"[:;]", cells[2])[0])
            rows[name.group(1)] = set(re.findall(r"`(\w+)`", allowed))
    return rows


def test_the_manuals_layer_table_is_this_one() -> None:
    """The architecture page restates ``LAYERS`` for its subpackages and ``config.py``: the two must agree."""
    doc = documented_layers()
    assert set(doc) == {"config", *(p.name for p in ROOT.iterdir() if (p / "__init__.py").exists())}, sorted(doc)
    assert doc == {name: LAYERS[name] for name in doc}


def test_the_coordinator_process_imports_no_torchtitan() -> None:
    """``python -m titan_recover.coordinator`` gets the job's settings as a record from its launcher."""
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "titan_recover.coordinator", "--help"],
        cwd=ROOT.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    assert "titan_recover.coordinator.shell" in imported
    assert sorted(m for m in imported if m.split(".")[0] == "torchtitan") == []


def test_only_the_adapter_imports_torchtitan() -> None:
    """Every contact with TorchTitan is in ``titan_recover.titan``: one module per TorchTitan line."""
    users = {m for m, deps in GRAPH.items() if any(d == "torchtitan" or d.startswith("torchtitan.") for d in deps)}
    assert users and users <= {m for m in GRAPH if m.startswith("titan_recover.titan.")}, users


def test_the_adapter_stands_below_the_trainers() -> None:
    """The adapter uses only the CPU shim and the ``[recover]`` section (which import no TorchTitan),
    so the trainers, the data path and the launcher may all import it without a circle."""
    for m, deps in OURS.items():
        if m == "titan_recover.titan" or m.startswith("titan_recover.titan."):
            below = {"titan_recover", "titan_recover.titan.cpu_shim", "titan_recover.config"}
            assert {d for d in deps if not d.startswith("titan_recover.titan")} <= below, m


def test_every_torchtitan_line_defines_the_whole_interface() -> None:
    """``titan_recover.titan`` loads the installed line's module and takes ``INTERFACE`` from it: each
    line's module must define every name, read from its source (so both lines are checked on either)."""
    tree = ast.parse((ROOT / "titan" / "__init__.py").read_text())
    found = {
        n.targets[0].id: n.value for n in tree.body if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name)
    }
    interface, lines = ast.literal_eval(found["INTERFACE"]), ast.literal_eval(found["LINES"])
    assert set(lines) == {"0.2", "0.3"}
    for module in lines.values():
        defined: set[str] = set()
        for node in ast.parse((ROOT / "titan" / f"{module}.py").read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, ast.Assign):
                defined.update(t.id for t in node.targets if isinstance(t, ast.Name))
            elif isinstance(node, ast.ImportFrom):
                defined.update(a.asname or a.name for a in node.names)
        assert set(interface) - defined == set(), module
