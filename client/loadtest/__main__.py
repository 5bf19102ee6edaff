"""``python -m mtpdraft.client.loadtest ...``: the ``mtpdraft loadtest`` command."""

import sys

from .run import main

sys.exit(main())
