"""PPO for RLHF: KL-penalized per-token rewards, GAE, the clipped policy surrogate and the clipped value loss.

`clipped_surrogate` is the per-token PPO-Clip term that GRPO and DAPO reuse with their own reductions.
Tensors are (B, T) over the completion tokens with a 0/1 mask; padding may hold any value."""

from __future__ import annotations

import torch
from torch import Tensor

from pipeline_lib.losses._masked import check_shape, token_mean, valid_mask, zero_invalid

# |log π - log π'| beyond this is clamped before exp(): e^20 ≈ 5e8 is already far past any clip range (as verl does)
MAX_LOG_RATIO = 20.0


def kl_penalized_rewards(
    scores: Tensor,  # (B,) reward-model score of each completion
    policy_logps: Tensor,  # (B, T)
    ref_logps: Tensor,  # (B, T)
    mask: Tensor,  # (B, T)
    *,
    kl_coef: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """InstructGPT eq. 2, per token: r_t = -β_kl (log π(y_t) - log π_ref(y_t)), plus the RM score at the last token.

    The score goes to each sequence's LAST VALID position (the largest index with mask = 1), so
    right-padded, left-padded and holed masks all work. Returns detached rewards (B, T), 0 on padding:
    they are targets for GAE, not something to differentiate."""
    check_shape("policy_logps", policy_logps, mask.shape)
    check_shape("ref_logps", ref_logps, mask.shape)
    if policy_logps.ndim != 2:
        raise ValueError(f"policy_logps: expected a 2-D (B, T) tensor, got shape {tuple(policy_logps.shape)}")
    check_shape("scores", scores, mask.shape[:1])
    valid = valid_mask(mask, policy_logps)
    positions = torch.arange(valid.shape[1], device=valid.device).expand_as(valid)  # (B, T)
    last = torch.where(valid, positions, -1).amax(dim=-1)  # (B,)
    if (last < 0).any():
        row = int((last < 0).nonzero()[0, 0])
        raise ValueError(f"mask: sequence {row} has no valid token, so there is nowhere to put its score")

    kl = zero_invalid(policy_logps.detach() - ref_logps.detach(), valid)  # (B, T) k1 estimator
    non_score = -kl_coef * kl  # (B, T)
    rewards = non_score.clone()
    rewards[torch.arange(rewards.shape[0], device=rewards.device), last] += scores.detach().to(rewards.dtype)
    stats = {
        # sequence-level KL(π‖π_ref) estimate: sum of k1 over the sequence's tokens, mean over sequences
        "objective/kl": kl.sum(-1).mean(),
        "objective/scores": scores.detach().float().mean(),
        "objective/non_score_reward": non_score.sum(-1).mean(),
        "objective/rlhf_reward": rewards.sum(-1).mean(),
    }
    return rewards, stats


def compute_gae(
    rewards: Tensor,  # (B, T)
    values: Tensor,  # (B, T)
    mask: Tensor,  # (B, T)
    *,
    gamma: float,
    lam: float,
) -> tuple[Tensor, Tensor]:
    """GAE (Schulman et al. 2016, §3): δ_t = r_t + γV(s_{t+1}) - V(s_t), A_t = Σ_l (γλ)^l δ_{t+l}, R = A + V.

    Layout: completions are usually right-padded (valid tokens first). Only masked positions take
    part: the "next step" of a valid token is the next VALID position, so left offsets and holes are
    skipped; the value after a sequence's last valid token is 0 (the episode ends). Padding gets
    advantage and return 0. Inputs are detached: advantages and returns are targets."""
    check_shape("rewards", rewards, mask.shape)
    check_shape("values", values, mask.shape)
    if rewards.ndim != 2:
        raise ValueError(f"rewards: expected a 2-D (B, T) tensor, got shape {tuple(rewards.shape)}")
    valid = valid_mask(mask, rewards)
    rewards = zero_invalid(rewards.detach(), valid)
    values = zero_invalid(values.detach(), valid)
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros_like(rewards[:, 0])  # (B,) V at the next valid position; 0 past the end
    next_advantage = torch.zeros_like(rewards[:, 0])  # (B,)
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]  # (B,)
        advantage = delta + gamma * lam * next_advantage  # (B,)
        # padded positions are skipped: they neither get an advantage nor break the recursion
        advantages[:, t] = torch.where(valid[:, t], advantage, 0.0)
        next_value = torch.where(valid[:, t], values[:, t], next_value)
        next_advantage = torch.where(valid[:, t], advantage, next_advantage)
    returns = zero_invalid(advantages + values, valid)
    return advantages, returns


def clipped_surrogate(
    logps: Tensor,  # (B, T)
    old_logps: Tensor,  # (B, T)
    advantages: Tensor,  # (B,) per sequence or (B, T) per token
    mask: Tensor,  # (B, T)
    *,
    eps_low: float,
    eps_high: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO eq. 7 per token, negated to minimize: -min(ρA, clip(ρ, 1-ε_low, 1+ε_high)A), ρ = π/π_old.

    Returns the (B, T) per-token loss (0 on padding), left to the caller to reduce, and stats over
    valid tokens: `policy/clipfrac_low` (ρ < 1-ε_low with A < 0) and `policy/clipfrac_high` (ρ > 1+ε_high
    with A > 0) are where the clip is active (zero gradient); `policy/approx_kl` is the k3 estimator
    (ρ - 1) - log ρ of KL(π_old‖π) (Schulman 2020, "Approximating KL divergence")."""
    check_shape("logps", logps, mask.shape)
    check_shape("old_logps", old_logps, mask.shape)
    if logps.ndim != 2:
        raise ValueError(f"logps: expected a 2-D (B, T) tensor, got shape {tuple(logps.shape)}")
    if advantages.shape == mask.shape[:1]:
        advantages = advantages.unsqueeze(-1).expand_as(logps)  # one advantage for every token of o_i
    check_shape("advantages", advantages, mask.shape)
    if eps_low < 0 or eps_high < 0:
        raise ValueError(f"eps_low/eps_high: expected >= 0, got {eps_low}/{eps_high}")
    valid = valid_mask(mask, logps)
    # zero the padding BEFORE exp(): garbage there would otherwise give inf and NaN gradients; the clamp keeps
    # exp() finite, else a clipped token's unused branch would backpropagate 0 * inf = NaN
    log_ratio = zero_invalid(logps, valid) - zero_invalid(old_logps.detach(), valid)  # (B, T)
    log_ratio = torch.clamp(log_ratio, -MAX_LOG_RATIO, MAX_LOG_RATIO)
    advantages = zero_invalid(advantages.detach(), valid)  # (B, T)
    ratio = torch.exp(log_ratio)  # (B, T)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * advantages
    per_token = zero_invalid(-torch.minimum(unclipped, clipped), valid)  # (B, T)

    ratio_d = ratio.detach()
    clipped_low = (ratio_d < 1.0 - eps_low) & (advantages < 0)  # (B, T)
    clipped_high = (ratio_d > 1.0 + eps_high) & (advantages > 0)  # (B, T)
    stats = {
        "policy/clipfrac": token_mean((clipped_low | clipped_high).float(), valid),
        "policy/clipfrac_low": token_mean(clipped_low.float(), valid),
        "policy/clipfrac_high": token_mean(clipped_high.float(), valid),
        "policy/approx_kl": token_mean(torch.expm1(log_ratio.detach()) - log_ratio.detach(), valid),
        "policy/ratio_mean": token_mean(ratio_d, valid),
    }
    return per_token, stats


def ppo_policy_loss(
    logps: Tensor,  # (B, T)
    old_logps: Tensor,  # (B, T)
    advantages: Tensor,  # (B, T)
    mask: Tensor,  # (B, T)
    *,
    clip_eps: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO eq. 7: -E_t[min(ρ_t A_t, clip(ρ_t, 1-ε, 1+ε) A_t)], E_t = token mean over all valid tokens of the batch.

    The token mean (sum over valid tokens / their count) is what PPO-for-RLHF implementations use;
    stats are those of `clipped_surrogate` (clipfrac low/high split; approx_kl is the k3 estimator)."""
    per_token, stats = clipped_surrogate(logps, old_logps, advantages, mask, eps_low=clip_eps, eps_high=clip_eps)
    return token_mean(per_token, mask), stats


def ppo_value_loss(
    values: Tensor,  # (B, T)
    old_values: Tensor,  # (B, T)
    returns: Tensor,  # (B, T)
    mask: Tensor,  # (B, T)
    *,
    clip_eps: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss (OpenAI baselines PPO2): 0.5·max((V-R)², (clip(V, V_old±ε) - R)²), token mean.

    `value/clipfrac` is the fraction of valid tokens where the clipped term is the larger one
    (there the gradient wrt V is 0)."""
    check_shape("values", values, mask.shape)
    check_shape("old_values", old_values, mask.shape)
    check_shape("returns", returns, mask.shape)
    valid = valid_mask(mask, values)
    values = zero_invalid(values, valid)
    old_values = zero_invalid(old_values.detach(), valid)
    returns = zero_invalid(returns.detach(), valid)
    clipped_values = old_values + torch.clamp(values - old_values, -clip_eps, clip_eps)  # (B, T)
    loss_unclipped = (values - returns) ** 2  # (B, T)
    loss_clipped = (clipped_values - returns) ** 2  # (B, T)
    loss = 0.5 * token_mean(torch.maximum(loss_unclipped, loss_clipped), valid)
    stats = {
        "value/clipfrac": token_mean((loss_clipped > loss_unclipped).float(), valid),
        "value/loss": loss.detach(),
    }
    return loss, stats
