"""Training tasks (SFT, reward model, DPO): store tables in, a final model dir out (trained in this process or
under torchrun, `train.launch.train_stage`), metrics and the model to MLflow, the key result as a Prefect
artifact. Cached on the config and the inputs' fingerprint (a rerun of an unchanged stage is a Prefect cache hit);
retries=0: a rerun after a crash resumes from the stage's checkpoint; force drops the stage dir and retrains."""

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
from pipeline_lib.train.launch import train_stage
from pipeline_lib.train.rm import load_rm_data, train_rm
from pipeline_lib.train.sft import load_sft_data, train_sft
from tasks.common import CACHED, artifact_key, current_workspace, run_tags

SFT_CURVES = ["train/loss", "eval/loss"]
RM_CURVES = ["train/loss", "eval/rm_accuracy", "eval/rm_margin"]
DPO_CURVES = ["train/loss", "rewards/margins", "rewards/accuracies", "eval/pref_accuracy"]


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


def curves_figure(history: list[tuple[int, dict[str, float]]], keys: list[str]) -> Figure:
    """One panel per metric against the training step (metrics a run never logged are left out)."""
    keys = [key for key in keys if any(key in metrics for _, metrics in history)]
    figure = Figure(figsize=(3.2 * len(keys), 3))
    for i, key in enumerate(keys):
        points = [(step, metrics[key]) for step, metrics in history if key in metrics]
        axis = figure.add_subplot(1, len(keys), i + 1)
        axis.plot([s for s, _ in points], [v for _, v in points], marker="o" if len(points) < 30 else None,
                  markersize=3)
        axis.set_title(key)
        axis.set_xlabel("step")
    figure.tight_layout()
    return figure


def log_curves(keys: list[str], artifact_file: str) -> None:
    """The training curves of `keys` into the active MLflow run, one panel per metric, from the run's points (a
    resumed run's include those it carried over from the run it resumes)."""
    history = tracking.metric_history(keys)
    if history:  # a run that logged one point (max_steps <= log_every) gets its dots
        tracking.log_figure(curves_figure(history, keys), artifact_file)


def sft_stage(cfg: SFTConfig) -> str:
    """The stage name of an SFT run in MLflow and Prefect: rejection-sampling SFT (Best-of-N data) is `rs_sft`."""
    return "rs_sft" if cfg.data == "best_of_n" else "sft"


def sft_task_run_name(parameters: dict) -> str:
    """The task run's name in the Prefect UI: its stage (`sft` or `rs_sft`)."""
    return sft_stage(parameters["cfg"])


@task(name="sft", task_run_name=sft_task_run_name, retries=0, **CACHED)
def sft_task(cfg: SFTConfig, inputs_fingerprint: str = "", force: bool = False) -> str:
    workspace = current_workspace()
    with open_store(workspace.store_path, read_only=True) as store:
        rows, eval_rows = load_sft_data(store, cfg)
    stage = sft_stage(cfg)
    # models/rs_sft/...: eval names it after its stage. The held-out rows key the dir too: its final's eval/loss
    # is theirs, so a changed held-out set trains again (the same weights) rather than report a stale loss
    held_out = () if eval_rows is None else (eval_rows,)
    out_dir = stage_dir(workspace.models_dir, stage, cfg, rows, *held_out)
    if force:
        shutil.rmtree(out_dir, ignore_errors=True)
    with tracking.stage_run(workspace, stage, cfg, tags=run_tags(inputs_fingerprint)) as log:
        final = train_stage(train_sft, cfg, {"rows": rows, "eval_rows": eval_rows}, out_dir, log)
        tracking.log_model(final)
        log_curves(SFT_CURVES, f"{stage}_curves.png")
    metrics = final_metrics(final)
    create_markdown_artifact(result_table(f"SFT ({cfg.data}) -> {final}", metrics,
                                          ["data/rows", "train/loss", "eval/loss", "train/seconds"]),
                             key=artifact_key(stage, "result"))
    return str(final)


@task(name="reward-model", retries=0, **CACHED)
def rm_task(cfg: RMConfig, inputs_fingerprint: str = "", force: bool = False) -> str:
    workspace = current_workspace()
    with open_store(workspace.store_path, read_only=True) as store:
        data = load_rm_data(store, cfg)
    out_dir = stage_dir(workspace.models_dir, "rm", cfg, data)
    if force:
        shutil.rmtree(out_dir, ignore_errors=True)
    with tracking.stage_run(workspace, "rm", cfg, tags=run_tags(inputs_fingerprint)) as log:
        final = train_stage(train_rm, cfg, {"data": data}, out_dir, log)
        tracking.log_model(final)
        log_curves(RM_CURVES, "rm_curves.png")
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
    with tracking.stage_run(workspace, "dpo", cfg, tags=run_tags(inputs_fingerprint)) as log:
        final = train_stage(train_dpo, cfg, {"pairs": pairs}, out_dir, log,
                            cache_dir=workspace.root / "cache")
        tracking.log_model(final)
        metrics = final_metrics(final)
        tracking.log_figure(before_after_figure(metrics, keys), "dpo_before_after.png")
        log_curves(DPO_CURVES, "dpo_curves.png")
    shown = [k for key in keys for k in (f"{key}_start", key)]
    create_markdown_artifact(result_table(f"DPO -> {final}", metrics, shown), key="dpo-result")
    return str(final)
