"""The ingest stage through all three layers: flow under the Prefect harness, DuckDB file, MLflow run."""

from __future__ import annotations

from pathlib import Path

from flows.ingest import ingest_flow
from pipeline_lib import tracking
from pipeline_lib.config import IngestConfig
from pipeline_lib.store.db import open_store

DATA = Path(__file__).resolve().parents[2] / "data"


def test_ingest_flow_fills_store_and_logs_counts_to_mlflow(flow_workspace, prefect_run):
    cfg = IngestConfig(path=str(DATA / "demo" / "pairs.jsonl"), source="demo")
    state = ingest_flow(cfg, return_state=True)
    report = state.result()
    assert prefect_run(state)[0] == "ingest-pairs.jsonl"

    assert report["table"] == "preference_pairs"
    assert report["rows_read"] == 3000
    assert report["rows_read"] == report["accepted"] + report["duplicates"] + report["quarantined"]
    with open_store(flow_workspace.store_path) as store:
        assert store.count("preference_pairs") == report["accepted"]

    runs = tracking.find_runs(flow_workspace, "tags.`alignflow.stage` = 'ingest'")
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.data.metrics["ingest/accepted"] == report["accepted"]
    assert run.data.metrics["ingest/rows_read"] == 3000
    assert run.data.params["path"].endswith("pairs.jsonl")
    assert run.data.tags["prefect.flow_run_id"]
    assert run.data.tags["data.fingerprint"] == report["fingerprint"]
    assert run.data.tags["data.file"] == str((DATA / "demo" / "pairs.jsonl").resolve())


def test_an_ingest_run_names_the_file_it_read_where_the_path_was_the_checkouts_data(flow_workspace, tmp_path,
                                                                                   monkeypatch):
    """`data/demo/rankings.jsonl` from another dir is the checkout's shipped file: the run's `path` param holds it as
    written, its `data.file` tag the file read (a pipeline's five ingest runs, all named `ingest`, told apart)."""
    monkeypatch.chdir(tmp_path)
    ingest_flow(IngestConfig(path="data/demo/rankings.jsonl", source="demo"))
    run = tracking.find_runs(flow_workspace, "tags.`alignflow.stage` = 'ingest'")[0]
    assert run.data.params["path"] == "data/demo/rankings.jsonl"
    assert run.data.tags["data.file"] == str((DATA / "demo" / "rankings.jsonl").resolve())


def test_reingest_through_flow_adds_nothing(flow_workspace):
    cfg = IngestConfig(path=str(DATA / "demo" / "problems.jsonl"), source="demo")
    first = ingest_flow(cfg)
    second = ingest_flow(cfg)
    assert first["accepted"] == 10000
    assert second["accepted"] == 0 and second["duplicates"] == 10000
