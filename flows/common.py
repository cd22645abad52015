"""The decorator every flow uses: a Prefect flow whose run holds the workspace's run lock, so a deployment run
started from the Prefect UI and a CLI run never write one workspace at the same time."""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable
from pathlib import Path

from prefect import Flow, Task, flow

from pipeline_lib.workspace import workspace_lock
from tasks.common import current_workspace

R = typing.TypeVar("R")


def stage_flow(name: str, **flow_options) -> Callable[[Callable[..., R]], Flow]:
    """`@flow(name=name, log_prints=True, **flow_options)` around a body that holds the run lock; re-entrant, so
    the pipeline flow (and the CLI, which takes the lock before Prefect starts) can run stage flows inside it."""

    def decorate(body: Callable[..., R]) -> Flow:
        @functools.wraps(body)
        def locked(*args, **kwargs) -> R:
            with workspace_lock(current_workspace(), f"{name} flow"):
                return body(*args, **kwargs)

        # Prefect validates parameters against the signature: give it the body's with real types, since string
        # annotations (`from __future__ import annotations`) would resolve in this module's namespace
        locked.__signature__ = inspect.signature(body, eval_str=True)
        locked.__annotations__ = typing.get_type_hints(body)
        return flow(name=name, log_prints=True, **flow_options)(locked)

    return decorate


def run_model_task(task: Task, *args, refresh: bool, **kwargs) -> str:
    """Run a cached task that returns a model dir (refresh: recompute even on a cache hit). A cache hit whose
    dir has been deleted since (by hand, or a cleaned models/) recomputes it instead of handing the next stage
    a path that is gone."""
    path = task.with_options(refresh_cache=refresh)(*args, **kwargs)
    if not Path(path).is_dir():
        path = task.with_options(refresh_cache=True)(*args, **kwargs)
    return path
