"""``python -m gepool.cli``: the ``gepool`` command."""

import sys

from gepool.cli import main

sys.exit(main())
