"""Bradley-Terry and Plackett-Luce reward-model losses: hand values, K = 2 equivalence, masked rankings."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline_lib.losses.reward import bradley_terry_loss, plackett_luce_loss


def test_bradley_terry_matches_the_seed_example():
    """Seed 002: r_w - r_l = 4 → -log σ(4) = log(1 + e^-4) = 0.018150; swapped (-4) → 4.018150. Mean 2.018150."""
    loss, stats = bradley_terry_loss(torch.tensor([5.0, 1.0]), torch.tensor([1.0, 5.0]))
    assert loss.item() == pytest.approx(2.0181499, abs=1e-6)
    assert stats["rewards/accuracies"].item() == 0.5
    assert stats["rewards/chosen"].item() == 3.0
    assert stats["rewards/rejected"].item() == 3.0
    assert stats["rewards/margins"].item() == 0.0


def test_bradley_terry_margin_float_and_tensor():
    """margin 1: differences 3 and -5 → (log(1+e^-3) + log(1+e^5)) / 2 = (0.048587 + 5.006715) / 2 = 2.527651."""
    chosen, rejected = torch.tensor([5.0, 1.0]), torch.tensor([1.0, 5.0])
    loss, _ = bradley_terry_loss(chosen, rejected, margin=1.0)
    assert loss.item() == pytest.approx(2.5276514, abs=1e-6)
    loss_t, _ = bradley_terry_loss(chosen, rejected, margin=torch.tensor([1.0, 1.0]))
    assert loss_t.item() == loss.item()
    # per-pair margins 0 and 2: differences 4 and -6 → (log(1+e^-4) + log(1+e^6)) / 2
    loss_pp, _ = bradley_terry_loss(chosen, rejected, margin=torch.tensor([0.0, 2.0]))
    assert loss_pp.item() == pytest.approx((math.log1p(math.exp(-4)) + math.log1p(math.exp(6))) / 2, abs=1e-6)


def test_bradley_terry_is_stable_for_huge_differences():
    loss, _ = bradley_terry_loss(torch.tensor([-500.0]), torch.tensor([500.0]))
    assert loss.item() == pytest.approx(1000.0)


def test_bradley_terry_gradient_raises_chosen_lowers_rejected():
    chosen = torch.tensor([0.3], requires_grad=True)
    rejected = torch.tensor([0.1], requires_grad=True)
    bradley_terry_loss(chosen, rejected)[0].backward()
    assert chosen.grad.item() < 0 < rejected.grad.item()


def test_bradley_terry_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="rejected_scores"):
        bradley_terry_loss(torch.zeros(3), torch.zeros(2))


def test_plackett_luce_hand_value():
    """Scores 2 > 1 > 0: -[2 - lse(2,1,0)] - [1 - lse(1,0)] - 0 = log(1+e^-1+e^-2) + log(1+e^-1)
    = 0.407606 + 0.313262 = 0.720868."""
    loss, stats = plackett_luce_loss(torch.tensor([[2.0, 1.0, 0.0]]))
    assert loss.item() == pytest.approx(0.7208677, abs=1e-6)
    assert stats["rewards/accuracies"].item() == 1.0
    assert stats["rewards/top"].item() == 2.0
    assert stats["rewards/margins"].item() == 1.0


def test_plackett_luce_with_two_responses_equals_bradley_terry():
    torch.manual_seed(0)
    scores = torch.randn(16, 2) * 3
    pl, pl_stats = plackett_luce_loss(scores)
    bt, bt_stats = bradley_terry_loss(scores[:, 0], scores[:, 1])
    assert pl.item() == bt.item()
    assert pl_stats["rewards/accuracies"].item() == bt_stats["rewards/accuracies"].item()


def test_plackett_luce_mask_equals_the_truncated_ranking():
    torch.manual_seed(1)
    scores = torch.randn(3, 4)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0]])
    garbage = torch.where(mask.bool(), scores, torch.tensor(float("nan")))
    loss, _ = plackett_luce_loss(garbage, mask=mask)
    per_ranking = [plackett_luce_loss(scores[i : i + 1, : int(mask[i].sum())])[0] for i in range(3)]
    torch.testing.assert_close(loss, torch.stack(per_ranking).mean())


@pytest.mark.parametrize("short_row", [[0, 0, 0], [1, 0, 0]], ids=["empty", "one response"])
def test_plackett_luce_leaves_rows_that_rank_nothing_out_of_the_mean(short_row):
    scores = torch.tensor([[1.0, 2.0, 3.0], [5.0, 0.0, 0.0]])
    loss, _ = plackett_luce_loss(scores, mask=torch.tensor([[1, 1, 1], short_row]))
    torch.testing.assert_close(loss, plackett_luce_loss(scores[:1])[0])


def test_plackett_luce_masked_accuracy_counts_only_valid_adjacent_pairs():
    """Row 0: 3 > 1 ✓, 1 < 2 ✗ (its 4th entry is padding); row 1: 0 < 5 ✗ → 1 of 3 pairs.
    Top score (3 + 0) / 2 = 1.5."""
    scores = torch.tensor([[3.0, 1.0, 2.0, 100.0], [0.0, 5.0, -7.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    _, stats = plackett_luce_loss(scores, mask=mask)
    assert stats["rewards/accuracies"].item() == pytest.approx(1 / 3)
    assert stats["rewards/top"].item() == pytest.approx(1.5)


def test_plackett_luce_gradient_is_finite_under_padding():
    scores = torch.tensor([[1.0, 0.5, 7.0]], requires_grad=True)
    plackett_luce_loss(scores, mask=torch.tensor([[1, 1, 0]]))[0].backward()
    assert torch.isfinite(scores.grad).all()
    assert scores.grad[0, 2].item() == 0.0
    assert scores.grad[0, 0].item() < 0 < scores.grad[0, 1].item()


def test_plackett_luce_rejects_a_non_prefix_mask():
    with pytest.raises(ValueError, match="mask: expected the valid entries of each ranking to be a prefix"):
        plackett_luce_loss(torch.zeros(1, 3), mask=torch.tensor([[1, 0, 1]]))
