"""Evaluation flow: Pass@K / Maj@K of one model on held-out problems (`alignflow eval`)."""

from __future__ import annotations

from prefect.runtime import flow_run

from flows.common import stage_flow
from pipeline_lib.config import EvalConfig
from tasks.evaluation import eval_task, model_label
from tasks.store import inputs_fingerprint_task


def eval_run_name() -> str:
    """`eval-<model>`, as its MLflow run: the pipeline's evaluations differ by model, not by a random name."""
    return f"eval-{model_label(flow_run.parameters['cfg'])}"


@stage_flow("evaluate", flow_run_name=eval_run_name)
def eval_flow(cfg: EvalConfig, force: bool = False) -> list[dict]:
    return eval_task.with_options(refresh_cache=force)(cfg, inputs_fingerprint_task(cfg))
