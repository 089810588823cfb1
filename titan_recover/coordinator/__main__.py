"""``python -m titan_recover.coordinator``: the coordinator process (``coordinator.shell``)."""

import sys

from titan_recover.coordinator.shell import main
from titan_recover.node import procs
from titan_recover.observability import logs

if __name__ == "__main__":
    logs.setup("coordinator")
    procs.dumps_stacks()
    sys.exit(main(sys.argv[1:]))
