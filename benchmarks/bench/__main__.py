"""``python -m benchmarks.bench [options]`` (from the repository root): the same as ``python -m benchmarks bench [options]``."""

import sys

from .cli import main

sys.exit(main())
