"""GRPO: group advantages (population std, Dr.GRPO centering), the k3 KL estimator, the sequence-level loss."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline_lib.losses import LOSSES, dapo_loss
from pipeline_lib.losses.grpo import dr_grpo_loss, group_advantages, grpo_loss, kl_k3

NAN = float("nan")


# ---- group_advantages


def test_group_advantages_hand_value_population_std():
    """Group [1, 0, 0, 0]: mean 0.25, population var (0.75² + 3·0.25²)/4 = 0.1875, std 0.433013:
    A = [0.75, -0.25, -0.25, -0.25] / 0.433013 = [1.732051, -0.577350, -0.577350, -0.577350].
    Group [2, 4]: mean 3, population std 1 → [-1, 1] (the unbiased std √2 would give ±0.707107)."""
    advantages = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 4.0, 2.0, 4.0]), group_size=4, eps=0.0)
    expected = torch.tensor([math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3), -1, 1, -1, 1])
    torch.testing.assert_close(advantages, expected)


def test_group_advantages_sum_to_zero_and_have_unit_population_std_per_group():
    torch.manual_seed(0)
    advantages = group_advantages(torch.randn(24), group_size=8, eps=0.0).view(3, 8)
    torch.testing.assert_close(advantages.sum(-1), torch.zeros(3), atol=1e-5, rtol=0)
    torch.testing.assert_close(advantages.std(-1, correction=0), torch.ones(3))


def test_group_advantages_eps_sits_outside_the_sqrt():
    """[2, 4] with eps 0.5: (±1) / (1 + 0.5) = ±0.666667."""
    advantages = group_advantages(torch.tensor([2.0, 4.0]), group_size=2, eps=0.5)
    torch.testing.assert_close(advantages, torch.tensor([-2 / 3, 2 / 3]))


def test_group_advantages_accept_integer_and_bool_rewards():
    expected = group_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), group_size=2)
    torch.testing.assert_close(group_advantages(torch.tensor([1, 0, 1, 1]), group_size=2), expected)
    torch.testing.assert_close(group_advantages(torch.tensor([True, False, True, True]), group_size=2), expected)


def test_group_advantages_all_equal_rewards_give_zero():
    advantages = group_advantages(torch.ones(4), group_size=4)
    assert (advantages == 0).all()


@pytest.mark.parametrize("reward", [0.7, 0.1, 7.9, 13.37, 123.456, -2.3])
@pytest.mark.parametrize("group_size", [3, 6, 8, 16])
def test_equal_float32_rewards_give_exactly_zero_advantages(reward, group_size):
    """In float32 the mean of 8 x 0.7 is one ulp off 0.7, and that ulp / (std + eps) gave every member 0.056."""
    rewards = torch.tensor([reward] * group_size + [0.0, 1.0] * (group_size // 2) + [1.0] * (group_size % 2))
    advantages = group_advantages(rewards, group_size=group_size)
    assert advantages.dtype == torch.float32
    assert (advantages[:group_size] == 0).all()
    assert advantages[group_size:].abs().max() > 0.9  # the mixed group still gets its full-size advantages


def test_kl_k3_stays_finite_where_the_policy_has_ruled_a_token_out():
    ref_logps = torch.tensor([-1.0])
    logps = torch.tensor([-150.0], requires_grad=True)
    kl = kl_k3(logps, ref_logps)
    kl.backward()
    assert torch.isfinite(kl).all() and torch.isfinite(logps.grad).all()
    assert kl.item() == pytest.approx(math.expm1(20.0) - 20.0, rel=1e-6)  # log-ratio clamped at 20


@pytest.mark.parametrize("log_ratio", [-5.0, -21.0, -25.0, -60.0])
def test_kl_k3_keeps_its_value_and_gradient_where_the_policy_far_outweighs_the_reference(log_ratio):
    """d = log π_ref - log π far below 0: k3 = e^d - d - 1 is finite (about -d - 1), d k3 / d log π = 1 - e^d.
    A clamp at -20 froze it at 19 with gradient 0 for d = -25, so the KL term stopped pulling such a token back."""
    logps = torch.tensor([-0.01], dtype=torch.float64, requires_grad=True)
    kl = kl_k3(logps, logps.detach() + log_ratio)
    kl.backward()
    assert kl.item() == pytest.approx(math.exp(log_ratio) - log_ratio - 1, rel=1e-9)
    assert logps.grad.item() == pytest.approx(1 - math.exp(log_ratio), rel=1e-9)


def test_dr_grpo_only_centers():
    """scale=False: [1, 0, 0, 0] - 0.25 = [0.75, -0.25, -0.25, -0.25]."""
    advantages = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), group_size=4, scale=False)
    torch.testing.assert_close(advantages, torch.tensor([0.75, -0.25, -0.25, -0.25]))


def test_dr_grpo_loss_weighs_every_token_alike_whatever_its_answer_length():
    """ρ = 1, A = -0.5 for answers of 2 and 10 tokens, max_len 10: per-token loss -ρA = 0.5.
    Dr.GRPO: 12 · 0.5 / (2 · 10) = 0.3, d/dlogπ = -A/(B·L) = 0.025 on every token.
    GRPO: mean(0.5, 0.5) = 0.5, d/dlogπ = 0.5/2/2 = 0.125 on the short answer's tokens, 0.025 on the long one's."""
    mask = torch.zeros(2, 10)
    mask[0, :2], mask[1] = 1, 1
    advantages = torch.tensor([-0.5, -0.5])
    grads = []
    for loss_fn, kwargs, expected in ((dr_grpo_loss, {"max_len": 10}, 0.3), (grpo_loss, {}, 0.5)):
        logps = torch.full((2, 10), -1.0, requires_grad=True)
        loss, _ = loss_fn(logps, logps.detach(), None, advantages, mask, beta=0.0, **kwargs)
        loss.backward()
        assert loss.item() == pytest.approx(expected)
        grads.append(logps.grad)
    torch.testing.assert_close(grads[0], 0.025 * mask)
    assert grads[1][0, 0].item() == pytest.approx(0.125) and grads[1][1, 0].item() == pytest.approx(0.025)


def test_dr_grpo_loss_keeps_grpos_kl_term_and_refuses_a_budget_below_one():
    """With ρ = 1 and A = 0 only β·k3 is left: Σ kl / (B · max_len)."""
    logps, ref = torch.tensor([[-1.0, -2.0, 0.0]]), torch.tensor([[-1.5, -1.0, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    loss, stats = dr_grpo_loss(logps, logps, ref, torch.zeros(1), mask, max_len=4, beta=0.1)
    kl = kl_k3(logps[:, :2], ref[:, :2]).sum()
    assert loss.item() == pytest.approx(0.1 * kl.item() / 4)
    assert "policy/kl_ref" in stats
    with pytest.raises(ValueError, match="max_len=0: expected >= 1"):
        dr_grpo_loss(logps, logps, None, torch.zeros(1), mask, max_len=0)


def test_group_advantages_rejects_a_non_divisible_length():
    with pytest.raises(ValueError, match="group_size: expected a positive divisor of len\\(rewards\\)=5"):
        group_advantages(torch.zeros(5), group_size=2)


# ---- kl_k3


def test_kl_k3_hand_value():
    """d = log π_ref - log π = log 2: e^d - d - 1 = 2 - 0.693147 - 1 = 0.306853."""
    value = kl_k3(torch.tensor([0.0]), torch.tensor([math.log(2)]))
    assert value.item() == pytest.approx(1 - math.log(2), abs=1e-6)


def test_kl_k3_is_non_negative_and_zero_iff_equal():
    torch.manual_seed(0)
    policy = torch.randn(1000) * 3
    ref = torch.randn(1000) * 3
    assert (kl_k3(policy, ref) > 0).all()
    assert (kl_k3(policy, policy) == 0).all()
    assert (kl_k3(policy, policy + 1e-3) > 0).all()


# ---- grpo_loss


def test_grpo_hand_value_with_kl():
    """One sequence, 2 tokens, ρ = 1, A = 0.5, β = 0.04, ref - π = [0, log 2]: k3 = [0, 0.306853].
    loss = mean_t(-0.5 + 0.04·k3) = -0.5 + 0.02·0.306853 = -0.493863."""
    logps = torch.tensor([[-1.0, -2.0]])
    ref = logps + torch.tensor([[0.0, math.log(2)]])
    loss, stats = grpo_loss(logps, logps, ref, torch.tensor([0.5]), torch.ones(1, 2), beta=0.04)
    assert loss.item() == pytest.approx(-0.4938629, abs=1e-6)
    assert stats["policy/kl_ref"].item() == pytest.approx((1 - math.log(2)) / 2, abs=1e-6)


def test_grpo_ratio_one_gives_minus_mean_advantage_per_sequence():
    """ρ = 1, β = 0: each sequence contributes -A_i, whatever its length: -(1 + 3)/2 = -2."""
    logps = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    loss, stats = grpo_loss(logps, logps, None, torch.tensor([1.0, 3.0]), mask, beta=0.0)
    assert loss.item() == pytest.approx(-2.0)
    assert "policy/kl_ref" not in stats


def test_grpo_accepts_per_token_advantages():
    logps = -torch.rand(2, 3)
    mask = torch.ones(2, 3)
    per_seq, _ = grpo_loss(logps, logps, None, torch.tensor([1.0, -2.0]), mask, beta=0.0)
    per_tok, _ = grpo_loss(logps, logps, None, torch.tensor([[1.0] * 3, [-2.0] * 3]), mask, beta=0.0)
    assert per_seq.item() == per_tok.item()


def test_grpo_zero_gradient_outside_the_clip_range_on_the_clipped_side():
    """β = 0, one sequence of 4 tokens (ρ, A): (1.5, +1), (0.5, -1) clipped → 0; (1.5, -1) → -ρA/4 = 0.375;
    (1, +1) → -1/4."""
    logps = torch.log(torch.tensor([[1.5, 0.5, 1.5, 1.0]])).requires_grad_()
    advantages = torch.tensor([[1.0, -1.0, -1.0, 1.0]])
    loss, stats = grpo_loss(logps, torch.zeros(1, 4), None, advantages, torch.ones(1, 4), beta=0.0)
    loss.backward()
    torch.testing.assert_close(logps.grad, torch.tensor([[0.0, 0.0, 0.375, -0.25]]))
    assert stats["policy/clipfrac_low"].item() == 0.25
    assert stats["policy/clipfrac_high"].item() == 0.25


def test_grpo_kl_gradient_pulls_towards_the_reference():
    """A = 0 leaves β·k3, and d/dπ (e^{ref-π} - (ref-π) - 1) = 1 - e^{ref-π}.
    ref -1, π -2, β 0.1 → 0.1·(1 - e) = -0.171828 < 0: descent raises π towards ref."""
    logps = torch.tensor([[-2.0]], requires_grad=True)
    grpo_loss(logps, logps.detach(), torch.tensor([[-1.0]]), torch.zeros(1), torch.ones(1, 1), beta=0.1)[0].backward()
    assert logps.grad.item() == pytest.approx(0.1 * (1 - math.e), abs=1e-6)


def test_grpo_padding_invariance():
    torch.manual_seed(0)
    logps, old, ref = -torch.rand(3, 4), -torch.rand(3, 4), -torch.rand(3, 4)
    advantages = torch.randn(3)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    base = logps.clone().requires_grad_()
    loss, stats = grpo_loss(base, old, ref, advantages, mask)
    loss.backward()

    def pad(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, torch.tensor([[NAN, float("inf"), -1e30]]).expand(3, 3)], dim=-1)

    padded = pad(logps).requires_grad_()
    padded_mask = torch.cat([mask, torch.zeros(3, 3, dtype=mask.dtype)], dim=-1)
    loss_p, stats_p = grpo_loss(padded, pad(old), pad(ref), advantages, padded_mask)
    loss_p.backward()
    torch.testing.assert_close(loss_p, loss)
    for key in stats:
        torch.testing.assert_close(stats_p[key], stats[key])
    torch.testing.assert_close(padded.grad[:, :4], base.grad)
    assert (padded.grad[:, 4:] == 0).all()


def test_grpo_requires_ref_logps_when_beta_is_set():
    with pytest.raises(ValueError, match="ref_logps: required when beta != 0"):
        grpo_loss(torch.zeros(1, 2), torch.zeros(1, 2), None, torch.zeros(1), torch.ones(1, 2), beta=0.04)


def test_losses_dispatch_dict():
    assert LOSSES == {"grpo": grpo_loss, "dr_grpo": dr_grpo_loss, "dapo": dapo_loss}
