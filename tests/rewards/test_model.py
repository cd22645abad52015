"""RewardModelScorer with a tiny stand-in reward model: left padding, batching, order, truncation, no_grad."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from pipeline_lib.models.tiny import build_tokenizer
from pipeline_lib.rewards.model import RewardModelScorer

TEXTS = ["12+34=46", "7+1=8", "99+99=198", "0+0=0", "5+5=10"]


class LastTokenLength(nn.Module):
    """score = 100 * (id of the last token) + (number of valid tokens): right only with left padding and a true mask."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Linear(1, 1)
        self.grad_enabled: list[bool] = []
        self.batch_sizes: list[int] = []

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        self.grad_enabled.append(torch.is_grad_enabled() or self.training)
        self.batch_sizes.append(input_ids.shape[0])
        return 100.0 * input_ids[:, -1].float() + attention_mask.sum(dim=-1).float()  # (B,)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(["0123456789+="])


def expected(tokenizer, text: str) -> float:
    ids = tokenizer(text)["input_ids"]
    return 100.0 * ids[-1] + len(ids)


@pytest.mark.parametrize("batch_size", [1, 2, 16])
def test_scores_match_unbatched_and_keep_input_order(tokenizer, batch_size):
    model = LastTokenLength()
    scores = RewardModelScorer(model, tokenizer, batch_size=batch_size)(TEXTS)
    assert scores == [expected(tokenizer, t) for t in TEXTS]
    assert max(model.batch_sizes) <= batch_size
    assert sum(model.batch_sizes) == len(TEXTS)
    assert not any(model.grad_enabled)  # no_grad and eval mode in every forward


def test_max_length_truncates_from_the_left(tokenizer):
    scores = RewardModelScorer(LastTokenLength(), tokenizer, batch_size=4, max_length=3)(TEXTS)
    assert scores == [100.0 * tokenizer(t)["input_ids"][-1] + 3 for t in TEXTS]


def test_training_mode_is_restored_and_empty_input_is_empty(tokenizer):
    model = LastTokenLength().train()
    scorer = RewardModelScorer(model, tokenizer)
    scorer(TEXTS[:2])
    assert model.training
    assert scorer([]) == []


def test_bad_arguments_and_outputs_are_reported(tokenizer):
    with pytest.raises(ValueError, match="batch_size"):
        RewardModelScorer(LastTokenLength(), tokenizer, batch_size=0)

    class TwoScores(LastTokenLength):
        def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
            return torch.zeros(input_ids.shape[0], 2)

    with pytest.raises(ValueError, match="expected scores of shape"):
        RewardModelScorer(TwoScores(), tokenizer)(TEXTS)
    with pytest.raises(ValueError, match="no tokens"):
        RewardModelScorer(LastTokenLength(), tokenizer)(["1+1=2", ""])


def test_a_text_that_starts_with_the_bos_token_gets_no_second_one():
    """Llama-style tokenizers add bos, and their chat templates write it too: a chat-rendered prompt + response
    is read with one bos, in reward-model training (encode_texts) as in scoring."""
    from tokenizers.processors import TemplateProcessing

    from pipeline_lib.rewards.model import text_ids
    from pipeline_lib.train.data import encode_texts

    tokenizer = build_tokenizer(["0123456789+="])
    bos = tokenizer.bos_token_id
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    plain = tokenizer("12")["input_ids"]
    assert plain[0] == bos and tokenizer("<s>12")["input_ids"] == [bos, *plain]  # the double bos
    assert text_ids(tokenizer, ["<s>12", "12"]) == [plain, plain]
    assert encode_texts(tokenizer, ["<s>12"], max_length=8).prompt_ids == [plain]
    model = LastTokenLength()
    assert RewardModelScorer(model, tokenizer)(["<s>12"]) == [expected(tokenizer, "12")]
    plain = build_tokenizer(["0123456789+="])  # adds no bos: a text's own leading bos tokens are all kept
    assert text_ids(plain, ["<s><s>12"]) == [[bos, bos, *plain("12")["input_ids"]]]
