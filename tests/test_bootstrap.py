"""scripts/bootstrap.sh: into an environment that has torch already, from a folder of wheels, offline (what a
cluster's container without internet needs, ``TORCH_FROM=env WHEELS=DIR``), and which packages it installs where
(the training install without the test tools, the tests adding only theirs, an environment with a torch of its own).

The environment with torch is made here from this suite's own: a folder holding only torch, triton and
what torch needs (links into ./.venv), as a CUDA image holds them; the wheel folder holds everything
else the TorchTitan 0.2 line needs, fetched with ``pip download`` (pip's cache serves it after the
suite's environment was made). The package index is pointed at a closed port, so any install that
reaches for the network fails.
"""

import fcntl
import os
import shlex
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
LINE_REQUIREMENTS = subprocess.run(
    [sys.executable, str(ROOT / "scripts" / "requirements.py"), "torchtitan022"],
    capture_output=True,
    text=True,
    check=True,
).stdout.split()


def closure(roots: list[str]) -> dict[str, metadata.Distribution]:
    """The installed distributions ``roots`` need, themselves included (extras left out)."""
    seen: dict[str, metadata.Distribution] = {}
    todo = list(roots)
    while todo:
        req = Requirement(todo.pop())
        if req.marker and not req.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(req.name)
        if name not in seen:
            seen[name] = metadata.distribution(name)
            todo += seen[name].requires or []
    return seen


def torch_environment(where: Path) -> Path:
    """A site folder with torch, triton and their needs only, linked from this suite's environment."""
    where.mkdir()
    for dist in closure(["torch", "triton"]).values():
        for file in dist.files or []:
            top = Path(str(file)).parts[0]
            if not top.startswith(".."):  # a script in bin/ is not the package
                source = Path(str(dist.locate_file(top)))
                if source.exists() and not (where / top).exists():
                    (where / top).symlink_to(source)
    return where


@pytest.mark.toml("the wheel folder is the 0.2 line's")
def test_a_torch_environment_gets_the_rest_from_a_wheel_folder_offline(tmp_path: Path) -> None:
    site = torch_environment(tmp_path / "image")
    have = set(closure(["torch", "triton"]))
    wanted = {n: d.version for n, d in closure(LINE_REQUIREMENTS).items() if n not in have}
    wheels = tmp_path / "wheels"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--only-binary=:all:",
            "-d",
            str(wheels),
            *(f"{n}=={v}" for n, v in wanted.items()),
        ],
        check=True,
        timeout=900,
    )
    env = {
        **os.environ,
        "TORCH_FROM": "env",
        "PYTHON": sys.executable,
        "PYTHONPATH": str(site),
        "WHEELS": str(wheels),
        "VENV": str(tmp_path / "env"),
        "EXTRAS": "none",
        "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
        "PIP_COMPILE": "0",  # byte-compiling every dependency is half a minute that checks nothing here
    }
    made = subprocess.run(
        ["bash", "-c", "source scripts/bootstrap.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    assert made.returncode == 0, made.stderr[-3000:]
    assert f"[bootstrap] reusing torch {metadata.version('torch')} from {site}" in made.stderr
    python = tmp_path / "env" / "bin" / "python"
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the environment alone now: its .pth line
    seen = subprocess.run(
        [str(python), "-c", "import titan_recover.titan as t, torch, torchtitan; print(torch.__file__); print(t.LINE)"],
        cwd=tmp_path,
        env=clean,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert seen.returncode == 0, seen.stderr[-3000:]
    assert seen.stdout.split() == [str(site / "torch" / "__init__.py"), "0.2"]
    own = next((tmp_path / "env" / "lib").glob("python*/site-packages"))
    assert not (own / "torch").exists() and (own / "torchtitan").is_dir()  # torch reused, the rest installed
    # the job's checks run in it: the preflight of the default job, through the self-test
    check = subprocess.run(
        [str(python), "-m", "titan_recover.selftest", "--only", "preflight"],
        cwd=ROOT,
        env=clean,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert check.returncode == 0 and "self-test PASSED" in check.stdout, check.stdout[-2000:] + check.stderr[-2000:]
    again = subprocess.run(
        ["bash", "-c", "source scripts/bootstrap.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert again.returncode == 0 and "setting up" not in again.stderr  # made once: its stamp holds
    wrong = subprocess.run(
        ["bash", "-c", "source scripts/bootstrap.sh"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**env, "VENV": str(tmp_path / "other"), "PYTHONPATH": "", "PYTHON": "/usr/bin/env"},
    )
    assert wrong.returncode == 2 and "TORCH_FROM=env: /usr/bin/env cannot import torch" in wrong.stderr


# ---- which packages a run installs where: scripts/bootstrap.sh's decisions, with a python that records them

STAMP = ".titan_recover-installed"
PIN = "torch==2.13.0"  # the 0.2.2 line's


def recording_environment(where: Path) -> tuple[Path, Path]:
    """An environment whose ``bin/python`` writes each call's arguments to a log and takes pip's calls as done;
    any other call runs in this suite's python (its torch and numpy). Returns it and its log."""
    log = where.parent / f"{where.name}.calls"
    (where / "bin").mkdir(parents=True)
    python = where / "bin" / "python"
    python.write_text(
        "#!/usr/bin/env bash\n"
        f'printf "%s\\n" "$*" >> {shlex.quote(str(log))}\n'
        '[ "$1 $2" = "-m pip" ] && exit 0\n'
        f'exec {shlex.quote(sys.executable)} "$@"\n'
    )
    python.chmod(0o755)
    return where, log


def bootstrap(venv: Path, extras: str) -> subprocess.CompletedProcess[str]:
    """``source scripts/bootstrap.sh`` as ./run_train.sh (``extras`` none) or ./run_tests.sh (test) do, on the 0.2.2
    line; PYTHON=false: a new virtualenv would fail at once."""
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_FROM", "WHEELS", "PYTHONPATH")}
    env |= {"VENV": str(venv), "EXTRAS": extras, "TORCHTITAN": "0.2.2", "PYTHON": "false"}
    return subprocess.run(
        ["bash", "-c", "source scripts/bootstrap.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


def calls(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def test_the_training_install_has_no_test_tools_and_the_tests_add_only_theirs(tmp_path: Path) -> None:
    """./run_train.sh's environment (the line's extra alone), then ./run_tests.sh: it adds the test extra and
    nothing else; an environment with the test extra serves ./run_train.sh as it is."""
    venv, log = recording_environment(tmp_path / "venv")
    (venv / STAMP).write_text((ROOT / "pyproject.toml").read_text() + "extras: torchtitan022\n")
    same = bootstrap(venv, "none")
    assert same.returncode == 0 and same.stderr == "" and calls(log) == [], same.stderr
    added = bootstrap(venv, "test")
    assert added.returncode == 0, added.stderr
    assert "[bootstrap] adding the extras test to" in added.stderr and "setting up" not in added.stderr
    assert calls(log) == ["-m pip install -e .[torchtitan022,test]"]  # no torch, no pip upgrade
    assert (venv / STAMP).read_text().endswith("extras: torchtitan022,test\n")
    for extras in ("none", "test"):  # a superset serves both
        again = bootstrap(venv, extras)
        assert again.returncode == 0 and again.stderr == "", again.stderr
    assert len(calls(log)) == 1


def test_an_environment_with_its_own_torch_gets_only_the_rest_beside_its_torch_and_numpy(tmp_path: Path) -> None:
    """VENV naming a conda environment or a container's, with torch and no titan_recover stamp: no torch pin,
    pip held to its torch and numpy, one line saying so; the environment is not made anew next time."""
    venv, log = recording_environment(tmp_path / "conda")
    made = bootstrap(venv, "none")
    assert made.returncode == 0, made.stderr
    (said,) = [line for line in made.stderr.splitlines() if "of its own" in line]
    assert "never torch, triton or numpy" in said
    assert f"[bootstrap] reusing torch {metadata.version('torch')}" in made.stderr
    pip = [c for c in calls(log) if c.startswith("-m pip")]
    assert pip == [
        f"-m pip install -c {venv}/constraints.txt -r {venv}/requirements.txt",
        "-m pip install --no-deps --no-build-isolation -e .",
    ]
    assert not any("venv" in c.split()[:2] or PIN in c for c in calls(log))
    held = (venv / "constraints.txt").read_text().split()
    assert f"torch=={metadata.version('torch')}" in held and f"numpy=={metadata.version('numpy')}" in held
    wanted = (venv / "requirements.txt").read_text().split()
    assert "numpy" in wanted and not [r for r in wanted if r.startswith(("torch==", "triton", "numpy=="))]
    assert "torchtitan==0.2.2" in wanted and not [r for r in wanted if r.startswith("pytest")]
    assert not list(venv.glob("**/titan_recover_torch.pth"))  # its torch is its own: no link to another
    before = len(calls(log))
    again = bootstrap(venv, "none")
    assert again.returncode == 0 and again.stderr == "" and len(calls(log)) == before


def test_an_environment_this_script_made_keeps_the_pinned_torch(tmp_path: Path) -> None:
    """A virtualenv bootstrap made, whose first install stopped before the stamp, is not taken for one with a torch
    of its own: the pinned torch goes in. A folder with bin/python3 alone (a container's /usr) is never made one."""
    venv, log = recording_environment(tmp_path / "venv")
    (venv / ".titan_recover-made").touch()
    made = bootstrap(venv, "none")
    assert made.returncode == 0 and "of its own" not in made.stderr, made.stderr
    assert calls(log) == ["-m pip install --upgrade pip", f"-m pip install {PIN}", "-m pip install -e .[torchtitan022]"]
    usr = tmp_path / "usr"
    (usr / "bin").mkdir(parents=True)
    (usr / "bin" / "python3").symlink_to(sys.executable)
    refused = bootstrap(usr, "none")
    assert refused.returncode == 2 and "has bin/python3 but no bin/python" in refused.stderr
    assert sorted(p.name for p in usr.iterdir()) == ["bin"]  # nothing written there


def test_bootstraps_of_one_environment_at_once_take_turns_and_the_command_after_holds_no_lock(tmp_path: Path) -> None:
    """The launchers of a multi-node job share one environment and bootstrap together: while one holds the
    environment's lock, another says it waits and installs nothing; it then finds the extra it lacked and adds it.
    The lock is released before the command runs (a test run holding it would stall every node's launcher)."""
    venv, log = recording_environment(tmp_path / "venv")
    (venv / STAMP).write_text((ROOT / "pyproject.toml").read_text() + "extras: torchtitan022\n")
    lock = venv / ".titan_recover-lock"
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_FROM", "WHEELS", "PYTHONPATH")}
    env |= {"VENV": str(venv), "EXTRAS": "test", "TORCHTITAN": "0.2.2", "PYTHON": "false"}
    after = f"source scripts/bootstrap.sh && flock -n {shlex.quote(str(lock))} echo free"
    with lock.open("a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        waiting = subprocess.Popen(
            ["bash", "-c", after], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        assert waiting.stderr is not None
        said = waiting.stderr.readline()  # the first line is the wait's, before any install
        assert said.startswith(f"[bootstrap] another bootstrap is setting up {venv}: waiting"), said
        assert waiting.poll() is None and calls(log) == []
    out, err = waiting.communicate(timeout=60)
    assert waiting.returncode == 0 and out == "free\n", err
    assert calls(log) == ["-m pip install -e .[torchtitan022,test]"]
