"""Per-token log-probabilities (and entropies) of the taken tokens under a causal LM, computed chunk by chunk
over positions so no full (B, T, V) float32 log-softmax is ever materialised; gradients flow."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel

DEFAULT_CHUNK_SIZE = 64


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Positions counted over valid tokens only (cumsum - 1, pads clamped to 0), so a sequence gets the
    same positions whether it is left- or right-padded."""
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)  # (B, T)


def _chunk_logps(
    lm_head: nn.Module, hidden: Tensor, targets: Tensor, with_entropy: bool
) -> tuple[Tensor, Tensor]:
    """Log-prob of `targets` and entropy for one chunk of positions; the chunk's logits die here."""
    logits = lm_head(hidden).float()  # (B, C, V)
    normalizer = torch.logsumexp(logits, dim=-1)  # (B, C)
    logps = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - normalizer  # (B, C)
    if not with_entropy:
        return logps, torch.zeros_like(logps)
    probs = torch.exp(logits - normalizer.unsqueeze(-1))  # (B, C, V)
    entropy = normalizer - (probs * logits).sum(dim=-1)  # (B, C): H = lse(z) - Σ p z
    return logps, entropy


def _check_inputs(input_ids: Tensor, attention_mask: Tensor, completion_mask: Tensor) -> None:
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids: expected shape (B, T), got {tuple(input_ids.shape)}")
    for name, mask in (("attention_mask", attention_mask), ("completion_mask", completion_mask)):
        if mask.shape != input_ids.shape:
            raise ValueError(f"{name}: expected shape {tuple(input_ids.shape)} like input_ids, got {tuple(mask.shape)}")


def _final_hidden(model: PreTrainedModel, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """Last hidden layer after the final norm, from the model's own forward.

    Calling `model(...)` (not its inner decoder) keeps DDP/PEFT wrappers in the loop; logits_to_keep=1
    makes the built-in lm_head run on one position only."""
    config = getattr(getattr(model, "module", model), "config", None)  # DDP keeps the model in .module
    for field in ("final_logit_softcapping", "logit_scale"):
        if getattr(config, field, None) not in (None, 1.0):
            raise ValueError(f"model config {field}={getattr(config, field)}: logits = lm_head(hidden) is assumed")
    outputs = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        output_hidden_states=True,
        logits_to_keep=1,
        use_cache=False,
    )
    return outputs.hidden_states[-1]  # (B, T, H): transformers applies the final norm to the last entry


def sequence_logprobs(
    model: PreTrainedModel,
    input_ids: Tensor,
    attention_mask: Tensor,
    completion_mask: Tensor,
    *,
    return_entropy: bool = False,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> Tensor | tuple[Tensor, Tensor]:
    """log π(x_t | x_<t) of each taken token, aligned to input_ids positions; position 0 gets 0.

    Values are zero wherever completion_mask is 0. With return_entropy, also the entropy of the
    distribution that predicted each position, masked the same way. Logits are built `chunk_size`
    positions at a time, only over the span of columns that hold completion tokens; under autograd each
    chunk is checkpointed, so backward recomputes its logits instead of keeping them all alive."""
    _check_inputs(input_ids, attention_mask, completion_mask)
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size}: expected >= 1")
    batch, seq_len = input_ids.shape
    hidden = _final_hidden(model, input_ids, attention_mask)  # (B, T, H)
    lm_head = getattr(model, "module", model).get_output_embeddings()

    logps = hidden.new_zeros((batch, seq_len), dtype=torch.float32)  # (B, T)
    entropy = torch.zeros_like(logps)
    needed = completion_mask[:, 1:].bool().any(dim=0).nonzero().flatten()  # target columns - 1
    if needed.numel() > 0:
        lo, hi = int(needed.min()), int(needed.max()) + 1  # hidden at column t predicts token t + 1
        logp_chunks, entropy_chunks = [], []
        for start in range(lo, hi, chunk_size):
            stop = min(start + chunk_size, hi)
            args = (lm_head, hidden[:, start:stop], input_ids[:, start + 1:stop + 1], return_entropy)
            if torch.is_grad_enabled():
                chunk_logps, chunk_entropy = checkpoint(_chunk_logps, *args, use_reentrant=False)
            else:
                chunk_logps, chunk_entropy = _chunk_logps(*args)
            logp_chunks.append(chunk_logps)
            entropy_chunks.append(chunk_entropy)
        # Concatenate then pad: in-place writes into `logps` would break autograd on the chunks.
        pad = (lo + 1, seq_len - hi - 1)
        logps = nn.functional.pad(torch.cat(logp_chunks, dim=1), pad)  # (B, T)
        entropy = nn.functional.pad(torch.cat(entropy_chunks, dim=1), pad)  # (B, T)

    keep = completion_mask.bool()
    logps = torch.where(keep, logps, torch.zeros_like(logps))  # (B, T)
    if return_entropy:
        return logps, torch.where(keep, entropy, torch.zeros_like(entropy))
    return logps


def completion_logprob_sums(
    model: PreTrainedModel,
    input_ids: Tensor,
    attention_mask: Tensor,
    completion_mask: Tensor,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> Tensor:
    """Σ_t log π(y_t | x, y_<t) over each sequence's completion tokens (DPO's log π(y|x)), shape (B,)."""
    logps = sequence_logprobs(model, input_ids, attention_mask, completion_mask, chunk_size=chunk_size)
    return logps.sum(dim=-1)  # (B,)
