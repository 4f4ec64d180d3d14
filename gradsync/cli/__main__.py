"""`python -m gradsync.cli`: the `gradsync` command."""

import sys

from gradsync.cli import main

if __name__ == "__main__":
    sys.exit(main())
