"""scripts/bootstrap.sh into an environment that has torch already, from a folder of wheels, offline:
what a cluster's container without internet needs (``TORCH_FROM=env WHEELS=DIR``).

The environment with torch is made here from this suite's own: a folder holding only torch, triton and
what torch needs (links into ./.venv), as a CUDA image holds them; the wheel folder holds everything
else the TorchTitan 0.2 line needs, fetched with ``pip download`` (pip's cache serves it after the
suite's environment was made). The package index is pointed at a closed port, so any install that
reaches for the network fails.
"""

import os
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
