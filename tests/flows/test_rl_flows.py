"""PPO, GRPO and DAPO stages through all three layers: flows under the Prefect harness read the store's prompts,
train a tiny model for two rollouts, and leave an MLflow run with per-step metrics, the curves plot, the model
and the config; a rerun returns the finished model, `force` retrains it."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest
from mlflow import MlflowClient

from flows.dapo import dapo_flow
from flows.grpo import grpo_flow
from flows.ppo import ppo_flow
from pipeline_lib.config import DAPOConfig, GRPOConfig, PPOConfig
from pipeline_lib.models import RewardModel, build_tiny_model, load_policy, load_tokenizer
from pipeline_lib.store.db import open_store
from pipeline_lib.train.common import final_metrics
from tasks.rl import grpo_task

ROLLOUT = dict(max_steps=2, prompts_per_step=4, max_new_tokens=6, device="cpu")
# the random tiny model's samples vary in length, so overlong shaping gives every group a signal
SHAPED = ({"name": "verifier"}, {"name": "overlong", "max_len": 6, "cache_len": 4})


@pytest.fixture
def tiny(flow_workspace, tmp_path) -> str:
    problems = pl.DataFrame({
        "problem_id": [f"p{i:02d}" for i in range(16)], "source": "demo", "split": ["train"] * 12 + ["test"] * 4,
        "prompt": [f"{i:02d}+{i + 3:02d}=" for i in range(16)], "answer": [str(2 * i + 3) for i in range(16)],
    })
    with open_store(flow_workspace.store_path) as store:
        store.insert_new("problems", problems)
    return str(build_tiny_model(tmp_path / "tiny", ["0123456789+="], hidden_size=64, num_heads=2,
                                intermediate_size=128))


def test_grpo_flow_trains_on_the_store_problems_and_logs_curves(flow_workspace, tiny, the_run, prefect_run):
    cfg = GRPOConfig(policy_path=tiny, problems_source="demo", group_size=4, rewards=SHAPED, **ROLLOUT)
    state = grpo_flow(cfg, return_state=True)
    assert prefect_run(state)[0] == "grpo"  # named by its stage, not two random words
    final = Path(state.result())
    assert final.name == "final" and final.parent.parent == flow_workspace.models_dir / "grpo"
    load_policy(final, device="cpu")
    run, artifacts = the_run(flow_workspace, "grpo")
    assert {"rewards/accuracy", "rewards/mean", "policy/kl_ref", "policy/clipfrac_low", "policy/entropy",
            "rollout/groups_filtered_frac", "perf/tokens_per_s"} <= set(run.data.metrics)
    assert run.data.params["group_size"] == "4" and run.data.params["loss"] == "grpo"
    assert (artifacts / "grpo_curves.png").is_file() and (artifacts / "model" / "model.safetensors").is_file()
    assert final_metrics(final)["rewards/mean"] == run.data.metrics["rewards/mean"]  # the last step's value


def test_grpo_task_rerun_returns_the_finished_model_and_force_retrains(flow_workspace, tiny):
    cfg = GRPOConfig(policy_path=tiny, group_size=4, rewards=SHAPED, **ROLLOUT)
    first = grpo_task.fn(cfg)
    stamp = (Path(first) / "model.safetensors").stat().st_mtime_ns
    assert grpo_task.fn(cfg) == first
    assert (Path(first) / "model.safetensors").stat().st_mtime_ns == stamp
    assert grpo_task.fn(cfg, force=True) == first
    assert (Path(first) / "model.safetensors").stat().st_mtime_ns != stamp


def test_dapo_flow_logs_dynamic_sampling(flow_workspace, tiny, the_run):
    hard = pl.DataFrame({"problem_id": [f"h{i}" for i in range(8)], "source": "hard", "split": "train",
                         "prompt": [f"{i}*1111=" for i in range(1, 9)], "answer": [str(1111 * i) for i in range(1, 9)]})
    with open_store(flow_workspace.store_path) as store:
        store.insert_new("problems", hard)
    cfg = DAPOConfig(policy_path=tiny, problems_source="hard", group_size=4, mini_batch_size=8, warmup_steps=0,
                     rewards=SHAPED, max_refill_rounds=1, **ROLLOUT)
    Path(dapo_flow(cfg))
    run, artifacts = the_run(flow_workspace, "dapo")
    # a random model does not write 4-digit products: every group is filtered and the refill round runs
    assert run.data.metrics["rollout/groups_filtered_frac"] == 1.0
    assert run.data.metrics["rollout/refill_rounds"] == 1.0
    assert run.data.params["loss"] == "dapo" and run.data.params["clip_eps_high"] == "0.28"
    assert (artifacts / "dapo_curves.png").is_file()


def test_ppo_flow_trains_with_a_reward_model_and_logs_kl(flow_workspace, tiny, tmp_path, the_run):
    reward_model = RewardModel.from_policy(tiny, device="cpu", seed=1).save_pretrained(tmp_path / "rm",
                                                                                       load_tokenizer(tiny))
    cfg = PPOConfig(policy_path=tiny, reward_model_path=str(reward_model), problems_source="demo",
                    mini_batch_size=2, ppo_epochs=1, **ROLLOUT)
    final = Path(ppo_flow(cfg))
    load_policy(final, device="cpu")
    run, artifacts = the_run(flow_workspace, "ppo")
    assert {"rewards/mean", "objective/kl", "objective/kl_k3", "value/loss", "policy/clipfrac",
            "rewards/accuracy"} <= set(run.data.metrics)
    assert (artifacts / "ppo_curves.png").is_file()


@pytest.mark.parametrize("stage", ["grpo", "ppo"])
def test_the_run_time_a_final_holds_reaches_the_mlflow_run_at_the_last_step(flow_workspace, tiny, tmp_path, the_run,
                                                                            stage):
    """train/seconds went into the final's marker only: it is logged with the last step's metrics, so the MLflow run
    holds every metric the marker does."""
    if stage == "grpo":
        final = grpo_flow(GRPOConfig(policy_path=tiny, group_size=4, rewards=SHAPED, **ROLLOUT))
    else:
        reward_model = RewardModel.from_policy(tiny, device="cpu", seed=1).save_pretrained(tmp_path / "rm",
                                                                                           load_tokenizer(tiny))
        final = ppo_flow(PPOConfig(policy_path=tiny, reward_model_path=str(reward_model), mini_batch_size=2,
                                   ppo_epochs=1, **ROLLOUT))
    stored = final_metrics(Path(final))
    run, _ = the_run(flow_workspace, stage)
    assert "train/seconds" in stored and set(stored) <= set(run.data.metrics)
    assert {key: run.data.metrics[key] for key in stored} == pytest.approx(stored)
    history = MlflowClient(flow_workspace.tracking_uri).get_metric_history(run.info.run_id, "train/seconds")
    assert [metric.step for metric in history] == [2]
