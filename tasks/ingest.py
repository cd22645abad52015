"""Ingest task: a data file into the DuckDB store, counts to MLflow and a Prefect artifact."""

from __future__ import annotations

from prefect import task
from prefect.artifacts import create_markdown_artifact

from pipeline_lib import tracking
from pipeline_lib.config import IngestConfig
from pipeline_lib.store.db import open_store
from pipeline_lib.store.ingest import ingest_file
from tasks.common import current_workspace, retry_on_io, run_tags


@task(name="ingest-file", retries=2, retry_delay_seconds=2, retry_condition_fn=retry_on_io)
def ingest_task(cfg: IngestConfig) -> dict:
    workspace = current_workspace()
    with tracking.stage_run(workspace, "ingest", cfg, tags=run_tags(), echo=False) as log:
        with open_store(workspace.store_path) as store:
            report = ingest_file(cfg.resolved_path, store, format=cfg.format, source=cfg.source,
                                 split=cfg.split, max_record_bytes=cfg.max_record_bytes, replace=cfg.replace)
        log(report.metrics(), 0)
        # the file read: `path` as written may be the checkout's shipped data/, found by `resolved_path`
        tracking.set_tags({"data.fingerprint": report.fingerprint, "data.table": report.table,
                           "data.file": str(cfg.resolved_path.resolve())})
    print(report.summary())
    create_markdown_artifact(report.markdown(), key="ingest-counts", description=report.summary())
    return report.as_dict()
