"""Training stages: shared loop helpers (common.py) and one explicit loop per stage."""

import os

LAUNCH_PARENT = os.getppid()
"""This process's parent when the package was first imported, before the slow imports of a stage module run as a
torchrun worker: `data.run_main` compares it to the parent it has then, to tell whether torchrun died meanwhile."""
