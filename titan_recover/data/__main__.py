"""``python -m titan_recover.data``: the data command line (``data.cli``)."""

import sys

from titan_recover.data.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
