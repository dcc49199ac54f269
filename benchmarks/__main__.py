"""``python -m benchmarks <command> [options]`` from the repository root."""

import sys

from .cli import main

sys.exit(main())
