"""The shell commands the manual shows, read from its pages, and how each is checked (pure: no process,
no TorchTitan). ``tests/test_doc_commands.py`` runs the checks.

A command is a line of a fenced ``bash``/``sh``/``shell`` block (in a ``console`` block, a line after a
``$ `` prompt): lines ending in ``\\`` continue it, a ``#`` that starts a word begins its comment, leading
``NAME=value`` words are its environment, and an ``export NAME=value`` line gives the block's later
commands that environment too. A command that cannot run here is marked on the page with a reason: a
comment ``# needs: 8 GPUs`` on it, or ``<!-- needs: a Slurm cluster -->`` on the line before its block (every
command of the block). Every other command must have a check (``kind``); one with neither fails the test,
naming its page and line.
"""

from __future__ import annotations

import ast
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "README.md")
SHELL_BLOCKS = {"bash", "sh", "shell", "console"}
FENCE = re.compile(r"^\s*(```|~~~)\s*([\w+-]*)")
PROMPT = "$ "  # a console block's command lines
NEEDS = re.compile(r"\bneeds:(.*)")
BLOCK_NEEDS = re.compile(r"^\s*<!--\s*needs:(.*?)-->\s*$")
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
OPERATORS = {"|", "||", "&", "&&", ";", ";;", ">", ">>", "<", "<<", "(", ")", "2>", "&>"}

MARKED = "marked"  # cannot run here: the page says what it needs
ENVIRONMENT = "environment"  # export NAME=value: a name the code reads; the block's later commands get it
LAUNCH = "launch"  # ./run_train.sh, python -m titan_recover.launch: the job loaded as the launcher loads it
SLURM = "slurm"  # scripts/slurm/train.sbatch: its dry run, and every node's command loaded as LAUNCH
TESTS = "tests"  # ./run_tests.sh: its markers registered, its paths there, its -k naming tests
RUN = "run"  # python -m of a pure tool (RUNNABLE), run in a second
COMPARE = "compare"  # titan_recover.compare: its folders a documented run's, run on two small event logs there
PARSE = "parse"  # python -m MODULE: its arguments parsed by the module's own argparse parser
SCRIPT = "script"  # a shell script of the repository: there, executable, naming each flag given

RUNNABLE = {"titan_recover.tools.goodput": "arithmetic on the command line's numbers, a tenth of a second"}
"""Modules run for real when no argument names a file: pure, quick, writing nothing unless asked."""
LAUNCHER = "titan_recover.launch"
COMPARER = "titan_recover.compare"
SBATCH = "scripts/slurm/train.sbatch"
PYTHONS = re.compile(r"^(?:\S*/)?python(?:3(?:\.\d+)?)?$")
FILE_SUFFIXES = (".json", ".jsonl", ".toml", ".csv", ".txt", ".yaml")
PYTEST_FLAGS = {"-q", "-v", "-x", "-s", "-ra"}
"""pytest options a run_tests.sh command may pass besides -m, -k and paths."""

# what ./run_train.sh runs (mirrored here; test_doc_commands checks the script still says so)
RUN_TRAIN = "./run_train.sh"
RUN_TESTS = "./run_tests.sh"
DEFAULT_CONFIG = "./train_configs/llama3_debug_cpu.toml"
DEFAULT_RECIPE = "llama3_debug_cpu"
CHECK = "--check"  # the launcher's check of the job (titan_recover.launch.check.FLAG): the job loads without it


class Unchecked(ValueError):
    """A command with no check and no marker: the message says what to do."""


@dataclass(frozen=True)
class Command:
    page: str  # relative to the repository
    line: int  # its first line on the page
    text: str  # as written, its lines joined, its comment left out
    words: tuple[str, ...]  # the command's words after its environment
    env: dict[str, str] = field(default_factory=dict)  # its own NAME=value words and the block's exports
    own_env: tuple[str, ...] = ()  # the names it sets itself (export's included)
    needs: str | None = None  # the marker's reason ('' when it gives none)

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def split_comment(line: str) -> tuple[str, str]:
    """``line`` as its code and its comment: from a ``#`` that starts a word outside quotes."""
    quote = ""
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = ""
            elif ch == "\\" and quote == '"':
                continue
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), line[i + 1 :].strip()
    return line.rstrip(), ""


def words_of(code: str) -> list[str]:
    """The shell words of ``code``; an operator (a pipe, ``&&``, a redirection) is its own word."""
    lexer = shlex.shlex(code, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    return list(lexer)


def _logical_lines(block: list[tuple[int, str]], console: bool) -> list[tuple[int, str, str]]:
    """A block's commands as (first line, code, comment): continuation lines joined."""
    out: list[tuple[int, str, str]] = []
    pending: tuple[int, list[str], list[str]] | None = None
    for number, raw in block:
        if pending is None:
            if console:
                if not raw.startswith(PROMPT):
                    continue  # output
                raw = raw[len(PROMPT) :]
            pending = (number, [], [])
        code, comment = split_comment(raw)
        if comment:
            pending[2].append(comment)
        if code.endswith("\\"):
            pending[1].append(code[:-1].strip())
            continue
        pending[1].append(code.strip())
        out.append((pending[0], " ".join(c for c in pending[1] if c), " ".join(pending[2])))
        pending = None
    if pending is not None:
        out.append((pending[0], " ".join(c for c in pending[1] if c), " ".join(pending[2])))
    return out


def extract(text: str, page: str) -> list[Command]:
    """Every shell command of a page's fenced shell blocks."""
    commands: list[Command] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        opener, language = fence.group(1), fence.group(2).lower()
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        block_needs = BLOCK_NEEDS.match(before)
        start, i = i, i + 1
        while i < len(lines) and not lines[i].strip().startswith(opener):
            i += 1
        block = [(n + 1, lines[n]) for n in range(start + 1, i)]
        i += 1
        if language in SHELL_BLOCKS:
            commands += _commands(block, language == "console", page, block_needs.group(1) if block_needs else None)
    return commands


def _commands(block: list[tuple[int, str]], console: bool, page: str, block_needs: str | None) -> list[Command]:
    commands, exported = [], {}
    for number, code, comment in _logical_lines(block, console):
        if not code:
            continue
        try:
            words = words_of(code)
        except ValueError as e:  # an unclosed quote
            words = [f"<unparsable: {e}>"]
        env: dict[str, str] = {}
        while words and ASSIGNMENT.match(words[0]):
            name, value = words.pop(0).split("=", 1)
            env[name] = value
        if words[:1] == ["export"]:
            exports = dict(w.split("=", 1) for w in words[1:] if ASSIGNMENT.match(w))
            exported.update(exports)
            env.update(exports)
        needs = NEEDS.search(comment)
        reason = needs.group(1).strip() if needs else block_needs.strip() if block_needs is not None else None
        commands.append(Command(page, number, code, tuple(words), {**exported, **env}, tuple(env), reason))
    return commands


def page_commands() -> list[Command]:
    """Every command of the manual's pages (``PAGES``)."""
    return [c for page in PAGES for c in extract(page.read_text(), page.relative_to(ROOT).as_posix())]


def module_of(command: Command) -> tuple[str, list[str]] | None:
    """``python -m MODULE ARGS``' module and arguments; None for another program."""
    words = list(command.words)
    if len(words) >= 3 and PYTHONS.match(words[0]) and words[1] == "-m":
        return words[2], words[3:]
    return None


def names_a_file(args: list[str]) -> bool:
    return any("/" in a or a.endswith(FILE_SUFFIXES) for a in args if not a.startswith("-"))


def kind(command: Command) -> str:
    """How ``command`` is checked; ``Unchecked`` says what to do when it cannot be."""
    if command.needs is not None:
        if not command.needs:
            raise Unchecked(f"{command.where}: its needs: marker names no reason; say what it needs (e.g. 8 GPUs)")
        return MARKED
    words = list(command.words)
    operators = [w for w in words if w in OPERATORS]
    if operators:
        raise Unchecked(f"{command.where}: {command.text!r} joins commands ({' '.join(operators)}): one command a line")
    if words[0] == "export":
        return ENVIRONMENT
    if words[0] == RUN_TRAIN:
        return LAUNCH
    if words[0] == RUN_TESTS:
        return TESTS
    if words[0] == "sbatch" or words[:2] == ["bash", SBATCH]:
        if SBATCH not in words:
            raise Unchecked(f"{command.where}: sbatch of another script than {SBATCH}: mark it # needs: ...")
        return SLURM
    found = module_of(command)
    if found is not None:
        module, args = found
        if module == LAUNCHER:
            return LAUNCH
        if module == COMPARER:
            return COMPARE
        if module in RUNNABLE and not names_a_file(args):
            return RUN
        if parser_source(module) is None:
            raise Unchecked(
                f"{command.where}: python -m {module} has no argparse parser in this repository to check its "
                "arguments with: give it one, or mark the command # needs: ..."
            )
        return PARSE
    script = words[1] if words[0] == "bash" and len(words) > 1 else words[0]
    if (ROOT / script).is_file() and (script.startswith("./") or words[0] == "bash"):
        return SCRIPT
    raise Unchecked(
        f"{command.where}: no check for {command.text!r}: make it one of the checked forms (tests/doc_commands.py), "
        "or mark it on the page with what it needs: a comment '# needs: REASON' on it, or '<!-- needs: REASON -->' "
        "before its block"
    )


def module_file(module: str) -> Path | None:
    """The file ``python -m module`` runs, when the module is the repository's."""
    base = ROOT.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__main__.py"):
        if path.is_file():
            return path
    return None


def parser_source(module: str) -> Path | None:
    """The repository file that builds ``python -m module``'s argparse parser: the module's own, or that of the
    module its ``main`` comes from. None: it parses its arguments some other way (or is no module of the
    repository), and running it to parse them would run it."""
    path = module_file(module)
    if path is None:
        return None
    text = path.read_text()
    if "argparse" in text:
        return path
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom) and node.module and any(a.name == "main" for a in node.names):
            return parser_source(node.module)
    return None


def line_of(command: Command) -> str | None:
    """The TorchTitan line the command's check needs (``0.2``: TOML configs; ``0.3``: recipes), None for any."""
    words, found = list(command.words), kind_or_none(command)
    if found == LAUNCH:
        return "0.3" if command.env.get("TORCHTITAN") == "0.3.0" or "--module" in words else "0.2"
    if found == SLURM or any(w.startswith("--job.") or w.endswith(".toml") for w in words):
        return "0.2"
    return None


def kind_or_none(command: Command) -> str | None:
    try:
        return kind(command)
    except Unchecked:
        return None


def launcher_argv(command: Command) -> list[str]:
    """What ``python -m titan_recover.launch`` gets for a LAUNCH command (``./run_train.sh`` builds it)."""
    words = [w for w in command.words if w != CHECK]
    if words[0] != RUN_TRAIN:
        found = module_of(command)
        assert found is not None and found[0] == LAUNCHER, command
        return [a for a in found[1] if a != CHECK]
    if command.env.get("TORCHTITAN") == "0.3.0":
        return ["--module", "titan_recover.recipes", "--config", command.env.get("RECIPE", DEFAULT_RECIPE), *words[1:]]
    return ["--job.config_file", command.env.get("CONFIG_FILE", DEFAULT_CONFIG), *words[1:]]


def pytest_problems(args: list[str], markers: set[str], tests: dict[Path, set[str]]) -> list[str]:
    """What is wrong with ``./run_tests.sh ARGS``: a marker not registered (``markers``), a path that is not
    there, a ``-k`` that names no test of the files it runs (``tests``: each test file's test names), an option
    this check does not know."""
    problems, files, keywords = [], [], []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in ("-m", "-k", "-n") and i + 1 < len(args):
            value = args[i + 1]
            i += 2
            if arg == "-m":
                unknown = [w for w in re.findall(r"\w+", value) if w not in ("and", "or", "not") and w not in markers]
                problems += [f"-m {value!r}: marker {w!r} is not registered (pyproject.toml)" for w in unknown]
            elif arg == "-k":
                keywords += [w for w in re.findall(r"\w+", value) if w not in ("and", "or", "not")]
            continue
        i += 1
        if arg.startswith("-"):
            if arg not in PYTEST_FLAGS:
                problems.append(f"pytest option {arg!r}: not one this check knows ({sorted(PYTEST_FLAGS)})")
        elif not (ROOT / arg.split("::")[0]).exists():
            problems.append(f"{arg}: no such path")
        else:
            files.append((ROOT / arg.split("::")[0]).resolve())
    names = [n for path, found in tests.items() if not files or path in files for n in found]
    problems += [
        f"-k {k!r} names no test of {[f.name for f in files] or 'tests/'}"
        for k in keywords
        if not any(k in n for n in names)
    ]
    return problems


def test_names(path: Path) -> set[str]:
    """The test functions of a test file (and of its classes)."""
    return {
        node.name
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test")
    }


def script_problems(command: Command) -> list[str]:
    """A repository script's command: the script there and executable (or run by bash), each flag named in it."""
    words = list(command.words)
    script = words[1] if words[0] == "bash" else words[0]
    path = ROOT / script
    problems = [] if words[0] == "bash" or path.stat().st_mode & 0o111 else [f"{script} is not executable"]
    text = path.read_text()
    return problems + [
        f"{script} does not handle {flag}" for flag in words[1:] if flag.startswith("-") and flag not in text
    ]


def env_names_read(texts: list[str], names: list[str]) -> list[str]:
    """Those of ``names`` that none of the code ``texts`` mentions (a name the code reads appears in it)."""
    return [n for n in names if not any(re.search(rf"\b{re.escape(n)}\b", t) for t in texts)]
