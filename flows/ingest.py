"""Ingest flow: one data file into the workspace store."""

from __future__ import annotations

from flows.common import stage_flow
from pipeline_lib.config import IngestConfig
from tasks.ingest import ingest_task


@stage_flow("ingest")
def ingest_flow(cfg: IngestConfig) -> dict:
    return ingest_task(cfg)
