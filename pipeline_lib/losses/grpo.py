"""GRPO (DeepSeekMath, arXiv:2402.03300): group-normalized advantages instead of a critic, k3 KL to the reference.

Dr.GRPO (arXiv:2503.20783) removes GRPO's two normalizations: the std (`group_advantages(..., scale=False)`)
and the 1/|o_i| per-answer length (`dr_grpo_loss`)."""

from __future__ import annotations

import torch
from torch import Tensor

from pipeline_lib.losses._masked import (
    check_shape,
    masked_sum,
    seq_mean_token_mean,
    token_mean,
    valid_mask,
    zero_invalid,
)
from pipeline_lib.losses.ppo import MAX_LOG_RATIO, clipped_surrogate


def group_advantages(rewards: Tensor, *, group_size: int, scale: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO outcome advantages (DeepSeekMath §4.1.2): A_i = (r_i - mean(r)) / (std(r) + eps) within each group.

    rewards: (B·G,), groups are consecutive runs of `group_size`. std is the POPULATION std
    (1/G Σ (r_j - mean)², as in the seeds' formula); the eps sits outside the sqrt, (r - mean) / (std + eps), as
    TRL and verl add it (the seed article writes it inside, sqrt(1/G Σ (r_j - mean)² + eps)).
    scale=False returns r_i - mean(r) (Dr.GRPO). Returns (B·G,) in the rewards' float dtype (at least float32).

    The group statistics are taken in float64: a group of equal float32 rewards then has a mean equal to each
    reward, so its advantages are exactly 0 (in float32 the mean can be one ulp off, and that ulp divided by
    std + eps gives every member the same arbitrary non-zero advantage)."""
    if rewards.ndim != 1:
        raise ValueError(f"rewards: expected a 1-D (B*G,) tensor, got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"group_size: expected a positive divisor of len(rewards)={rewards.numel()}, got {group_size}")
    grouped = rewards.to(torch.float64).view(-1, group_size)  # (B, G)
    centered = grouped - grouped.mean(dim=-1, keepdim=True)  # (B, G)
    if scale:
        centered = centered / (grouped.std(dim=-1, correction=0, keepdim=True) + eps)
    return centered.view(-1).to(torch.promote_types(rewards.dtype, torch.float32))


def kl_k3(policy_logps: Tensor, ref_logps: Tensor) -> Tensor:
    """k3 estimator of KL(π‖π_ref) per token (DeepSeekMath eq. 4): π_ref/π - log(π_ref/π) - 1, always >= 0.

    Written as expm1(d) - d with d = log π_ref - log π, which keeps precision when d is tiny. d is clamped from
    above only, at MAX_LOG_RATIO, so a token the policy has all but ruled out gives a large finite penalty, not
    inf; below, e^d - d - 1 is about -d - 1 with gradient 1 and stays exact, so a token the policy made far likelier
    than the reference keeps its whole penalty and its pull back."""
    check_shape("ref_logps", ref_logps, policy_logps.shape)
    log_ratio = torch.clamp(ref_logps - policy_logps, max=MAX_LOG_RATIO)
    return torch.expm1(log_ratio) - log_ratio


def kl_penalized_surrogate(
    logps: Tensor, old_logps: Tensor, ref_logps: Tensor | None, advantages: Tensor, mask: Tensor, *, eps_low: float,
    eps_high: float, beta: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """-[min(ρA, clip(ρ, 1-ε_low, 1+ε_high)A) - β·k3(π‖π_ref)] per token (B, T), before any reduction (GRPO,
    Dr.GRPO and DAPO reduce it differently)."""
    per_token, stats = clipped_surrogate(logps, old_logps, advantages, mask, eps_low=eps_low, eps_high=eps_high)
    if ref_logps is not None:
        check_shape("ref_logps", ref_logps, mask.shape)
        valid = valid_mask(mask, logps)
        # zero both sides on padding so kl there is exactly 0 whatever the inputs held
        kl = kl_k3(zero_invalid(logps, valid), zero_invalid(ref_logps.detach(), valid))  # (B, T)
        stats["policy/kl_ref"] = token_mean(kl.detach(), valid)
        per_token = per_token + beta * kl
    elif beta != 0:
        raise ValueError(f"ref_logps: required when beta != 0 (got beta={beta})")
    return per_token, stats


def grpo_loss(
    logps: Tensor,  # (B, T)
    old_logps: Tensor,  # (B, T)
    ref_logps: Tensor | None,  # (B, T); may be None when beta == 0
    advantages: Tensor,  # (B,) one per sequence, or (B, T)
    mask: Tensor,  # (B, T)
    *,
    clip_eps: float = 0.2,
    beta: float = 0.04,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO eq. 3, negated: -1/G Σ_i 1/|o_i| Σ_t [min(ρA, clip(ρ, 1-ε, 1+ε)A) - β·k3(π‖π_ref)].

    Aggregation: mean over each sequence's valid tokens, then over sequences
    (`seq_mean_token_mean`). beta = 0 drops the KL term (ref_logps may then be None)."""
    per_token, stats = kl_penalized_surrogate(logps, old_logps, ref_logps, advantages, mask, eps_low=clip_eps,
                                              eps_high=clip_eps, beta=beta)
    return seq_mean_token_mean(per_token, mask), stats


def dr_grpo_loss(
    logps: Tensor,  # (B, T)
    old_logps: Tensor,  # (B, T)
    ref_logps: Tensor | None,  # (B, T); may be None when beta == 0
    advantages: Tensor,  # (B,) one per sequence, or (B, T)
    mask: Tensor,  # (B, T)
    *,
    max_len: int,
    clip_eps: float = 0.2,
    beta: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Dr.GRPO (arXiv:2503.20783 §3.2), negated: GRPO's per-token objective summed over every valid token and
    divided by the constant B·max_len (max_len: the generation budget) instead of 1/G Σ_i 1/|o_i|, so a token
    weighs the same in a short answer as in a long one and wrong answers are not pushed to grow. Its advantages
    are centred without the std (`group_advantages(..., scale=False)`)."""
    if max_len < 1:
        raise ValueError(f"max_len={max_len}: expected >= 1 (the generation budget in tokens)")
    per_token, stats = kl_penalized_surrogate(logps, old_logps, ref_logps, advantages, mask, eps_low=clip_eps,
                                              eps_high=clip_eps, beta=beta)
    return masked_sum(per_token, mask) / (mask.shape[0] * max_len), stats
