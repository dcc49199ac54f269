"""``python -m hf_polybasic.cli``: the ``hf-polybasic`` command."""

import sys

from .main import main

sys.exit(main())
