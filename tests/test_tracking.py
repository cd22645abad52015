"""MLflow tracking against the real sqlite store: experiment location, nested stage runs, FAILED runs."""

from __future__ import annotations

import mlflow
import pytest
from matplotlib.figure import Figure
from mlflow.tracking import MlflowClient

from pipeline_lib import tracking
from pipeline_lib.config import EvalConfig


def test_stage_run_logs_params_metrics_config_and_tags(workspace):
    cfg = EvalConfig(model_path="/m/" + "x" * 900, n=4, ks=(1, 2, 4))
    with tracking.stage_run(workspace, "eval", cfg, tags={"prefect.flow_run_id": "abc"}, echo=False) as log:
        log({"eval/pass_at_1": 0.25}, 0)
        log({"eval/pass_at_1": 0.5}, 1)
        fig = Figure()
        fig.add_subplot().plot([1, 2], [3, 4])
        tracking.log_figure(fig, "plots/curve.png")
    (run,) = tracking.find_runs(workspace)
    assert run.info.status == "FINISHED"
    assert run.info.artifact_uri.startswith(workspace.mlflow_artifacts.as_uri())
    assert run.data.tags["prefect.flow_run_id"] == "abc"
    assert run.data.params["ks"] == "[1, 2, 4]"
    assert run.data.params["model_path"].endswith("...[truncated]") and len(run.data.params["model_path"]) <= 500
    history = MlflowClient(workspace.tracking_uri).get_metric_history(run.info.run_id, "eval/pass_at_1")
    assert [(m.step, m.value) for m in history] == [(0, 0.25), (1, 0.5)]
    artifacts = {a.path for a in MlflowClient(workspace.tracking_uri).list_artifacts(run.info.run_id, "plots")}
    assert artifacts == {"plots/curve.png"}
    assert mlflow.artifacts.load_dict(f"{run.info.artifact_uri}/config.json")["n"] == 4


def test_stage_runs_nest_under_the_pipeline_run_and_failures_are_marked(workspace):
    cfg = EvalConfig(model_path="/m", n=1, ks=(1,))
    with tracking.pipeline_run(workspace, "demo", cfg) as parent_id:
        with tracking.stage_run(workspace, "sft", {"lr": 0.1}, echo=False) as log:
            log({"train/loss": 1.0}, 0)
        with pytest.raises(RuntimeError):
            with tracking.stage_run(workspace, "dpo", {"beta": 0.1}, echo=False):
                raise RuntimeError("boom")
    runs = {r.info.run_name: r for r in tracking.find_runs(workspace)}
    assert runs["demo"].info.status == "FINISHED"
    assert runs["sft"].data.tags["mlflow.parentRunId"] == parent_id
    assert runs["dpo"].data.tags["mlflow.parentRunId"] == parent_id
    assert runs["dpo"].info.status == "FAILED" and runs["sft"].info.status == "FINISHED"


def test_flatten_params_nests_and_truncates():
    flat = tracking.flatten_params({"a": {"b": 1, "c": [1, 2]}, "d": "x" * 600})
    assert flat["a.b"] == "1" and flat["a.c"] == "[1, 2]"
    assert len(flat["d"]) == tracking.MAX_PARAM_CHARS and flat["d"].endswith("[truncated]")
