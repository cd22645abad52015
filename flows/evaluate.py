"""Evaluation flow: Pass@K / Maj@K of one model on held-out problems (`alignflow eval`)."""

from __future__ import annotations

from flows.common import stage_flow
from pipeline_lib.config import EvalConfig
from tasks.evaluation import eval_task
from tasks.store import inputs_fingerprint_task


@stage_flow("evaluate")
def eval_flow(cfg: EvalConfig, force: bool = False) -> list[dict]:
    return eval_task.with_options(refresh_cache=force)(cfg, inputs_fingerprint_task(cfg))
