"""``python -m titan_recover.coordinator``: the coordinator process (``coordinator.shell``)."""

import sys

from titan_recover.coordinator.shell import main
from titan_recover.node import procs

if __name__ == "__main__":
    procs.dumps_stacks()
    sys.exit(main(sys.argv[1:]))
