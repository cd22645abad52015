"""Reward-model losses: Bradley-Terry for preference pairs, Plackett-Luce for K ranked responses.

Both are negative log-likelihoods of the observed preference under a softmax-of-scores choice model."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from pipeline_lib.losses._masked import check_shape, valid_mask


def bradley_terry_loss(
    chosen_scores: Tensor,  # (B,)
    rejected_scores: Tensor,  # (B,)
    *,
    margin: Tensor | float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Bradley-Terry RM loss (InstructGPT eq. 1; Llama 2 eq. 2 with margin): mean -log σ(r_w - r_l - m).

    `margin` is a float or a (B,) tensor (Llama 2's preference-strength margin); logsigmoid keeps
    large negative differences finite."""
    if chosen_scores.ndim != 1 or chosen_scores.numel() == 0:
        raise ValueError(f"chosen_scores: expected a non-empty 1-D (B,) tensor, got shape {tuple(chosen_scores.shape)}")
    check_shape("rejected_scores", rejected_scores, chosen_scores.shape)
    diff = chosen_scores - rejected_scores  # (B,)
    if margin is not None:
        if isinstance(margin, Tensor) and margin.ndim > 0:
            check_shape("margin", margin, chosen_scores.shape)
        diff = diff - margin
    loss = -F.logsigmoid(diff).mean()
    stats = {
        "rewards/chosen": chosen_scores.detach().mean(),
        "rewards/rejected": rejected_scores.detach().mean(),
        "rewards/margins": (chosen_scores - rejected_scores).detach().mean(),
        "rewards/accuracies": (chosen_scores > rejected_scores).float().mean(),
    }
    return loss, stats


def plackett_luce_loss(
    scores: Tensor,  # (B, K) ordered best -> worst
    *,
    mask: Tensor | None = None,  # (B, K) valid entries, a prefix of each row
) -> tuple[Tensor, dict[str, Tensor]]:
    """Plackett-Luce ranking loss (Plackett 1975; DPO appendix A.3): mean over rankings of -Σ_i log P(i first of i..K).

    Per ranking: -Σ_i [s_i - logsumexp(s_i..s_K)] over its valid entries. Each term is written as
    logsigmoid(s_i - logsumexp(s_{i+1}..s_K)), so with K = 2 it is exactly the Bradley-Terry loss. Rows
    with fewer than two valid entries (padding, or a ranking of one) rank nothing and are left out of the mean."""
    if scores.ndim != 2 or scores.shape[0] == 0:
        raise ValueError(f"scores: expected a non-empty 2-D (B, K) tensor, got shape {tuple(scores.shape)}")
    if mask is None:
        valid = torch.ones_like(scores, dtype=torch.bool)
    else:
        valid = valid_mask(mask, scores)
        # a ranking of fewer responses is a prefix: once an entry is invalid, all after it are
        if (valid[:, 1:] & ~valid[:, :-1]).any():
            raise ValueError("mask: expected the valid entries of each ranking to be a prefix (1...1 0...0)")
    # invalid entries get the most negative finite score: exp() makes them 0 in every logsumexp
    # without the inf - inf = NaN that -inf would produce in the backward pass
    floor = torch.finfo(scores.dtype).min
    filled = torch.where(valid, scores, torch.full_like(scores, floor))  # (B, K)
    suffix_lse = torch.logcumsumexp(filled.flip(-1), dim=-1).flip(-1)  # (B, K): lse(s_i..s_K)
    rest_lse = torch.cat([suffix_lse[:, 1:], torch.full_like(suffix_lse[:, :1], floor)], dim=-1)  # lse(s_{i+1}..s_K)
    log_probs = torch.where(valid, F.logsigmoid(filled - rest_lse), torch.zeros_like(scores))  # (B, K)
    loss = -log_probs.sum(-1).sum() / (valid.sum(dim=-1) >= 2).sum().clamp(min=1)

    pair_valid = valid[:, 1:] & valid[:, :-1]  # (B, K-1) adjacent pairs inside a ranking
    gaps = (filled[:, :-1] - filled[:, 1:]).detach()  # (B, K-1)
    n_pairs = pair_valid.sum().clamp(min=1)
    stats = {
        "rewards/accuracies": ((gaps > 0) & pair_valid).sum() / n_pairs,
        "rewards/margins": torch.where(pair_valid, gaps, torch.zeros_like(gaps)).sum() / n_pairs,
        "rewards/top": torch.where(valid[:, 0], filled[:, 0], torch.zeros_like(filled[:, 0])).detach().sum()
        / valid[:, 0].sum().clamp(min=1),
    }
    return loss, stats
