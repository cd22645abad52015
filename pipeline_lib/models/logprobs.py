"""Per-token log-probabilities (and entropies) of the taken tokens under a causal LM, computed chunk by chunk
over positions so no full (B, T, V) float32 log-softmax is ever materialised; gradients flow. Rows that share a
prompt (GRPO's G samples) can run that prompt once and attend to its cached keys/values; a DPO pair's chosen and
rejected answers can share one row behind their prompt."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import DynamicLayer

from pipeline_lib.errors import AlignflowError

DEFAULT_CHUNK_SIZE = 64
CHOSEN, REJECTED = 1, 2  # segments of a packed pair's row (0: its prompt)


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Positions counted over valid tokens only (cumsum - 1, pads clamped to 0), so a sequence gets the
    same positions whether it is left- or right-padded."""
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)  # (B, T)


OutputLogits = Callable[[Tensor], Tensor]  # hidden states (..., H) -> float32 logits (..., V)


class UnsupportedModelError(AlignflowError, ValueError):
    """The model makes its logits in a way these log-probs do not reproduce."""


def transformers_model(model: nn.Module) -> PreTrainedModel:
    """The transformers model inside DDP (.module) and peft (get_base_model) wrappers."""
    inner = getattr(model, "module", model)
    return inner.get_base_model() if hasattr(inner, "get_base_model") else inner


def model_positions(model: nn.Module) -> int | None:
    """The positions `model` can read: `max_position_embeddings` of its text config (GPT-2's `n_positions` answers to
    that name), through DDP and peft wrappers and a RewardModel's or ValueModel's `backbone`; None where the config
    names none. Learned absolute positions (GPT-2, OPT) raise IndexError past them, so rows are cut to them and
    rollouts checked against them: the one place every stage reads this limit from."""
    inner = transformers_model(model)
    inner = getattr(inner, "backbone", inner)
    return getattr(inner.config.get_text_config(), "max_position_embeddings", None)


def stop_token_ids(model: nn.Module, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """The token ids sampling stops on: the model's generation_config `eos_token_id` (one or a list: Llama 3
    instruct's `<|eot_id|>` beside its eos, Qwen's `<|im_end|>`), else the tokenizer's eos; what the HF sampler
    stops on and what a chat row's end of turn must be one of (`train.data.turn_end_ids`)."""
    eos = transformers_model(model).generation_config.eos_token_id
    eos = tokenizer.eos_token_id if eos is None else eos
    return {eos} if isinstance(eos, int) else set(eos or ())


def output_logits(model: PreTrainedModel) -> OutputLogits:
    """Hidden states -> float32 logits as the model's own forward makes them from its output layer: times
    `logit_scale` (Cohere), divided by `logits_scaling` (Granite), soft-capped by `final_logit_softcapping`
    (Gemma 2 and 3). `_final_hidden` checks the result against the model's own logits at every call."""
    inner = transformers_model(model)
    lm_head, config = inner.get_output_embeddings(), inner.config
    scale = getattr(config, "logit_scale", None) or 1.0
    divisor = getattr(config, "logits_scaling", None) or 1.0
    cap = getattr(config, "final_logit_softcapping", None)

    def logits_of(hidden: Tensor) -> Tensor:
        logits = lm_head(hidden).float() * scale / divisor
        return logits if cap is None else torch.tanh(logits / cap) * cap

    return logits_of


def _chunk_logps(
    logits_of: OutputLogits, hidden: Tensor, targets: Tensor, with_entropy: bool, temperature: float
) -> tuple[Tensor, Tensor]:
    """Log-prob of `targets` and entropy for one chunk of positions under softmax(logits / temperature);
    the chunk's logits die here."""
    logits = logits_of(hidden)  # (B, C, V)
    if temperature != 1.0:
        logits = logits / temperature
    normalizer = torch.logsumexp(logits, dim=-1)  # (B, C)
    logps = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - normalizer  # (B, C)
    if not with_entropy:
        return logps, torch.zeros_like(logps)
    # A logged statistic, never a loss term: no graph, so backward neither keeps nor recomputes its (B, C, V) tensors.
    # H = log Z - Σ e^s s / Z on s = z - max z, Z = Σ e^s >= 1: two terms >= 0, so H is never negative and nothing
    # cancels. (As lse(z) - Σ p z, two large numbers when the logits are, as at a low temperature, their difference
    # came out at -6e-3 for T = 0.01.)
    with torch.no_grad():
        shifted = logits - logits.amax(dim=-1, keepdim=True)  # (B, C, V), <= 0
        weights = shifted.exp()  # (B, C, V)
        total = weights.sum(dim=-1)  # (B, C), >= 1
        entropy = total.log() - (weights * shifted).sum(dim=-1) / total  # (B, C)
    return logps, entropy


def _check_inputs(input_ids: Tensor, attention_mask: Tensor, completion_mask: Tensor) -> None:
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids: expected shape (B, T), got {tuple(input_ids.shape)}")
    for name, mask in (("attention_mask", attention_mask), ("completion_mask", completion_mask)):
        if mask.shape != input_ids.shape:
            raise ValueError(f"{name}: expected shape {tuple(input_ids.shape)} like input_ids, got {tuple(mask.shape)}")


def _check_options(chunk_size: int, temperature: float) -> None:
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size}: expected >= 1")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature}: expected > 0")


def _final_hidden(model: PreTrainedModel, logits_of: OutputLogits, input_ids: Tensor, attention_mask: Tensor,
                  **cache_args) -> Tensor:
    """Last hidden layer after the final norm, from the model's own forward.

    Calling `model(...)` (not its inner decoder) keeps DDP/PEFT wrappers in the loop; logits_to_keep=1
    makes the built-in lm_head run on one position only, whose logits `logits_of` must give too (an
    architecture whose forward transforms them otherwise is an UnsupportedModelError, not wrong log-probs).
    `cache_args` (position_ids, cache) continue a cached prefix or give a packed row's positions; without them
    positions come from the mask and nothing is cached."""
    outputs = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        output_hidden_states=True,
        logits_to_keep=1,
        **(cache_args or {"position_ids": position_ids_from_mask(attention_mask), "use_cache": False}),
    )
    hidden = outputs.hidden_states[-1]  # (B, T, H): transformers applies the final norm to the last entry
    with torch.no_grad():
        theirs, ours = outputs.logits[:, -1:].float(), logits_of(hidden[:, -1:])  # (B, 1, V)
        # diverged weights (inf/NaN) are the loss guard's to report; bf16 autocast rounds the model's transform and
        # ours differently, a missing transform is far off
        finite = theirs.isfinite() & ours.isfinite()
        theirs, ours = theirs[finite], ours[finite]
        if theirs.numel() and not torch.allclose(ours, theirs, rtol=1e-2,
                                                 atol=1e-2 * (1.0 + float(theirs.abs().max()))):
            inner = getattr(model, "module", model)  # DDP keeps the model in .module
            raise UnsupportedModelError(
                f"{type(inner).__name__} ({inner.config.model_type}): its forward makes its "
                "logits otherwise than from its output layer (alignflow reproduces logit_scale, logits_scaling and "
                f"final_logit_softcapping); max difference {float((ours - theirs).abs().max()):.3g}")
    return hidden


def _chunked_logps(logits_of: OutputLogits, hidden: Tensor, targets: Tensor, return_entropy: bool, chunk_size: int,
                   temperature: float) -> tuple[Tensor, Tensor]:
    """log π(targets) and entropies from hidden states that predict them, `chunk_size` positions at a time;
    under autograd each chunk is checkpointed, so backward recomputes its logits instead of keeping them."""
    logp_chunks, entropy_chunks = [], []
    for start in range(0, hidden.shape[1], chunk_size):
        args = (logits_of, hidden[:, start:start + chunk_size], targets[:, start:start + chunk_size], return_entropy,
                temperature)
        if torch.is_grad_enabled():
            chunk_logps, chunk_entropy = checkpoint(_chunk_logps, *args, use_reentrant=False)
        else:
            chunk_logps, chunk_entropy = _chunk_logps(*args)
        logp_chunks.append(chunk_logps)
        entropy_chunks.append(chunk_entropy)
    return torch.cat(logp_chunks, dim=1), torch.cat(entropy_chunks, dim=1)  # (B, T')


def sequence_logprobs(
    model: PreTrainedModel,
    input_ids: Tensor,
    attention_mask: Tensor,
    completion_mask: Tensor,
    *,
    return_entropy: bool = False,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    temperature: float = 1.0,
) -> Tensor | tuple[Tensor, Tensor]:
    """log π(x_t | x_<t) of each taken token, aligned to input_ids positions; a row's first valid token (position 0,
    or the first after left padding) has nothing before it and gets 0.

    `temperature` divides the logits, as the sampler did: the log-probs of the distribution a rollout drew from.

    Values are zero wherever completion_mask is 0. With return_entropy, also the entropy of the
    distribution that predicted each position, masked the same way: a statistic to log, without gradient. The model runs only up to the column
    before the last completion token (later columns predict nothing asked for); logits are built `chunk_size`
    positions at a time, only over the span of columns that hold completion tokens; under autograd each
    chunk is checkpointed, so backward recomputes its logits instead of keeping them all alive."""
    _check_inputs(input_ids, attention_mask, completion_mask)
    _check_options(chunk_size, temperature)
    batch, seq_len = input_ids.shape
    logps = torch.zeros((batch, seq_len), dtype=torch.float32, device=input_ids.device)  # (B, T)
    entropy = torch.zeros_like(logps)
    after_valid = nn.functional.pad(attention_mask[:, :-1].bool(), (1, 0))  # (B, T): a valid token precedes it
    keep = completion_mask.bool() & after_valid
    needed = keep[:, 1:].any(dim=0).nonzero().flatten()  # target columns - 1
    if needed.numel() > 0:
        lo, hi = int(needed.min()), int(needed.max()) + 1  # hidden at column t predicts token t + 1
        logits_of = output_logits(model)
        hidden = _final_hidden(model, logits_of, input_ids[:, :hi], attention_mask[:, :hi])  # (B, hi, H)
        span_logps, span_entropy = _chunked_logps(logits_of, hidden[:, lo:], input_ids[:, lo + 1:hi + 1],
                                                  return_entropy, chunk_size, temperature)
        # Pad rather than write in place: in-place writes into `logps` would break autograd on the chunks.
        pad = (lo + 1, seq_len - hi - 1)
        logps = nn.functional.pad(span_logps, pad)  # (B, T)
        entropy = nn.functional.pad(span_entropy, pad)  # (B, T)

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


class _RowSelect(torch.autograd.Function):
    """x.index_select(0, index) whose backward is index_select's (index_add_ into x's rows, the same values) on a
    contiguous copy of the gradient: index_select's own backward scatters a strided one (a slice of the
    concatenated keys) element by element, several times slower. On CPU index_add_ adds a prompt's rows in a
    fixed order, where advanced indexing's backward (index_put_ with accumulate) adds them from several threads in
    any order, so two identical runs trained differently; on CUDA both use atomic adds."""

    @staticmethod
    def forward(ctx, x: Tensor, index: Tensor) -> Tensor:
        ctx.save_for_backward(index)
        ctx.rows = x.shape[0]
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        (index,) = ctx.saved_tensors
        return grad.new_zeros((ctx.rows, *grad.shape[1:])).index_add_(0, index, grad.contiguous()), None


def _select_rows(cache: DynamicCache, index: Tensor) -> None:
    """Each layer's cached keys/values of rows `index` (`_RowSelect`)."""
    for layer in cache.layers:
        if type(layer).batch_select_indices is DynamicLayer.batch_select_indices:  # it selects keys/values only
            layer.keys, layer.values = _RowSelect.apply(layer.keys, index), _RowSelect.apply(layer.values, index)
        else:
            layer.batch_select_indices(index)


def shared_prompt_logprobs(
    model: PreTrainedModel,
    prompt_ids: Tensor,  # (U, P) left-padded distinct prompts
    prompt_mask: Tensor,  # (U, P)
    prompt_index: Tensor,  # (N,) row -> its prompt
    completion_ids: Tensor,  # (N, C) right-padded
    completion_mask: Tensor,  # (N, C)
    *,
    return_entropy: bool = False,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    temperature: float = 1.0,
) -> Tensor | tuple[Tensor, Tensor]:
    """log π(y_t | x, y_<t) of each completion token, (N, C) aligned to completion_ids; 0 where the mask is 0.

    The same values as `sequence_logprobs` on the rows prompt + completion, computed with each distinct prompt
    run once: its keys/values are cached, gathered per row (a differentiable index, so gradients from every row
    reach the shared prompt) and the completions attend to them at the positions they have in the full row,
    up to the column before the last one any row fills (later columns predict nothing asked for). GRPO's G
    samples of a prompt cost one prompt pass instead of G."""
    for name, tensor, dims in (("prompt_ids", prompt_ids, 2), ("completion_ids", completion_ids, 2),
                               ("prompt_index", prompt_index, 1)):
        if tensor.dim() != dims:
            raise ValueError(f"{name}: expected {dims} dimensions, got shape {tuple(tensor.shape)}")
    if prompt_mask.shape != prompt_ids.shape or completion_mask.shape != completion_ids.shape:
        raise ValueError("prompt_mask / completion_mask: expected the shapes of prompt_ids / completion_ids")
    if prompt_index.shape[0] != completion_ids.shape[0]:
        raise ValueError(f"prompt_index: expected one entry per completion row ({completion_ids.shape[0]}), "
                         f"got {prompt_index.shape[0]}")
    if completion_ids.shape[1] == 0:
        raise ValueError("completion_ids: expected at least one column")
    empty = (~prompt_mask.bool().any(dim=1)).nonzero().flatten()
    if empty.numel():  # nothing would predict its rows' first completion token
        raise ValueError(f"prompt_mask: prompt {int(empty[0])} has no token; every prompt needs at least one")
    _check_options(chunk_size, temperature)
    cache = DynamicCache(config=transformers_model(model).config)
    logits_of = output_logits(model)
    prompt_hidden = _final_hidden(model, logits_of, prompt_ids, prompt_mask, cache=cache, use_cache=True,
                                  position_ids=position_ids_from_mask(prompt_mask))  # (U, P, H)
    # the last prompt position predicts completion token 0, completion position t predicts token t + 1; only
    # the first `width` columns hold completion tokens (a mini-batch of short rows leaves trailing padding)
    filled = completion_mask.bool().any(dim=0).nonzero()
    width = int(filled.max()) + 1 if filled.numel() else 1
    hidden = _RowSelect.apply(prompt_hidden[:, -1:], prompt_index)  # (N, 1, H)
    if width > 1:
        _select_rows(cache, prompt_index)  # (U, ...) -> (N, ...)
        inputs, input_mask = completion_ids[:, :width - 1], completion_mask[:, :width - 1]  # (N, width-1)
        prompt_lengths = prompt_mask.long().sum(dim=-1)[prompt_index]  # (N,)
        positions = prompt_lengths.unsqueeze(1) + torch.arange(inputs.shape[1], device=inputs.device)
        completion_hidden = _final_hidden(model, logits_of, inputs,
                                          torch.cat([prompt_mask[prompt_index], input_mask], 1), cache=cache,
                                          use_cache=True, position_ids=positions)  # (N, width-1, H)
        hidden = torch.cat([hidden, completion_hidden], dim=1)  # (N, width, H)
    logps, entropy = _chunked_logps(logits_of, hidden, completion_ids[:, :width], return_entropy,
                                    chunk_size, temperature)
    pad = (0, completion_ids.shape[1] - width)  # back to (N, C); padded, not written in place (autograd)
    logps, entropy = nn.functional.pad(logps, pad), nn.functional.pad(entropy, pad)
    keep = completion_mask.bool()
    logps = torch.where(keep, logps, torch.zeros_like(logps))  # (N, C)
    if return_entropy:
        return logps, torch.where(keep, entropy, torch.zeros_like(entropy))
    return logps


def packs_pairs(model: nn.Module, width: int) -> bool:
    """Whether this model's hidden states on packed rows of up to `width` columns (`packed_mask`: DPO's
    `pair_logprob_sums`, a reward model's `PackedGroups`) can be those of the rows they pack: a transformers model
    (its forward takes a prepared 4D mask as it is) whose attention applies such a mask (sdpa, eager; flash attention
    takes none), whose layers are all attention (a recurrent or linear-attention layer reads every earlier column,
    mask or not), with no attention window narrower than the row (the one 4D mask would stand for the windowed
    layers' too: `sliding_window`, GPT-Neo's `window_size`) and the row within its positions (GPT-Neo indexes
    buffers by column). `train.common.choose_packed` then checks the values themselves."""
    inner = transformers_model(model)
    config = inner.config
    limits = [getattr(config, name, None) for name in ("sliding_window", "window_size")] + [model_positions(inner)]
    return (type(inner).__module__.startswith("transformers.models.")
            and config._attn_implementation in ("sdpa", "eager")
            and set(getattr(config, "layer_types", None) or ()) <= {"full_attention", "sliding_attention"}
            and all(limit is None or width <= limit for limit in limits))


def packed_mask(attention_mask: Tensor, segments: Tensor, implementation: str, dtype: torch.dtype) -> Tensor:
    """(B, 1, L, L) mask of packed rows (answers one after another behind the prefix they share) in the form the
    attention takes (sdpa: True = attend; eager: 0 or the dtype's minimum, added to the scores): causal over real
    tokens, and a token of answer k (segment k >= 1) sees the prefix (segment 0) and answer k only. A padding column
    sees itself, so no query row is empty (an empty row gives NaN, which reaches the real tokens' outputs through
    0 x NaN)."""
    columns = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    causal = columns[:, None] >= columns[None, :]  # (L, L) query, key
    real_keys = attention_mask.bool()[:, None, :]  # (B, 1, L)
    same_part = (segments[:, None, :] == 0) | (segments[:, :, None] == segments[:, None, :])  # (B, L, L)
    allowed = (causal & real_keys & same_part) | torch.eye(len(columns), dtype=torch.bool, device=columns.device)
    allowed = allowed[:, None]  # (B, 1, L, L)
    if implementation == "sdpa":
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


def pair_logprob_sums(
    model: PreTrainedModel,
    input_ids: Tensor,  # (B, L) a pair per row: prompt, chosen and rejected without their last tokens; left-padded
    attention_mask: Tensor,  # (B, L)
    position_ids: Tensor,  # (B, L) rejected tokens at the positions they have right after the prompt
    segments: Tensor,  # (B, L) 0 prompt or padding, CHOSEN, REJECTED
    sources: Tensor,  # (B, S) the column whose hidden state predicts each target
    targets: Tensor,  # (B, S) the chosen tokens, then the rejected ones; right-padded
    target_sides: Tensor,  # (B, S) CHOSEN, REJECTED, 0 = padding
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> Tensor:
    """(B, 2): Σ_t log π(y_t | x, y_<t) of each pair's chosen and rejected completion, the prompt run once.

    The same sums as `completion_logprob_sums` on the rows prompt + chosen and prompt + rejected (prefix sharing):
    a rejected token attends to the prompt and the rejected tokens before it, never to a chosen one, at the position
    it has in its own row, and the last prompt column predicts both answers' first tokens. Neither answer's last
    token is run (it predicts nothing asked for). Only for models `packs_pairs` accepts (sdpa or eager attention,
    whose forward takes a prepared 4D mask as it is)."""
    if input_ids.dim() != 2 or sources.dim() != 2:
        raise ValueError(f"input_ids, sources: expected shape (B, L), (B, S), got {tuple(input_ids.shape)}, "
                         f"{tuple(sources.shape)}")
    _check_options(chunk_size, 1.0)
    inner = transformers_model(model)
    mask = packed_mask(attention_mask, segments, inner.config._attn_implementation,
                       inner.get_input_embeddings().weight.dtype)
    logits_of = output_logits(model)
    hidden = _final_hidden(model, logits_of, input_ids, mask, position_ids=position_ids, use_cache=False)  # (B, L, H)
    predicting = hidden.gather(1, sources.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))  # (B, S, H)
    logps, _ = _chunked_logps(logits_of, predicting, targets, False, chunk_size, 1.0)  # (B, S)
    sums = [torch.where(target_sides == side, logps, torch.zeros_like(logps)).sum(-1) for side in (CHOSEN, REJECTED)]
    return torch.stack(sums, dim=1)  # (B, 2)
