"""SFT flow: fine-tune a policy on gold answers, preferred responses or a Best-of-N selection (`alignflow run sft`)."""

from __future__ import annotations

from prefect.runtime import flow_run

from flows.common import run_model_task, stage_flow
from pipeline_lib.config import SFTConfig
from tasks.store import inputs_fingerprint_task
from tasks.training import sft_stage, sft_task


def sft_run_name() -> str:
    """The run's stage, `sft` or `rs_sft` (the pipeline runs this flow for both), as its MLflow run."""
    return sft_stage(flow_run.parameters["cfg"])


@stage_flow("sft", flow_run_name=sft_run_name)
def sft_flow(cfg: SFTConfig, force: bool = False) -> str:
    """force: retrain from scratch, even if a cached result exists."""
    return run_model_task(sft_task, cfg, inputs_fingerprint_task(cfg, sft_stage(cfg)), force=force, refresh=force)
