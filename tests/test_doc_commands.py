"""The manual's shell commands work as written: each is run where that takes a second, or has its arguments
checked by what would run it (the job loaded as the launcher loads it, the module's own argparse parser, the
Slurm script's dry run, pytest's markers), or is marked on its page with what it needs. How commands are
read, and which check each gets: ``doc_commands``. A command added without either fails
``test_every_command_has_a_check_or_a_marker``, naming its page and line."""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import runpy
import subprocess
import sys
import warnings
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import doc_commands as dc
import pytest
from launcher_in_process import restored

from titan_recover.titan.jobs import LINE

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the package it was taken from, which titan_recover depends on
    import tomli as tomllib

ROOT = dc.ROOT
COMMANDS = dc.page_commands()
CODE = ("titan_recover/**/*.py", "scripts/**/*", "bench/*.py", "bench/*.sh", "*.sh")
"""Where an environment variable a command sets must be read."""
SLURM_STEP_S = 60  # a dry run of the Slurm script prints in a fraction of a second; bounded all the same


def params(kind: str) -> list[Any]:
    """The pages' commands checked as ``kind``, one test each named by page and line, skipped off their line."""
    out = []
    for command in COMMANDS:
        if dc.kind_or_none(command) != kind:
            continue
        marks: list[Any] = []
        line = dc.line_of(command)
        if line == "0.2":
            marks.append(pytest.mark.toml("a TOML config: TorchTitan 0.2's"))
        elif line == "0.3":
            why = f"TorchTitan 0.3's recipes (installed: {LINE}); TORCHTITAN=0.3.0 ./run_tests.sh -m lines checks it"
            marks += [pytest.mark.lines, pytest.mark.skipif(LINE != "0.3", reason=why)]
        out.append(pytest.param(command, id=command.where, marks=marks))
    return out


# how the pages are read ------------------------------------------------------------------------------------------


@pytest.mark.unit
def test_continuations_comments_environment_and_exports_are_read() -> None:
    page = "\n".join(
        [
            "Text, then a block:",
            "```bash",
            "# a comment line",
            "export TITAN_RECOVER_SECRET=s   # same on every node",
            "A=1 B='two words' ./run_train.sh --x.y 1 \\",
            "    --z 'has # no comment'   # the comment",
            "./run_tests.sh -m unit",
            "```",
            "```python",
            "print('not shell')",
            "```",
        ]
    )
    first, second, third = dc.extract(page, "p.md")
    assert (first.line, first.words, first.own_env) == (
        4,
        ("export", "TITAN_RECOVER_SECRET=s"),
        ("TITAN_RECOVER_SECRET",),
    )
    assert second.line == 5 and second.words == ("./run_train.sh", "--x.y", "1", "--z", "has # no comment")
    assert second.env == {"TITAN_RECOVER_SECRET": "s", "A": "1", "B": "two words"} and second.own_env == ("A", "B")
    assert third.env == {"TITAN_RECOVER_SECRET": "s"} and dc.kind(third) == dc.TESTS


@pytest.mark.unit
def test_a_console_block_has_commands_after_its_prompt_only() -> None:
    page = "```console\n$ ./run_tests.sh \\\n  -m unit\n894 passed\n$ ./run_tests.sh -q\n```\n"
    assert [(c.line, c.words) for c in dc.extract(page, "p.md")] == [
        (2, ("./run_tests.sh", "-m", "unit")),
        (5, ("./run_tests.sh", "-q")),
    ]


@pytest.mark.unit
def test_markers_need_a_reason() -> None:
    page = "```bash\nkubectl apply -f x.yaml   # needs: a Kubernetes cluster\nnvidia-smi   # needs:\n```\n"
    marked, bare = dc.extract(page, "p.md")
    assert dc.kind(marked) == dc.MARKED and marked.needs == "a Kubernetes cluster"
    with pytest.raises(dc.Unchecked, match="p.md:3: its needs: marker names no reason"):
        dc.kind(bare)
    block = "<!-- needs: a Slurm cluster -->\n\n```bash\nsinfo\nsqueue\n```\n"
    assert [(dc.kind(c), c.needs) for c in dc.extract(block, "p.md")] == [(dc.MARKED, "a Slurm cluster")] * 2


@pytest.mark.unit
def test_a_command_without_a_check_or_a_marker_is_refused_naming_its_page_and_line() -> None:
    page = "# T\n\n```sh\n.venv/bin/python -m titan_recover.compare a b\nkubectl get pods\nls | wc -l\n```\n"
    compare, unknown, piped = dc.extract(page, "docs/new.md")
    assert dc.kind(compare) == dc.COMPARE
    with pytest.raises(dc.Unchecked, match=r"docs/new.md:5: no check for 'kubectl get pods'.*# needs: REASON"):
        dc.kind(unknown)
    with pytest.raises(dc.Unchecked, match=r"docs/new.md:6: .* joins commands \(\|\)"):
        dc.kind(piped)


@pytest.mark.unit
def test_a_module_is_parsed_only_by_an_argparse_parser_of_the_repository() -> None:
    assert dc.parser_source("titan_recover.data") == ROOT / "titan_recover" / "data" / "cli.py"  # via __main__
    assert dc.parser_source("titan_recover.status") == ROOT / "titan_recover" / "status.py"
    assert dc.parser_source("pip") is None  # running it would run it


@pytest.mark.unit
def test_run_train_builds_the_launcher_command_line_mirrored_here() -> None:
    """``doc_commands.launcher_argv`` mirrors ./run_train.sh: the script must still say what it mirrors."""
    script = (ROOT / "run_train.sh").read_text()
    assert f'CONFIG_FILE=${{CONFIG_FILE:-"{dc.DEFAULT_CONFIG}"}}' in script
    assert f'--module titan_recover.recipes --config "${{RECIPE:-{dc.DEFAULT_RECIPE}}}" "$@"' in script
    assert '--job.config_file "$CONFIG_FILE" "$@"' in script


@pytest.mark.unit
def test_test_and_script_checks_name_what_is_wrong() -> None:
    markers, tests = {"unit"}, {ROOT / "tests" / "test_x.py": {"test_kill_one"}}
    assert dc.pytest_problems(["-m", "unit and not slow", "-k", "rejoin", "tests/test_x.py", "-q"], markers, tests) == [
        "-m 'unit and not slow': marker 'slow' is not registered (pyproject.toml)",
        "tests/test_x.py: no such path",
        "-k 'rejoin' names no test of tests/",
    ]
    assert dc.pytest_problems(["-k", "kill", "--lf"], markers, tests) == [
        "pytest option '--lf': not one this check knows (['-q', '-ra', '-s', '-v', '-x'])"
    ]
    (quick,) = dc.extract("```bash\n./bench/run.sh --fast\n```\n", "p.md")
    assert dc.script_problems(quick) == ["./bench/run.sh does not handle --fast"]


# every page's commands -----------------------------------------------------------------------------------------


@pytest.mark.unit
def test_every_command_has_a_check_or_a_marker() -> None:
    assert len(COMMANDS) > 40, "the pages' commands were not found: see doc_commands.extract"
    refused = []
    for command in COMMANDS:
        try:
            dc.kind(command)
        except dc.Unchecked as e:
            refused.append(str(e))
    assert refused == [], "\n".join(refused)


@pytest.mark.unit
def test_the_environment_a_command_sets_is_read_by_the_code() -> None:
    code = [p.read_text() for pattern in CODE for p in ROOT.glob(pattern) if p.is_file()]
    unread = [
        f"{c.where}: {name}" for c in COMMANDS if c.needs is None for name in dc.env_names_read(code, list(c.own_env))
    ]
    assert unread == [], f"environment variables no code of titan_recover, scripts/ or bench/ reads: {unread}"


@pytest.mark.unit
@pytest.mark.parametrize("command", params(dc.TESTS))
def test_a_test_command_runs_registered_markers_and_existing_tests(command: dc.Command) -> None:
    assert dc.pytest_problems(list(command.words[1:]), *suite()) == [], command.where


@functools.cache
def suite() -> tuple[set[str], dict[Path, set[str]]]:
    """The registered markers (pyproject.toml) and each test file's test names."""
    ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    markers = {m.split(":")[0].split("(")[0] for m in ini["markers"]}
    return markers, {p.resolve(): dc.test_names(p) for p in (ROOT / "tests").glob("test_*.py")}


@pytest.mark.unit
@pytest.mark.parametrize("command", params(dc.SCRIPT))
def test_a_script_command_names_flags_its_script_handles(command: dc.Command) -> None:
    assert dc.script_problems(command) == [], command.where


# the checks that load TorchTitan, run a module or a script ------------------------------------------------------


@functools.cache
def _load(argv: tuple[str, ...], env: tuple[tuple[str, str], ...]) -> Any:
    """The job the launcher would run for ``argv`` in the environment ``env`` (its ``node_job``), from the
    repository root; the error it would stop on, as a string."""
    from titan_recover.config import ConfigError
    from titan_recover.launch.launcher import node_job

    with restored(), pytest.MonkeyPatch.context() as mp:
        mp.chdir(ROOT)
        try:
            return node_job(list(argv), dict(env))
        except ConfigError as e:
            return f"error: {e}"
        except SystemExit as e:  # TorchTitan's parser refused a flag (it said which on stderr)
            return f"TorchTitan's command-line parser exited {e.code} (an unknown flag or a bad value: see stderr)"


def job_of(command: dc.Command) -> Any:
    """A LAUNCH command's job as the launcher loads it (``--check``: the same job, which the launcher's check
    loads), or the error it stops on."""
    from titan_recover.launch import check

    argv = tuple(a for a in dc.launcher_argv(command) if a != check.FLAG)
    return _load(argv, tuple(sorted(command.env.items())))


def loaded(command: dc.Command) -> Any:
    """``command``'s job (``job_of``); pytest fails naming the page and line where it does not load."""
    found = job_of(command)
    if isinstance(found, str):
        pytest.fail(f"{command.where}: {command.text}\n{found}")
    return found


@pytest.mark.parametrize("command", params(dc.LAUNCH))
def test_a_training_command_loads_as_the_launcher_loads_it(command: dc.Command) -> None:
    loaded(command)


def node_commands(command: dc.Command, output: str) -> list[dc.Command]:
    """Each node's ``./run_train.sh`` command from the Slurm script's dry run: ``node I (HOST): ENV... env [-u
    NAME] ENV... ./run_train.sh ARGS``."""
    nodes = []
    for line in output.splitlines():
        found = re.match(r"node \d+ \([^)]*\): (.*)", line)
        if not found:
            continue
        words, env = dc.words_of(found.group(1)), {}
        while words and words[0] != dc.RUN_TRAIN:
            word = words.pop(0)
            if word == "-u":
                words.pop(0)
            elif dc.ASSIGNMENT.match(word):
                name, value = word.split("=", 1)
                env[name] = value
        nodes.append(dc.Command(command.page, command.line, found.group(1), tuple(words), env))
    return nodes


@pytest.mark.parametrize("command", params(dc.SLURM))
def test_a_slurm_command_prints_its_plan_in_a_dry_run_and_every_node_loads(command: dc.Command, tmp_path: Path) -> None:
    """``sbatch [--nodes=N] scripts/slurm/train.sbatch ARGS`` run as its dry run (``DRY_RUN=1``, N hosts, no
    GPUs seen), as is a ``bash scripts/slurm/train.sbatch`` command; each node's command loads as the launcher
    loads it. A job that joins a run (``JOIN_RUN``) finds the run's secret where the run's job saved it."""
    words = list(command.words)
    script = words.index(dc.SBATCH)
    options = " ".join(words[1:script])
    nodes = re.search(r"(?:--nodes[= ]|-N ?)(\d+)", options)
    default = re.search(r"^#SBATCH --nodes=(\d+)", (ROOT / dc.SBATCH).read_text(), re.MULTILINE)
    assert default is not None
    count = int(nodes.group(1) if nodes else default.group(1))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TITAN_RECOVER_"))}
    env.update({"DRY_RUN": "1", "DRY_RUN_NODES": " ".join(f"node{i}" for i in range(count)), **command.env})
    if "GPUS_PER_NODE" in command.env and not {"GROUPS_PER_NODE", "RANKS_PER_GROUP"} & set(command.env):
        env["RANKS_PER_GROUP"] = str(ranks_per_group(words[script + 1 :]))  # what the script would start Python for
    if "JOIN_RUN" in command.env and not {"TITAN_RECOVER_SECRET", "TITAN_RECOVER_SECRET_FILE"} & set(command.env):
        saved = tmp_path / "secret"  # as the joined run's job left it (outputs/slurm/<run id>/secret)
        saved.write_text("0123456789abcdef0123456789abcdef\n")
        env["TITAN_RECOVER_SECRET_FILE"] = str(saved)
    done = subprocess.run(
        ["bash", dc.SBATCH, *words[script + 1 :]],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=SLURM_STEP_S,
    )
    assert done.returncode == 0, f"{command.where}: the dry run exited {done.returncode}:\n{done.stdout}{done.stderr}"
    nodes_run = node_commands(command, done.stdout)
    assert len(nodes_run) == len(env["DRY_RUN_NODES"].split()), done.stdout
    for node in nodes_run:
        loaded(node)


def ranks_per_group(args: list[str]) -> int:
    """The ranks of a replica group the Slurm script reads with GPUs on its nodes (``config.group_ranks`` of the
    job ``CONFIG [--flag value ...]``), read here from the job this process has loaded instead of a new Python's."""
    from titan_recover import config

    job = _load(("--job.config_file", *args), ())
    assert not isinstance(job, str), job
    return config.group_ranks(job.job_config.parallelism)


class Parsed(BaseException):
    """The module's parser parsed its arguments: nothing past that runs."""

    def __init__(self, result: Any) -> None:
        self.result = result


@contextmanager
def stop_after_parsing() -> Iterator[None]:
    """argparse stops the program once its outermost parse returns (a subcommand's parse is inside it)."""
    depth = 0

    def stopping(original: Any) -> Any:
        def parse(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
            nonlocal depth
            depth += 1
            try:
                result = original(self, *args, **kwargs)
            finally:
                depth -= 1
            if depth == 0:
                raise Parsed(result)
            return result

        return parse

    with pytest.MonkeyPatch.context() as mp:
        for name in ("parse_args", "parse_known_args"):
            mp.setattr(argparse.ArgumentParser, name, stopping(getattr(argparse.ArgumentParser, name)))
        yield


def run_module(
    module: str,
    args: list[str],
    cwd: Path,
    capsys: pytest.CaptureFixture[str],
    env: Mapping[str, str],
    parse_only: bool = False,
) -> tuple[Any, str]:
    """``python -m module ARGS`` in this process as ``python -m`` runs it, from ``cwd``, starting no process
    (with ``parse_only``, stopped once its arguments are parsed): its exit code (or the ``Parsed`` that stopped
    it), and what it printed."""
    capsys.readouterr()
    with restored(), pytest.MonkeyPatch.context() as mp, warnings.catch_warnings(), ExitStack() as stack:
        if parse_only:
            stack.enter_context(stop_after_parsing())
        warnings.simplefilter("ignore", RuntimeWarning)  # runpy: the module is imported already (by a test)
        mp.chdir(cwd)
        mp.setattr(sys, "argv", [module, *args])
        mp.setattr(subprocess, "Popen", _no_process)
        for name, value in env.items():
            mp.setenv(name, value)
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            outcome: Any = 0
        except Parsed as e:
            outcome = e
        except SystemExit as e:
            outcome = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    out, err = capsys.readouterr()
    return outcome, out + err


def _no_process(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("a documented command's check started a process")


@pytest.mark.parametrize("command", params(dc.PARSE))
def test_a_module_command_is_parsed_by_its_own_parser(command: dc.Command, capsys: pytest.CaptureFixture[str]) -> None:
    """Its parser takes its arguments (``--help`` exits 0); what a parser leaves (``parse_known_args``) the
    module hands to the job's config, so it loads as one (``data check``)."""
    found = dc.module_of(command)
    assert found is not None
    outcome, said = run_module(*found, ROOT, capsys, command.env, parse_only=True)
    assert isinstance(outcome, Parsed) or outcome == 0, f"{command.where}: {command.text}\nexited {outcome}: {said}"
    if isinstance(outcome, Parsed) and isinstance(outcome.result, tuple) and outcome.result[1]:
        job = _load(tuple(outcome.result[1]), ())
        assert not isinstance(job, str), f"{command.where}: {command.text}\nits job flags: {job}"


@pytest.mark.parametrize("command", params(dc.RUN))
def test_a_quick_command_runs(command: dc.Command, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    found = dc.module_of(command)
    assert found is not None
    outcome, said = run_module(*found, tmp_path, capsys, command.env)
    assert outcome == 0, f"{command.where}: {command.text}\nexited {outcome}: {said}"


def documented_dump_folders() -> set[str]:
    """Where the pages' training commands write (those this TorchTitan line loads): their dump folders."""
    from titan_recover import titan

    folders = set()
    for command in COMMANDS:
        if dc.kind_or_none(command) == dc.LAUNCH and dc.line_of(command) in (None, LINE):
            found = job_of(command)
            if not isinstance(found, str):
                folders.add(os.path.normpath(titan.dump_folder(found.job_config)))
    return folders


def small_events(exact: bool) -> str:
    """Two steps of a run's event log, with parameter digests for ``--exact``."""
    events: list[dict[str, Any]] = []
    for step in (1, 2):
        events.append({"event": "step", "step": step, "loss": 9.0 - step, "data_digest": "ab", "microbatches": [0, 1]})
        events += [{"event": "param_digest", "step": step, "replica": 0, "digest": f"d{step}"}] if exact else []
    return "".join(json.dumps(e) + "\n" for e in events)


@pytest.mark.toml("the documented runs that write the compared folders use TOML configs")
@pytest.mark.parametrize("command", params(dc.COMPARE))
def test_a_compare_command_compares_what_documented_runs_write(
    command: dc.Command, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each of its two paths is a documented run's dump folder (or that folder's event log), two different runs;
    run on two small identical event logs made at those paths, it says they agree (exit 0)."""
    found = dc.module_of(command)
    assert found is not None
    module, args = found
    paths = [a for i, a in enumerate(args) if not a.startswith("-") and (i == 0 or args[i - 1] != "--rel-tol")]
    folders = documented_dump_folders()
    runs = [
        os.path.normpath(p[: -len("/recover_events.jsonl")] if p.endswith("/recover_events.jsonl") else p)
        for p in paths
    ]
    strays = [p for p, run in zip(paths, runs) if run not in folders]
    assert len(paths) == 2 and not strays and runs[0] != runs[1], (
        f"{command.where}: {command.text}\ncompares {paths}: each must be the dump folder (or its "
        f"recover_events.jsonl) of a different run the pages document; their folders: {sorted(folders)}"
    )
    for path in paths:
        log = tmp_path / path if path.endswith(".jsonl") else tmp_path / path / "recover_events.jsonl"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(small_events(exact="--exact" in args))
    outcome, said = run_module(module, args, tmp_path, capsys, command.env)
    assert outcome == 0, f"{command.where}: {command.text}\nexited {outcome} on two identical logs: {said}"


@pytest.mark.toml("the job's TOML config")
def test_the_checks_fail_on_a_bad_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """A misspelled flag fails the job's load and a module's parse, saying so."""
    (bad_job, bad_flag) = dc.extract(
        "```bash\n./run_train.sh --training.stepz 3\n.venv/bin/python -m titan_recover.tools.goodput --gpuz 8\n```\n",
        "p.md",
    )
    assert isinstance(job_of(bad_job), str)
    found = dc.module_of(bad_flag)
    assert found is not None
    outcome, said = run_module(*found, ROOT, capsys, {}, parse_only=True)
    assert outcome == 2 and "unrecognized arguments: --gpuz 8" in said, said
