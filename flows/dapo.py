"""DAPO flow: the GRPO loop with DAPO's preset (clip-higher, dynamic sampling, token-level loss, overlong shaping)."""

from __future__ import annotations

from flows.common import run_model_task, stage_flow
from pipeline_lib.config import DAPOConfig
from tasks.rl import dapo_task
from tasks.store import inputs_fingerprint_task


@stage_flow("dapo")
def dapo_flow(cfg: DAPOConfig, force: bool = False) -> str:
    """Train into the stage dir of this config and data; returns the final policy dir. force: retrain from scratch."""
    return run_model_task(dapo_task, cfg, inputs_fingerprint_task(cfg, "dapo"), force=force, refresh=force)
