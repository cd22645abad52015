"""DAPO (arXiv:2503.14476): GRPO with clip-higher, a token-level loss, no KL term by default, and overlong reward
shaping.

Dynamic sampling (keep groups with 0 < #correct < G) is data selection and lives in pipeline_lib/filters.py."""

from __future__ import annotations

import torch
from torch import Tensor

from pipeline_lib.losses._masked import token_mean
from pipeline_lib.losses.grpo import kl_penalized_surrogate


def dapo_loss(
    logps: Tensor,  # (B, T)
    old_logps: Tensor,  # (B, T)
    advantages: Tensor,  # (B,) one per sequence, or (B, T)
    mask: Tensor,  # (B, T)
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    ref_logps: Tensor | None = None,  # (B, T); needed when beta > 0
    beta: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DAPO §3 objective, negated: -1/Σ|o_i| Σ_i Σ_t min(ρA, clip(ρ, 1-ε_low, 1+ε_high)A).

    Token-level (§3.3): the sum over ALL valid tokens of the batch divided by their count (`token_mean`),
    so a 200-token answer weighs 20x a 10-token one instead of the same (GRPO's per-sequence mean).
    No KL term by default (§2.3); beta > 0 subtracts GRPO's β·k3(π‖π_ref) from every token's term, reduced
    token-level with it."""
    per_token, stats = kl_penalized_surrogate(logps, old_logps, ref_logps, advantages, mask, eps_low=eps_low,
                                              eps_high=eps_high, beta=beta)
    return token_mean(per_token, mask), stats


def overlong_penalty(lengths: Tensor | list[int], *, max_len: int, cache_len: int) -> Tensor:
    """DAPO §3.4 soft overlong punishment: 0 to L_max - L_cache, then (L_max - L_cache - L)/L_cache, -1 past L_max.

    lengths: (N,) response lengths in tokens (tensor or list of ints). Returns a float (N,) tensor
    to add to the task reward."""
    if cache_len <= 0 or cache_len > max_len:
        raise ValueError(f"cache_len: expected 0 < cache_len <= max_len={max_len}, got {cache_len}")
    lengths = torch.as_tensor(lengths).float()  # (N,)
    soft_start = max_len - cache_len
    ramp = (soft_start - lengths) / cache_len  # (N,) 0 at soft_start, -1 at max_len
    return torch.where(lengths <= soft_start, 0.0, torch.where(lengths <= max_len, ramp, -1.0))
