"""DPO loss: log 2 at policy == ref, a hand value, conservative DPO, gradient directions, stats."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline_lib.losses.dpo import dpo_loss


def test_policy_equal_to_reference_gives_log_2():
    logps = torch.tensor([-3.0, -10.0, -0.5])
    loss, stats = dpo_loss(logps, logps - 2, logps, logps - 2, beta=0.1)
    assert loss.item() == pytest.approx(math.log(2))
    assert stats["rewards/margins"].item() == 0.0
    assert stats["rewards/accuracies"].item() == 0.0


def test_hand_value_and_stats():
    """π_c - ref_c = -1 - (-2) = 1, π_r - ref_r = -3 - (-2) = -1, h = 2, βh = 0.2:
    loss = log(1 + e^-0.2) = 0.598139; rewards chosen 0.1, rejected -0.1, margin 0.2."""
    loss, stats = dpo_loss(
        torch.tensor([-1.0]), torch.tensor([-3.0]), torch.tensor([-2.0]), torch.tensor([-2.0]), beta=0.1
    )
    assert loss.item() == pytest.approx(0.5981389, abs=1e-6)
    assert stats["rewards/chosen"].item() == pytest.approx(0.1)
    assert stats["rewards/rejected"].item() == pytest.approx(-0.1)
    assert stats["rewards/margins"].item() == pytest.approx(0.2)
    assert stats["rewards/accuracies"].item() == 1.0
    assert stats["logps/chosen"].item() == -1.0
    assert stats["logps/rejected"].item() == -3.0


def test_label_smoothing_is_conservative_dpo():
    """ls = 0.1, βh = 0.2: 0.9·log(1+e^-0.2) + 0.1·log(1+e^0.2) = 0.9·0.598139 + 0.1·0.798139 = 0.618139."""
    loss, _ = dpo_loss(
        torch.tensor([-1.0]),
        torch.tensor([-3.0]),
        torch.tensor([-2.0]),
        torch.tensor([-2.0]),
        beta=0.1,
        label_smoothing=0.1,
    )
    assert loss.item() == pytest.approx(0.6181389, abs=1e-6)


def test_gradient_raises_chosen_and_lowers_rejected():
    """dL/dπ_c = -β σ(-βh) = -0.1·σ(-0.2) = -0.045017; dL/dπ_r = +0.045017."""
    chosen = torch.tensor([-1.0], requires_grad=True)
    rejected = torch.tensor([-3.0], requires_grad=True)
    loss, _ = dpo_loss(chosen, rejected, torch.tensor([-2.0]), torch.tensor([-2.0]), beta=0.1)
    loss.backward()
    # gradient descent moves against the gradient: chosen up, rejected down
    assert chosen.grad.item() == pytest.approx(-0.0450166, abs=1e-6)
    assert rejected.grad.item() == pytest.approx(0.0450166, abs=1e-6)


def test_rpo_adds_the_per_token_nll_of_the_chosen_response():
    """Pair 1 of test_hand_value (π_c = -1 over 4 tokens) and a pair at policy == ref (π_c = -6 over 2 tokens):
    DPO mean (0.598139 + log 2) / 2 = 0.645643; NLL mean (1/4 + 6/2) / 2 = 1.625; α = 0.5 adds 0.8125.
    dL/dπ_c of pair 1: DPO's -0.045017 / 2 plus the NLL's -α / (2 · 4) = -0.0625."""
    chosen = torch.tensor([-1.0, -6.0], requires_grad=True)
    loss, stats = dpo_loss(chosen, torch.tensor([-3.0, -8.0]), torch.tensor([-2.0, -6.0]), torch.tensor([-2.0, -8.0]),
                           beta=0.1, rpo_alpha=0.5, chosen_lengths=torch.tensor([4, 2]))
    assert loss.item() == pytest.approx(0.6456430 + 0.8125, abs=1e-6)
    assert stats["nll/chosen"].item() == pytest.approx(1.625)
    loss.backward()
    assert chosen.grad[0].item() == pytest.approx(-0.0450166 / 2 - 0.0625, abs=1e-6)
    plain, plain_stats = dpo_loss(chosen, torch.tensor([-3.0, -8.0]), torch.tensor([-2.0, -6.0]),
                                  torch.tensor([-2.0, -8.0]), beta=0.1)
    assert plain.item() == pytest.approx(0.6456430, abs=1e-6) and "nll/chosen" not in plain_stats


def test_rpo_needs_the_chosen_lengths():
    ones = torch.ones(2)
    with pytest.raises(ValueError, match="chosen_lengths: required when rpo_alpha > 0"):
        dpo_loss(ones, ones, ones, ones, beta=0.1, rpo_alpha=1.0)
    with pytest.raises(ValueError, match="chosen_lengths: expected every chosen response"):
        dpo_loss(ones, ones, ones, ones, beta=0.1, rpo_alpha=1.0, chosen_lengths=torch.tensor([3, 0]))
    with pytest.raises(ValueError, match="rpo_alpha: expected >= 0"):
        dpo_loss(ones, ones, ones, ones, beta=0.1, rpo_alpha=-1.0)


def test_stats_are_detached():
    chosen = torch.tensor([-1.0, -2.0], requires_grad=True)
    _, stats = dpo_loss(chosen, chosen.detach() - 1, chosen.detach(), chosen.detach(), beta=0.5)
    assert all(not value.requires_grad and value.ndim == 0 for value in stats.values())


def test_bad_arguments_name_the_field():
    ones = torch.ones(2)
    with pytest.raises(ValueError, match="ref_rejected_logps"):
        dpo_loss(ones, ones, ones, torch.ones(3), beta=0.1)
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(ones, ones, ones, ones, beta=0.0)
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(ones, ones, ones, ones, beta=0.1, label_smoothing=0.7)
