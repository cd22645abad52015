"""What every task needs: the current workspace and the Prefect run ids as MLflow tags."""

from __future__ import annotations

from prefect.runtime import flow_run

from pipeline_lib.workspace import Workspace, resolve_workspace


def current_workspace() -> Workspace:
    """The workspace chosen by the CLI (`--workspace` / ALIGNFLOW_HOME), created if missing."""
    return resolve_workspace().create()


def run_tags() -> dict[str, str]:
    """MLflow tags linking a stage run to its Prefect flow run."""
    run_id = flow_run.get_id()
    return {"prefect.flow_run_id": str(run_id)} if run_id else {}
