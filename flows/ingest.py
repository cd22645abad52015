"""Ingest flow: one data file into the workspace store."""

from __future__ import annotations

from prefect import flow

from pipeline_lib.config import IngestConfig
from tasks.ingest import ingest_task


@flow(name="ingest", log_prints=True)
def ingest_flow(cfg: IngestConfig) -> dict:
    return ingest_task(cfg)
