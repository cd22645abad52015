"""Evaluation flow: Pass@K / Maj@K of one model on held-out problems (`alignflow eval`)."""

from __future__ import annotations

from prefect.runtime import flow_run

from flows.common import stage_flow
from pipeline_lib.config import EvalConfig
from tasks.evaluation import eval_task, model_label
from tasks.store import eval_results_held_task, inputs_fingerprint_task


def eval_run_name() -> str:
    """`eval-<model>`, as its MLflow run: the pipeline's evaluations differ by model, not by a random name."""
    return f"eval-{model_label(flow_run.parameters['cfg'])}"


@stage_flow("evaluate", flow_run_name=eval_run_name)
def eval_flow(cfg: EvalConfig, force: bool = False) -> list[dict]:
    """A cache hit whose eval_results rows have left the store since, or were replaced (another evaluation under
    the same name and sampling run, with other ks), evaluates again (its samples are still there, so only the
    scoring runs), so the store (`alignflow demo`'s summary) holds what is printed."""
    inputs = inputs_fingerprint_task(cfg, eval_run_name())
    rows = eval_task.with_options(refresh_cache=force)(cfg, inputs)
    if eval_results_held_task(cfg) != sorted((row["k"], row["pass_at_k"], row["maj_at_k"]) for row in rows):
        rows = eval_task.with_options(refresh_cache=True)(cfg, inputs)
    return rows
