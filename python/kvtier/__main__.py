"""`python -m kvtier`: the same as the `kvtier` command (see kvtier.cli)."""

import sys

from kvtier.cli import main

sys.exit(main())
