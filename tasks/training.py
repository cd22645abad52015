"""Training tasks (SFT, reward model, DPO): store tables in, a final model dir out, metrics and the model to
MLflow, the key result as a Prefect artifact. Cached on the config and the inputs' fingerprint (a rerun of an
unchanged stage is a Prefect cache hit); retries=0: a rerun after a crash resumes from the stage's checkpoint;
force drops the stage dir and retrains."""

from __future__ import annotations

import shutil
from collections.abc import Mapping

from matplotlib.figure import Figure
from prefect import task
from prefect.artifacts import create_markdown_artifact

from pipeline_lib import tracking
from pipeline_lib.config import DPOConfig, RMConfig, SFTConfig
from pipeline_lib.store.db import open_store
from pipeline_lib.train.common import final_metrics
from pipeline_lib.train.data import stage_dir
from pipeline_lib.train.dpo import load_dpo_data, train_dpo
from pipeline_lib.train.rm import load_rm_data, train_rm
from pipeline_lib.train.sft import load_sft_data, train_sft
from tasks.common import CACHED, current_workspace, run_tags


def result_table(title: str, metrics: Mapping[str, float], keys: list[str]) -> str:
    rows = "\n".join(f"| {key} | {metrics[key]:.4g} |" for key in keys if key in metrics)
    return f"### {title}\n\n| metric | value |\n|---|---|\n{rows}\n"


def before_after_figure(metrics: Mapping[str, float], keys: list[str]) -> Figure:
    """Bars of held-out metrics at the start and the end of a stage."""
    figure = Figure(figsize=(3 * len(keys), 3))
    for i, key in enumerate(keys):
        axis = figure.add_subplot(1, len(keys), i + 1)
        axis.bar(["start", "final"], [metrics[f"{key}_start"], metrics[key]], color=["#999999", "#1f77b4"])
        axis.set_title(key)
    figure.tight_layout()
    return figure


@task(name="sft", retries=0, **CACHED)
def sft_task(cfg: SFTConfig, inputs_fingerprint: str = "", force: bool = False) -> str:
    workspace = current_workspace()
    with open_store(workspace.store_path, read_only=True) as store:
        rows, eval_rows = load_sft_data(store, cfg)
    out_dir = stage_dir(workspace.models_dir, "sft", cfg, rows)
    if force:
        shutil.rmtree(out_dir, ignore_errors=True)
    stage = "rs_sft" if cfg.data == "best_of_n" else "sft"  # rejection-sampling SFT gets its own name in MLflow
    with tracking.stage_run(workspace, stage, cfg, tags=run_tags() | {"data.fingerprint": inputs_fingerprint}) as log:
        final = train_sft(cfg, rows, out_dir, log=log, eval_rows=eval_rows)
        tracking.log_artifact(final, "model")
    metrics = {**final_metrics(final), "data/rows": float(rows.height)}
    create_markdown_artifact(result_table(f"SFT ({cfg.data}) -> {final}", metrics,
                                          ["data/rows", "train/loss", "eval/loss", "train/seconds"]), key="sft-result")
    return str(final)


@task(name="reward-model", retries=0, **CACHED)
def rm_task(cfg: RMConfig, inputs_fingerprint: str = "", force: bool = False) -> str:
    workspace = current_workspace()
    with open_store(workspace.store_path, read_only=True) as store:
        data = load_rm_data(store, cfg)
    out_dir = stage_dir(workspace.models_dir, "rm", cfg, data)
    if force:
        shutil.rmtree(out_dir, ignore_errors=True)
    with tracking.stage_run(workspace, "rm", cfg, tags=run_tags() | {"data.fingerprint": inputs_fingerprint}) as log:
        final = train_rm(cfg, data, out_dir, log=log)
        tracking.log_artifact(final, "model")
    create_markdown_artifact(result_table(f"Reward model ({cfg.loss}) -> {final}", final_metrics(final),
                                          ["eval/rm_accuracy", "eval/rm_margin", "eval/n_groups", "train/seconds"]),
                             key="rm-result")
    return str(final)


@task(name="dpo", retries=0, **CACHED)
def dpo_task(cfg: DPOConfig, inputs_fingerprint: str = "", force: bool = False) -> str:
    workspace = current_workspace()
    with open_store(workspace.store_path, read_only=True) as store:
        pairs = load_dpo_data(store, cfg)
    out_dir = stage_dir(workspace.models_dir, "dpo", cfg, pairs)
    if force:
        shutil.rmtree(out_dir, ignore_errors=True)
    keys = ["eval/pref_accuracy", "eval/logp_margin"]
    with tracking.stage_run(workspace, "dpo", cfg, tags=run_tags() | {"data.fingerprint": inputs_fingerprint}) as log:
        final = train_dpo(cfg, pairs, out_dir, log=log, cache_dir=workspace.root / "cache")
        tracking.log_artifact(final, "model")
        metrics = final_metrics(final)
        tracking.log_figure(before_after_figure(metrics, keys), "dpo_before_after.png")
    shown = [k for key in keys for k in (f"{key}_start", key)]
    create_markdown_artifact(result_table(f"DPO -> {final}", metrics, shown), key="dpo-result")
    return str(final)
