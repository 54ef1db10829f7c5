"""``python -m kvlab``: the CLI, for launchers that start a module (``torchrun -m kvlab serve ...``)."""

import sys

from kvlab.cli import main

sys.exit(main())
