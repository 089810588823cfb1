"""The package's layers, read from its source: imports (also those inside functions) point down only."""

import ast
import pathlib

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


def test_the_control_plane_imports_only_itself() -> None:
    for m, deps in OURS.items():
        if m.startswith("titan_recover.control"):
            assert {d for d in deps if not d.startswith("titan_recover.control")} == set(), m


def test_nothing_imports_the_launcher_or_the_bench_tools() -> None:
    assert [m for m, deps in OURS.items() if "titan_recover.launch" in deps] == []
    assert [m for m, deps in OURS.items() if any(d.startswith("titan_recover.tools") for d in deps)
            and not m.startswith("titan_recover.tools")] == []


def test_only_the_adapter_imports_torchtitan() -> None:
    """Every contact with TorchTitan is in ``titan_recover.titan``: one module per TorchTitan line."""
    users = {m for m, deps in GRAPH.items() if any(d == "torchtitan" or d.startswith("torchtitan.") for d in deps)}
    assert users and users <= {m for m in GRAPH if m.startswith("titan_recover.titan.")}, users


def test_the_adapter_stands_below_the_trainers() -> None:
    """The adapter uses only the CPU shim and the ``[recover]`` section (which import no TorchTitan),
    so the trainers, the data path and the launcher may all import it without a circle."""
    for m, deps in OURS.items():
        if m == "titan_recover.titan" or m.startswith("titan_recover.titan."):
            below = {"titan_recover", "titan_recover.cpu_shim", "titan_recover.config"}
            assert {d for d in deps if not d.startswith("titan_recover.titan")} <= below, m


def test_every_torchtitan_line_defines_the_whole_interface() -> None:
    """``titan_recover.titan`` loads the installed line's module and takes ``INTERFACE`` from it: each
    line's module must define every name, read from its source (so both lines are checked on either)."""
    tree = ast.parse((ROOT / "titan" / "__init__.py").read_text())
    found = {n.targets[0].id: n.value for n in tree.body if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name)}
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
