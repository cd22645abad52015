"""Evaluation tasks: Pass@K / Maj@K of one model (metrics, curves, table artifact) and the comparison plot."""

from __future__ import annotations

from pathlib import Path

import polars as pl
from prefect import task
from prefect.artifacts import create_markdown_artifact

from pipeline_lib import tracking
from pipeline_lib.config import EvalConfig
from pipeline_lib.evaluation import plot_curves, plot_histograms, run_eval_stage
from pipeline_lib.store.db import open_store
from tasks.common import CACHED, artifact_key, current_workspace, retry_on_io, run_tags


def model_label(cfg: EvalConfig) -> str:
    """The evaluated model's short name in run names (`eval-<name>`) and artifact keys: its model_name, else the
    stage that wrote it (`models/<stage>/<hash>/final` of the workspace), else its dir name."""
    if cfg.model_name:
        return cfg.model_name
    path = Path(cfg.model_path).resolve()
    models_dir = current_workspace().models_dir.resolve()
    return path.relative_to(models_dir).parts[0] if path.is_relative_to(models_dir) else path.name


# cached on the config and the inputs (the problems, the model's content); retries: sampling resumes where a
# failed try stopped
@task(name="evaluate", retries=1, retry_delay_seconds=5, retry_condition_fn=retry_on_io, **CACHED)
def eval_task(cfg: EvalConfig, inputs_fingerprint: str) -> list[dict]:
    workspace = current_workspace()
    name = model_label(cfg)
    logged = cfg.model_copy(update={"ks": cfg.k_values})  # the K values evaluated, where `ks` was left to its default
    with tracking.stage_run(workspace, f"eval-{name}", logged, tags=run_tags(inputs_fingerprint), echo=False) as log:
        with open_store(workspace.store_path) as store:
            results, samples, report = run_eval_stage(cfg, store, log=log)
        tracking.set_tags(report.tags())  # the sampling run it scored, as the sample stage tags its run
        fig_pass, fig_maj = plot_curves(results)
        tracking.log_figure(fig_pass, "plots/pass_at_k.png")
        tracking.log_figure(fig_maj, "plots/maj_at_k.png")
        tracking.log_figure(plot_histograms(samples, cfg.label), "plots/reward_length_hist.png")
    create_markdown_artifact(results_markdown(results), key=artifact_key("eval-results", name),
                             description=f"Pass@K / Maj@K of {cfg.label}")
    print(results_markdown(results))
    return results.to_dicts()


@task(name="compare-models")
def compare_task(rows: list[dict], pipeline_run_id: str) -> str:
    """All models' curves in one plot and one table, logged to the pipeline's MLflow run."""
    tracking.configure(current_workspace())
    results = pl.DataFrame(rows)
    fig_pass, fig_maj = plot_curves(results)
    tracking.log_figure(fig_pass, "plots/pass_at_k_by_model.png", run_id=pipeline_run_id)
    tracking.log_figure(fig_maj, "plots/maj_at_k_by_model.png", run_id=pipeline_run_id)
    table = results_markdown(results)
    tracking.log_text(table, "eval_results.md", run_id=pipeline_run_id)
    create_markdown_artifact(table, key="eval-comparison", description="Pass@K / Maj@K per model")
    return table


def results_markdown(results: pl.DataFrame) -> str:
    lines = ["| model | dataset | K | Pass@K | Maj@K | n |", "|---|---|---|---|---|---|"]
    for row in results.sort("model", "k").iter_rows(named=True):
        lines.append(f"| {row['model']} | {row['dataset']} | {row['k']} | {row['pass_at_k']:.3f} | "
                     f"{row['maj_at_k']:.3f} | {row['n_samples']} |")
    return "\n".join(lines)
