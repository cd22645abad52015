"""Evaluation flow: Pass@K / Maj@K of one model on held-out problems (`alignflow eval`)."""

from __future__ import annotations

from prefect import flow

from pipeline_lib.config import EvalConfig
from tasks.evaluation import eval_task
from tasks.store import model_fingerprint_task


@flow(name="evaluate", log_prints=True)
def eval_flow(cfg: EvalConfig, force: bool = False) -> list[dict]:
    return eval_task.with_options(refresh_cache=force)(cfg, model_fingerprint_task(cfg.model_path))
