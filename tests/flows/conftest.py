"""Flows run under one session-scoped Prefect test harness, each test in its own workspace."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import psutil
import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, FlowRunFilter, FlowRunFilterId
from prefect.testing.utilities import prefect_test_harness

from pipeline_lib import tracking


@pytest.fixture(scope="session", autouse=True)
def prefect_harness():
    with prefect_test_harness(server_startup_timeout=60):
        yield


@pytest.fixture
def flow_workspace(workspace, monkeypatch):
    """The workspace the tasks resolve through ALIGNFLOW_HOME."""
    monkeypatch.setenv("ALIGNFLOW_HOME", str(workspace.root))
    return workspace


@pytest.fixture
def insert_samples():
    """`insert_samples(store, samples)`: a sampling run's rows, and a problem row for each of their prompt_ids
    (what reads a run leaves out the samples of problems the store no longer holds)."""

    def insert(store, samples: pl.DataFrame) -> None:
        problems = samples.select(pl.col("prompt_id").alias("problem_id"), "prompt").unique("problem_id", keep="first")
        store.insert_new("problems", problems.with_columns(source=pl.lit("sampled"), split=pl.lit("test"),
                                                           answer=pl.lit("0")))
        store.insert_new("samples", samples)

    return insert


@pytest.fixture
def listening_sockets():
    """`listening_sockets(pid)`: (address, port) of every listening TCP socket of `pid` and its descendants (the
    sockets themselves, not the URLs a command prints)."""

    def find(pid: int) -> set[tuple[str, int]]:
        found = set()
        root = psutil.Process(pid)
        for process in [root, *root.children(recursive=True)]:
            try:
                found |= {(c.laddr.ip, c.laddr.port) for c in process.net_connections("inet")
                          if c.status == psutil.CONN_LISTEN}
            except psutil.NoSuchProcess:  # a child that exited during the scan
                continue
        return found

    return find


@pytest.fixture
def the_run():
    """`run, artifacts = the_run(workspace, stage)`: the one MLflow run of `stage`, finished and started by a
    flow run, with its artifact directory."""

    def find(workspace, stage: str):
        runs = tracking.find_runs(workspace, f"tags.`alignflow.stage` = '{stage}'")
        assert len(runs) == 1
        run = runs[0]
        assert run.info.status == "FINISHED" and run.data.tags["prefect.flow_run_id"]
        return run, Path(run.info.artifact_uri.removeprefix("file://"))

    return find


@pytest.fixture
def prefect_run():
    """`name, task_names, artifact_keys = prefect_run(state)`: what the Prefect UI shows of the flow run that ended
    in `state` (a flow called with `return_state=True`): its name, its task runs' names, its artifacts' keys."""

    def find(state) -> tuple[str, set[str], set[str]]:
        flow_run_id = state.state_details.flow_run_id
        with get_client(sync_client=True) as client:
            name = client.read_flow_run(flow_run_id).name
            tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
            artifacts = client.read_artifacts(
                artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
        return name, {task.name for task in tasks}, {artifact.key for artifact in artifacts}

    return find
