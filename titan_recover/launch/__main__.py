"""``python -m titan_recover.launch``: the node launcher (``launch.launcher``); with ``--check``, what it would do
(``launch.check``)."""

import os
import sys

from titan_recover.launch import check
from titan_recover.launch.launcher import main
from titan_recover.node.procs import dumps_stacks

if __name__ == "__main__":
    dumps_stacks()
    exit_code = check.main(sys.argv[1:]) if check.FLAG in sys.argv[1:] else main(sys.argv[1:])
    # Not sys.exit: the node agent's epoch thread may be blocked in a store wait or connect (C++, GIL
    # released). Returning from it during interpreter shutdown unwinds through a noexcept frame and aborts
    # the launcher (SIGABRT, "terminate called without an active exception") instead of exiting with its
    # code. main has stopped and reaped everything it started; nothing is left for finalizers to do.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)
