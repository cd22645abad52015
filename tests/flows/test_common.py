"""Every flow holds the workspace run lock: a stage flow started while another process runs on the workspace
(a deployment run from the Prefect UI beside a CLI run) fails at once with the holder's pid, writing nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from flows.ingest import ingest_flow
from pipeline_lib.config import IngestConfig
from pipeline_lib.workspace import WorkspaceLockedError

ROOT = Path(__file__).resolve().parents[2]


def test_stage_flow_refuses_a_workspace_another_process_runs_on(flow_workspace, lock_holder):
    holder = lock_holder(flow_workspace, "alignflow run pipeline")
    try:
        with pytest.raises(WorkspaceLockedError, match=f"in use by alignflow process {holder.pid} "):
            ingest_flow(IngestConfig(path=str(ROOT / "data" / "demo" / "pairs.jsonl"), source="demo"))
        assert not flow_workspace.store_path.exists()
    finally:
        holder.kill()
        holder.wait()
    assert ingest_flow(IngestConfig(path=str(ROOT / "data" / "demo" / "pairs.jsonl"), source="demo"))
