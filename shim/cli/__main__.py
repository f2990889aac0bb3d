"""`python -m shim.cli`: the `podshim` command, as the console script runs it."""

import sys

from shim.cli import main

sys.exit(main())
