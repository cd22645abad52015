"""Prefect flows: one per stage (runnable and schedulable alone) and pipeline.py chaining them.

Kept free of imports so the CLI can set PREFECT_HOME before prefect loads."""
