"""Entry point: ``python -m conformance --runtime-endpoint unix:///… [--junit FILE]``."""

import sys

from conformance.cli import main

sys.exit(main())
