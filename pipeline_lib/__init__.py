"""alignflow's library: data store, models, losses, sampling, training loops, evaluation.

Never imports prefect, flows or tasks (the layers: flows -> tasks -> pipeline_lib)."""


def alignflow_version() -> str:
    """The installed alignflow's version: part of every cache key and sampling run id, and an MLflow tag."""
    # imported here, not at the top: `import pipeline_lib` stays instant (~50 ms less), which narrows the window in
    # which a torchrun worker cannot yet see its agent die (pipeline_lib.train.LAUNCH_PARENT)
    import importlib.metadata

    try:
        return importlib.metadata.version("alignflow")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that is not installed
        return "unknown"
