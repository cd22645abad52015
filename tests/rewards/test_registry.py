"""Reward registry: built-in rewards with hand-computed values, the weighted combinator, spec validation."""

from __future__ import annotations

import math

import pytest

from pipeline_lib.errors import AlignflowError
from pipeline_lib.model_dirs import ModelLoadError
from pipeline_lib.models import RewardModel, build_tiny_model, load_tokenizer
from pipeline_lib.rewards import registry
from pipeline_lib.rewards.registry import REWARDS, build_reward, combined_reward, register_reward

PROMPTS = ["2+2=", "3+4=", "10-1=", "5*5="]
COMPLETIONS = ["#### 4", "The answer is 8", "9.0", "no idea"]
ANSWERS = ["4", "7", "9", None]
LENGTHS = [5, 10, 15, 25]


def test_builtins_are_registered():
    assert {"verifier", "overlong", "reward_model"} <= set(REWARDS)


def test_verifier_scores_correct_answers_one():
    scores = REWARDS["verifier"](PROMPTS, COMPLETIONS, answers=ANSWERS, lengths=LENGTHS)
    assert scores == [1.0, 0.0, 1.0, 0.0]  # None gold never matches


def test_verifier_scores_wrong_answers_its_incorrect_option():
    """DAPO's R = ±1: a wrong or unscorable answer gets `incorrect`, a right one still 1."""
    scores = REWARDS["verifier"](PROMPTS, COMPLETIONS, answers=ANSWERS, lengths=LENGTHS, incorrect=-1.0)
    assert scores == [1.0, -1.0, 1.0, -1.0]


def test_overlong_ramps_from_the_soft_limit():
    """max_len 20, cache_len 10: soft start 10. 5 -> 0, 10 -> 0, 15 -> (10-15)/10 = -0.5, 25 -> -1."""
    scores = REWARDS["overlong"](PROMPTS, COMPLETIONS, answers=ANSWERS, lengths=LENGTHS, max_len=20, cache_len=10)
    assert scores == pytest.approx([0.0, 0.0, -0.5, -1.0])


def test_reward_model_scores_prompt_plus_completion():
    seen = []

    def scorer(texts):
        seen.extend(texts)
        return [float(len(t)) for t in texts]

    scores = REWARDS["reward_model"](PROMPTS, COMPLETIONS, answers=ANSWERS, lengths=LENGTHS, scorer=scorer)
    assert seen == [p + c for p, c in zip(PROMPTS, COMPLETIONS)]
    assert scores == [10.0, 19.0, 8.0, 11.0]


def test_combined_reward_is_the_weighted_sum_and_keeps_components():
    """total = 1.0 * verifier + 0.5 * overlong: [1+0, 0+0, 1-0.25, 0-0.5]."""
    reward = combined_reward([
        {"name": "verifier", "weight": 1.0},
        {"name": "overlong", "weight": 0.5, "max_len": 20, "cache_len": 10},
    ])
    total, components = reward(PROMPTS, COMPLETIONS, answers=ANSWERS, lengths=LENGTHS)
    assert total == pytest.approx([1.0, 0.0, 0.75, -0.5])
    assert components["verifier"] == [1.0, 0.0, 1.0, 0.0]
    assert components["overlong"] == pytest.approx([0.0, 0.0, -0.5, -1.0])


def test_weight_defaults_to_one_and_scorer_plugs_in():
    reward = combined_reward([{"name": "reward_model", "scorer": lambda texts: [2.0] * len(texts)}])
    total, _ = reward(PROMPTS[:2], COMPLETIONS[:2], answers=ANSWERS[:2], lengths=LENGTHS[:2])
    assert total == [2.0, 2.0]


@pytest.mark.parametrize(
    ("specs", "message"),
    [
        ([], "at least one"),
        ([{"weight": 1.0}], "'name'"),
        ([{"name": "nope"}], "unknown reward 'nope'"),
        ([{"name": "verifier", "weight": "high"}], "weight"),
        ([{"name": "verifier", "weight": math.inf}], "weight"),
        ([{"name": "overlong", "max_len": 20}], "cache_len"),
        ([{"name": "verifier", "temperature": 2}], "temperature"),
        ([{"name": "verifier"}, {"name": "verifier"}], "once"),
    ],
)
def test_bad_specs_fail_at_build_time_with_the_field(specs, message):
    with pytest.raises(ValueError, match=message):
        combined_reward(specs)


def test_bad_component_output_is_reported():
    nan_rm = combined_reward([{"name": "reward_model", "scorer": lambda texts: [math.nan] * len(texts)}])
    with pytest.raises(ValueError, match="non-finite"):
        nan_rm(PROMPTS, COMPLETIONS, answers=ANSWERS, lengths=LENGTHS)
    short_rm = combined_reward([{"name": "reward_model", "scorer": lambda texts: [1.0]}])
    with pytest.raises(ValueError, match="1 scores for 4 texts"):
        short_rm(PROMPTS, COMPLETIONS, answers=ANSWERS, lengths=LENGTHS)
    with pytest.raises(ValueError, match="one entry per sample"):
        combined_reward([{"name": "verifier"}])(PROMPTS, COMPLETIONS, answers=ANSWERS[:2], lengths=LENGTHS)


def test_register_reward_adds_a_named_function(monkeypatch):
    monkeypatch.setattr(registry, "REWARDS", dict(REWARDS))

    @register_reward("length_bonus")
    def length_bonus(prompts, completions, *, answers, lengths, scale):
        return [scale * n for n in lengths]

    reward = combined_reward([{"name": "verifier", "weight": 2.0}, {"name": "length_bonus", "weight": 1.0, "scale": 0.1}])
    total, _ = reward(PROMPTS, COMPLETIONS, answers=ANSWERS, lengths=LENGTHS)
    assert total == pytest.approx([2.5, 1.0, 3.5, 2.5])
    with pytest.raises(ValueError, match="already registered"):
        register_reward("length_bonus")(length_bonus)


def test_build_reward_reports_a_bad_spec_in_one_line():
    with pytest.raises(AlignflowError, match=r"^rewards: .*unknown reward 'bleu'") as caught:
        build_reward([{"name": "verifier"}, {"name": "bleu"}])
    assert "\n" not in str(caught.value)


def test_build_reward_sums_weighted_components():
    reward = build_reward([{"name": "verifier", "weight": 2.0}, {"name": "overlong", "max_len": 4, "cache_len": 2}])
    total, parts = reward(["1+1="] * 2, ["2", "3"], answers=["2", "2"], lengths=[1, 4])
    assert parts["verifier"] == [1.0, 0.0] and parts["overlong"] == [0.0, -1.0]
    assert total == [2.0, -1.0]


def test_a_reward_model_with_its_own_code_loads_only_with_trust_remote_code(tmp_path, remote_code_copy):
    """A reward model dir whose backbone and tokenizer are its own code: refused in one line and the code never runs,
    unless the stage sets trust_remote_code; then it scores as the same weights under the stock classes do."""
    tiny = build_tiny_model(tmp_path / "tiny", ["12+34=46", "hello world"])
    plain = RewardModel.from_policy(tiny, device="cpu", seed=1).save_pretrained(tmp_path / "rm", load_tokenizer(tiny))
    remote, marker = remote_code_copy(plain, tmp_path / "rm-remote")
    specs = [{"name": "reward_model"}]
    with pytest.raises(ModelLoadError, match="contains custom code") as refused:
        build_reward(specs, reward_model_path=str(remote))
    assert "\n" not in str(refused.value) and not marker.exists()
    texts = (["12+34="] * 2, ["46", "hello"])
    scored, _ = build_reward(specs, reward_model_path=str(remote), trust_remote_code=True)(
        *texts, answers=[None] * 2, lengths=[1, 1])
    assert marker.exists()
    stock, _ = build_reward(specs, reward_model_path=str(plain))(*texts, answers=[None] * 2, lengths=[1, 1])
    assert scored == pytest.approx(stock, abs=1e-5)
