"""Masked reductions shared by the losses: token-level (DAPO) vs sequence-level (GRPO) means.

Masks are 0/1 (float or bool) tensors shaped like the values; padded positions may hold any garbage
(even NaN/inf): every reduction selects valid entries with `torch.where`, never multiplies by the mask."""

from __future__ import annotations

import torch
from torch import Tensor


def check_shape(name: str, tensor: Tensor, shape: torch.Size) -> None:
    """One-line error naming the argument when its shape is not `shape`."""
    if tensor.shape != shape:
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(tensor.shape)}")


def valid_mask(mask: Tensor, values: Tensor, name: str = "mask") -> Tensor:
    """The mask as bool, checked to have the shape of `values`."""
    check_shape(name, mask, values.shape)
    return mask if mask.dtype == torch.bool else mask != 0


def zero_invalid(values: Tensor, mask: Tensor) -> Tensor:
    """Values with padded positions set to 0, so garbage there reaches neither the loss nor its gradient."""
    return torch.where(valid_mask(mask, values), values, torch.zeros((), dtype=values.dtype, device=values.device))


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of the valid entries (over everything, or along `dim`)."""
    zeroed = zero_invalid(values, mask)
    return zeroed.sum() if dim is None else zeroed.sum(dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of the valid entries (over everything, or along `dim`); 0 where nothing is valid."""
    count = valid_mask(mask, values).sum() if dim is None else valid_mask(mask, values).sum(dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1).to(values.dtype)


def token_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Sum over all valid tokens of the batch / their count: every token weighs the same (DAPO §3.3)."""
    return masked_mean(values, mask)


def seq_mean_token_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean over each sequence's valid tokens, then over sequences (GRPO eq. 3: 1/G Σ_i 1/|o_i| Σ_t).

    values, mask: (B, T). Sequences without any valid token are left out of the outer mean, so
    padding rows appended to fill a batch change nothing."""
    per_seq = masked_mean(values, mask, dim=-1)  # (B,)
    non_empty = valid_mask(mask, values).any(dim=-1)  # (B,)
    return per_seq.sum() / non_empty.sum().clamp(min=1).to(values.dtype)


def masked_whiten(values: Tensor, mask: Tensor, *, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """(x - mean) / std over the valid entries (population variance); padded positions become 0.

    shift_mean=False adds the mean back (scale only), as PPO implementations do for rewards."""
    mean = token_mean(values, mask)
    centered = zero_invalid(values - mean, mask)  # padding zeroed before any arithmetic reaches the gradient
    whitened = centered * torch.rsqrt(token_mean(centered**2, mask) + eps)
    if not shift_mean:
        whitened = whitened + mean
    return zero_invalid(whitened, mask)
