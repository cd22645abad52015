"""alignflow's library: data store, models, losses, sampling, training loops, evaluation.

Never imports prefect, flows or tasks (the layers: flows -> tasks -> pipeline_lib)."""

import functools


def alignflow_version() -> str:
    """The installed alignflow's version (an MLflow tag; `code_version` holds it)."""
    # imported here, not at the top: `import pipeline_lib` stays instant (~50 ms less), which narrows the window in
    # which a torchrun worker cannot yet see its agent die (pipeline_lib.train.LAUNCH_PARENT)
    import importlib.metadata

    try:
        return importlib.metadata.version("alignflow")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that is not installed
        return "unknown"


@functools.cache
def code_version() -> str:
    """alignflow's version and a fingerprint of its library's code (every .py file of pipeline_lib): part of every
    cache key and sampling run id, so a result is reused only by the code that made it. A release changes the
    version; an edit in a checkout, which keeps it, changes the fingerprint."""
    import hashlib
    from pathlib import Path

    root = Path(__file__).parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return f"{alignflow_version()} code {digest.hexdigest()[:16]}"
