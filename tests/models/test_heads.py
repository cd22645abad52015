"""Reward and value heads: padding-side independence, pooling against unpadded references, save/load round trips."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import pytest
import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, OPTConfig, OPTForCausalLM

from pipeline_lib.models import POOLINGS, RewardModel, ValueModel, build_tiny_model, load_policy
from pipeline_lib.models.heads import PackedGroups
from pipeline_lib.models.loading import ModelLoadError
from pipeline_lib.train.data import Encoded, collate_groups

CORPUS = [f"{a:02d}+{b:02d}={a + b}" for a in range(0, 100, 9) for b in range(0, 100, 13)]
SEQUENCES = [[9, 10, 7, 11, 12], [8, 9, 7, 13, 14, 15, 16, 10], [11, 12]]  # lengths 5, 8, 2
ATOL = 1e-5


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "policy", CORPUS)


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory) -> Path:
    """Absolute position embeddings: unlike Llama's RoPE (shift-invariant), wrong position ids change scores."""
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=20, n_positions=32, n_embd=64, n_layer=2, n_head=2)
    out = tmp_path_factory.mktemp("gpt2") / "policy"
    GPT2LMHeadModel(config).save_pretrained(out)
    return out


def _padded(side: str, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in SEQUENCES)
    ids = torch.full((len(SEQUENCES), width), pad_id)
    mask = torch.zeros_like(ids)
    for row, seq in enumerate(SEQUENCES):
        cols = slice(width - len(seq), width) if side == "left" else slice(0, len(seq))
        ids[row, cols] = torch.tensor(seq)
        mask[row, cols] = 1
    return ids, mask


@torch.no_grad()
def _unpadded_reference(model: RewardModel, sequences: list[list[int]] = SEQUENCES) -> torch.Tensor:
    """Each sequence alone (no padding at all), pooled by hand from the backbone's hidden states."""
    scores = []
    for seq in sequences:
        out = model.backbone(torch.tensor([seq]), output_hidden_states=True)
        last, before = out.hidden_states[-1][0], out.hidden_states[-2][0]  # (T, H)
        norm = getattr(model.backbone, "ln_f", None) or model.backbone.norm  # GPT-2, Llama: hidden_states[-1]'s norm
        pooled = {"last_token": last[-1], "mean": last.mean(dim=0),
                  "last_two_layers": (last[-1] + norm(before[-1])) / 2}
        scores.append(model.head(pooled[model.pooling]).squeeze())
    return torch.stack(scores)


@pytest.mark.parametrize("backbone", ["policy_dir", "gpt2_dir"])
@pytest.mark.parametrize("pooling", POOLINGS)
def test_reward_is_the_same_for_left_and_right_padding(request, backbone, pooling):
    model = RewardModel.from_policy(request.getfixturevalue(backbone), pooling=pooling)
    with torch.no_grad():
        left = model(*_padded("left"))
        right = model(*_padded("right"))
    assert left.shape == (3,) and left.dtype == torch.float32
    torch.testing.assert_close(left, right, atol=ATOL, rtol=0)
    torch.testing.assert_close(left, _unpadded_reference(model), atol=ATOL, rtol=0)


# groups of texts sharing their first tokens: 2 of 3 texts, all but the last token of two equal ones, none
GROUPS = [[[9, 10, 7, 11, 12], [9, 10, 7, 13, 14, 15], [9, 10, 8]], [[8, 9, 7, 13], [8, 9, 7, 13]],
          [[11, 12], [5, 6, 7]]]


def _packed_groups() -> tuple[torch.Tensor, torch.Tensor, PackedGroups]:
    texts = [text for group in GROUPS for text in group]
    rows, start = [], 0
    for group in GROUPS:
        rows.append(list(range(start, start + len(group))))
        start += len(group)
    batch = collate_groups(Encoded(texts, [[] for _ in texts]), rows, pad_id=0, texts=3)
    return batch.input_ids, batch.attention_mask, batch.packed


@pytest.mark.parametrize("backbone", ["policy_dir", "gpt2_dir"])
@pytest.mark.parametrize("pooling", POOLINGS)
def test_packed_groups_score_each_text_as_its_own_row_does(request, backbone, pooling):
    model = RewardModel.from_policy(request.getfixturevalue(backbone), pooling=pooling)
    with torch.no_grad():
        scores = model(*_packed_groups())  # (3 groups, 3 texts)
    assert scores.shape == (3, 3) and scores.dtype == torch.float32
    valid = torch.tensor([[True, True, True], [True, True, False], [True, True, False]])
    assert (scores[~valid] == 0).all()  # past a group's size
    expected = _unpadded_reference(model, [text for group in GROUPS for text in group])
    torch.testing.assert_close(scores[valid], expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("pooling", ["last_token", "mean"])
def test_packed_groups_give_the_rows_gradients(policy_dir, pooling):
    model = RewardModel.from_policy(policy_dir, pooling=pooling)
    texts = [text for group in GROUPS for text in group]
    weights = torch.arange(1.0, len(texts) + 1)
    grads = []
    for packed in (False, True):
        model.zero_grad()
        if packed:
            scores = model(*_packed_groups())[torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 0]], dtype=torch.bool)]
        else:
            scores = torch.cat([model(torch.tensor([text]), torch.ones(1, len(text), dtype=torch.long))
                                for text in texts])
        (scores * weights).sum().backward()
        grads.append({name: param.grad.clone() for name, param in model.named_parameters()})
    for name, grad in grads[0].items():  # fp32 rounding of sums taken in another order, on the tensor's scale
        assert float((grads[1][name] - grad).abs().max()) <= 1e-6 * (1.0 + float(grad.abs().max())), name


def test_poolings_differ(policy_dir):
    ids, mask = _padded("left")
    scores = [RewardModel.from_policy(policy_dir, pooling=p)(ids, mask).detach() for p in POOLINGS]
    assert not torch.allclose(scores[0], scores[1]) and not torch.allclose(scores[0], scores[2])


def test_pad_token_content_does_not_matter(policy_dir):
    model = RewardModel.from_policy(policy_dir, pooling="mean")
    ids, mask = _padded("left", pad_id=0)
    other_ids, _ = _padded("left", pad_id=5)
    with torch.no_grad():
        torch.testing.assert_close(model(ids, mask), model(other_ids, mask), atol=ATOL, rtol=0)


def test_from_policy_uses_policy_weights_and_seeded_head(policy_dir):
    policy = load_policy(policy_dir)
    model = RewardModel.from_policy(policy_dir)
    assert torch.equal(model.backbone.embed_tokens.weight, policy.model.embed_tokens.weight)
    assert torch.equal(model.head.weight, RewardModel.from_policy(policy_dir).head.weight)
    assert not torch.equal(model.head.weight, RewardModel.from_policy(policy_dir, seed=1).head.weight)
    assert float(model.head.bias.detach()) == 0.0
    assert 0.03 < float(model.head.weight.detach().std()) < 0.15  # N(0, 1/sqrt(129) = 0.088)


def test_heads_take_a_policy_backbone_without_a_load_report(policy_dir):
    """The policy's (untied) LM head is dropped on purpose: transformers must not report it as unexpected."""
    path = policy_dir
    policy = load_policy(path)
    log = logging.StreamHandler(io.StringIO())
    transformers.logging.add_handler(log)
    try:
        models = (RewardModel.from_policy(path), ValueModel.from_policy(path))
    finally:
        transformers.logging.remove_handler(log)
    for model in models:
        assert type(model.backbone) is type(policy.base_model)
        for name, tensor in policy.base_model.state_dict().items():
            assert torch.equal(model.backbone.state_dict()[name], tensor), name
    assert "LOAD REPORT" not in log.stream.getvalue()


@pytest.mark.parametrize("pooling", POOLINGS)
def test_reward_model_round_trip(policy_dir, tmp_path, pooling):
    model = RewardModel.from_policy(policy_dir, pooling=pooling)
    with torch.no_grad():
        model.head.bias.fill_(0.25)  # a non-default value must survive too
    out = model.save_pretrained(tmp_path / "rm")
    assert json.loads((out / "reward_config.json").read_text())["pooling"] == pooling
    assert {"model.safetensors", "reward_head.safetensors", "config.json"} <= {p.name for p in out.iterdir()}
    loaded = RewardModel.from_pretrained(out)
    ids, mask = _padded("right")
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, mask), model(ids, mask), atol=0, rtol=0)
    assert loaded.pooling == pooling


def test_value_model_round_trip_and_padding(policy_dir, tmp_path):
    model = ValueModel.from_policy(policy_dir)
    ids, mask = _padded("left")
    assert torch.count_nonzero(model(ids, mask)) == 0  # zero head: V = 0 everywhere at start
    with torch.no_grad():
        model.head.weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(0))
        left = model(ids, mask)  # (B, T)
        right = model(*_padded("right"))
    assert left.shape == ids.shape
    assert torch.all(left[mask == 0] == 0)
    for row, seq in enumerate(SEQUENCES):  # same per-token values at the valid tokens, either padding
        torch.testing.assert_close(left[row, -len(seq):], right[row, : len(seq)], atol=ATOL, rtol=0)
    loaded = ValueModel.from_pretrained(model.save_pretrained(tmp_path / "critic"))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, mask), left, atol=0, rtol=0)


def test_value_gradients_reach_backbone(policy_dir):
    model = ValueModel.from_policy(policy_dir)
    with torch.no_grad():
        model.head.weight.fill_(0.01)
    ids, mask = _padded("left")
    model(ids, mask).sum().backward()
    assert model.backbone.embed_tokens.weight.grad.abs().sum() > 0


def test_bad_inputs_are_one_line_errors(policy_dir, tmp_path):
    with pytest.raises(ValueError, match="pooling='max'"):
        RewardModel.from_policy(policy_dir, pooling="max")
    model = RewardModel.from_policy(policy_dir)
    ids, mask = _padded("left")
    mask[2] = 0
    with pytest.raises(ValueError, match="at least one valid"):
        model(ids, mask)
    with pytest.raises(ValueError, match="attention_mask"):
        model(ids, mask[:, 1:])
    with pytest.raises(ModelLoadError, match="reward_config.json.*rm stage"):
        RewardModel.from_pretrained(policy_dir)
    with pytest.raises(ModelLoadError, match="not a value model dir"):
        ValueModel.from_pretrained(RewardModel.from_policy(policy_dir).save_pretrained(tmp_path / "rm"))


def test_last_two_layers_needs_a_final_norm_and_refuses_a_head_trained_without_it(policy_dir, tmp_path):
    """OPT keeps its final norm inside `decoder`: found there, the layer before the last goes through it. OPT-350m's
    layout (post-norm layers, no final norm, a projection after the last layer) and a projection after the final
    norm have none that gives the last hidden state: refused at construction, not at the first score. A reward dir
    saved before the layer before the last was normed (no `penultimate_normed`) would score with a head trained on
    another scale: refused, naming the cure."""
    sizes = dict(vocab_size=20, hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=2,
                 max_position_embeddings=32)
    torch.manual_seed(0)
    OPTForCausalLM(OPTConfig(**sizes, word_embed_proj_dim=32)).save_pretrained(tmp_path / "opt")
    model = RewardModel.from_policy(tmp_path / "opt", pooling="last_two_layers")
    assert model.norm_name == "decoder.final_layer_norm"
    with torch.no_grad():
        out = model.backbone(torch.tensor([SEQUENCES[0]]), output_hidden_states=True)
        norm = model.backbone.decoder.final_layer_norm
        by_hand = (out.hidden_states[-1][0, -1] + norm(out.hidden_states[-2][0, -1])) / 2
        assert torch.allclose(model(torch.tensor([SEQUENCES[0]]), torch.ones(1, len(SEQUENCES[0]), dtype=torch.long)),
                              model.head(by_hand), atol=1e-6)
    for post_norm in (True, False):
        OPTForCausalLM(OPTConfig(**sizes, word_embed_proj_dim=16, do_layer_norm_before=not post_norm)).save_pretrained(
            tmp_path / "projected")
        with pytest.raises(ModelLoadError, match="OPTModel has no final norm that gives.*pooling last_token or mean"):
            RewardModel.from_policy(tmp_path / "projected", pooling="last_two_layers")
        assert RewardModel.from_policy(tmp_path / "projected", pooling="mean").pooling == "mean"
    out = RewardModel.from_policy(policy_dir, pooling="last_two_layers").save_pretrained(tmp_path / "rm")
    config = json.loads((out / "reward_config.json").read_text())
    assert config["penultimate_normed"] is True
    del config["penultimate_normed"]
    (out / "reward_config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="alignflow < 0.4.1.*train it again"):
        RewardModel.from_pretrained(out)


def test_a_reward_or_value_model_dir_is_no_policy(policy_dir, tmp_path):
    """Its backbone has no LM head: transformers would start one at random and only log it, and eval would score a
    random policy; load_policy refuses the dir instead, naming what it is."""
    rm_dir = RewardModel.from_policy(policy_dir).save_pretrained(tmp_path / "rm")
    with pytest.raises(ModelLoadError, match=r"a reward model dir \(reward_config.json\): its weights lack "
                                             "lm_head.weight, which AutoModelForCausalLM needs"):
        load_policy(rm_dir, device="cpu")
    critic_dir = ValueModel.from_policy(policy_dir).save_pretrained(tmp_path / "critic")
    with pytest.raises(ModelLoadError, match=r"a value model dir \(value_config.json\)"):
        load_policy(critic_dir, device="cpu")
