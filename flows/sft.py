"""SFT flow: fine-tune a policy on gold answers, preferred responses or a Best-of-N selection (`alignflow sft`)."""

from __future__ import annotations

from flows.common import run_model_task, stage_flow
from pipeline_lib.config import SFTConfig
from tasks.training import sft_task
from tasks.store import inputs_fingerprint_task


@stage_flow("sft")
def sft_flow(cfg: SFTConfig, force: bool = False) -> str:
    """force: retrain from scratch, even if a cached result exists."""
    return run_model_task(sft_task, cfg, inputs_fingerprint_task(cfg), force=force, refresh=force)
