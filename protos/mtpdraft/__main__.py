"""`python -m mtpdraft` is the `mtpdraft` command."""

import sys

from mtpdraft.service.cli import main

sys.exit(main())
