"""Writes tests/durations.json, the seconds each test file took, from a pytest run's ``--durations=0`` report.

    PYTEST_ADDOPTS=--durations=0 ./run_tests.sh > suite.log 2>&1; python scripts/test_durations.py suite.log

``tests/conftest.py`` runs the files heaviest first from that file: with ``--dist loadfile`` each of the
workers takes the next file as it frees up, so a heavy file queued last would stretch the suite's end. A file's
figure is the sum of its tests' setup, call and teardown (a session fixture's run counts where it was made).
"""

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

LINE = re.compile(r"^(\d+(?:\.\d+)?)s (?:setup|call|teardown)\s+tests/([\w.]+\.py)::")
OUT = Path(__file__).resolve().parents[1] / "tests" / "durations.json"


def per_file(report: str) -> dict[str, float]:
    """Each test file's seconds in ``report`` (pytest's ``--durations`` lines), heaviest first."""
    seconds: dict[str, float] = defaultdict(float)
    for line in report.splitlines():
        if m := LINE.match(line.strip()):
            seconds[m.group(2)] += float(m.group(1))
    return {name: round(s, 1) for name, s in sorted(seconds.items(), key=lambda kv: -kv[1])}


def main(paths: list[str]) -> int:
    if not paths:
        print(__doc__, file=sys.stderr)
        return 2
    found = [per_file(Path(p).read_text()) for p in paths]
    if not all(found):
        print(f"error: no --durations lines in {[p for p, f in zip(paths, found) if not f]}", file=sys.stderr)
        return 2
    names = set().union(*found)  # several runs: each file's median would need 3; their mean
    mean = {n: round(sum(f.get(n, 0.0) for f in found) / len(found), 1) for n in names}
    OUT.write_text(json.dumps(dict(sorted(mean.items(), key=lambda kv: -kv[1])), indent=1) + "\n")
    print(f"{OUT}: {len(mean)} files, {sum(mean.values()):.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
