"""Texts -> token ids: each distinct text tokenized once, and prompts as a model continues them (the tokenizer's
leading special tokens, none of those it appends after every text). Training and both samplers tokenize prompts
here, so a completion's log-probs are taken after the very ids it was sampled after."""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

# texts per tokenizer call: its output for a whole dataset at once (an Encoding object per text, offsets and token
# strings included) held 3.4 GiB for 450k texts where the ids alone take 0.7 (a helper's scale audit)
TOKENIZE_CHUNK = 10_000
_PROBE = "a"


def token_ids(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], **kwargs: object) -> list[list[int]]:
    """`tokenizer(texts, **kwargs)["input_ids"]`, each distinct text tokenized once (a DPO pair's prompt is two rows'
    prompt; copies of a text share one list), TOKENIZE_CHUNK texts a call."""
    distinct = list(dict.fromkeys(texts))
    ids: list[list[int]] = []
    for start in range(0, len(distinct), TOKENIZE_CHUNK):
        ids += tokenizer(distinct[start:start + TOKENIZE_CHUNK], **kwargs)["input_ids"]
    of_text = dict(zip(distinct, ids))
    return [of_text[text] for text in texts]


def appended_special_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The special tokens the tokenizer writes after every text when it adds its special tokens: eos for a
    `<s> $A </s>` post-processor or Llama's `add_eos_token`; [] for most causal LMs, which add a bos at most."""
    plain = tokenizer(_PROBE, add_special_tokens=False)["input_ids"]
    full = tokenizer(_PROBE)["input_ids"]
    if not plain:
        return []
    special = set(tokenizer.all_special_ids)
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            after = full[start + len(plain):]
            return after if all(token in special for token in after) else []
    return []


def prompt_token_ids(tokenizer: PreTrainedTokenizerBase, prompts: Sequence[str], *,
                     add_special_tokens: bool = True) -> list[list[int]]:
    """Token ids of prompts a model continues: with the tokenizer's special tokens where `add_special_tokens` (a
    raw prompt: bos for most LMs; a chat-rendered one holds its own), but not those it appends after every text
    (`appended_special_ids`): a prompt ending with eos would have the model sample, and train, past its own end."""
    ids = token_ids(tokenizer, prompts, add_special_tokens=add_special_tokens)
    suffix = appended_special_ids(tokenizer) if add_special_tokens else []
    if not suffix:
        return ids
    return [row[:-len(suffix)] if row[-len(suffix):] == suffix else row for row in ids]
