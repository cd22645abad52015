"""DAPO: clip-higher, token-level aggregation (vs GRPO's sequence-level), overlong reward shaping."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline_lib.losses.dapo import dapo_loss, overlong_penalty
from pipeline_lib.losses.grpo import grpo_loss

NAN = float("nan")


def test_token_level_differs_from_sequence_level_for_different_lengths():
    """ρ = 1, A = [+1, -1], lengths 1 and 3: per-token loss -A.
    DAPO: (-1·1 + 1·3) / 4 tokens = 0.5.   GRPO: mean(-1, +1) = 0."""
    logps = torch.tensor([[-1.0, 0.0, 0.0], [-1.0, -2.0, -3.0]])
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]])
    advantages = torch.tensor([1.0, -1.0])
    dapo, _ = dapo_loss(logps, logps, advantages, mask)
    grpo, _ = grpo_loss(logps, logps, None, advantages, mask, beta=0.0)
    assert dapo.item() == pytest.approx(0.5)
    assert grpo.item() == pytest.approx(0.0)


def test_one_sequence_with_symmetric_clip_equals_grpo_without_kl():
    torch.manual_seed(0)
    logps, old = -torch.rand(1, 6), -torch.rand(1, 6)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]])
    advantages = torch.tensor([0.7])
    dapo, dapo_stats = dapo_loss(logps, old, advantages, mask, eps_low=0.2, eps_high=0.2)
    grpo, grpo_stats = grpo_loss(logps, old, None, advantages, mask, clip_eps=0.2, beta=0.0)
    torch.testing.assert_close(dapo, grpo)
    assert dapo_stats.keys() == grpo_stats.keys()


def test_a_kl_term_is_reduced_token_level_with_the_surrogate():
    """ρ = 1, A = [+1, -1], lengths 1 and 3, β = 0.5: each token's term is -A + β·k3(π‖π_ref) with
    k3 = e^d - d - 1, d = log π_ref - log π; the loss is their sum over the 4 tokens / 4. β = 0 (the default) and
    no reference give the surrogate alone; β > 0 without one is an error."""
    logps = torch.tensor([[-1.0, 0.0, 0.0], [-1.0, -2.0, -3.0]])
    ref = torch.tensor([[-1.5, 9.0, 9.0], [-0.5, -2.0, -2.0]])
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]])
    advantages = torch.tensor([1.0, -1.0])
    k3 = [math.exp(d) - d - 1 for d in (-0.5, 0.5, 0.0, 1.0)]
    loss, stats = dapo_loss(logps, logps, advantages, mask, ref_logps=ref, beta=0.5)
    assert loss.item() == pytest.approx((-1 + 1 + 1 + 1 + 0.5 * sum(k3)) / 4)
    assert stats["policy/kl_ref"].item() == pytest.approx(sum(k3) / 4)
    assert dapo_loss(logps, logps, advantages, mask)[0].item() == pytest.approx(0.5)
    with pytest.raises(ValueError, match="ref_logps: required when beta != 0"):
        dapo_loss(logps, logps, advantages, mask, beta=0.5)


def test_clip_higher_bounds_and_gradients():
    """eps_low 0.2, eps_high 0.28. Tokens (ρ, A):
    (1.25, +1) inside [0.8, 1.28] → loss -1.25, grad -ρA/N = -1.25/4;
    (1.3, +1) clipped high → -1.28, grad 0;
    (0.75, -1) clipped low → 0.8, grad 0;
    (0.75, +1) min picks the unclipped ρA → -0.75, grad -0.75/4.
    loss = (-1.25 - 1.28 + 0.8 - 0.75)/4 = -0.62; clipfrac_high = clipfrac_low = 0.25."""
    logps = torch.log(torch.tensor([[1.25, 1.3, 0.75, 0.75]])).requires_grad_()
    advantages = torch.tensor([[1.0, 1.0, -1.0, 1.0]])
    loss, stats = dapo_loss(logps, torch.zeros(1, 4), advantages, torch.ones(1, 4))
    assert loss.item() == pytest.approx(-0.62, abs=1e-6)
    assert stats["policy/clipfrac_high"].item() == 0.25
    assert stats["policy/clipfrac_low"].item() == 0.25
    assert stats["policy/clipfrac"].item() == 0.5
    loss.backward()
    torch.testing.assert_close(logps.grad, torch.tensor([[-1.25 / 4, 0.0, 0.0, -0.75 / 4]]))


@pytest.mark.parametrize("log_ratio, advantage", [(89.0, 1.0), (200.0, 1.0), (-200.0, -1.0)])
def test_far_clipped_tokens_give_zero_gradient_not_nan(log_ratio, advantage):
    """exp(89) overflows float32: without the clamp the unused branch backpropagated 0 * inf = NaN."""
    logps = torch.tensor([[log_ratio, 0.1]], requires_grad=True)
    loss, _ = dapo_loss(logps, torch.zeros(1, 2), torch.tensor([advantage]), torch.ones(1, 2))
    loss.backward()
    assert torch.isfinite(loss)
    assert logps.grad[0, 0].item() == 0.0
    assert logps.grad[0, 1].item() == pytest.approx(-advantage * torch.exp(torch.tensor(0.1)).item() / 2)


def test_ratio_one_gives_minus_token_mean_advantage():
    """ρ = 1: loss = -(2·3 + (-1)·1)/4 tokens = -1.25."""
    logps = -torch.rand(2, 3)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    loss, stats = dapo_loss(logps, logps, torch.tensor([2.0, -1.0]), mask)
    assert loss.item() == pytest.approx(-1.25)
    assert stats["policy/ratio_mean"].item() == pytest.approx(1.0)


def test_dapo_padding_invariance():
    torch.manual_seed(1)
    logps, old, advantages = -torch.rand(2, 3), -torch.rand(2, 3), torch.randn(2, 3)
    mask = torch.tensor([[1, 1, 1], [0, 1, 1]])
    base = logps.clone().requires_grad_()
    loss, stats = dapo_loss(base, old, advantages, mask)
    loss.backward()

    def pad(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, torch.tensor([[NAN, float("inf")]]).expand(2, 2)], dim=-1)

    padded = pad(logps).requires_grad_()
    loss_p, stats_p = dapo_loss(padded, pad(old), pad(advantages), torch.cat([mask, torch.zeros(2, 2)], dim=-1))
    loss_p.backward()
    torch.testing.assert_close(loss_p, loss)
    for key in stats:
        torch.testing.assert_close(stats_p[key], stats[key])
    torch.testing.assert_close(padded.grad[:, :3], base.grad)
    assert (padded.grad[:, 3:] == 0).all()


def test_overlong_penalty_at_the_boundaries():
    """max_len 20, cache_len 4 → soft zone (16, 20]: L=16 → 0; 17 → (16-17)/4 = -0.25; 18 → -0.5;
    20 → -1; 21 → -1; 0 → 0."""
    lengths = [0, 16, 17, 18, 20, 21, 1000]
    penalty = overlong_penalty(lengths, max_len=20, cache_len=4)
    assert penalty.dtype == torch.float32
    torch.testing.assert_close(penalty, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0, -1.0]))
    from_tensor = overlong_penalty(torch.tensor(lengths), max_len=20, cache_len=4)
    torch.testing.assert_close(from_tensor, penalty)


def test_overlong_penalty_rejects_a_bad_cache_len():
    with pytest.raises(ValueError, match="cache_len: expected 0 < cache_len <= max_len=20"):
        overlong_penalty([5], max_len=20, cache_len=30)
