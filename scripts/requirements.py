"""Prints the requirements of pyproject.toml and the extras named, one per line, without the packages
named after --without: what scripts/bootstrap.sh installs into an environment whose torch it reuses.

    python scripts/requirements.py torchtitan022,test --without torch triton
"""

import argparse
import re
import sys
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    sys.exit("error: reusing an installed torch needs Python >= 3.11 (tomllib), or TORCH_FROM=pip")


def requirements(pyproject: dict, extras: list[str], without: set[str]) -> list[str]:
    project = pyproject["project"]
    wanted = list(project["dependencies"])
    for extra in extras:
        if extra not in project["optional-dependencies"]:
            raise SystemExit(f"error: pyproject.toml has no extra {extra!r}")
        wanted += project["optional-dependencies"][extra]
    name = lambda req: re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0].strip().lower()  # noqa: E731
    return list(dict.fromkeys(r for r in wanted if name(r) not in without))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("extras", help="comma-separated extras of pyproject.toml")
    parser.add_argument("--without", nargs="*", default=[], help="package names to leave out")
    args = parser.parse_args()
    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    extras = [e for e in args.extras.split(",") if e]
    print("\n".join(requirements(pyproject, extras, {w.lower() for w in args.without})))


if __name__ == "__main__":
    main()
