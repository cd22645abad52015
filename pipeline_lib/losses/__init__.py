"""Alignment losses as pure functions of tensors, each returning `(loss, stats)`; LOSSES dispatches RL policy losses.

GRPO, Dr.GRPO and DAPO share PPO's clipped surrogate and differ in reduction: `seq_mean_token_mean`, a sum over
B·max_len, `token_mean`."""

from pipeline_lib.losses._masked import masked_mean, masked_sum, masked_whiten, seq_mean_token_mean, token_mean
from pipeline_lib.losses.dapo import dapo_loss, overlong_penalty
from pipeline_lib.losses.dpo import dpo_loss
from pipeline_lib.losses.grpo import dr_grpo_loss, group_advantages, grpo_loss, kl_k3
from pipeline_lib.losses.ppo import (
    clipped_surrogate,
    compute_gae,
    kl_penalized_rewards,
    ppo_policy_loss,
    ppo_value_loss,
)
from pipeline_lib.losses.reward import bradley_terry_loss, plackett_luce_loss

# critic-free policy losses selectable by name in the GRPO-family training loop.
# Their keyword arguments differ (grpo: ref_logps, clip_eps, beta; dr_grpo: those and max_len; dapo: ref_logps,
# eps_low, eps_high, beta).
LOSSES = {"grpo": grpo_loss, "dr_grpo": dr_grpo_loss, "dapo": dapo_loss}
# reward-model losses by RMConfig.loss: Bradley-Terry takes the chosen and rejected scores (and a margin),
# Plackett-Luce the whole ranking (B, K) and its mask.
REWARD_LOSSES = {"bradley_terry": bradley_terry_loss, "plackett_luce": plackett_luce_loss}

__all__ = [
    "LOSSES",
    "REWARD_LOSSES",
    "bradley_terry_loss",
    "clipped_surrogate",
    "compute_gae",
    "dapo_loss",
    "dpo_loss",
    "dr_grpo_loss",
    "group_advantages",
    "grpo_loss",
    "kl_k3",
    "kl_penalized_rewards",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "overlong_penalty",
    "plackett_luce_loss",
    "ppo_policy_loss",
    "ppo_value_loss",
    "seq_mean_token_mean",
    "token_mean",
]
