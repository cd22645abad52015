"""MLflow helpers: the workspace's experiment, stage runs (nested under a pipeline run), logging.

The only module that imports mlflow. Library code receives a `log(metrics, step)` callable;
`stage_run` supplies the MLflow one, `no_log` is for unit tests. Callers in tasks/ pass the
Prefect flow-run id as a tag (`prefect.flow_run_id`)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlflow
from mlflow.tracking import MlflowClient
from pydantic import BaseModel

from pipeline_lib.logfns import LogFn, print_log
from pipeline_lib.workspace import Workspace

EXPERIMENT = "alignflow"
PARENT_ENV = "ALIGNFLOW_PARENT_RUN_ID"  # set by the pipeline flow so stage runs nest under it
MAX_PARAM_CHARS = 500  # MLflow's param value limit is 6000; keep the UI readable
TRUNCATED = "...[truncated]"


def configure(workspace: Workspace, experiment: str = EXPERIMENT) -> str:
    """Point MLflow at the workspace (sqlite + file artifacts) and return the experiment id."""
    mlflow.set_tracking_uri(workspace.tracking_uri)
    found = mlflow.get_experiment_by_name(experiment)
    if found is not None:
        experiment_id = found.experiment_id
    else:
        experiment_id = mlflow.create_experiment(
            experiment, artifact_location=workspace.mlflow_artifacts.as_uri()
        )
    mlflow.set_experiment(experiment_id=experiment_id)
    return experiment_id


def flatten_params(value: Any, prefix: str = "") -> dict[str, str]:
    """Nested config -> {"a.b": "v"}; long values truncated with a marker."""
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    if isinstance(value, Mapping):
        flat: dict[str, str] = {}
        for key, item in value.items():
            flat.update(flatten_params(item, f"{prefix}{key}."))
        return flat
    text = json.dumps(value) if isinstance(value, (list, tuple)) else str(value)
    if len(text) > MAX_PARAM_CHARS:
        text = text[: MAX_PARAM_CHARS - len(TRUNCATED)] + TRUNCATED
    return {prefix.rstrip("."): text}


@contextmanager
def stage_run(
    workspace: Workspace,
    stage: str,
    config: BaseModel | Mapping[str, Any] | None = None,
    *,
    tags: Mapping[str, str] | None = None,
    echo: bool = True,
) -> Iterator[LogFn]:
    """An MLflow run for one stage (nested under $ALIGNFLOW_PARENT_RUN_ID when set).

    Logs the flattened config as params and as `config.json`; yields `log(metrics, step)`.
    An exception marks the run FAILED and propagates."""
    configure(workspace)
    parent = os.environ.get(PARENT_ENV)
    run = mlflow.start_run(run_name=stage, nested=parent is not None, parent_run_id=parent)
    try:
        mlflow.set_tags({"alignflow.stage": stage, **dict(tags or {})})
        if config is not None:
            mlflow.log_params(flatten_params(config))
            dumped = config.model_dump(mode="json") if isinstance(config, BaseModel) else dict(config)
            mlflow.log_dict(dumped, "config.json")

        def log(metrics: Mapping[str, float], step: int) -> None:
            clean = {k: float(v) for k, v in metrics.items()}
            mlflow.log_metrics(clean, step=step, run_id=run.info.run_id)
            if echo:
                print_log(clean, step)

        yield log
    except BaseException:
        mlflow.end_run(status="FAILED")
        raise
    mlflow.end_run(status="FINISHED")


@contextmanager
def pipeline_run(
    workspace: Workspace, name: str, config: BaseModel, *, tags: Mapping[str, str] | None = None
) -> Iterator[str]:
    """The parent run of a pipeline: stage runs started inside nest under it."""
    configure(workspace)
    run = mlflow.start_run(run_name=name)
    os.environ[PARENT_ENV] = run.info.run_id
    try:
        mlflow.set_tags({"alignflow.stage": "pipeline", **dict(tags or {})})
        mlflow.log_params(flatten_params(config))
        mlflow.log_dict(config.model_dump(mode="json"), "config.json")
        yield run.info.run_id
    except BaseException:
        mlflow.end_run(status="FAILED")
        raise
    finally:
        os.environ.pop(PARENT_ENV, None)
    mlflow.end_run(status="FINISHED")


def log_figure(figure: Any, artifact_file: str, *, run_id: str | None = None) -> None:
    """Into the active run of this thread, or into `run_id` (e.g. the pipeline run, from a task thread)."""
    if run_id:
        MlflowClient().log_figure(run_id, figure, artifact_file)
    else:
        mlflow.log_figure(figure, artifact_file)


def log_artifact(path: str | Path, artifact_path: str | None = None) -> None:
    path = Path(path)
    if path.is_dir():
        mlflow.log_artifacts(str(path), artifact_path)
    else:
        mlflow.log_artifact(str(path), artifact_path)


def log_dict(value: Mapping[str, Any], artifact_file: str, *, run_id: str | None = None) -> None:
    if run_id:
        MlflowClient().log_dict(run_id, dict(value), artifact_file)
    else:
        mlflow.log_dict(dict(value), artifact_file)


def set_tags(tags: Mapping[str, str]) -> None:
    mlflow.set_tags(dict(tags))


def find_runs(workspace: Workspace, filter_string: str = "") -> list[Any]:
    """Runs of the workspace experiment (newest first), for tests and `alignflow` summaries."""
    experiment_id = configure(workspace)
    return MlflowClient(workspace.tracking_uri).search_runs(
        [experiment_id], filter_string=filter_string, order_by=["attributes.start_time DESC"]
    )



def log_text(text: str, artifact_file: str, *, run_id: str | None = None) -> None:
    if run_id:
        MlflowClient().log_text(run_id, text, artifact_file)
    else:
        mlflow.log_text(text, artifact_file)

