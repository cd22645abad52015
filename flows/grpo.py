"""GRPO flow: group-relative policy optimization on verifiable problems."""

from __future__ import annotations

from flows.common import run_model_task, stage_flow
from pipeline_lib.config import GRPOConfig
from tasks.rl import grpo_task
from tasks.store import inputs_fingerprint_task


@stage_flow("grpo")
def grpo_flow(cfg: GRPOConfig, force: bool = False) -> str:
    """Train into the stage dir of this config and data; returns the final policy dir. force: retrain from scratch."""
    return run_model_task(grpo_task, cfg, inputs_fingerprint_task(cfg, "grpo"), force=force, refresh=force)
