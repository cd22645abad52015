"""Batched reward-model scoring: texts (prompt + completion) -> one float each, for RL rewards and Best-of-N."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase


def text_ids(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of whole texts (prompt + response) as a reward model reads them, in training and scoring: with
    the tokenizer's own special tokens, once: where the tokenizer adds a bos, a chat-rendered prompt that
    already starts with it (Llama, Mistral and Gemma templates write it) does not get a second one."""
    ids = tokenizer(list(texts))["input_ids"]
    bos = tokenizer.bos_token_id
    if bos is None or tokenizer("")["input_ids"][:1] != [bos]:  # GPT-2 adds none: its text keeps every token
        return ids
    return [row[1:] if row[:2] == [bos, bos] else row for row in ids]


class RewardModelScorer:
    """Scores texts with `model(input_ids, attention_mask) -> (B,)` (e.g. models.heads.RewardModel).

    Texts are tokenized by `text_ids`, truncated from the LEFT to `max_length`
    (the end of the completion is what last-token pooling reads), sorted by length so each batch pads
    little, left-padded, and scored under no_grad in eval mode; scores come back in input order."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        batch_size: int = 16,
        max_length: int | None = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size: expected >= 1, got {batch_size}")
        if max_length is not None and max_length < 1:
            raise ValueError(f"max_length: expected None or >= 1, got {max_length}")
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad_id is None:
            raise ValueError("tokenizer: expected a pad_token_id or eos_token_id to pad batches with")
        self.model, self.tokenizer = model, tokenizer
        self.batch_size, self.max_length, self.pad_id = batch_size, max_length, pad_id

    def _batch(self, ids: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(row) for row in ids)
        input_ids = torch.full((len(ids), width), self.pad_id, dtype=torch.long)  # (B, T)
        attention_mask = torch.zeros((len(ids), width), dtype=torch.long)  # (B, T)
        for i, row in enumerate(ids):
            input_ids[i, width - len(row):] = torch.tensor(row, dtype=torch.long)
            attention_mask[i, width - len(row):] = 1
        return input_ids.to(device), attention_mask.to(device)

    def __call__(self, texts: Sequence[str]) -> list[float]:
        texts = list(texts)
        if not texts:
            return []
        ids = text_ids(self.tokenizer, texts)
        if self.max_length is not None:
            ids = [row[-self.max_length:] for row in ids]
        empty = next((i for i, row in enumerate(ids) if not row), None)
        if empty is not None:
            raise ValueError(f"texts[{empty}]: tokenizes to no tokens; a reward model needs at least one")
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        device = next(self.model.parameters()).device
        scores = [0.0] * len(ids)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                for start in range(0, len(order), self.batch_size):
                    chunk = order[start:start + self.batch_size]
                    input_ids, attention_mask = self._batch([ids[i] for i in chunk], device)
                    out = self.model(input_ids=input_ids, attention_mask=attention_mask)  # (B,)
                    if out.dim() == 2 and out.shape[-1] == 1:
                        out = out.squeeze(-1)
                    if out.shape != (len(chunk),):
                        raise ValueError(f"model: expected scores of shape ({len(chunk)},), got {tuple(out.shape)}")
                    for i, score in zip(chunk, out.float().cpu().tolist()):
                        scores[i] = score
        finally:
            self.model.train(was_training)
        return scores
