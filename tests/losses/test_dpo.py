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
