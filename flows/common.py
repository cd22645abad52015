"""The decorator every flow uses: a Prefect flow whose run holds the workspace's run lock, so a deployment run
started from the Prefect UI and a CLI run never write one workspace at the same time, and whose process is on
record while it runs, so that a later run can end the flow runs of a killed process."""

from __future__ import annotations

import functools
import inspect
import json
import logging
import os
import typing
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
from prefect import Flow, Task, flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (FlowRunFilter, FlowRunFilterId, TaskRunFilter, TaskRunFilterState,
                                            TaskRunFilterStateType)
from prefect.client.schemas.objects import StateType
from prefect.exceptions import ObjectNotFound, ParameterTypeError
from prefect.runtime import flow_run
from prefect.settings import get_current_settings
from prefect.states import Crashed
from pydantic import BaseModel

from pipeline_lib.config import refuse_stage_references
from pipeline_lib.errors import AlignflowError
from pipeline_lib.model_dirs import model_dir_complete
from flows.signals import exit_soon_after_sigterm
from pipeline_lib.workspace import Workspace, host_id, process_alive, workspace_lock
from tasks.common import current_workspace

R = typing.TypeVar("R")


class DropUserErrorTracebacks(logging.Filter):
    """Prefect logs a failed run's exception with its traceback; an AlignflowError already says in one line what
    is wrong (and the CLI prints it), so its traceback is dropped (any other exception keeps its own) and its text
    is kept on the record for the CLI's console (`flows.cli.ShowUserErrorOnce`). So is the traceback of the
    ParameterTypeError a deployment run's parameters get from Prefect's check, which runs the configs' validators:
    its message names the field and what is wrong (`cfg: Value error, ks [1, 2, 8]: expected values in 1..n=4`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], AlignflowError):
            record.alignflow_error = str(record.exc_info[1])
            record.exc_info, record.exc_text = None, None
        elif record.exc_info and isinstance(record.exc_info[1], ParameterTypeError):
            record.msg, record.args = f"{record.getMessage()}: {' '.join(str(record.exc_info[1]).split())}", ()
            record.exc_info, record.exc_text = None, None
        return True


# on Prefect's run and engine loggers of every process that imports a flow: the CLI's, and a deployment run's
# (`python -m prefect.engine`, started by `alignflow serve`), whose records reach the UI and serve's console
for _name in ("prefect.flow_runs", "prefect.task_runs", "prefect.engine"):
    logging.getLogger(_name).addFilter(DropUserErrorTracebacks())


def stage_flow(name: str, **flow_options) -> Callable[[Callable[..., R]], Flow]:
    """`@flow(name=name, flow_run_name=name, log_prints=True, **flow_options)` around a body that holds the run
    lock; re-entrant, so
    the pipeline flow (and the CLI, which takes the lock before Prefect starts) can run stage flows inside it."""

    def decorate(body: Callable[..., R]) -> Flow:
        @functools.wraps(body)
        def locked(*args, **kwargs) -> R:
            for value in (*args, *kwargs.values()) if name != "pipeline" else ():  # its stages get resolved ones
                if isinstance(value, BaseModel):
                    refuse_stage_references(value, origin=f"{name} parameters")
            workspace = current_workspace()
            busy = "wait for it to finish, then run this flow again"  # from the Prefect UI, a deployment's user
            exit_soon_after_sigterm()
            with workspace_lock(workspace, f"{name} flow", busy), on_record(workspace, flow_run.get_id()):
                end_orphaned_flow_runs(workspace)
                return body(*args, **kwargs)

        # Prefect validates parameters against the signature: give it the body's with real types, since string
        # annotations (`from __future__ import annotations`) would resolve in this module's namespace
        locked.__signature__ = inspect.signature(body, eval_str=True)
        locked.__annotations__ = typing.get_type_hints(body)
        # a flow run is named by its stage (Prefect would pick two random words) unless the stage names it further
        return flow(name=name, log_prints=True, **({"flow_run_name": name} | flow_options))(locked)

    return decorate


def run_model_task(task: Task, *args, refresh: bool, **kwargs) -> str:
    """Run a cached task that returns a model dir (refresh: recompute even on a cache hit). A cache hit whose
    dir has been deleted or cut since (by hand, a cleaned models/, a partial copy) recomputes it instead of
    handing the next stage a model that is gone or broken."""
    path = task.with_options(refresh_cache=refresh)(*args, **kwargs)
    if not model_dir_complete(path):
        path = task.with_options(refresh_cache=True)(*args, **kwargs)
    return path


# a recorded flow run (or its task run) in one of these states when its process is gone will never leave it:
# SCHEDULED is AwaitingRetry here (a recorded run had started), CANCELLING and PAUSED wait for that process
UNFINISHED = [StateType.PENDING, StateType.RUNNING, StateType.SCHEDULED, StateType.CANCELLING, StateType.PAUSED]


def _records(workspace: Workspace) -> Path:
    return workspace.prefect_home / "flow-runs"


def _api() -> str:
    """The Prefect API this process records its runs in: PREFECT_API_URL, or the temporary server of PREFECT_HOME
    (every process of a workspace starts its own on the same database)."""
    settings = get_current_settings()
    return str(settings.api.url or f"temporary server of {settings.home}")


def _identity(process: psutil.Process) -> list:
    """A process's pid and start time: a pid the system gave to a new process since is not the same process."""
    return [process.pid, process.create_time()]


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
    """While a flow runs, `prefect/flow-runs/<flow run id>.json` names its process, its Prefect API and the
    temporary Prefect server that process started (Prefect starts one per process when no PREFECT_API_URL is
    set); the file goes when the flow returns or raises an error. A killed process leaves it behind, and so
    does a signal (SIGTERM, Ctrl-C) ending the flow: its process is on its way out and may leave that server
    running; the next flow ends what is left once the process is gone."""
    me = psutil.Process()
    path = _records(workspace) / f"{flow_run_id}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"host": host_id(), "api": _api(), "process": _identity(me),
              "servers": [_identity(server) for server in _prefect_servers(me)]}
    partial = path.with_suffix(".tmp")
    partial.write_text(json.dumps(record))
    os.replace(partial, path)  # whole or absent: a record is never read half-written
    try:
        yield
    except Exception:
        path.unlink(missing_ok=True)
        raise
    path.unlink(missing_ok=True)


def end_orphaned_flow_runs(workspace: Workspace) -> None:
    """Mark Crashed the flow runs (and their unfinished task runs) of this workspace whose process on this host is
    gone (SIGKILL, OOM, a Ctrl-C'd `serve`), after stopping the temporary Prefect server such a process left
    running. A run recorded through another Prefect API is ended here when this API's database holds it (`alignflow
    ui`'s server and the CLI's temporary server share the workspace's); otherwise its record waits for a flow of
    that API. Called with the run lock held, so no other flow of the workspace is starting meanwhile. Best effort:
    a run it cannot end now is warned about and tried again by the next flow; it never stops the flow that calls
    it."""
    for path in sorted(_records(workspace).glob("*.json")):
        try:
            record = json.loads(path.read_text())
            ours = record["host"] == host_id()
            same_api = record["api"] == _api()
            pid, started = record["process"]
            servers = list(record["servers"])
        except (OSError, ValueError, KeyError, TypeError) as exc:  # not a record this code wrote: it names nothing
            warnings.warn(f"{path}: unreadable flow-run record ({exc!r}); removed", RuntimeWarning, stacklevel=2)
            path.unlink(missing_ok=True)
            continue
        if not ours or process_alive(pid, started):
            continue  # another host's, or still running
        try:
            _stop_servers(servers)
            held = _crash(path.stem, f"alignflow process {pid} ended without finishing this flow run (killed)")
            if held or same_api:  # ended; or gone from its own API's database (a reset Prefect home)
                path.unlink()
        except Exception as exc:  # noqa: BLE001 - cleanup of an earlier run must not fail this one
            warnings.warn(f"{path}: could not end the flow run of a killed process ({exc!r}); the next flow "
                          "will try again", RuntimeWarning, stacklevel=2)


def _stop_servers(servers: list) -> None:
    for identity in servers:
        if process_alive(*identity):
            server = psutil.Process(identity[0])
            server.terminate()
            try:
                server.wait(timeout=10)
            except psutil.TimeoutExpired:
                server.kill()


def _crash(flow_run_id: str, message: str) -> bool:
    """End a flow run and its unfinished task runs Crashed; False when this API's database does not hold it."""
    with get_client(sync_client=True) as client:
        try:
            flow_run_state = client.read_flow_run(flow_run_id).state_type
        except ObjectNotFound:
            return False
        if flow_run_state in UNFINISHED:
            client.set_flow_run_state(flow_run_id, Crashed(message=message), force=True)
        task_runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
            task_run_filter=TaskRunFilter(state=TaskRunFilterState(type=TaskRunFilterStateType(any_=UNFINISHED))))
        for task_run in task_runs:
            client.set_task_run_state(task_run.id, Crashed(message=message), force=True)
    return True
