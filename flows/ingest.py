"""Ingest flow: one data file into the workspace store."""

from __future__ import annotations

from prefect.runtime import flow_run

from flows.common import stage_flow
from pipeline_lib.config import IngestConfig
from tasks.ingest import ingest_task


def ingest_run_name() -> str:
    """`ingest-<file name>`: a pipeline's ingest runs differ by file, not by a random name."""
    return f"ingest-{flow_run.parameters['cfg'].resolved_path.name}"


@stage_flow("ingest", flow_run_name=ingest_run_name)
def ingest_flow(cfg: IngestConfig) -> dict:
    return ingest_task(cfg)
