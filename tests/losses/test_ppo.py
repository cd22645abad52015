"""PPO pieces: KL-penalized rewards, GAE, clipped policy surrogate, clipped value loss."""

from __future__ import annotations

import pytest
import torch

from pipeline_lib.losses.ppo import compute_gae, kl_penalized_rewards, ppo_policy_loss, ppo_value_loss

NAN = float("nan")


def pad_with_garbage(tensor: torch.Tensor, n: int = 3) -> torch.Tensor:
    """Append n columns of NaN / inf / huge values, to sit under mask 0."""
    garbage = torch.tensor([NAN, float("inf"), -1e30] * n)[:n].expand(tensor.shape[0], n)
    return torch.cat([tensor, garbage], dim=-1)


def pad_mask(mask: torch.Tensor, n: int = 3) -> torch.Tensor:
    return torch.cat([mask, torch.zeros(mask.shape[0], n, dtype=mask.dtype)], dim=-1)


# ---- kl_penalized_rewards


def test_kl_penalized_rewards_hand_value_right_padded():
    """k1 = π - ref = [-1 - (-1.5), -2 - (-1)] = [0.5, -1.0]; r = -0.1·k1 = [-0.05, 0.1], + score 2 at t = 1.
    objective/kl = 0.5 - 1.0 = -0.5, non-score reward 0.05, rlhf reward 2.05."""
    rewards, stats = kl_penalized_rewards(
        torch.tensor([2.0]),
        torch.tensor([[-1.0, -2.0, NAN]]),
        torch.tensor([[-1.5, -1.0, 7.0]]),
        torch.tensor([[1, 1, 0]]),
        kl_coef=0.1,
    )
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, 2.1, 0.0]]))
    assert stats["objective/kl"].item() == pytest.approx(-0.5)
    assert stats["objective/non_score_reward"].item() == pytest.approx(0.05)
    assert stats["objective/rlhf_reward"].item() == pytest.approx(2.05)
    assert stats["objective/scores"].item() == 2.0


def test_score_lands_on_the_last_valid_token_for_any_padding():
    mask = torch.tensor(
        [
            [1, 1, 1, 0, 0],  # right-padded
            [0, 0, 1, 1, 1],  # left-padded
            [0, 1, 0, 1, 0],  # holes, last valid at 3
        ]
    )
    logps = torch.zeros(3, 5)
    rewards, _ = kl_penalized_rewards(torch.tensor([1.0, 2.0, 3.0]), logps, logps, mask, kl_coef=0.5)
    expected = torch.zeros(3, 5)
    expected[0, 2], expected[1, 4], expected[2, 3] = 1.0, 2.0, 3.0
    torch.testing.assert_close(rewards, expected)


def test_kl_penalized_rewards_rejects_an_empty_sequence():
    logps = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="mask: sequence 1 has no valid token"):
        kl_penalized_rewards(torch.zeros(2), logps, logps, torch.tensor([[1, 0, 0], [0, 0, 0]]), kl_coef=0.1)


# ---- compute_gae


def test_gae_hand_value_three_tokens():
    """γ = 0.9, λ = 0.8 (γλ = 0.72), r = [0.1, -0.2, 1.0], V = [0.5, 0.4, 0.6], V after the end = 0:
    δ2 = 1.0 - 0.6 = 0.4;  δ1 = -0.2 + 0.9·0.6 - 0.4 = -0.06;  δ0 = 0.1 + 0.9·0.4 - 0.5 = -0.04
    A2 = 0.4;  A1 = -0.06 + 0.72·0.4 = 0.228;  A0 = -0.04 + 0.72·0.228 = 0.12416
    returns = A + V = [0.62416, 0.628, 1.0]."""
    rewards = torch.tensor([[0.1, -0.2, 1.0]])
    values = torch.tensor([[0.5, 0.4, 0.6]])
    advantages, returns = compute_gae(rewards, values, torch.ones(1, 3), gamma=0.9, lam=0.8)
    torch.testing.assert_close(advantages, torch.tensor([[0.12416, 0.228, 0.4]]))
    torch.testing.assert_close(returns, torch.tensor([[0.62416, 0.628, 1.0]]))


def test_gae_skips_padding_left_offsets_and_holes():
    """Same three valid tokens placed right-padded, left-padded and with holes: same advantages there, 0 elsewhere."""
    layouts = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [0, 1, 0, 1, 1]])
    rewards = torch.full((3, 5), NAN)
    values = torch.full((3, 5), float("inf"))
    for row, mask in enumerate(layouts):
        rewards[row, mask.bool()] = torch.tensor([0.1, -0.2, 1.0])
        values[row, mask.bool()] = torch.tensor([0.5, 0.4, 0.6])
    advantages, returns = compute_gae(rewards, values, layouts, gamma=0.9, lam=0.8)
    for row, mask in enumerate(layouts):
        torch.testing.assert_close(advantages[row, mask.bool()], torch.tensor([0.12416, 0.228, 0.4]))
        torch.testing.assert_close(returns[row, mask.bool()], torch.tensor([0.62416, 0.628, 1.0]))
        assert (advantages[row, ~mask.bool()] == 0).all() and (returns[row, ~mask.bool()] == 0).all()


def test_gae_with_gamma_lambda_one_is_reward_to_go_minus_value():
    torch.manual_seed(0)
    rewards, values = torch.randn(4, 6), torch.randn(4, 6)
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] * 2 + [0] * 4, [1] + [0] * 5])
    advantages, returns = compute_gae(rewards, values, mask, gamma=1.0, lam=1.0)
    masked_rewards = rewards * mask
    reward_to_go = masked_rewards.flip(-1).cumsum(-1).flip(-1)  # Σ_{k ≥ t} r_k
    torch.testing.assert_close(advantages, (reward_to_go - values) * mask)
    torch.testing.assert_close(returns, reward_to_go * mask)


def test_gae_outputs_are_detached():
    values = torch.randn(2, 3, requires_grad=True)
    advantages, returns = compute_gae(torch.randn(2, 3), values, torch.ones(2, 3), gamma=1.0, lam=0.95)
    assert not advantages.requires_grad and not returns.requires_grad


# ---- ppo_policy_loss


def test_ratio_one_gives_minus_mean_advantage():
    """ρ = 1 everywhere: loss = -(1 + 2 - 3 + 0.5)/4 tokens = -0.125 (token mean over valid tokens)."""
    logps = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.1, 0.0]])
    advantages = torch.tensor([[1.0, 2.0, -3.0], [0.5, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    loss, stats = ppo_policy_loss(logps, logps, advantages, mask, clip_eps=0.2)
    assert loss.item() == pytest.approx(-0.125)
    assert stats["policy/clipfrac"].item() == 0.0
    assert stats["policy/ratio_mean"].item() == pytest.approx(1.0)
    assert stats["policy/approx_kl"].item() == pytest.approx(0.0)


def test_clip_stats_hand_values():
    """Tokens (ρ, A): (1.5, +1) clipped high; (0.5, -1) clipped low; (1.5, -1) not clipped; (1, +1) not.
    ratio_mean = (1.5 + 0.5 + 1.5 + 1)/4 = 1.125; k3 = (ρ-1) - log ρ: 0.094535, 0.193147, 0.094535, 0 → 0.095554.
    loss = -[min(1.5, 1.2) + min(-0.5, -0.8) + min(-1.5, -1.2) + 1]/4 = -(1.2 - 0.8 - 1.5 + 1)/4 = 0.025."""
    old = torch.zeros(1, 4)
    logps = torch.log(torch.tensor([[1.5, 0.5, 1.5, 1.0]]))
    advantages = torch.tensor([[1.0, -1.0, -1.0, 1.0]])
    loss, stats = ppo_policy_loss(logps, old, advantages, torch.ones(1, 4), clip_eps=0.2)
    assert loss.item() == pytest.approx(0.025, abs=1e-6)
    assert stats["policy/clipfrac_high"].item() == 0.25
    assert stats["policy/clipfrac_low"].item() == 0.25
    assert stats["policy/clipfrac"].item() == 0.5
    assert stats["policy/ratio_mean"].item() == pytest.approx(1.125)
    assert stats["policy/approx_kl"].item() == pytest.approx(0.0955542, abs=1e-6)


def test_zero_gradient_outside_the_clip_range_on_the_clipped_side():
    """Gradient per token, -ρA/N unless clipped: 0 for (1.5, +1) and (0.5, -1);
    -(1.5·-1)/4 = 0.375 for (1.5, -1); -1/4 for (1, +1)."""
    old = torch.zeros(1, 4)
    logps = torch.log(torch.tensor([[1.5, 0.5, 1.5, 1.0]])).requires_grad_()
    advantages = torch.tensor([[1.0, -1.0, -1.0, 1.0]])
    ppo_policy_loss(logps, old, advantages, torch.ones(1, 4), clip_eps=0.2)[0].backward()
    torch.testing.assert_close(logps.grad, torch.tensor([[0.0, 0.0, 0.375, -0.25]]))


def test_policy_loss_padding_invariance():
    torch.manual_seed(0)
    logps, old, advantages = -torch.rand(2, 4), -torch.rand(2, 4), torch.randn(2, 4)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    base_logps = logps.clone().requires_grad_()
    loss, stats = ppo_policy_loss(base_logps, old, advantages, mask, clip_eps=0.2)
    loss.backward()
    padded_logps = pad_with_garbage(logps).requires_grad_()
    loss_p, stats_p = ppo_policy_loss(
        padded_logps, pad_with_garbage(old), pad_with_garbage(advantages), pad_mask(mask), clip_eps=0.2
    )
    loss_p.backward()
    torch.testing.assert_close(loss_p, loss)
    assert stats_p.keys() == stats.keys()
    for key in stats:
        torch.testing.assert_close(stats_p[key], stats[key])
    torch.testing.assert_close(padded_logps.grad[:, :4], base_logps.grad)
    assert (padded_logps.grad[:, 4:] == 0).all()


def test_policy_stats_are_detached_scalars():
    logps = torch.randn(2, 3, requires_grad=True)
    _, stats = ppo_policy_loss(logps, logps.detach(), torch.randn(2, 3), torch.ones(2, 3), clip_eps=0.2)
    assert all(not v.requires_grad and v.ndim == 0 for v in stats.values())


def test_policy_loss_rejects_mismatched_advantages():
    with pytest.raises(ValueError, match="advantages"):
        ppo_policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3), clip_eps=0.2)


# ---- ppo_value_loss


def test_value_loss_hand_value_and_clip_gradient():
    """ε = 0.2. Token 0: V 1.0, V_old 0.5, R 2.0 → (V-R)² = 1, clip(V) = 0.7 → (0.7-2)² = 1.69: clipped wins.
    Token 1: V 1.0, V_old 0.5, R 0.0 → 1 vs 0.49: unclipped wins. loss = 0.5·(1.69 + 1)/2 = 0.6725.
    dL/dV: token 0 is 0 (clipped); token 1 is 0.5·2·(1 - 0)/2 = 0.5."""
    values = torch.tensor([[1.0, 1.0, NAN]], requires_grad=True)
    loss, stats = ppo_value_loss(
        values,
        torch.tensor([[0.5, 0.5, float("inf")]]),
        torch.tensor([[2.0, 0.0, -1e30]]),
        torch.tensor([[1, 1, 0]]),
        clip_eps=0.2,
    )
    assert loss.item() == pytest.approx(0.6725)
    assert stats["value/clipfrac"].item() == 0.5
    assert stats["value/loss"].item() == pytest.approx(0.6725)
    loss.backward()
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, 0.5, 0.0]]))


def test_value_loss_at_old_values_is_half_mse():
    """V = V_old: both terms equal, loss = 0.5·mean((V-R)²) = 0.5·(1 + 4)/2 = 1.25."""
    values = torch.tensor([[1.0, -1.0]])
    loss, stats = ppo_value_loss(values, values, torch.tensor([[0.0, 1.0]]), torch.ones(1, 2), clip_eps=0.2)
    assert loss.item() == pytest.approx(1.25)
    assert stats["value/clipfrac"].item() == 0.0
