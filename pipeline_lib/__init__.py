"""alignflow's library: data store, models, losses, sampling, training loops, evaluation.

Never imports prefect, flows or tasks (the layers: flows -> tasks -> pipeline_lib)."""

import importlib.metadata


def alignflow_version() -> str:
    """The installed alignflow's version: part of every cache key and sampling run id, and an MLflow tag."""
    try:
        return importlib.metadata.version("alignflow")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that is not installed
        return "unknown"
