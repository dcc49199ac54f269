"""``python -m hf_polybasic.tools.bench [options]``: the same as ``hf-polybasic bench [options]``."""

import sys

from .cli import main

sys.exit(main())
