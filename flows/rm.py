"""Reward-model flow: Bradley-Terry on preference pairs or Plackett-Luce on rankings (`alignflow rm`)."""

from __future__ import annotations

from flows.common import stage_flow
from pipeline_lib.config import RMConfig
from tasks.training import rm_task
from tasks.store import inputs_fingerprint_task


@stage_flow("rm")
def rm_flow(cfg: RMConfig, force: bool = False) -> str:
    """force: retrain from scratch, even if a cached result exists."""
    run = rm_task.with_options(refresh_cache=force)
    return run(cfg, inputs_fingerprint_task(cfg), force=force)
