"""Prints the requirements of pyproject.toml and the extras named, one per line, without the packages
named after --without and with no version for those named after --unpin: what scripts/bootstrap.sh
installs into an environment whose torch it reuses (keeping the numpy there, installing one only where
there is none).

    python scripts/requirements.py torchtitan022,test --without torch triton --unpin numpy
"""

import argparse
import re
import sys
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    sys.exit("error: reusing an installed torch needs Python >= 3.11 (tomllib), or TORCH_FROM=pip")


def requirements(
    pyproject: dict, extras: list[str], without: set[str], unpin: frozenset[str] = frozenset()
) -> list[str]:
    project = pyproject["project"]
    wanted = list(project["dependencies"])
    for extra in extras:
        if extra not in project["optional-dependencies"]:
            raise SystemExit(f"error: pyproject.toml has no extra {extra!r}")
        wanted += project["optional-dependencies"][extra]
    name = lambda req: re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0].strip().lower()  # noqa: E731
    return list(dict.fromkeys(name(r) if name(r) in unpin else r for r in wanted if name(r) not in without))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("extras", help="comma-separated extras of pyproject.toml")
    parser.add_argument("--without", nargs="*", default=[], help="package names to leave out")
    parser.add_argument("--unpin", nargs="*", default=[], help="package names to require at any version")
    args = parser.parse_args()
    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    extras = [e for e in args.extras.split(",") if e]
    lowered = lambda names: {n.lower() for n in names}  # noqa: E731
    print("\n".join(requirements(pyproject, extras, lowered(args.without), frozenset(lowered(args.unpin)))))


if __name__ == "__main__":
    main()
