"""``python -m kvtier.bench.ttft [...]``: the same as ``kvtier bench ttft [...]``. The parent process
starts each engine phase this way (``--run-phase SPEC``, see orchestrate.launch_phase)."""

import sys

from kvtier.bench.ttft.entry import main

if __name__ == "__main__":
    sys.exit(main())
