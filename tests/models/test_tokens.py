"""Prompt token ids: the tokenizer's leading special tokens kept, those it appends after every text (a `<s> $A </s>`
post-processor, Llama's add_eos_token) left off, whatever else the tokenizer adds."""

from __future__ import annotations

import pytest
from tokenizers.processors import TemplateProcessing

from pipeline_lib.models import build_tokenizer
from pipeline_lib.models.tokens import appended_special_ids, prompt_token_ids


def with_template(template: str | None):
    """The tiny tokenizer (no post-processor), or with `template` as its post-processor."""
    tokenizer = build_tokenizer(["0123456789+=ab"])
    if template is not None:
        specials = [("<s>", tokenizer.bos_token_id), ("</s>", tokenizer.eos_token_id)]
        tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
            single=template, special_tokens=[(token, i) for token, i in specials if token in template])
    return tokenizer


@pytest.mark.parametrize(("template", "lead", "appended"), [
    (None, [], []), ("<s> $A", ["<s>"], []), ("<s> $A </s>", ["<s>"], ["</s>"]), ("$A </s>", [], ["</s>"]),
    ("<s> $A </s> </s>", ["<s>"], ["</s>", "</s>"]),
], ids=["none", "bos", "bos-eos", "eos", "bos-eos-eos"])
def test_prompts_keep_the_leading_special_tokens_and_lose_the_appended_ones(template, lead, appended):
    tokenizer = with_template(template)
    lead_ids, appended_ids = tokenizer.convert_tokens_to_ids(lead), tokenizer.convert_tokens_to_ids(appended)
    assert appended_special_ids(tokenizer) == appended_ids
    prompts = ["12+34=", "5+6=", "12+34="]
    plain = [tokenizer(prompt, add_special_tokens=False)["input_ids"] for prompt in prompts]
    assert tokenizer(prompts[0])["input_ids"] == lead_ids + plain[0] + appended_ids  # what the tokenizer writes
    assert prompt_token_ids(tokenizer, prompts) == [lead_ids + row for row in plain]
    assert prompt_token_ids(tokenizer, prompts, add_special_tokens=False) == plain  # a chat-rendered prompt's


def test_an_eos_the_prompt_itself_writes_is_kept():
    """Only what the tokenizer appends is left off: a prompt text ending with `</s>` keeps that one."""
    tokenizer = with_template("<s> $A </s>")
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    digits = tokenizer("12", add_special_tokens=False)["input_ids"]
    assert prompt_token_ids(tokenizer, ["12</s>"]) == [[bos, *digits, eos]]
