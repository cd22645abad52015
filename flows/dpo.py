"""DPO flow: align a policy on preference pairs against its frozen starting point (`alignflow run dpo`)."""

from __future__ import annotations

from flows.common import run_model_task, stage_flow
from pipeline_lib.config import DPOConfig
from tasks.training import dpo_task
from tasks.store import inputs_fingerprint_task


@stage_flow("dpo")
def dpo_flow(cfg: DPOConfig, force: bool = False) -> str:
    """force: retrain from scratch, even if a cached result exists."""
    return run_model_task(dpo_task, cfg, inputs_fingerprint_task(cfg, "dpo"), force=force, refresh=force)
