"""RewardModelScorer with a tiny stand-in reward model (left padding, batching, order, truncation, no_grad) and with a
tiny Llama reward model (texts sharing their start packed in one row)."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
import torch
import transformers
from torch import Tensor, nn

from pipeline_lib.models import RewardModel, build_tiny_model, load_tokenizer
from pipeline_lib.models.tiny import build_tokenizer
from pipeline_lib.rewards.model import RewardModelScorer
from pipeline_lib.train.common import packing_saves

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

    from pipeline_lib.train.data import encode_texts, text_ids

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


# ---- a reward model's texts packed behind the start they share (the samples of one prompt)


@pytest.fixture(scope="module")
def tiny_rm(tmp_path_factory) -> Path:
    corpus = ["0123456789+=?. abcdefghijklmnopqrstuvwxyz"]
    return build_tiny_model(tmp_path_factory.mktemp("rm") / "policy", corpus, max_position_embeddings=512)


def _samples(prompts: int, per_prompt: int, *, prompt_chars: int, answer_chars: tuple[int, int], seed: int = 0):
    """`per_prompt` answers of each of `prompts` prompts (prompt + answer), shuffled."""
    rng = random.Random(seed)
    texts = []
    for p in range(prompts):
        prompt = "".join(rng.choice("abcdefghij +=") for _ in range(prompt_chars)) + f" {p}?"
        texts += [prompt + "".join(rng.choice("0123456789.") for _ in range(rng.randint(*answer_chars)))
                  for _ in range(per_prompt)]
    rng.shuffle(texts)
    return texts


def _texts_per_forward(model: nn.Module) -> list[int]:
    seen: list[int] = []

    def hook(module, args, out):
        seen.append(int((args[2].lengths > 0).sum()) if len(args) > 2 and args[2] is not None else out.shape[0])

    model.register_forward_hook(hook)
    return seen


@pytest.mark.parametrize("pooling", ["last_token", "mean", "last_two_layers"])
def test_samples_of_one_prompt_are_scored_packed_as_their_own_rows_score_them(tiny_rm, pooling):
    tokenizer = load_tokenizer(tiny_rm)
    model = RewardModel.from_policy(tiny_rm, device="cpu", pooling=pooling)
    texts = _samples(4, 6, prompt_chars=40, answer_chars=(1, 12)) + ["lone text 1", "another lone one ?"]
    alone = [RewardModelScorer(model, tokenizer)([text])[0] for text in texts]
    seen = _texts_per_forward(model)
    scorer = RewardModelScorer(model, tokenizer, batch_size=4)
    scores = scorer(texts)
    torch.testing.assert_close(torch.tensor(scores), torch.tensor(alone), atol=1e-5, rtol=0)
    assert torch.tensor(alone).std() > 1e-3  # the texts' scores differ
    assert scorer.packing_holds and scorer.packed_texts == 24  # the lone texts run as rows
    assert max(seen) <= 4 and sum(seen) == len(texts) + 2 * 4  # + the check: the widest group, packed and as rows
    seen.clear()
    unpacked = RewardModelScorer(model, tokenizer, batch_size=4, pack=False)
    torch.testing.assert_close(torch.tensor(unpacked(texts)), torch.tensor(alone), atol=1e-5, rtol=0)
    assert unpacked.packed_texts == 0 and max(seen) <= 4 and sum(seen) == len(texts)


def test_copies_of_a_text_score_exactly_alike_packed_too(tiny_rm):
    """A converged policy samples one answer several times: packed behind their prompt, each copy sat at other
    columns of the row and scored up to ~1e-6 apart (the audit's 30 of 30 groups), which GRPO's std-normalized
    advantages turned into signals of up to ±0.31. Copies are scored once, and each of them is scored as before."""
    tokenizer = load_tokenizer(tiny_rm)
    model = RewardModel.from_policy(tiny_rm, device="cpu", seed=3)
    prompts = _samples(6, 1, prompt_chars=40, answer_chars=(1, 1))
    texts = [prompt + answer for prompt in prompts for answer in ("12.5", "12.5", "7", "12.5", "7", "3")]
    seen = _texts_per_forward(model)
    scorer = RewardModelScorer(model, tokenizer, batch_size=8)
    scores = scorer(texts)
    for start in range(0, len(texts), 6):
        group = scores[start:start + 6]
        assert group[0] == group[1] == group[3] and group[2] == group[4] and len(set(group)) == 3
    scored_texts = sum(seen)
    seen.clear()
    RewardModelScorer(model, tokenizer, batch_size=8)(list(dict.fromkeys(texts)))
    assert scored_texts == sum(seen)  # each distinct text once
    alone = [RewardModelScorer(model, tokenizer)([text])[0] for text in texts]
    torch.testing.assert_close(torch.tensor(scores), torch.tensor(alone), atol=1e-5, rtol=0)
    # texts differing only in what the cut removes are the same tokens to the model: they tie as well
    cut = RewardModelScorer(model, tokenizer, batch_size=8, max_length=12)
    answers = [cut([f"{first}{prompt}{answer}" for first in "abcdefgh"]) for prompt in prompts for answer in ("1", "22")]
    assert all(len(set(group)) == 1 for group in answers) and len({group[0] for group in answers}) > 1


def test_a_model_whose_packed_scores_do_not_hold_scores_rows_with_one_note(tiny_rm, capsys, dropping):
    tokenizer = load_tokenizer(tiny_rm)
    model = RewardModel.from_policy(tiny_rm, device="cpu")
    backbone = dropping(transformers.LlamaModel, "position_ids")(model.backbone.config)
    quirky = RewardModel(backbone, model.head, "last_token")
    quirky.backbone.load_state_dict(model.backbone.state_dict())
    texts = _samples(3, 5, prompt_chars=30, answer_chars=(2, 8))
    alone = [RewardModelScorer(quirky, tokenizer)([text])[0] for text in texts]
    scorer = RewardModelScorer(quirky, tokenizer)
    capsys.readouterr()
    for _ in range(2):
        torch.testing.assert_close(torch.tensor(scorer(texts)), torch.tensor(alone), atol=1e-5, rtol=0)
    assert scorer.packing_holds is False and scorer.packed_texts == 0
    assert re.fullmatch(r"note: _DropsPositions's packed rows do not give the rows' values \(max difference "
                        r"[0-9.e+-]+ on the 3 widest groups of texts\): each text is scored as its own row\n",
                        capsys.readouterr().err)  # once: the check is not repeated


def test_texts_pack_only_where_it_saves_compute_and_fits_the_models_positions(tiny_rm):
    tokenizer = load_tokenizer(tiny_rm)
    model = RewardModel.from_policy(tiny_rm, device="cpu")
    config = model.backbone.config
    scorer = RewardModelScorer(model, tokenizer)
    short_start = _samples(2, 4, prompt_chars=1, answer_chars=(150, 200))  # a few shared tokens, long answers
    for case in (short_start, _samples(1, 2, prompt_chars=1, answer_chars=(150, 200))):
        alone = [RewardModelScorer(model, tokenizer)([text])[0] for text in case]
        torch.testing.assert_close(torch.tensor(scorer(case)), torch.tensor(alone), atol=1e-5, rtol=0)
    assert scorer.packed_texts == 0 and scorer.packing_holds is None  # nothing came to the check
    texts = _samples(1, 5, prompt_chars=150, answer_chars=(100, 100))  # 5 x ~255 tokens: ~655 columns packed
    lengths = [len(tokenizer(text)["input_ids"]) for text in texts]
    shared = lengths[0] - 100
    assert packing_saves(config, [lengths], [shared + 500]) == [True] and config.max_position_embeddings == 512
    alone = [RewardModelScorer(model, tokenizer)([text])[0] for text in texts]
    packed_shapes: list[tuple[int, int]] = []
    model.register_forward_hook(lambda module, args, out: packed_shapes.append(tuple(args[0].shape))
                                if len(args) > 2 else None)
    torch.testing.assert_close(torch.tensor(scorer(texts)), torch.tensor(alone), atol=1e-5, rtol=0)
    # 3 in a row of ~455 columns (a fourth would pass the model's 512 positions), then the other 2
    assert scorer.packed_texts == 5 and packed_shapes[-1] == (2, shared + 300)
    texts = _samples(1, 8, prompt_chars=145, answer_chars=(60, 60))  # 6 fit 512 positions: 4 + 4, not 6 + 2
    shared = len(tokenizer(texts[0])["input_ids"]) - 60
    assert shared + 6 * 60 <= 512 < shared + 7 * 60
    alone = [RewardModelScorer(model, tokenizer)([text])[0] for text in texts]
    torch.testing.assert_close(torch.tensor(scorer(texts)), torch.tensor(alone), atol=1e-5, rtol=0)
    assert scorer.packed_texts == 13 and packed_shapes[-1] == (2, shared + 4 * 60)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_reward_model_packs_within_its_own_rounding(tiny_rm, dtype, capsys, dropping):
    """On CUDA a reward model loads in bf16 (`dtype: auto`): the check compares packed and rows within 4 eps of the
    dtype (a correct layout measured within 1.5 eps), so packing holds there and still fails a wrong layout."""
    tokenizer = load_tokenizer(tiny_rm)
    model = RewardModel.from_policy(tiny_rm, device="cpu", dtype=dtype)
    texts = _samples(4, 8, prompt_chars=60, answer_chars=(2, 30))
    rows = torch.tensor(RewardModelScorer(model, tokenizer, pack=False)(texts))
    scorer = RewardModelScorer(model, tokenizer)
    capsys.readouterr()
    packed = torch.tensor(scorer(texts))
    assert scorer.packing_holds and scorer.packed_texts == 32 and capsys.readouterr().err == ""
    eps = torch.finfo(dtype).eps
    assert ((packed - rows).abs() <= 4 * eps * (1 + rows.abs())).all()
    backbone = dropping(transformers.LlamaModel, "position_ids")(model.backbone.config)
    quirky = RewardModel(backbone, model.head, "last_token")
    quirky.backbone.load_state_dict(model.backbone.state_dict())
    with torch.no_grad():  # larger weights, so positions move the scores as in a trained model (the random tiny
        for weight in quirky.backbone.parameters():  # one's scores move ~0.03: within bf16's 4 eps)
            weight.mul_(3.0 if weight.dim() >= 2 else 1.0)
    scorer = RewardModelScorer(quirky, tokenizer)
    quirky.backbone.to(dtype)
    scorer(texts)
    assert scorer.packing_holds is False and "do not give the rows' values" in capsys.readouterr().err


def test_texts_past_the_models_positions_are_cut_to_them_with_one_note(tokenizer, tmp_path, capsys):
    """GPT-2's absolute positions raise IndexError past `n_positions`: by default a reward model scores a longer text
    on its last `max_position_embeddings` tokens, as `max_length` would cut it, and says so once."""
    config = transformers.GPT2Config(vocab_size=len(tokenizer), n_positions=16, n_embd=32, n_layer=2, n_head=2)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    model = RewardModel.from_policy(tmp_path / "gpt2", device="cpu")
    texts = ["12+34=46" * 4, "1+1=2", "99+99=198" * 3]
    capsys.readouterr()
    scorer = RewardModelScorer(model, tokenizer)
    scores = scorer(texts)
    assert capsys.readouterr().err == ("note: 2 of 3 texts are longer than the reward model's 16 positions: they are "
                                       "scored on their last tokens\n")
    assert scores == pytest.approx(RewardModelScorer(model, tokenizer, max_length=16)(texts), abs=1e-6)
    scorer(texts)
    assert capsys.readouterr().err == ""  # once
