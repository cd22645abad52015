"""Reward-model flow: Bradley-Terry on preference pairs or Plackett-Luce on rankings (`alignflow run rm`)."""

from __future__ import annotations

from flows.common import run_model_task, stage_flow
from pipeline_lib.config import RMConfig
from tasks.training import rm_task
from tasks.store import inputs_fingerprint_task


@stage_flow("rm")
def rm_flow(cfg: RMConfig, force: bool = False) -> str:
    """force: retrain from scratch, even if a cached result exists."""
    return run_model_task(rm_task, cfg, inputs_fingerprint_task(cfg, "rm"), force=force, refresh=force)
