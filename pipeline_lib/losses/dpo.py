"""Direct Preference Optimization: the policy's log-ratio to the reference is an implicit reward.

Inputs are sequence log-probabilities (sum over the response tokens), one per pair; the reference
ones are computed once per dataset and cached by the training loop."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from pipeline_lib.losses._masked import check_shape


def dpo_loss(
    policy_chosen_logps: Tensor,  # (B,)
    policy_rejected_logps: Tensor,  # (B,)
    ref_chosen_logps: Tensor,  # (B,)
    ref_rejected_logps: Tensor,  # (B,)
    *,
    beta: float,
    label_smoothing: float = 0.0,
    rpo_alpha: float = 0.0,
    chosen_lengths: Tensor | None = None,  # (B,) tokens in each chosen response, for rpo_alpha > 0
) -> tuple[Tensor, dict[str, Tensor]]:
    """DPO eq. 7: -log σ(β[(π_c - ref_c) - (π_r - ref_r)]), mean over pairs.

    label_smoothing ε > 0 is conservative DPO (Mitchell 2023): the label is flipped with probability ε,
    (1-ε)·(-log σ(βh)) + ε·(-log σ(-βh)). The gradient raises π_c and lowers π_r with weight σ(-βh).

    rpo_alpha α > 0 adds RPO's NLL term (Pang et al. 2024, arXiv:2404.19733, eq. 3): α · mean(-π_c / |y_c|),
    the chosen response's per-token negative log-likelihood. DPO alone often lowers π_c along with π_r when the
    two responses differ in a few tokens (near-miss math answers); the NLL term holds the chosen answers up."""
    if policy_chosen_logps.ndim != 1 or policy_chosen_logps.numel() == 0:
        raise ValueError(
            f"policy_chosen_logps: expected a non-empty 1-D (B,) tensor, got shape {tuple(policy_chosen_logps.shape)}"
        )
    for name, tensor in (
        ("policy_rejected_logps", policy_rejected_logps),
        ("ref_chosen_logps", ref_chosen_logps),
        ("ref_rejected_logps", ref_rejected_logps),
    ):
        check_shape(name, tensor, policy_chosen_logps.shape)
    if beta <= 0:
        raise ValueError(f"beta: expected > 0, got {beta}")
    if not 0.0 <= label_smoothing <= 0.5:
        raise ValueError(f"label_smoothing: expected a value in [0, 0.5], got {label_smoothing}")
    if rpo_alpha < 0:
        raise ValueError(f"rpo_alpha: expected >= 0, got {rpo_alpha}")
    if rpo_alpha > 0:
        if chosen_lengths is None:
            raise ValueError("chosen_lengths: required when rpo_alpha > 0 (the NLL term is per token)")
        check_shape("chosen_lengths", chosen_lengths, policy_chosen_logps.shape)
        if bool((chosen_lengths <= 0).any()):
            raise ValueError("chosen_lengths: expected every chosen response to hold at least one token")

    chosen_logratios = policy_chosen_logps - ref_chosen_logps  # (B,)
    rejected_logratios = policy_rejected_logps - ref_rejected_logps  # (B,)
    logits = beta * (chosen_logratios - rejected_logratios)  # (B,)
    losses = -(1.0 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)
    loss = losses.mean()

    chosen_rewards = beta * chosen_logratios.detach()  # (B,) implicit rewards, DPO §5
    rejected_rewards = beta * rejected_logratios.detach()  # (B,)
    stats = {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
        "logps/chosen": policy_chosen_logps.detach().mean(),
        "logps/rejected": policy_rejected_logps.detach().mean(),
    }
    if rpo_alpha > 0:
        nll = -(policy_chosen_logps / chosen_lengths).mean()
        loss = loss + rpo_alpha * nll
        stats["nll/chosen"] = nll.detach()
    return loss, stats
