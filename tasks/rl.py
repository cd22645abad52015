"""Online RL tasks (PPO, GRPO, DAPO): the store's prompts in, a final policy dir out, per-step metrics and
reward/KL curves to MLflow, the key result as a Prefect artifact. retries=0: a rerun resumes from the checkpoint."""

from __future__ import annotations

import shutil
from collections.abc import Callable

from prefect import task
from prefect.artifacts import create_markdown_artifact
from pydantic import BaseModel

from pipeline_lib import tracking
from pipeline_lib.config import DAPOConfig, GRPOConfig, PPOConfig
from pipeline_lib.store.db import open_store
from pipeline_lib.train.common import final_metrics
from pipeline_lib.train.data import stage_dir
from pipeline_lib.train.grpo import load_grpo_data, train_grpo
from pipeline_lib.train.ppo import load_ppo_data, train_ppo
from tasks.common import CACHED, artifact_key, current_workspace, run_tags
from tasks.training import log_curves, result_table

GRPO_CURVES = ["rewards/accuracy", "rewards/mean", "policy/kl_ref", "policy/entropy", "completions/mean_length"]
DAPO_CURVES = ["rewards/accuracy", "rewards/mean", "rollout/groups_filtered_frac", "policy/clipfrac_high",
               "policy/entropy"]
PPO_CURVES = ["rewards/mean", "objective/kl", "objective/kl_coef", "value/loss", "rewards/accuracy"]


def run_rl_stage(stage: str, cfg: BaseModel, load: Callable, train: Callable, curves: list[str], force: bool,
                 inputs_fingerprint: str) -> str:
    """Shared body of the three tasks: read, train into the config's stage dir, log the model and the curves."""
    workspace = current_workspace()
    with open_store(workspace.store_path, read_only=True) as store:
        data = load(store, cfg)
    out_dir = stage_dir(workspace.models_dir, stage, cfg, data)
    if force:
        shutil.rmtree(out_dir, ignore_errors=True)
    with tracking.stage_run(workspace, stage, cfg, tags=run_tags(inputs_fingerprint)) as log:
        final = train(cfg, data, out_dir, log=log)
        tracking.log_model(final)
        log_curves(curves, f"{stage}_curves.png")
    shown = [key for key in curves + ["train/updates", "train/seconds"] if key in final_metrics(final)]
    create_markdown_artifact(result_table(f"{stage.upper()} -> {final}", final_metrics(final), shown),
                             key=artifact_key(stage, "result"))
    return str(final)


@task(name="grpo", retries=0, **CACHED)
def grpo_task(cfg: GRPOConfig, inputs_fingerprint: str = "", force: bool = False) -> str:
    return run_rl_stage("grpo", cfg, load_grpo_data, train_grpo, GRPO_CURVES, force, inputs_fingerprint)


@task(name="dapo", retries=0, **CACHED)
def dapo_task(cfg: DAPOConfig, inputs_fingerprint: str = "", force: bool = False) -> str:
    return run_rl_stage("dapo", cfg, load_grpo_data, train_grpo, DAPO_CURVES, force, inputs_fingerprint)


@task(name="ppo", retries=0, **CACHED)
def ppo_task(cfg: PPOConfig, inputs_fingerprint: str = "", force: bool = False) -> str:
    return run_rl_stage("ppo", cfg, load_ppo_data, train_ppo, PPO_CURVES, force, inputs_fingerprint)
