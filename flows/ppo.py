"""PPO flow: RLHF with actor, critic, frozen reference and a reward model from the RM stage."""

from __future__ import annotations

from flows.common import run_model_task, stage_flow
from pipeline_lib.config import PPOConfig
from tasks.rl import ppo_task
from tasks.store import inputs_fingerprint_task


@stage_flow("ppo")
def ppo_flow(cfg: PPOConfig, force: bool = False) -> str:
    """Train into the stage dir of this config and data; returns the final policy dir. force: retrain from scratch."""
    return run_model_task(ppo_task, cfg, inputs_fingerprint_task(cfg, "ppo"), force=force, refresh=force)
