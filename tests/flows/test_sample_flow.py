"""The sampling stage through all three layers: flow under the Prefect harness, samples table, MLflow run."""

from __future__ import annotations

import polars as pl

from flows.sample import sample_flow
from pipeline_lib import tracking
from pipeline_lib.config import SampleConfig
from pipeline_lib.models import build_tiny_model
from pipeline_lib.store.db import open_store
from tasks.sampling import sample_task
from tasks.store import inputs_fingerprint_task


def _setup(workspace, tmp_path) -> str:
    problems = pl.DataFrame({"problem_id": ["p1", "p2", "p3"], "source": "demo", "split": "test",
                             "prompt": ["12+34=", "5+6=", "70+59="], "answer": ["46", "11", "129"]})
    with open_store(workspace.store_path) as store:
        store.insert_new("problems", problems)
    return str(build_tiny_model(tmp_path / "tiny", ["0123456789+="]))


def test_sample_flow_writes_samples_and_logs_to_mlflow(flow_workspace, tmp_path):
    cfg = SampleConfig(model_path=_setup(flow_workspace, tmp_path), n=2, max_new_tokens=4, batch_size=2,
                       device="cpu")
    report = sample_flow(cfg)

    assert report["n_rows"] == report["rows_written_now"] == 6 and report["prompts_skipped"] == 0
    with open_store(flow_workspace.store_path) as store:
        rows = store.read("samples", run_id=report["run_id"])
    assert rows.height == 6 and set(rows["prompt_id"]) == {"p1", "p2", "p3"}

    runs = tracking.find_runs(flow_workspace, "tags.`alignflow.stage` = 'sample'")
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.data.metrics["sample/rows"] == 6
    assert run.data.metrics["sample/accuracy"] == report["accuracy"]
    assert run.data.params["n"] == "2"
    assert run.data.tags["samples.run_id"] == report["run_id"]
    assert run.data.tags["data.fingerprint"] == inputs_fingerprint_task.fn(cfg, "sample")  # the problems and the policy
    assert run.data.tags["prefect.flow_run_id"]


def test_a_new_problem_is_a_cache_miss_that_samples_only_it(flow_workspace, tmp_path):
    cfg = SampleConfig(model_path=_setup(flow_workspace, tmp_path), n=2, max_new_tokens=4, device="cpu")
    first = sample_flow(cfg)
    with open_store(flow_workspace.store_path) as store:
        store.insert_new("problems", pl.DataFrame({"problem_id": ["p4"], "source": "demo", "split": "test",
                                                   "prompt": ["1+1="], "answer": ["2"]}))
    second = sample_flow(cfg)
    assert second["run_id"] == first["run_id"]
    assert (second["prompts_skipped"], second["rows_written_now"], second["n_rows"]) == (3, 2, 8)


def test_sample_task_rerun_resumes_and_writes_nothing(flow_workspace, tmp_path):
    cfg = SampleConfig(model_path=_setup(flow_workspace, tmp_path), n=2, max_new_tokens=4, device="cpu")
    first = sample_task.fn(cfg, "fingerprint")
    second = sample_task.fn(cfg, "fingerprint")
    assert first["run_id"] == second["run_id"]
    assert (second["prompts_skipped"], second["rows_written_now"], second["n_rows"]) == (3, 0, 6)


def test_a_cache_hit_whose_rows_left_the_store_samples_again(flow_workspace, tmp_path):
    """Rows deleted by hand after a run: the cached result would hand the filters an empty run."""
    cfg = SampleConfig(model_path=_setup(flow_workspace, tmp_path), n=2, max_new_tokens=4, device="cpu")
    first = sample_flow(cfg)
    assert sample_flow(cfg) == first  # a cache hit
    with open_store(flow_workspace.store_path) as store:
        store.con.execute("DELETE FROM samples WHERE run_id = ? AND prompt_id = 'p2'", [first["run_id"]])
    again = sample_flow(cfg)
    assert (again["run_id"], again["prompts_skipped"], again["rows_written_now"], again["n_rows"]) == (
        first["run_id"], 2, 2, 6)
    with open_store(flow_workspace.store_path) as store:
        assert store.count("samples", run_id=first["run_id"]) == 6
