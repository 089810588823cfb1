"""The package's one logging path (``observability.logs``): handlers set up once per process by its entry
point, the prefix of the process kind, and every module's logger named by ``__name__``."""

from __future__ import annotations

import ast
import logging
import pathlib
from collections.abc import Iterator

import pytest
from launcher_in_process import restored

from titan_recover.observability import logs

pytestmark = pytest.mark.unit

REPO = pathlib.Path(__file__).resolve().parents[1]
SCRIPTS = "test_logs_scripts"  # a package of scripts, as bench's entry points name theirs
TOUCHED = (logs.ROOT, SCRIPTS, f"{logs.ROOT}.launch.launcher")


@pytest.fixture(autouse=True)
def put_back() -> Iterator[None]:
    """Puts back the loggers a test sets up, for the tests after it in this worker (made first, so they are
    among the loggers ``restored`` puts back)."""
    for name in TOUCHED:
        logging.getLogger(name)
    with restored():
        yield


@pytest.mark.parametrize(
    "kind, prefix",
    [
        ("launcher", "[titan_recover launcher]"),
        ("coordinator", "[titan_recover coordinator]"),
        ("rank", "[titan_recover]"),
    ],
)
def test_the_prefix_is_the_process_kinds_whichever_module_logs(
    kind: str, prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    logs.setup(kind)
    logging.getLogger("titan_recover.control.lifeline").info("from the lifeline")
    logging.getLogger("titan_recover.rank.manager").info("from the manager %s", 7)
    assert capsys.readouterr().out == f"{prefix} from the lifeline\n{prefix} from the manager 7\n"


def test_info_goes_to_stdout_and_warnings_and_errors_to_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    logs.setup("status")
    log = logging.getLogger("titan_recover.status")
    log.debug("not shown")
    log.info("an info")
    log.warning("a warning")
    log.error("an error")
    out, err = capsys.readouterr()  # capsys swapped sys.stdout and sys.stderr: the handlers look them up per record
    assert out == "[titan_recover status] an info\n"
    assert err == "[titan_recover status] a warning\n[titan_recover status] an error\n"


def test_a_second_setup_adds_no_handler_and_its_kind_names_the_lines(capsys: pytest.CaptureFixture[str]) -> None:
    logs.setup("launcher")
    handlers = list(logging.getLogger(logs.ROOT).handlers)
    logs.setup("selftest")
    assert logging.getLogger(logs.ROOT).handlers == handlers and len(handlers) == 2
    logging.getLogger("titan_recover.selftest").info("once")
    assert capsys.readouterr().out == "[titan_recover selftest] once\n"


def test_set_up_records_do_not_reach_the_root_logger(capsys: pytest.CaptureFixture[str]) -> None:
    """TorchTitan configures the root logger: a line that reached it too would be printed twice."""

    class Catcher(logging.Handler):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[logging.LogRecord] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.seen.append(record)

    catcher = Catcher()
    logging.getLogger().addHandler(catcher)
    try:
        logs.setup("rank")
        logging.getLogger("titan_recover.train").warning("once")
    finally:
        logging.getLogger().removeHandler(catcher)
    assert catcher.seen == [] and capsys.readouterr().err == "[titan_recover] once\n"


def test_an_entry_points_own_loggers_get_the_same_lines(capsys: pytest.CaptureFixture[str]) -> None:
    """``__main__`` (a module run as ``python -m``) and a package of scripts; a name under titan_recover
    is its logger's already and is not set up twice (its lines would be doubled)."""
    logs.setup("bench", SCRIPTS, "titan_recover.launch.launcher")
    logging.getLogger(f"{SCRIPTS}.growth").info("a sample")
    logging.getLogger("titan_recover.launch.launcher").warning("a launcher's warning")
    out, err = capsys.readouterr()
    assert out == "[titan_recover bench] a sample\n"
    assert err == "[titan_recover bench] a launcher's warning\n"
    assert logging.getLogger("titan_recover.launch.launcher").handlers == []


def test_without_setup_records_propagate_like_any_librarys(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger(logs.ROOT)
    logger.handlers[:] = []  # as in a process whose entry point is not ours
    logger.propagate = True
    with caplog.at_level(logging.INFO):
        logging.getLogger("titan_recover.rank.manager").info("in a library")
    assert [(r.name, r.getMessage()) for r in caplog.records] == [("titan_recover.rank.manager", "in a library")]


def test_a_ranks_lines_begin_with_its_replica_and_rank(capsys: pytest.CaptureFixture[str]) -> None:
    logs.setup("rank")
    log = logs.for_rank(logging.getLogger("titan_recover.train"), 1, 0)
    log.info("(attempt 1) asks to join; %s", "the membership is full")
    log.warning("sent 1.0 MiB of state to replica 2 (epoch 3)")
    out, err = capsys.readouterr()
    assert out == "[titan_recover] replica 1 rank 0: (attempt 1) asks to join; the membership is full\n"
    assert err == "[titan_recover] replica 1 rank 0: sent 1.0 MiB of state to replica 2 (epoch 3)\n"


# ---- the rule, read from the source ------------------------------------------------------------------

SOURCES = sorted((REPO / "titan_recover").rglob("*.py")) + sorted((REPO / "bench").rglob("*.py"))
SETS_UP = REPO / "titan_recover" / "observability" / "logs.py"  # the one module that names loggers


def _called(node: ast.Call) -> str:
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def _is_main_guard(node: ast.AST) -> bool:
    """``if __name__ == "__main__":``"""
    return (
        isinstance(node, ast.If)
        and isinstance(node.test, ast.Compare)
        and isinstance(node.test.left, ast.Name)
        and node.test.left.id == "__name__"
        and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in node.test.comparators)
    )


def _import_time_calls(tree: ast.Module) -> Iterator[ast.Call]:
    """The calls a module makes when imported: outside functions and ``if __name__ == "__main__":``."""
    todo: list[ast.AST] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) or _is_main_guard(node):
            continue
        if isinstance(node, ast.Call):
            yield node
        todo.extend(ast.iter_child_nodes(node))


def test_every_module_logs_through_its_own_name_and_none_configures_logging_itself() -> None:
    """``logging.getLogger(__name__)`` only (no name chosen to get a prefix), no ``basicConfig``
    (``logs.setup`` is the one place handlers come from)."""
    found = []
    for path in SOURCES:
        where = path.relative_to(REPO)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call):
                continue
            called = _called(node)
            if called == "basicConfig":
                found.append(f"{where}:{node.lineno}: basicConfig (call logs.setup(kind) in the entry point)")
            elif called == "getLogger" and path != SETS_UP:
                by_name = len(node.args) == 1 and isinstance(node.args[0], ast.Name) and node.args[0].id == "__name__"
                if not by_name or node.keywords:
                    found.append(f"{where}:{node.lineno}: {ast.unparse(node)} (want getLogger(__name__))")
    assert found == []


def test_no_module_sets_up_logging_when_imported() -> None:
    """Handlers come from an entry point (a main, or its ``__main__`` block), never from an import."""
    found = [
        f"{path.relative_to(REPO)}:{node.lineno}"
        for path in SOURCES
        for node in _import_time_calls(ast.parse(path.read_text(), str(path)))
        if _called(node) in ("setup", "addHandler")
    ]
    assert found == []


def test_a_line_lists_a_few_groups_and_spans_many() -> None:
    assert logs.id_list((0, 2, 3)) == "[0, 2, 3]"
    many = [0, *range(2, 12_500)]
    assert logs.id_list(many) == "[0, 2-12499] (12,499 groups)"
    assert logs.ranges([1, 2, 3, 7, 9, 10]) == "1-3, 7, 9-10"
