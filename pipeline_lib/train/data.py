"""Rows -> training tensors for the SFT, RM and DPO loops: prompt rendering (raw text or the chat template),
tokenization once per dataset, left-padded batches with a completion mask, DPO's pairs and a reward model's groups
packed a pair (group) per row, length buckets, the seeded held-out split, and
the `--config run.json` file that the loop modules' `__main__` read (`torchrun -m pipeline_lib.train.dpo`)."""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import signal
import sys
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TypeVar

import polars as pl
import torch
import torch.distributed as dist
from jinja2 import TemplateError
from pydantic import BaseModel, ConfigDict
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from pipeline_lib import code_version
from pipeline_lib.config import config_key, model_paths, validate_config
from pipeline_lib.errors import AlignflowError, one_line, text_start
from pipeline_lib.fingerprint import content_id, frame_fingerprint, keyed_dir, model_fingerprint
from pipeline_lib.logfns import jsonl_log, print_log
from pipeline_lib.models.heads import PackedGroups
from pipeline_lib.models.logprobs import CHOSEN, REJECTED
from pipeline_lib.models.tokens import prompt_token_ids, token_ids
from pipeline_lib.train import LAUNCH_PARENT

C = TypeVar("C", bound=BaseModel)
B = TypeVar("B")  # Batch, PairBatch or GroupBatch: what `_in_buckets` collates


class TrainDataError(AlignflowError, ValueError):
    """Training rows that cannot be used (missing column, empty data), in one line."""


# ---- prompts


def _prompt_messages(raw: str | list | dict, row: int) -> list[dict]:
    """The prompt turns of a stored conversation: a message list, or the `prompt` list of a {prompt, chosen,
    rejected} object (preference_pairs.prompt_messages)."""
    value = json.loads(raw) if isinstance(raw, str) else raw
    if isinstance(value, dict):
        value = value.get("prompt")
    if not isinstance(value, list) or not all(isinstance(m, dict) and "role" in m and "content" in m for m in value):
        raise TrainDataError(f"prompt_messages[{row}]: expected a JSON list of {{role, content}} messages")
    return value


def require_chat_template(tokenizer: PreTrainedTokenizerBase, model_path: str, chat_template: bool) -> None:
    """A stage with `chat_template: true` needs a tokenizer that has one (else it would train on raw prompts)."""
    if chat_template and not getattr(tokenizer, "chat_template", None):
        raise TrainDataError(f"chat_template=True but the tokenizer in {model_path} has no chat template")


def with_user_turns(frame: pl.DataFrame) -> pl.DataFrame:
    """`frame` with each row's `prompt_messages` kept, or where it has none (or the frame has no such column) set to
    its plain `prompt` as one user turn: the rows a run with chat_template renders through the template."""
    turns = pl.Series([json.dumps([{"role": "user", "content": prompt}]) for prompt in frame["prompt"].to_list()],
                      dtype=pl.Utf8)
    messages = frame["prompt_messages"].fill_null(turns) if "prompt_messages" in frame.columns else turns
    return frame.with_columns(messages.alias("prompt_messages"))


def render_prompts(tokenizer: PreTrainedTokenizerBase, frame: pl.DataFrame) -> tuple[list[str], list[bool]]:
    """Prompt text per row and whether it came from the chat template.

    A row with `prompt_messages` is rendered with the tokenizer's chat template (assistant turn opened);
    a tokenizer without one is a one-line TrainDataError. Other rows keep their raw `prompt` (`12+34=`). A
    template that refuses a conversation (Gemma's and Mistral's raise on a `system` turn) is a one-line
    TrainDataError naming the row."""
    prompts = frame["prompt"].to_list()
    messages = frame["prompt_messages"].to_list() if "prompt_messages" in frame.columns else [None] * len(prompts)
    use_template = getattr(tokenizer, "chat_template", None) is not None
    chats = sum(raw is not None for raw in messages)
    if chats and not use_template:  # its display text (`user: ...`) is no prompt the model was made to read
        raise TrainDataError(f"{chats} of {len(prompts)} rows are chat conversations (prompt_messages), but the "
                             f"tokenizer of {tokenizer.name_or_path} has no chat template to render them: use a model "
                             "whose tokenizer has one (or set its chat_template), or ingest them as plain text "
                             "(prompt/chosen/rejected strings)")
    texts, templated = [], []
    for row, (prompt, raw) in enumerate(zip(prompts, messages)):
        if raw is not None and use_template:
            conversation = _prompt_messages(raw, row)
            try:
                rendered = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
            except (TemplateError, TypeError, ValueError) as exc:  # Gemma, Mistral: `raise_exception` on a role
                roles = ", ".join(m["role"] for m in conversation)
                raise TrainDataError(f"prompt_messages[{row}] (prompt {text_start(prompt)}, roles {roles}): the "
                                     f"chat template of {tokenizer.name_or_path} refuses it ({one_line(exc)}); "
                                     "use a model whose template takes these roles, or fix or drop the row"
                                     ) from None
            texts.append(rendered)
            templated.append(True)
        else:
            texts.append(prompt)
            templated.append(False)
    return texts, templated


# ---- tokenization, once per dataset


@dataclass(frozen=True)
class Encoded:
    """Token ids of (prompt, completion) rows; completions end with eos (chat-template rows: the template's end of
    an assistant turn, `turn_end_ids`) unless they were cut."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def completion_tokens(self, indices: Sequence[int]) -> int:
        return sum(len(self.completion_ids[i]) for i in indices)

    def fingerprint(self) -> str:
        """sha256 of every id: changes with the data, the tokenizer, the template or the truncation."""
        digest = hashlib.sha256()
        for prompt, completion in zip(self.prompt_ids, self.completion_ids):
            digest.update(json.dumps([prompt, completion]).encode())
        return digest.hexdigest()


_REPLY_MARK = "alignflowreplymark"


def turn_end_ids(tokenizer: PreTrainedTokenizerBase, stops: Collection[int]) -> list[int]:
    """The tokens that end an assistant reply of the tokenizer's chat template, up to and including the first of
    `stops` (the model's stop tokens, `models.logprobs.stop_token_ids`) after it: ChatML's `<|im_end|>`, Llama 3's
    `<|eot_id|>`, Gemma's `<end_of_turn>` where the model stops on them, eos in templates that end turns with it.
    So chat rows teach the token the model stops on at sampling time, as the template writes it. A template that
    writes none of `stops` after the reply (a base model's generation_config stops on eos alone, the template on
    `<|im_end|>`), or whose probe fails: [eos], which the model does stop on."""
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"},
                                              {"role": "assistant", "content": _REPLY_MARK}], tokenize=False)
    except Exception:  # noqa: BLE001 - a template refusing the probe: rows end with eos, as without one
        return [tokenizer.eos_token_id]
    if _REPLY_MARK not in text:
        return [tokenizer.eos_token_id]
    after = tokenizer(text[text.rindex(_REPLY_MARK) + len(_REPLY_MARK):], add_special_tokens=False)["input_ids"]
    end = next((i for i, token in enumerate(after) if token in stops), None)
    return [tokenizer.eos_token_id] if end is None else after[:end + 1]


def row_limit(max_length: int, positions: int | None) -> tuple[int, bool]:
    """(the tokens a row keeps, whether the model's `positions` set it): the fewer of `max_length` and the positions
    (learned absolute ones raise IndexError past them), where raising max_length would not help."""
    by_positions = positions is not None and positions < max_length
    return (positions if by_positions else max_length), by_positions


def cut_to(max_length: int, positions: int | None) -> str:
    """What a row is cut to (`row_limit`), as a warning names it."""
    length, by_positions = row_limit(max_length, positions)
    return f"the model's {length} positions" if by_positions else f"max_length = {max_length}"


def encode(
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    completions: Sequence[str],
    *,
    max_length: int,
    templated: Sequence[bool] | None = None,
    group_size: int = 1,
    positions: int | None = None,
    stops: Collection[int] = (),
) -> Encoded:
    """Tokenize prompts and completions separately (the completion mask is exact) and append eos (to a row whose
    prompt came from the chat template: the template's end of turn, where it is one of the model's `stops`,
    `turn_end_ids`).

    Raw prompts get the tokenizer's special tokens (bos for most LMs), as the samplers do; chat-template
    prompts already hold them. Rows over `max_length` lose prompt tokens from the left, then (a completion
    alone too long) completion tokens from the right, with a warning counting them. Consecutive runs of
    `group_size` rows answer one prompt (a DPO pair's chosen and rejected): the prompt is cut once for the
    longest of them, so every answer of the group is conditioned on the same tokens. The model's `positions`
    (`models.logprobs.model_positions`; learned absolute ones raise IndexError past them), where fewer than
    `max_length`, stand in for it, and a note counting the rows they cut replaces the warnings."""
    if len(prompts) != len(completions):
        raise TrainDataError(f"{len(prompts)} prompts but {len(completions)} completions")
    if not prompts:
        raise TrainDataError("no training rows: the selected table/split/source is empty")
    if tokenizer.eos_token_id is None:
        raise TrainDataError("tokenizer: has no eos token to end completions with")
    templated = list(templated) if templated is not None else [False] * len(prompts)
    prompt_ids: list[list[int]] = [[] for _ in prompts]
    for from_template in (False, True):
        rows = [i for i, flag in enumerate(templated) if flag == from_template]
        if rows:
            ids = prompt_token_ids(tokenizer, [prompts[i] for i in rows], add_special_tokens=not from_template)
            for i, row_ids in zip(rows, ids):
                prompt_ids[i] = row_ids
    empty = next((i for i, ids in enumerate(prompt_ids) if not ids), None)
    if empty is not None:
        raise TrainDataError(f"row {empty}: the prompt has no tokens (empty, and the tokenizer adds no bos), so "
                             "nothing predicts its completion's first token; give every row a prompt")
    completion_ids = token_ids(tokenizer, completions, add_special_tokens=False)
    if group_size < 1 or len(prompts) % group_size:
        raise TrainDataError(f"group_size {group_size}: expected a positive divisor of {len(prompts)} rows")
    eos = [tokenizer.eos_token_id]
    turn_end = turn_end_ids(tokenizer, stops) if any(templated) else eos
    ends = [completion + (turn_end if from_template else eos)
            for completion, from_template in zip(completion_ids, templated)]
    length, by_positions = row_limit(max_length, positions)
    cut = sum(len(end) > length - 1 for end in ends)
    if cut and not by_positions:
        print(f"warning: {cut} of {len(ends)} completions are longer than max_length - 1 = {max_length - 1} "
              f"tokens and were cut from the right, their end (eos) included; raise max_length to keep them whole",
              file=sys.stderr, flush=True)
    out_prompts, out_completions = [], []
    prompts_cut = 0
    for start in range(0, len(ends), group_size):
        group = [end[: length - 1] for end in ends[start:start + group_size]]
        room = length - max(len(completion) for completion in group)  # >= 1: never the whole row
        prompt = prompt_ids[start]
        prompts_cut += len(prompt) > room
        out_prompts += [prompt[-room:] if len(prompt) > room else list(prompt) for _ in group]
        out_completions += group
    if prompts_cut and not by_positions:
        print(f"warning: {prompts_cut} of {len(ends) // group_size} prompts do not fit max_length = {max_length} "
              "tokens beside their completion and lost their first tokens; raise max_length to keep them whole",
              file=sys.stderr, flush=True)
    rows_cut = sum(len(out_prompts[i]) < len(prompt_ids[i]) or len(out_completions[i]) < len(ends[i])
                   for i in range(len(ends)))
    if rows_cut and by_positions:
        print(f"note: {rows_cut} of {len(ends)} rows are cut to the model's {length} positions (under max_length "
              f"{max_length}): prompts lose their first tokens, then completions their last", file=sys.stderr,
              flush=True)
    warn_unknown_tokens(tokenizer, out_prompts + out_completions)
    return Encoded(out_prompts, out_completions)


UNKNOWN_SHARE = 0.01


def warn_unknown_tokens(tokenizer: PreTrainedTokenizerBase, rows: Sequence[Sequence[int]]) -> None:
    """A warning when over 1% of the tokens are the tokenizer's unknown token: its vocabulary does not cover the
    data (the tiny model's character tokenizer knows only its corpus_sources' characters), and the model would
    train on text it cannot see, with no other sign of it."""
    unknown = tokenizer.unk_token_id
    total = sum(len(row) for row in rows)
    if unknown is None or not total:
        return
    count = sum(row.count(unknown) for row in rows)
    if count > UNKNOWN_SHARE * total:
        print(f"warning: {count} of {total} tokens ({count / total:.0%}) are the tokenizer's unknown token "
              f"{tokenizer.unk_token!r}: its vocabulary does not cover this data (a tiny model's tokenizer holds only "
              "the characters of its corpus_sources; build it with these sources too)", file=sys.stderr, flush=True)


def text_ids(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of whole texts (prompt + response) as a reward model reads them, in training and scoring: with
    the tokenizer's own special tokens, once: where the tokenizer adds a bos, a chat-rendered prompt that
    already starts with it (Llama, Mistral and Gemma templates write it) does not get a second one."""
    ids = token_ids(tokenizer, texts)
    bos = tokenizer.bos_token_id
    if bos is None or tokenizer("")["input_ids"][:1] != [bos]:  # GPT-2 adds none: its text keeps every token
        return ids
    return [row[1:] if row[:2] == [bos, bos] else row for row in ids]


def encode_texts(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], *, max_length: int,
                 positions: int | None = None) -> Encoded:
    """Whole texts (prompt + response) tokenized the way rewards.model.RewardModelScorer reads them at scoring
    time (`text_ids`: the tokenizer's own special tokens, one bos), no eos appended, cut from the left to
    `max_length`, or to the model's `positions` where fewer (with a note, as the scorer cuts to them). Held as
    prompts with empty completions (a reward model has no completion mask)."""
    if not texts:
        raise TrainDataError("no training rows: the selected table/source is empty")
    length, by_positions = row_limit(max_length, positions)
    whole = text_ids(tokenizer, texts)
    ids = [row[-length:] for row in whole]
    empty = next((i for i, row in enumerate(ids) if not row), None)
    if empty is not None:
        raise TrainDataError(f"texts[{empty}]: tokenizes to no tokens")
    cut = sum(len(row) > length for row in whole)
    if cut and by_positions:
        print(f"note: {cut} of {len(texts)} texts (prompt + response) are longer than the model's {length} positions "
              f"(under max_length {max_length}) and lost their first tokens, as the reward model's scorer cuts them",
              file=sys.stderr, flush=True)
    elif cut:
        print(f"warning: {cut} of {len(texts)} texts (prompt + response) are longer than max_length = {max_length} "
              "tokens and lost their first tokens, as the reward model's scorer cuts them; raise max_length to "
              "keep them whole", file=sys.stderr, flush=True)
    warn_unknown_tokens(tokenizer, ids)
    return Encoded(ids, [[] for _ in ids])


def encode_frame(tokenizer: PreTrainedTokenizerBase, frame: pl.DataFrame, completion_column: str, *,
                 max_length: int, positions: int | None = None, stops: Collection[int] = ()) -> Encoded:
    """`encode` over a frame's rendered prompts and one completion column."""
    require_columns(frame, ["prompt", completion_column], "training rows")
    prompts, templated = render_prompts(tokenizer, frame)
    return encode(tokenizer, prompts, frame[completion_column].cast(pl.Utf8).to_list(), max_length=max_length,
                  templated=templated, positions=positions, stops=stops)


def require_columns(frame: pl.DataFrame, columns: Sequence[str], what: str) -> None:
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise TrainDataError(f"{what}: missing column(s) {missing}; got {frame.columns}")


# ---- batches


@dataclass(frozen=True)
class Batch:
    input_ids: Tensor  # (B, T)
    attention_mask: Tensor  # (B, T) 1 = real token
    completion_mask: Tensor  # (B, T) 1 = completion token (the loss is taken there)

    def to(self, device: torch.device) -> "Batch":
        return Batch(self.input_ids.to(device), self.attention_mask.to(device), self.completion_mask.to(device))


def collate(encoded: Encoded, indices: Sequence[int], *, pad_id: int) -> Batch:
    """Left-padded (B, T) tensors for rows `indices`; no padding at all when their lengths are equal."""
    rows = [encoded.prompt_ids[i] + encoded.completion_ids[i] for i in indices]
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    completion_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for r, (i, ids) in enumerate(zip(indices, rows)):
        start = width - len(ids)
        input_ids[r, start:] = torch.tensor(ids)
        attention_mask[r, start:] = 1
        completion_mask[r, width - len(encoded.completion_ids[i]):] = 1
    return Batch(input_ids, attention_mask, completion_mask)


@dataclass(frozen=True)
class PairBatch:
    """DPO pairs packed a pair per row (`collate_pairs`); the arguments of `pair_logprob_sums`."""

    input_ids: Tensor  # (B, L) prompt, chosen and rejected without their last tokens, left-padded
    attention_mask: Tensor  # (B, L) 1 = real token
    position_ids: Tensor  # (B, L) the rejected tokens at the positions they have right after the prompt
    segments: Tensor  # (B, L) 0 prompt or padding, CHOSEN, REJECTED
    sources: Tensor  # (B, S) the column whose hidden state predicts each target
    targets: Tensor  # (B, S) the chosen tokens, then the rejected ones, right-padded
    target_sides: Tensor  # (B, S) CHOSEN, REJECTED, 0 = padding

    def to(self, device: torch.device) -> "PairBatch":
        return PairBatch(*(getattr(self, field.name).to(device) for field in fields(self)))


def packed_width(encoded: Encoded, pair: int) -> int:
    """Columns of pair `pair`'s packed row (rows 2 pair and 2 pair + 1 of `encoded`, one prompt)."""
    return (len(encoded.prompt_ids[2 * pair]) + len(encoded.completion_ids[2 * pair])
            + len(encoded.completion_ids[2 * pair + 1]) - 2)


def collate_pairs(encoded: Encoded, pairs: Sequence[int], *, pad_id: int) -> PairBatch:
    """Left-padded rows prompt + chosen[:-1] + rejected[:-1] of `pairs` (`encode` gives both of a pair's rows one
    prompt). The last prompt column predicts each answer's first token; every other answer token is predicted by
    the column before it."""
    width = max(packed_width(encoded, i) for i in pairs)
    span = max(len(encoded.completion_ids[2 * i]) + len(encoded.completion_ids[2 * i + 1]) for i in pairs)
    input_ids, attention_mask, position_ids, segments = [], [], [], []
    sources, targets, target_sides = [], [], []
    for i in pairs:
        prompt, (chosen, rejected) = encoded.prompt_ids[2 * i], encoded.completion_ids[2 * i:2 * i + 2]
        row = prompt + chosen[:-1] + rejected[:-1]
        pad = width - len(row)
        last_prompt = pad + len(prompt) - 1  # its column
        first_rejected = last_prompt + len(chosen)  # the column of rejected[0], which predicts rejected[1]
        input_ids.append([pad_id] * pad + row)
        attention_mask.append([0] * pad + [1] * len(row))
        position_ids.append([0] * pad + list(range(len(prompt) + len(chosen) - 1))
                            + list(range(len(prompt), len(prompt) + len(rejected) - 1)))
        segments.append([0] * (pad + len(prompt)) + [CHOSEN] * (len(chosen) - 1) + [REJECTED] * (len(rejected) - 1))
        fill = span - len(chosen) - len(rejected)
        sources.append([last_prompt + k for k in range(len(chosen))]
                       + [last_prompt] + [first_rejected + k for k in range(len(rejected) - 1)] + [0] * fill)
        targets.append(chosen + rejected + [0] * fill)
        target_sides.append([CHOSEN] * len(chosen) + [REJECTED] * len(rejected) + [0] * fill)
    return PairBatch(*(torch.tensor(t, dtype=torch.long) for t in (input_ids, attention_mask, position_ids, segments,
                                                                    sources, targets, target_sides)))


@dataclass(frozen=True)
class GroupBatch:
    """Groups of texts (a reward model's pairs or rankings) packed a group per row (`collate_groups`)."""

    input_ids: Tensor  # (B, L) the shared prefix, then each text's own tokens; left-padded
    attention_mask: Tensor  # (B, L) 1 = real token
    packed: PackedGroups

    def to(self, device: torch.device) -> "GroupBatch":
        return GroupBatch(self.input_ids.to(device), self.attention_mask.to(device), self.packed.to(device))


def _group_texts(encoded: Encoded, group: Sequence[int]) -> tuple[list[list[int]], int]:
    """Rows `group`'s texts and the tokens they all begin with, leaving each text at least its last token."""
    texts = [encoded.prompt_ids[r] + encoded.completion_ids[r] for r in group]
    return texts, min(len(os.path.commonprefix(texts)), min(len(text) for text in texts) - 1)


def group_width(encoded: Encoded, group: Sequence[int]) -> int:
    """Columns of rows `group`'s packed row: their shared prefix once, then each one's own tokens."""
    texts, shared = _group_texts(encoded, group)
    return shared + sum(len(text) - shared for text in texts)


def collate_groups(encoded: Encoded, groups: Sequence[Sequence[int]], *, pad_id: int, texts: int) -> GroupBatch:
    """Left-padded rows holding each group's shared prefix, then each text's own tokens (at the positions they have
    in the text); `texts` (>= every group's size) is the width of the per-text tensors."""
    layouts = [_group_texts(encoded, group) for group in groups]
    widths = [shared + sum(len(row) - shared for row in rows) for rows, shared in layouts]
    input_ids, attention_mask, position_ids, segments, ends, lengths = [], [], [], [], [], []
    width = max(widths)
    for (rows, shared), own_width in zip(layouts, widths):
        pad = width - own_width
        input_ids.append([pad_id] * pad + rows[0][:shared] + [t for row in rows for t in row[shared:]])
        attention_mask.append([0] * pad + [1] * (width - pad))
        position_ids.append([0] * pad + list(range(shared)) + [p for row in rows for p in range(shared, len(row))])
        segments.append([0] * (pad + shared) + [k + 1 for k, row in enumerate(rows) for _ in range(len(row) - shared)])
        column, group_ends = pad + shared - 1, []
        for row in rows:
            column += len(row) - shared
            group_ends.append(column)
        fill = texts - len(rows)
        ends.append(group_ends + [0] * fill)
        lengths.append([len(row) for row in rows] + [0] * fill)
    input_ids, attention_mask, position_ids, segments, ends, lengths = (
        torch.tensor(t, dtype=torch.long) for t in (input_ids, attention_mask, position_ids, segments, ends, lengths))
    return GroupBatch(input_ids, attention_mask, PackedGroups(position_ids, segments, ends, lengths))


def length_buckets(lengths: Sequence[int], *, ratio: float = 1.5) -> list[list[int]]:
    """Positions sorted by length, cut where a row is over `ratio` x its bucket's shortest: each bucket pads
    little (a batch of 9-token answers and 75-token non-answers becomes two forwards, not one 75-wide)."""
    buckets: list[list[int]] = []
    for k in sorted(range(len(lengths)), key=lambda k: lengths[k]):
        if not buckets or lengths[k] > ratio * lengths[buckets[-1][0]]:
            buckets.append([])
        buckets[-1].append(k)
    return buckets


def _in_order(outputs: list[Tensor], positions: Sequence[int]) -> Tensor:
    """`outputs` concatenated (their entries are at `positions`, in that order), put back in position order."""
    return torch.cat(outputs)[torch.argsort(torch.tensor(positions, device=outputs[0].device))]


def _in_buckets(fn: Callable[[B], Tensor], lengths: Sequence[int], batch_of: Callable[[list[int]], B],
                device: torch.device) -> Tensor:
    """`fn(batch_of(positions).to(device))` over `length_buckets(lengths)`, concatenated back in position order."""
    buckets = length_buckets(lengths)
    return _in_order([fn(batch_of(bucket).to(device)) for bucket in buckets], [k for bucket in buckets for k in bucket])


def per_row(fn: Callable[[Batch], Tensor], encoded: Encoded, rows: Sequence[int], *, pad_id: int,
            device: torch.device) -> Tensor:
    """`fn(batch) -> (R,)` over `rows` in length buckets; results (len(rows),) in the order of `rows`.

    A row's value does not depend on its batch mates (positions come from the attention mask), so
    bucketing changes the cost, not the result; gradients flow through."""
    return _in_buckets(fn, [len(encoded.prompt_ids[r]) + len(encoded.completion_ids[r]) for r in rows],
                       lambda bucket: collate(encoded, [rows[k] for k in bucket], pad_id=pad_id), device)


def per_pair(fn: Callable[[PairBatch], Tensor], encoded: Encoded, pairs: Sequence[int], *, pad_id: int,
             device: torch.device) -> Tensor:
    """`fn(batch) -> (R, 2)` over packed `pairs` in length buckets; results (len(pairs), 2) in the order of `pairs`
    (as `per_row`: a pair's values do not depend on its batch mates)."""
    return _in_buckets(fn, [packed_width(encoded, i) for i in pairs],
                       lambda bucket: collate_pairs(encoded, [pairs[k] for k in bucket], pad_id=pad_id), device)


def per_group(fn: Callable[[GroupBatch], Tensor], encoded: Encoded, groups: Sequence[Sequence[int]], *, pad_id: int,
              device: torch.device) -> Tensor:
    """`fn(batch) -> (R, K)` over packed `groups` (lists of rows) in length buckets, K the largest group's size;
    results (len(groups), K) in the order of `groups` (as `per_row`: a group's values do not depend on its batch
    mates)."""
    texts = max(len(group) for group in groups)
    return _in_buckets(fn, [group_width(encoded, group) for group in groups],
                       lambda bucket: collate_groups(encoded, [groups[k] for k in bucket], pad_id=pad_id, texts=texts),
                       device)


def by_layout(ids: Sequence[int], packed: Collection[int], run_packed: Callable[[list[int]], Tensor],
              run_rows: Callable[[list[int]], Tensor]) -> Tensor:
    """Values of `ids` in their order: those in `packed` from `run_packed`, the others from `run_rows` (each gives one
    entry per id it gets, in its order, and the same trailing shape); gradients flow."""
    in_packs = [k for k, i in enumerate(ids) if i in packed]
    in_rows = [k for k, i in enumerate(ids) if i not in packed]
    parts = []
    if in_packs:
        parts.append(run_packed([ids[k] for k in in_packs]))
    if in_rows:
        parts.append(run_rows([ids[k] for k in in_rows]))
    return _in_order(parts, in_packs + in_rows)


def micro_batches(indices: Sequence[int], n_micro: int) -> list[list[int]]:
    """Split a rank's share of the step into `n_micro` equal micro-batches (gradient accumulation)."""
    if len(indices) % n_micro:
        raise TrainDataError(f"{len(indices)} rows per rank is not a multiple of grad_accum_steps {n_micro}")
    size = len(indices) // n_micro
    return [list(indices[k * size:(k + 1) * size]) for k in range(n_micro)]


def holdout_split(prompts: Sequence[str], fraction: float, *, seed: int) -> tuple[list[int], list[int]]:
    """Seeded (train, held_out) row indices, split by distinct prompt: every row of a held-out prompt is held
    out, so several pairs on one prompt never leak its preferred answer into the evaluation."""
    distinct = sorted(set(prompts))
    if len(distinct) < 2:
        raise TrainDataError(f"need at least 2 distinct prompts to hold some out, got {len(distinct)}")
    order = torch.randperm(len(distinct), generator=torch.Generator().manual_seed(seed + 7_919)).tolist()
    n_eval = min(len(distinct) - 1, max(1, round(len(distinct) * fraction)))
    held = {distinct[i] for i in order[:n_eval]}
    return ([i for i, prompt in enumerate(prompts) if prompt not in held],
            [i for i, prompt in enumerate(prompts) if prompt in held])


def _run_parts(cfg: BaseModel, frames: Sequence[pl.DataFrame]) -> list[str]:
    """`config_key` + the files of every model dir it names (starting policy, reward model) + data + the code that
    trains (`code_version`)."""
    models = [model_fingerprint(path) for path in model_paths(cfg)]
    return [config_key(cfg), *models, *(frame_fingerprint(frame) for frame in frames), code_version()]


def stage_dir(models_dir: Path, stage: str, cfg: BaseModel, *frames: pl.DataFrame) -> Path:
    """`keyed_dir` of config + models + data (`_run_parts`): a model retrained into the same path (new weights)
    gives a new dir."""
    return keyed_dir(models_dir, stage, *_run_parts(cfg, frames))


def run_key(cfg: BaseModel, *frames: pl.DataFrame) -> str:
    """What a training run's checkpoints and final model record, so that only the same run (config, models, data,
    code) resumes or reuses them."""
    return content_id(*_run_parts(cfg, frames))


# ---- the run file of `python -m pipeline_lib.train.<stage> --config run.json` (and torchrun)


class RunFile(BaseModel):
    """`{"config": {...stage config...}, "data": {"rows": "rows.parquet"}, "out_dir": "...", "options": {}}`;
    data paths are parquet/jsonl files, relative to the run file; options are extra keyword arguments."""

    model_config = ConfigDict(extra="forbid")

    config: dict
    data: dict[str, str]
    out_dir: str
    options: dict[str, str] = {}


def write_run_file(path: str | Path, cfg: BaseModel, frames: Mapping[str, pl.DataFrame], out_dir: str | Path,
                   **options: str) -> Path:
    """Write the frames as parquet beside `path` and the run file itself; returns `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {}
    for name, frame in frames.items():
        file = path.with_name(f"{path.stem}.{name}.parquet")
        frame.write_parquet(file)
        data[name] = file.name
    run = RunFile(config=cfg.model_dump(mode="json"), data=data, out_dir=str(out_dir),
                  options={k: str(v) for k, v in options.items()})
    path.write_text(run.model_dump_json(indent=2))
    return path


def read_run_file(path: str | Path, config_cls: type[C]) -> tuple[C, dict[str, pl.DataFrame], Path, dict[str, str]]:
    """(config, frames, out_dir, options) of a run file; one-line errors name the file and the field."""
    path = Path(path)
    if not path.is_file():
        raise TrainDataError(f"{path}: run file not found")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise TrainDataError(f"{path}: invalid JSON ({exc})") from None
    run = validate_config(RunFile, raw, origin=str(path))
    cfg = validate_config(config_cls, run.config, origin=f"{path}: config")
    frames = {}
    for name, file in run.data.items():
        data_path = path.parent / file
        if not data_path.is_file():
            raise TrainDataError(f"{path}: data.{name}: {data_path} not found")
        frames[name] = pl.read_parquet(data_path) if data_path.suffix == ".parquet" else pl.read_ndjson(data_path)
    return cfg, frames, Path(run.out_dir), run.options


PR_SET_PDEATHSIG = 1  # linux/prctl.h
FINAL_LINE = "final model: "
"""What `run_main` prints before the final model's path (`train.launch` reads it)."""


def die_with_parent() -> Callable[[], None] | None:
    """On Linux, a function that has the kernel SIGKILL the calling process when its parent (the thread that started
    it) dies; None elsewhere. Resolved here, before a fork, so a `preexec_fn` only calls it."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    return lambda: prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _die_with_torchrun() -> None:
    """Under torchrun (Linux), have the kernel SIGKILL this worker when its parent, the torchrun agent, dies.

    torchrun starts every worker in a session of its own, so a SIGKILL of torchrun (or of its process group) left
    the stage training on as an orphan (one rank or several), and the rerun that resumes it raced the orphan in
    the same out_dir: its checkpoint write failed on a temp dir the orphan had replaced. An agent that died before
    the request (while the worker imported torch) has left this worker a new parent: it kills itself then. Only
    an agent killed in the worker's first milliseconds, before `pipeline_lib.train` is imported, goes unnoticed."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or (request := die_with_parent()) is None:
        return
    request()
    if os.getppid() != LAUNCH_PARENT:
        os.kill(os.getpid(), signal.SIGKILL)


def run_main(config_cls: type[C], train: Callable[..., Path], argv: Sequence[str] | None = None) -> None:
    """`--config run.json` -> train(cfg, **frames, out_dir=, log=print_log, **options); one-line errors, exit 2.
    `--metrics FILE` logs to FILE as JSON lines instead (`jsonl_log`; the loops log on rank 0 only). A torchrun
    worker dies with its torchrun (`_die_with_torchrun`)."""
    _die_with_torchrun()
    parser = argparse.ArgumentParser(description=train.__doc__)
    parser.add_argument("--config", required=True, help="run file: stage config + data paths + out_dir")
    parser.add_argument("--metrics", type=Path, help="append each step's metrics to this file as JSON lines")
    args = parser.parse_args(argv)
    log = print_log if args.metrics is None else jsonl_log(args.metrics)
    try:
        cfg, frames, out_dir, options = read_run_file(args.config, config_cls)
        final = train(cfg, **frames, out_dir=out_dir, log=log, **options)
    except AlignflowError as exc:
        # one write per line (print writes its end apart): torchrun's workers (`python -u`) share its pipes, and
        # `train.launch` reads these lines whole
        print(f"error: {exc}\n", end="", file=sys.stderr, flush=True)
        if dist.is_initialized():  # at once: tearing the group down can wait on a rank inside a collective
            os._exit(2)  # (seen: rank 0 failing its checkpoint write hung with rank 1 in the next step's all-reduce)
        sys.exit(2)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    print(f"{FINAL_LINE}{final}\n", end="", flush=True)
