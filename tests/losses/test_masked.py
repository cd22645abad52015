"""Masked reductions: token-level vs sequence-level means, empty masks, garbage under padding, whitening."""

from __future__ import annotations

import pytest
import torch

from pipeline_lib.losses._masked import masked_mean, masked_sum, masked_whiten, seq_mean_token_mean, token_mean

VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])


def test_token_mean_weighs_every_token_equally():
    """(1 + 2 + 3 + 4) / 4 tokens = 2.5."""
    assert token_mean(VALUES, MASK).item() == pytest.approx(2.5)


def test_seq_mean_token_mean_weighs_every_sequence_equally():
    """Sequence means 2 and 4, then (2 + 4) / 2 = 3."""
    assert seq_mean_token_mean(VALUES, MASK).item() == pytest.approx(3.0)


def test_masked_sum_and_mean_along_a_dim():
    """Row sums 6 and 4; row means 6/3 = 2 and 4/1 = 4."""
    torch.testing.assert_close(masked_sum(VALUES, MASK, dim=-1), torch.tensor([6.0, 4.0]))
    torch.testing.assert_close(masked_mean(VALUES, MASK, dim=-1), torch.tensor([2.0, 4.0]))
    assert masked_sum(VALUES, MASK).item() == pytest.approx(10.0)


def test_bool_and_float_masks_agree():
    assert token_mean(VALUES, MASK.bool()).item() == token_mean(VALUES, MASK.float()).item()
    assert seq_mean_token_mean(VALUES, MASK.bool()).item() == seq_mean_token_mean(VALUES, MASK.float()).item()


def test_empty_mask_gives_zero_not_nan():
    empty = torch.zeros(2, 3)
    assert token_mean(VALUES, empty).item() == 0.0
    assert seq_mean_token_mean(VALUES, empty).item() == 0.0
    torch.testing.assert_close(masked_mean(VALUES, empty, dim=-1), torch.zeros(2))


def test_garbage_under_padding_is_ignored_in_value_and_gradient():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, float("nan"), float("inf")]], requires_grad=True)
    loss = token_mean(values, MASK) + seq_mean_token_mean(values, MASK)
    assert loss.item() == pytest.approx(2.5 + 3.0)
    loss.backward()
    # token_mean: 1/4 per valid token; seq mean: 1/(2*3) on row 0, 1/(2*1) on row 1
    expected = torch.tensor([[0.25 + 1 / 6] * 3, [0.25 + 0.5, 0.0, 0.0]])
    torch.testing.assert_close(values.grad, expected)


def test_all_padding_row_does_not_change_the_sequence_mean():
    values = torch.cat([VALUES, torch.full((1, 3), 99.0)])
    mask = torch.cat([MASK, torch.zeros(1, 3, dtype=MASK.dtype)])
    assert seq_mean_token_mean(values, mask).item() == pytest.approx(3.0)


def test_masked_whiten_has_zero_mean_unit_std_on_valid_tokens():
    """Valid values 1, 2, 3, 4: mean 2.5, population var 1.25."""
    whitened = masked_whiten(VALUES, MASK)
    assert token_mean(whitened, MASK).item() == pytest.approx(0.0, abs=1e-6)
    assert token_mean(whitened**2, MASK).item() == pytest.approx(1.0, abs=1e-6)
    assert whitened[0, 0].item() == pytest.approx((1 - 2.5) / 1.25**0.5, abs=1e-6)
    assert whitened[1, 1].item() == 0.0 and whitened[1, 2].item() == 0.0
    scaled = masked_whiten(VALUES, MASK, shift_mean=False)
    assert token_mean(scaled, MASK).item() == pytest.approx(2.5, abs=1e-6)


def test_masked_whiten_gradient_ignores_garbage_under_padding():
    values = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("inf"), 3.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    masked_whiten(values, mask).pow(2).sum().backward()
    assert torch.isfinite(values.grad).all()
    assert values.grad[0, 2].item() == 0.0 and values.grad[1, 1].item() == 0.0


def test_shape_mismatch_names_the_mask():
    with pytest.raises(ValueError, match=r"mask: expected shape \(2, 3\), got \(2, 2\)"):
        token_mean(VALUES, torch.ones(2, 2))
