"""The decorator every flow uses: a Prefect flow whose run holds the workspace's run lock, so a deployment run
started from the Prefect UI and a CLI run never write one workspace at the same time, and whose process is on
record while it runs, so that a later run can end the flow runs of a killed process."""

from __future__ import annotations

import functools
import inspect
import json
import typing
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
from prefect import Flow, Task, flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (FlowRunFilter, FlowRunFilterId, TaskRunFilter, TaskRunFilterState,
                                            TaskRunFilterStateType)
from prefect.client.schemas.objects import StateType
from prefect.exceptions import ObjectNotFound
from prefect.runtime import flow_run
from prefect.states import Crashed

from pipeline_lib.workspace import Workspace, host_id, workspace_lock
from tasks.common import current_workspace

R = typing.TypeVar("R")


def stage_flow(name: str, **flow_options) -> Callable[[Callable[..., R]], Flow]:
    """`@flow(name=name, log_prints=True, **flow_options)` around a body that holds the run lock; re-entrant, so
    the pipeline flow (and the CLI, which takes the lock before Prefect starts) can run stage flows inside it."""

    def decorate(body: Callable[..., R]) -> Flow:
        @functools.wraps(body)
        def locked(*args, **kwargs) -> R:
            workspace = current_workspace()
            with workspace_lock(workspace, f"{name} flow"), on_record(workspace, flow_run.get_id()):
                end_orphaned_flow_runs(workspace)
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


UNFINISHED = [StateType.PENDING, StateType.RUNNING]


def _records(workspace: Workspace) -> Path:
    return workspace.prefect_home / "flow-runs"


def _identity(process: psutil.Process) -> list:
    """A process's pid and start time: a pid the system gave to a new process since is not the same process."""
    return [process.pid, process.create_time()]


def _still_running(identity: list) -> bool:
    pid, started = identity
    try:  # start times are computed from the boot time, which the kernel may report a little differently later
        return abs(psutil.Process(pid).create_time() - started) < 1.0
    except psutil.NoSuchProcess:
        return False


def _prefect_servers(process: psutil.Process) -> list[psutil.Process]:
    """The temporary Prefect API servers `process` started."""
    servers = []
    for child in process.children():
        try:
            if "prefect.server.api.server:create_app" in child.cmdline():
                servers.append(child)
        except psutil.NoSuchProcess:  # a child that exited during the scan
            continue
    return servers


@contextmanager
def on_record(workspace: Workspace, flow_run_id: str) -> Iterator[None]:
    """While a flow runs, `prefect/flow-runs/<flow run id>.json` names its process and the temporary Prefect
    server that process started (Prefect starts one per process when no PREFECT_API_URL is set); the file goes
    when the flow ends, by an exception too. Only a killed process leaves it behind."""
    me = psutil.Process()
    path = _records(workspace) / f"{flow_run_id}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"host": host_id(), "process": _identity(me),
                                "servers": [_identity(server) for server in _prefect_servers(me)]}))
    try:
        yield
    finally:
        path.unlink(missing_ok=True)


def end_orphaned_flow_runs(workspace: Workspace) -> None:
    """Mark Crashed the flow runs (and their unfinished task runs) of this workspace whose process on this host is
    gone (SIGKILL, OOM), and stop the temporary Prefect server such a process left running. Called with the run
    lock held, so no other flow of the workspace is starting meanwhile."""
    for path in sorted(_records(workspace).glob("*.json")):
        record = json.loads(path.read_text())
        if record["host"] != host_id() or _still_running(record["process"]):
            continue
        message = f"alignflow process {record['process'][0]} ended without finishing this flow run (killed)"
        with get_client(sync_client=True) as client:
            try:
                if client.read_flow_run(path.stem).state_type in UNFINISHED:
                    client.set_flow_run_state(path.stem, Crashed(message=message), force=True)
                    task_runs = client.read_task_runs(
                        flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[path.stem])),
                        task_run_filter=TaskRunFilter(state=TaskRunFilterState(
                            type=TaskRunFilterStateType(any_=UNFINISHED))))
                    for task_run in task_runs:
                        client.set_task_run_state(task_run.id, Crashed(message=message), force=True)
            except ObjectNotFound:  # a run of another Prefect API than the one this process uses
                pass
        for server in record["servers"]:
            if _still_running(server):
                psutil.Process(server[0]).terminate()
        path.unlink()
