"""Batched reward-model scoring: texts (prompt + completion) -> one float each, for RL rewards and Best-of-N."""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence
from itertools import accumulate

import torch
from torch import Tensor, nn
from transformers import PreTrainedTokenizerBase

from pipeline_lib.models.heads import RewardModel
from pipeline_lib.models.logprobs import model_positions, packs_pairs
from pipeline_lib.train.common import packed_values_hold, packing_costs
from pipeline_lib.train.data import Encoded, collate_groups, group_width, text_ids


class RewardModelScorer:
    """Scores texts with `model(input_ids, attention_mask) -> (B,)` (e.g. models.heads.RewardModel).

    Texts are tokenized by `text_ids`, truncated from the LEFT to `max_length` (the end of the completion is what
    last-token pooling reads; by default, the length a RewardModel was trained on, `RewardModel.max_length`, or where
    it holds none its positions, `max_position_embeddings`; either with a note the first time a text is cut),
    left-padded, at most `batch_size` texts a forward, scored under no_grad in eval mode; scores come back in input
    order, one per distinct token row (copies of a text, a converged policy's samples, or texts that differ only
    before the cut, are scored once and tie exactly).
    With a RewardModel and `pack` on, texts that begin with the same tokens (the samples of one prompt) are packed
    into one row behind their shared start, as `train_rm` packs a pair's texts (`RewardModel.forward(..., packed)`),
    where that costs fewer multiply-adds than their own rows (`packing_costs`) and fits the model's positions and
    attention window; the first time groups pack, their packed scores are checked against the rows'
    (`packed_values_hold`), and a model that fails keeps the rows, with a note. The others run as rows, sorted by
    length so each batch pads little."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        batch_size: int = 16,
        max_length: int | None = None,
        pack: bool = True,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size: expected >= 1, got {batch_size}")
        if max_length is not None and max_length < 1:
            raise ValueError(f"max_length: expected None or >= 1, got {max_length}")
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad_id is None:
            raise ValueError("tokenizer: expected a pad_token_id or eos_token_id to pad batches with")
        # by default a RewardModel's texts are cut as its training cut them, else (an older alignflow's model) to its
        # positions (absolute ones raise IndexError past them); either with a note, once
        self.cut_note = None
        if max_length is None and isinstance(model, RewardModel) and model.max_length is not None:
            max_length = model.max_length
            self.cut_note = f"the {max_length} tokens the reward model's training cut its texts to"
        elif max_length is None and isinstance(model, RewardModel):
            max_length = model_positions(model)
            self.cut_note = f"the reward model's {max_length} positions" if max_length is not None else None
        self.model, self.tokenizer = model, tokenizer
        self.batch_size, self.max_length, self.pad_id = batch_size, max_length, pad_id
        self.pack = pack and isinstance(model, RewardModel)
        self.packing_holds: bool | None = None  # checked the first time groups pack
        self.packed_texts = 0  # texts scored packed so far

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
            cut = sum(len(row) > self.max_length for row in ids)
            if cut and self.cut_note:
                print(f"note: {cut} of {len(ids)} texts are longer than {self.cut_note}: they are scored on their "
                      "last tokens", file=sys.stderr, flush=True)
                self.cut_note = None
            ids = [row[-self.max_length:] for row in ids]
        empty = next((i for i, row in enumerate(ids) if not row), None)
        if empty is not None:
            raise ValueError(f"texts[{empty}]: tokenizes to no tokens; a reward model needs at least one")
        # texts that are the same tokens (copies; texts differing only before the cut) are scored once: packed, each
        # copy sat at other columns of its row, and their float rounding differed
        distinct = list(dict.fromkeys(map(tuple, ids)))
        scores = dict(zip(distinct, self._score([list(row) for row in distinct])))
        return [scores[tuple(row)] for row in ids]

    def _score(self, ids: list[list[int]]) -> list[float]:
        """The scores of token rows, packed where that pays (`_packed`), the others as rows."""
        encoded = Encoded(ids, [[] for _ in ids])
        scores = [0.0] * len(ids)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                packed = self._packed(encoded)
                in_packs = {i for group in packed for i in group}
                rows = sorted((i for i in range(len(ids)) if i not in in_packs), key=lambda i: len(ids[i]))
                batches = [(False, [[i] for i in rows[start:start + self.batch_size]])
                           for start in range(0, len(rows), self.batch_size)]
                batches += [(True, groups) for groups in self._fill(encoded, packed)]
                for is_packed, groups in batches:
                    for group, values in zip(groups, self._scores(encoded, groups, is_packed).cpu().tolist()):
                        for i, score in zip(group, values):
                            scores[i] = score
        finally:
            self.model.train(was_training)
        self.packed_texts += len(in_packs)
        return scores

    def _scores(self, encoded: Encoded, groups: list[list[int]], packed: bool) -> Tensor:
        """(G, K) float32 scores of `groups`' texts (K the largest group's size; 0 past a group's size): a group per
        row, or a text per row."""
        device = next(self.model.parameters()).device
        width = max(len(group) for group in groups)
        if packed:
            batch = collate_groups(encoded, groups, pad_id=self.pad_id, texts=width).to(device)
            return self.model(batch.input_ids, batch.attention_mask, batch.packed).float()  # (G, K)
        texts = [i for group in groups for i in group]
        out = self.model(*self._batch([encoded.prompt_ids[i] for i in texts], device))  # (B,)
        if out.dim() == 2 and out.shape[-1] == 1:
            out = out.squeeze(-1)
        if out.shape != (len(texts),):
            raise ValueError(f"model: expected scores of shape ({len(texts)},), got {tuple(out.shape)}")
        valid = torch.arange(width, device=device) < torch.tensor([len(group) for group in groups],
                                                                 device=device).unsqueeze(1)  # (G, K)
        return torch.zeros(valid.shape, device=device).masked_scatter(valid, out.float())

    def _packed(self, encoded: Encoded) -> list[list[int]]:
        """The groups of texts that run packed: neighbours in token order (texts sharing a start sort together), a
        text joining its group where the grown group packed costs less than the group and the text apart
        (`packing_costs`) and `packs_pairs` allows its width, at most `batch_size` texts a group; then two
        neighbouring groups of one prompt split again where they cost least; none unless this model's packed
        scores hold."""
        if not self.pack:
            return []
        backbone = self.model.backbone
        lengths = [len(row) for row in encoded.prompt_ids]
        costs = packing_costs(backbone.config)
        fits = functools.cache(functools.partial(packs_pairs, backbone))  # of a width

        def layout(group: list[int]) -> tuple[int, float, bool]:
            """(packed width, cost as it would run, whether it may run so) of a group: a lone text is a row."""
            width = group_width(encoded, group)
            unpacked, packed = costs([lengths[i] for i in group], width)
            if len(group) == 1:
                return width, unpacked, True
            return width, packed, len(group) <= self.batch_size and fits(width)

        groups: list[list[int]] = []
        layouts: list[tuple[int, float, bool]] = []
        for i in sorted(range(len(lengths)), key=lambda i: encoded.prompt_ids[i]):
            alone = layout([i])
            grown = layout([*groups[-1], i]) if groups else None
            if grown is not None and grown[2] and grown[1] < layouts[-1][1] + alone[1]:
                groups[-1].append(i)
                layouts[-1] = grown
            else:
                groups.append([i])
                layouts.append(alone)
        # a group closed for its cost, size or width leaves the next one the rest of its prompt's texts (8 samples:
        # 6 + 2, padded to the 6's width in a batch): two such neighbours are split again where they cost least, as
        # two groups still (a text more packed, a row more, is a forward's fixed cost more, which the count leaves out)
        for g in range(len(groups) - 1):
            pair = groups[g] + groups[g + 1]
            if min(len(groups[g]), len(groups[g + 1])) < 2:
                continue
            widths = (layout(pair)[0], layouts[g][0], layouts[g + 1][0])
            shared = [(sum(lengths[i] for i in group) - width) / (len(group) - 1)  # tokens they all begin with
                      for group, width in zip((pair, groups[g], groups[g + 1]), widths)]
            if shared[0] < min(shared[1:]):  # another prompt's texts: a group would lose tokens it shares
                continue
            splits = [(layout(pair[:k]), layout(pair[k:]), k) for k in range(2, len(pair) - 1)]  # theirs among them
            best = min((left[1] + right[1], k, left, right) for left, right, k in splits if left[2] and right[2])
            if best[0] < layouts[g][1] + layouts[g + 1][1]:
                cut = best[1]
                groups[g], groups[g + 1], layouts[g], layouts[g + 1] = pair[:cut], pair[cut:], best[2], best[3]
        groups = [group for group in groups if len(group) > 1]
        if groups and self.packing_holds is None:  # checked on the widest groups that fit one batch
            widths = [group_width(encoded, group) for group in groups]
            fit = accumulate(len(groups[g]) for g in sorted(range(len(groups)), key=lambda g: -widths[g]))
            self.packing_holds = packed_values_hold(
                backbone, range(len(groups)), widths,
                lambda ids, packed: self._scores(encoded, [groups[g] for g in ids], packed),
                unit="groups of texts", fallback="each text is scored as its own row",
                checked=max(1, sum(texts <= self.batch_size for texts in fit)))
        return groups if self.packing_holds else []

    def _fill(self, encoded: Encoded, groups: list[list[int]]) -> list[list[list[int]]]:
        """Packed groups in batches of at most `batch_size` texts, by packed width so each batch pads little."""
        batches: list[list[list[int]]] = []
        for group in sorted(groups, key=lambda group: group_width(encoded, group)):
            if not batches or sum(map(len, batches[-1])) + len(group) > self.batch_size:
                batches.append([])
            batches[-1].append(group)
        return batches
