"""GRPO/DAPO loop: dynamic sampling with refills on raw correctness (scripted sampler, hand-counted), rollout
tensors, 2-step runs (weights change, metrics finite, β = 0 loads no reference), crash + resume equals an
uninterrupted run, the NaN guard, the DAPO preset; vllm: weights reach the server every rollout."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

import polars as pl
import pytest
import torch
from safetensors.torch import load_file

from pipeline_lib.config import ConfigError, DAPOConfig, GRPOConfig, validate_config
from pipeline_lib.errors import AlignflowError
from pipeline_lib.model_dirs import ModelLoadError
from pipeline_lib.models import RewardModel, build_tiny_model, load_policy, load_tokenizer, sequence_logprobs
from pipeline_lib.rewards.registry import combined_reward
from pipeline_lib.sampling import Completion, SamplingError
from pipeline_lib.train import grpo as grpo_module
from pipeline_lib.train.common import CHECKPOINT_DIR, NonFiniteLossError, final_metrics
from pipeline_lib.train.data import write_run_file
from pipeline_lib.train.grpo import sample_groups, train_grpo
from pipeline_lib.train.rollout import (
    completions_batch,
    grouped_completions_batch,
    open_policy_sampler,
    rollout_seed,
)

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "data" / "demo"


class ScriptedSampler:
    """A `Sampler` whose samples are fixed per prompt; each text's length in tokens is its length in chars."""

    def __init__(self, script: dict[str, list[str]]):
        self.script = script
        self.calls: list[tuple[list[str], int | None]] = []

    def generate(self, prompts, *, n, max_new_tokens, temperature=1.0, top_p=1.0, seed=None, stop=(),
                 logprobs=False):
        self.calls.append((list(prompts), seed))
        return [[Completion(text=t, token_ids=[1] * len(t), finish_reason="stop") for t in self.script[p][:n]]
                for p in prompts]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A random tiny Llama over the demo's characters: its samples vary in length, so the overlong reward
    differs inside groups and every step has non-zero advantages."""
    return build_tiny_model(tmp_path_factory.mktemp("grpo") / "tiny", ["0123456789+="], hidden_size=64,
                            num_heads=2, intermediate_size=128)


@pytest.fixture(scope="module")
def problems() -> pl.DataFrame:
    return pl.read_ndjson(DEMO / "problems.jsonl").filter(pl.col("split") == "train").head(64)


def small_config(tiny: Path, **overrides) -> GRPOConfig:
    settings = dict(policy_path=str(tiny), max_steps=2, prompts_per_step=4, group_size=4, num_iterations=2,
                    lr=1e-3, max_new_tokens=6, device="cpu",
                    rewards=({"name": "verifier"}, {"name": "overlong", "max_len": 6, "cache_len": 4}))
    return GRPOConfig(**(settings | overrides))


# ---- rollouts and dynamic sampling


SCRIPT = {
    "1+1=": ["2", "2", "2", "2"],  # all correct: no signal
    "2+2=": ["4", "4", "5", "5"],  # 2 of 4
    "3+3=": ["7", "77", "777", "7777"],  # all wrong; the overlong shaping still makes the rewards differ
    "4+4=": ["8", "9", "9", "9"],  # 1 of 4
}
PROMPTS, ANSWERS = list(SCRIPT), ["2", "4", "6", "8"]


def scripted_config(**overrides) -> GRPOConfig:
    settings = dict(policy_path="unused", prompts_per_step=2, group_size=4, max_new_tokens=6, seed=3,
                    rewards=({"name": "verifier"}, {"name": "overlong", "max_len": 4, "cache_len": 2}))
    return GRPOConfig(**(settings | overrides))


def test_dynamic_sampling_keeps_informative_groups_by_raw_correctness_and_refills():
    """Round 0 draws prompts 0, 1 and keeps 1 (2/4 correct); round 1 draws 2, 3 and keeps 3 (1/4). Prompt 2
    is all wrong: its shaped rewards 0, 0, -0.5, -1 differ (lengths 1-4, L_max 4, L_cache 2) but it is dropped.
    Seen: 16 samples, 4 + 2 + 0 + 1 = 7 correct, overlong sum -1.5."""
    cfg = scripted_config(dynamic_sampling=True, max_refill_rounds=3)
    sampler = ScriptedSampler(SCRIPT)
    stream = iter([(0, [0, 1]), (1, [2, 3]), (2, [0, 1])])
    rollout = sample_groups(sampler, stream, PROMPTS, ANSWERS, combined_reward(cfg.rewards), cfg, step=5)

    assert rollout.groups_kept == 2 and rollout.data_step == 2
    assert rollout.prompts == ["2+2="] * 4 + ["4+4="] * 4
    assert [c.text for c in rollout.completions] == ["4", "4", "5", "5", "8", "9", "9", "9"]
    assert rollout.rewards == [1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    assert [seed for _, seed in sampler.calls] == [rollout_seed(3, 5, 0), rollout_seed(3, 5, 1)]
    m = rollout.metrics
    assert m["rollout/groups_filtered_frac"] == 0.5
    assert m["rollout/refill_rounds"] == 1.0
    assert m["rewards/accuracy"] == pytest.approx(7 / 16)
    assert m["rewards/overlong"] == pytest.approx(-1.5 / 16)
    assert m["rewards/mean"] == pytest.approx((7 - 1.5) / 16)
    assert m["completions/mean_length"] == pytest.approx((4 + 4 + 10 + 4) / 16)


def test_dynamic_sampling_reads_correctness_from_a_plus_minus_one_verifier():
    """DAPO's R = ±1 (verifier incorrect -1): the same groups are kept, wrong answers score -1."""
    cfg = scripted_config(dynamic_sampling=True, max_refill_rounds=3,
                          rewards=({"name": "verifier", "incorrect": -1.0},))
    stream = iter([(0, [0, 1]), (1, [2, 3]), (2, [0, 1])])
    rollout = sample_groups(ScriptedSampler(SCRIPT), stream, PROMPTS, ANSWERS, combined_reward(cfg.rewards), cfg,
                            step=5)
    assert rollout.prompts == ["2+2="] * 4 + ["4+4="] * 4
    assert rollout.rewards == [1.0, 1.0, -1.0, -1.0, 1.0, -1.0, -1.0, -1.0]
    assert rollout.metrics["rewards/accuracy"] == pytest.approx(7 / 16)


def test_dynamic_sampling_gives_up_after_max_refill_rounds():
    cfg = scripted_config(dynamic_sampling=True, max_refill_rounds=2)
    stream = iter([(k, [0]) for k in range(10)])  # prompt 0 is always all-correct
    with pytest.warns(RuntimeWarning, match=r"step 1: dynamic sampling found 0 of 2 groups with 0 < #correct < G "
                                            r"in 3 round\(s\); no update \(raise max_refill_rounds"):
        rollout = sample_groups(ScriptedSampler(SCRIPT), stream, PROMPTS, ANSWERS, combined_reward(cfg.rewards),
                                cfg, 0)
    assert rollout.groups_kept == 0 and rollout.completions == []
    assert rollout.data_step == 3  # 1 round + 2 refills drew 3 batches; the next step starts at the 4th
    assert rollout.metrics["rollout/refill_rounds"] == 2.0
    assert rollout.metrics["rollout/groups_filtered_frac"] == 1.0


def test_surplus_informative_groups_are_dropped_but_not_counted_as_filtered():
    cfg = scripted_config(dynamic_sampling=True, prompts_per_step=1)
    rollout = sample_groups(ScriptedSampler(SCRIPT), iter([(0, [0, 1, 3])]), PROMPTS, ANSWERS,
                            combined_reward(cfg.rewards), cfg, 0)
    assert rollout.groups_kept == 1 and rollout.prompts == ["2+2="] * 4
    assert rollout.metrics["rollout/groups_filtered_frac"] == pytest.approx(1 / 3)  # prompt 0 only


def test_dynamic_sampling_needs_the_verifier_among_the_rewards():
    for rewards in (({"name": "reward_model"},), ({"name": "reward_model"}, {"name": "verifier", "weight": 0})):
        with pytest.raises(ValueError, match="dynamic_sampling keeps the groups with 0 < #correct < G"):
            scripted_config(dynamic_sampling=True, rewards=rewards, reward_model_path="rm")


def test_without_dynamic_sampling_every_group_is_kept_in_one_round():
    cfg = scripted_config()
    rollout = sample_groups(ScriptedSampler(SCRIPT), iter([(7, [0, 2])]), PROMPTS, ANSWERS,
                            combined_reward(cfg.rewards), cfg, 0)
    assert rollout.groups_kept == 2 and rollout.data_step == 8
    assert rollout.rewards == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, -0.5, -1.0]
    assert rollout.metrics["rollout/groups_filtered_frac"] == 0.0


def test_completions_batch_left_pads_rows_and_masks_exactly_the_sampled_tokens(tiny):
    tokenizer = load_tokenizer(tiny)
    ids = tokenizer(["12+34=", "5+6="], add_special_tokens=True)["input_ids"]
    eos = tokenizer.eos_token_id
    completions = [Completion("46", [9, 10, eos], "stop"), Completion("1", [7], "length")]
    batch = completions_batch(tokenizer, ["12+34=", "5+6="], completions)
    pad = tokenizer.pad_token_id
    row0 = ids[0] + [9, 10, eos]  # 9 tokens: the widest row
    row1 = [pad] * (9 - len(ids[1]) - 1) + ids[1] + [7]
    assert batch.input_ids.tolist() == [row0, row1]
    assert batch.attention_mask.tolist() == [[1] * 9, [0] * 4 + [1] * 5]
    assert batch.completion_mask.tolist() == [[0] * 6 + [1] * 3, [0] * 8 + [1]]


def test_grouped_batch_stores_each_prompt_once_and_select_keeps_only_the_used_ones(tiny):
    tokenizer = load_tokenizer(tiny)
    ids = tokenizer(["12+34=", "5+6="], add_special_tokens=True)["input_ids"]
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    prompts = ["5+6=", "12+34=", "5+6="]
    completions = [Completion("1", [7], "length"), Completion("46", [9, 10, eos], "stop"),
                   Completion("11", [7, 7, eos], "stop")]
    batch = grouped_completions_batch(tokenizer, prompts, completions)
    short = [pad] * 2 + ids[1]  # "5+6=" left-padded to the 6 tokens of "12+34="
    assert batch.prompt_ids.tolist() == [short, ids[0]]  # first-seen order
    assert batch.prompt_mask.tolist() == [[0, 0, 1, 1, 1, 1], [1] * 6]
    assert batch.prompt_index.tolist() == [0, 1, 0]
    assert batch.completion_ids.tolist() == [[7, pad, pad], [9, 10, eos], [7, 7, eos]]
    assert batch.completion_mask.tolist() == [[1, 0, 0], [1, 1, 1], [1, 1, 1]]

    picked = batch.select(torch.tensor([2, 0]))  # both rows of "5+6=": one prompt left
    assert picked.prompt_ids.tolist() == [short] and picked.prompt_index.tolist() == [0, 0]
    assert picked.completion_ids.tolist() == [[7, 7, eos], [7, pad, pad]]


def test_grouped_logprobs_equal_the_full_rows(tiny):
    """The GRPO loop's shared-prompt log-probs are the per-token log-probs of the left-padded full rows."""
    tokenizer, policy = load_tokenizer(tiny), load_policy(tiny, device="cpu")
    prompts = ["12+34=", "12+34=", "5+6=", "5+6="]
    completions = [Completion("4", [9, 10], "length"), Completion("46", [9, 10, tokenizer.eos_token_id], "stop"),
                   Completion("1", [7], "length"), Completion("11", [7, 8], "length")]
    grouped = grouped_completions_batch(tokenizer, prompts, completions)
    full = completions_batch(tokenizer, prompts, completions)
    with torch.no_grad():
        shared = grouped.logprobs(policy)  # (4, 3)
        rows = sequence_logprobs(policy, full.input_ids, full.attention_mask, full.completion_mask)  # (4, T)
    torch.testing.assert_close(shared.sum(-1), rows.sum(-1), atol=1e-5, rtol=0)
    torch.testing.assert_close(shared[grouped.completion_mask.bool()], rows[full.completion_mask.bool()],
                               atol=1e-5, rtol=0)


# ---- the loop


def test_two_steps_change_the_weights_and_log_finite_metrics(tiny, problems, tmp_path, collect):
    logged, log = collect()
    final = train_grpo(small_config(tiny), problems, tmp_path / "out", log=log)

    assert [step for step, _ in logged] == [1, 2]
    for _, metrics in logged:
        assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
        for key in ("rewards/mean", "rewards/std", "rewards/accuracy", "rewards/overlong", "completions/mean_length",
                    "policy/clipfrac_low", "policy/clipfrac_high", "policy/approx_kl", "policy/kl_ref",
                    "policy/entropy", "rollout/groups_filtered_frac", "perf/tokens_per_s", "train/loss"):
            assert key in metrics, key
    before, after = load_file(str(tiny / "model.safetensors")), load_file(str(final / "model.safetensors"))
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert not (tmp_path / "out" / CHECKPOINT_DIR).exists()


def test_beta_zero_loads_no_reference_and_logs_no_reference_kl(tiny, problems, tmp_path, monkeypatch, collect):
    loads: list[str] = []

    def counting_load_policy(path, **kwargs):
        loads.append(str(path))
        return load_policy(path, **kwargs)

    monkeypatch.setattr(grpo_module, "load_policy", counting_load_policy)
    runs = {}
    for beta in (0.04, 0.0):
        loads.clear()
        logged, log = collect()
        train_grpo(small_config(tiny, beta=beta, max_steps=1, num_iterations=1), problems, tmp_path / str(beta),
                   log=log)
        runs[beta] = (len(loads), logged[0][1])
    assert runs[0.04][0] == 2 and runs[0.0][0] == 1  # the policy, plus the reference only when β > 0
    assert "policy/kl_ref" not in runs[0.0][1]
    assert runs[0.04][1]["policy/kl_ref"] == pytest.approx(0.0, abs=1e-6)  # one update, taken at π = π_ref


def test_every_log_prob_pass_uses_the_rollout_temperature(tiny, problems, tmp_path, monkeypatch):
    """θ, θ_old and the reference divide the logits by the sampling temperature, as TRL and verl do."""
    from pipeline_lib.train import rollout as rollout_module

    temperatures: list[float] = []
    real = rollout_module.shared_prompt_logprobs

    def recording(*args, temperature=1.0, **kwargs):
        temperatures.append(temperature)
        return real(*args, temperature=temperature, **kwargs)

    monkeypatch.setattr(rollout_module, "shared_prompt_logprobs", recording)
    train_grpo(small_config(tiny, temperature=0.7, max_steps=1, mini_batch_size=8), problems, tmp_path / "out")
    # reference and θ_old: 2 chunks of 8 rows each; θ: 2 iterations x 2 mini-batches
    assert temperatures == [0.7] * 8


def test_rewards_can_mix_a_reward_model_with_the_verifier(tiny, problems, tmp_path, collect):
    """rewards = 0.5·RM + verifier: each logged component is its own batch mean, the total their weighted sum."""
    reward_model = RewardModel.from_policy(tiny, device="cpu", seed=1).save_pretrained(tmp_path / "rm",
                                                                                       load_tokenizer(tiny))
    cfg = small_config(tiny, max_steps=1, reward_model_path=str(reward_model),
                       rewards=({"name": "reward_model", "weight": 0.5}, {"name": "verifier"}))
    logged, log = collect()
    train_grpo(cfg, problems, tmp_path / "out", log=log)
    metrics = logged[0][1]
    assert metrics["rewards/reward_model"] != 0.0
    assert metrics["rewards/mean"] == pytest.approx(0.5 * metrics["rewards/reward_model"] + metrics["rewards/verifier"])


def dapo_config(tiny: Path, **overrides) -> DAPOConfig:
    settings = dict(policy_path=str(tiny), max_steps=2, prompts_per_step=4, group_size=4, lr=1e-3, max_new_tokens=6,
                    mini_batch_size=8, warmup_steps=0, device="cpu",
                    rewards=({"name": "verifier"}, {"name": "overlong", "max_len": 6, "cache_len": 4}))
    return DAPOConfig(**(settings | overrides))


def test_dapo_preset_runs_the_same_loop_with_its_loss(tiny, problems, tmp_path, collect):
    """DAPO's loss through LOSSES (clip-higher, no reference KL), two mini-batches per rollout."""
    logged, log = collect()
    final = train_grpo(dapo_config(tiny, dynamic_sampling=False), problems, tmp_path / "dapo", log=log)
    assert "policy/kl_ref" not in logged[0][1] and "policy/clipfrac_high" in logged[0][1]
    assert final_metrics(final)["train/updates"] == 4  # 2 steps x 16 rows in mini-batches of 8
    assert [metrics["train/updates"] for _, metrics in logged] == [2, 4]  # the running count reaches the tracker
    before, after = load_file(str(tiny / "model.safetensors")), load_file(str(final / "model.safetensors"))
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_dapo_with_a_kl_term_loads_the_reference_and_logs_the_kl(tiny, problems, tmp_path, collect):
    """DAPO has no KL by default; beta > 0 adds GRPO's k3 term: the reference is loaded and the KL logged (0 on the
    first update, taken at π = π_ref)."""
    logged, log = collect()
    train_grpo(dapo_config(tiny, dynamic_sampling=False, max_steps=1, mini_batch_size=None, beta=0.04), problems,
               tmp_path / "kl", log=log)
    assert logged[0][1]["policy/kl_ref"] == pytest.approx(0.0, abs=1e-6) and "policy/clipfrac_high" in logged[0][1]


def test_dr_grpo_runs_the_grpo_loop_and_needs_unscaled_rewards(tiny, problems, tmp_path, collect):
    """loss dr_grpo through LOSSES with the KL to the reference; scale_rewards true is refused at load time."""
    logged, log = collect()
    final = train_grpo(small_config(tiny, max_steps=1, loss="dr_grpo", scale_rewards=False), problems,
                       tmp_path / "dr", log=log)
    assert "policy/kl_ref" in logged[0][1] and math.isfinite(logged[0][1]["train/loss"])
    before, after = load_file(str(tiny / "model.safetensors")), load_file(str(final / "model.safetensors"))
    assert any(not torch.equal(before[k], after[k]) for k in before)
    with pytest.raises(ConfigError, match="loss 'dr_grpo' centres the rewards without dividing by their std: "
                                          "scale_rewards must be false"):
        validate_config(GRPOConfig, {"policy_path": "m", "loss": "dr_grpo"})


def test_dapo_step_without_an_informative_group_updates_nothing(tiny, problems, tmp_path, collect):
    """The random model never answers correctly: every group is filtered, the refills run out, no update; a run
    without any update says so at its end and in its final metrics."""
    logged, log = collect()
    with pytest.warns(RuntimeWarning, match=r"dapo: no step of 1 kept a group with 0 < #correct < G, so the final "
                                            r"model is the start policy \(it solves every problem or none"):
        final = train_grpo(dapo_config(tiny, max_steps=1, max_refill_rounds=1), problems, tmp_path / "dapo", log=log)
    assert final_metrics(final)["train/updates"] == 0
    metrics = logged[0][1]
    assert metrics["train/updates"] == 0
    assert metrics["rollout/groups_filtered_frac"] == 1.0 and metrics["rollout/refill_rounds"] == 1.0
    assert "train/loss" not in metrics
    before, after = load_file(str(tiny / "model.safetensors")), load_file(str(final / "model.safetensors"))
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_grpo_without_a_reward_difference_in_any_group_warns_that_the_policy_is_unchanged(tiny, problems, tmp_path,
                                                                                        collect):
    """The random model never answers correctly and the verifier is the only reward: every group's rewards are
    equal, every advantage is 0. The steps still make their updates, with the KL term (β = 0.04), but the weights
    stay the start ones, and the run says so at its end; rewards that differ inside a group (overlong shaping) do not
    warn."""
    verifier_only = ({"name": "verifier"},)
    logged, log = collect()
    with pytest.warns(RuntimeWarning, match=r"grpo: no step of 2 had a group whose rewards differ, so every advantage "
                                            r"was 0 and the policy gradient zero throughout: the final model is the "
                                            r"start policy \(it solves every problem or none"):
        final = train_grpo(small_config(tiny, num_iterations=1, rewards=verifier_only), problems, tmp_path / "grpo",
                           log=log)
    assert final_metrics(final)["train/updates"] == 2  # updates were made: the warning is about what they carried
    assert [metrics["rewards/std"] for _, metrics in logged] == [0.0, 0.0]
    before, after = load_file(str(tiny / "model.safetensors")), load_file(str(final / "model.safetensors"))
    assert all(torch.equal(before[k], after[k]) for k in before)

    with pytest.warns(RuntimeWarning, match=r"the final model is the start policy but for weight decay \("):
        train_grpo(small_config(tiny, max_steps=1, num_iterations=1, rewards=verifier_only, weight_decay=0.1),
                   problems, tmp_path / "decay")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_grpo(small_config(tiny, max_steps=1, num_iterations=1), problems, tmp_path / "shaped")
    assert not [w for w in caught if "had a group whose rewards differ" in str(w.message)]


def test_all_zero_advantages_leave_the_policy_unchanged_over_several_mini_batches(tiny, tmp_path, monkeypatch,
                                                                                 collect):
    """4 prompts of other lengths x G = 4 completions of other lengths, none correct: every advantage is 0, and
    4 mini-batches of 4 rows make 8 updates with the KL term (β = 0.04). The reference's log-probs were computed
    over 4 consecutive rows, the policy's over 4 drawn ones: ~1e-7 apart, a KL gradient of noise that Adam made
    into steps (here KL 0.024 at step 1; a helper's run on the demo's SFT model: KL 141 at step 1).
    Now they come from the same mini-batches, and the policy stays the start one, bit for bit."""
    script = {"1+2=": ["7", "77", "777", "7777"], "123+45=": ["8", "888888", "88", "8888"],
              "12345+6789=": ["9999", "9", "99999", "99"], "9+87654321=": ["55", "5", "555555", "5555"]}
    tokenizer = load_tokenizer(tiny)

    class Sampler:
        def generate(self, prompts, *, n, **kwargs):
            return [[Completion(t, tokenizer(t)["input_ids"], "stop") for t in script[p][:n]] for p in prompts]

    @contextmanager
    def scripted_sampler(*args, **kwargs):
        yield Sampler(), lambda: 0.0

    monkeypatch.setattr(grpo_module, "open_policy_sampler", scripted_sampler)
    unsolved = pl.DataFrame({"prompt": list(script), "answer": ["-1"] * 4})
    logged, log = collect()
    with pytest.warns(RuntimeWarning, match=r"the final model is the start policy \("):
        final = train_grpo(small_config(tiny, mini_batch_size=4, rewards=({"name": "verifier"},)), unsolved,
                           tmp_path / "grpo", log=log)
    assert final_metrics(final)["train/updates"] == 16
    assert [metrics["policy/kl_ref"] for _, metrics in logged] == [0.0, 0.0]
    before, after = load_file(str(tiny / "model.safetensors")), load_file(str(final / "model.safetensors"))
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_the_learning_rate_schedule_follows_training_steps_not_updates(tiny, problems, tmp_path, collect):
    """Steps whose groups are all filtered make no update; the linear schedule still ends on time."""
    logged, log = collect()
    cfg = dapo_config(tiny, max_steps=3, max_refill_rounds=0, lr=1e-3, lr_schedule="linear", warmup_steps=0)
    train_grpo(cfg, problems, tmp_path / "dapo", log=log)
    assert [metrics["train/lr"] for _, metrics in logged] == pytest.approx([1e-3, 2e-3 / 3, 1e-3 / 3])


@pytest.mark.parametrize(("mini_batch_size", "rows_per_update"), [(4, [4, 3, 3]), (6, [5, 5]), (12, [10])])
def test_a_step_short_of_groups_splits_its_rows_without_a_short_last_update(tiny, tmp_path, monkeypatch,
                                                                           mini_batch_size, rows_per_update):
    """6 prompts x G = 2, no refill: "1+1=" is all correct, so dynamic sampling keeps 5 groups, 10 rows. They make
    ceil(10 / mini_batch_size) nearly equal updates per iteration, none over mini_batch_size rows: 4 + 3 + 3 (not
    4 + 4 + 2) and 5 + 5 (not 6 + 4)."""
    script = {"1+1=": ["2", "2"]} | {f"{a}+{a}=": [str(2 * a), "0"] for a in range(2, 7)}
    problems = pl.DataFrame({"prompt": list(script), "answer": [str(2 * a) for a in range(1, 7)]})

    @contextmanager
    def scripted_sampler(*args, **kwargs):
        yield ScriptedSampler(script), lambda: 0.0

    sizes: list[int] = []
    dapo_loss = grpo_module.LOSSES["dapo"]

    def recording_loss(**kwargs):
        sizes.append(len(kwargs["advantages"]))  # one loss per optimizer update
        return dapo_loss(**kwargs)

    monkeypatch.setattr(grpo_module, "open_policy_sampler", scripted_sampler)
    monkeypatch.setitem(grpo_module.LOSSES, "dapo", recording_loss)
    cfg = dapo_config(tiny, max_steps=1, prompts_per_step=6, group_size=2, mini_batch_size=mini_batch_size,
                      num_iterations=2, max_refill_rounds=0)
    with pytest.warns(RuntimeWarning, match="dynamic sampling found 5 of 6 groups"):
        train_grpo(cfg, problems, tmp_path / "out")
    n = len(rows_per_update)  # the same split in each of the 2 iterations, its mini-batches in a new order
    assert len(sizes) == 2 * n and sorted(sizes[:n]) == sorted(sizes[n:]) == sorted(rows_per_update)


def test_dapo_preset_has_the_papers_settings_and_configs_reject_mixed_ones():
    dapo = DAPOConfig(policy_path="m")
    assert (dapo.loss, dapo.beta, dapo.clip_eps_low, dapo.clip_eps_high, dapo.dynamic_sampling) == \
        ("dapo", 0.0, 0.2, 0.28, True)
    assert {"name": "overlong", "weight": 1.0, "max_len": 20480, "cache_len": 4096} in dapo.rewards
    assert {"name": "verifier", "weight": 1.0, "incorrect": -1.0} in dapo.rewards  # R = ±1 (DAPO §2.4)
    assert isinstance(dapo, GRPOConfig)
    grpo = GRPOConfig(policy_path="m")
    assert (grpo.loss, grpo.beta, grpo.group_size, grpo.clip_eps_high, grpo.dynamic_sampling) == \
        ("grpo", 0.04, 64, 0.2, False)
    with pytest.raises(ConfigError, match="clip_eps_high must equal clip_eps_low"):
        validate_config(GRPOConfig, {"policy_path": "m", "clip_eps_high": 0.28})
    assert validate_config(DAPOConfig, {"policy_path": "m", "beta": 0.04}).beta == 0.04  # no KL by default only
    assert validate_config(GRPOConfig, {"policy_path": "m", "loss": "dapo", "clip_eps_high": 0.28}).beta == 0.0
    assert validate_config(GRPOConfig, {"policy_path": "m", "loss": "dapo", "beta": 0.01}).beta == 0.01
    with pytest.raises(ConfigError, match="reward_model_path is not set"):
        validate_config(GRPOConfig, {"policy_path": "m", "rewards": [{"name": "reward_model"}]})
    with pytest.raises(ConfigError, match="max_len 20480 exceeds max_new_tokens 6"):
        validate_config(DAPOConfig, {"policy_path": "m", "max_new_tokens": 6})


def test_crash_then_resume_ends_with_the_weights_of_an_uninterrupted_run(one_thread, tiny, problems, tmp_path, collect):
    cfg = small_config(tiny, max_steps=3, save_every=1)
    full_log, log = collect()
    uninterrupted = train_grpo(cfg, problems, tmp_path / "a", log=log)

    def crash_at_step_2(metrics, step):
        if step == 2:
            raise KeyboardInterrupt("killed")  # after step 1's checkpoint, before step 2's

    with pytest.raises(KeyboardInterrupt):
        train_grpo(cfg, problems, tmp_path / "b", log=crash_at_step_2)
    assert json.loads((tmp_path / "b" / CHECKPOINT_DIR / "trainer_state.json").read_text())["step"] == 1
    resumed_log, log = collect()
    resumed = train_grpo(cfg, problems, tmp_path / "b", log=log)

    assert [step for step, _ in resumed_log] == [2, 3]
    for (_, a), (_, b) in zip(full_log[1:], resumed_log, strict=True):
        assert a["train/loss"] == b["train/loss"] and a["rewards/mean"] == b["rewards/mean"]
    a, b = load_file(str(uninterrupted / "model.safetensors")), load_file(str(resumed / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    # the update count survives the resume: 3 steps x num_iterations 2 x one mini-batch
    assert final_metrics(uninterrupted)["train/updates"] == final_metrics(resumed)["train/updates"] == 6


def test_nan_loss_stops_with_the_step_and_no_final_model(tiny, problems, tmp_path):
    """lr 1e30: the first update moves every weight by ~1e30, so the second pass over the rollout is not finite."""
    cfg = small_config(tiny, lr=1e30, max_grad_norm=None)
    with pytest.raises(NonFiniteLossError, match=r"train/loss is (nan|inf) at step 1; stopping"):
        train_grpo(cfg, problems, tmp_path / "out")
    assert not (tmp_path / "out" / "final").exists()


def test_a_rollout_from_diverged_weights_is_a_one_line_error_and_no_final_model(tiny, problems, tmp_path):
    """One pass per rollout: the step-1 update (lr 1e30) leaves weights whose logits are inf/NaN, and the
    step-2 rollout samples from them; the sampler says so in one line instead of torch.multinomial's traceback."""
    cfg = small_config(tiny, lr=1e30, max_grad_norm=None, num_iterations=1)
    with pytest.raises(SamplingError, match=r"logits (are not finite|became inf or NaN).*diverged or are damaged$"):
        train_grpo(cfg, problems, tmp_path / "out")
    assert not (tmp_path / "out" / "final").exists()


@pytest.mark.slow
def test_sigkilled_run_resumes_to_the_uninterrupted_weights(tiny, problems, tmp_path):
    """`python -m pipeline_lib.train.grpo --config run.json` killed with SIGKILL once a checkpoint exists, then
    rerun from the same run file, ends with the weights of an uninterrupted run of the same file."""
    cfg = small_config(tiny, max_steps=8, save_every=1)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}

    def command(name: str) -> list[str]:
        run_file = write_run_file(tmp_path / f"{name}.json", cfg, {"problems": problems}, tmp_path / name)
        return [sys.executable, "-m", "pipeline_lib.train.grpo", "--config", str(run_file)]

    full = subprocess.Popen(command("full"), cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    victim = subprocess.Popen(command("killed"), cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    state = tmp_path / "killed" / CHECKPOINT_DIR / "trainer_state.json"
    deadline = time.monotonic() + 300
    while not state.exists() and victim.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    victim.send_signal(signal.SIGKILL)
    assert victim.wait() == -signal.SIGKILL, "the run ended before it could be killed mid-way"
    assert not (tmp_path / "killed" / "final").exists()
    rerun = subprocess.run(command("killed"), cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    resumed_steps = [int(line.split()[1]) for line in rerun.stdout.splitlines() if line.startswith("step ")]
    assert resumed_steps[0] > 1 and resumed_steps[-1] == 8, "the rerun did not start from a checkpoint"
    _, errors = full.communicate(timeout=300)
    assert full.returncode == 0, errors.decode()[-2000:]
    a = load_file(str(tmp_path / "full" / "final" / "model.safetensors"))
    b = load_file(str(tmp_path / "killed" / "final" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


# ---- vLLM backend (its own venv; `make vllm-env`)


def _vllm_or_skip() -> None:
    from pipeline_lib.sampling.vllm import find_vllm_python

    if find_vllm_python() is None:
        pytest.skip("no vLLM environment (make vllm-env)")


@pytest.mark.vllm
def test_vllm_sampler_serves_the_policy_weights_after_each_sync(tiny, tmp_path):
    """Swapping two rows of the output layer swaps those tokens' logits, so greedy decoding must switch from
    its first token t0 to the other one t1 — once the new weights have been pushed, and not before."""
    _vllm_or_skip()
    tokenizer, policy = load_tokenizer(tiny), load_policy(tiny, device="cpu")
    with open_policy_sampler("vllm", policy, tokenizer, sync_dir=tmp_path / "sync") as (sampler, sync):
        before = sampler.generate(["12+34="], n=1, max_new_tokens=3, temperature=0)[0][0].token_ids
        t0 = before[0]
        t1 = next(t for t in range(3, len(tokenizer)) if t != t0)
        with torch.no_grad():
            head = policy.get_output_embeddings().weight
            head[[t0, t1]] = head[[t1, t0]].clone()
        stale = sampler.generate(["12+34="], n=1, max_new_tokens=3, temperature=0)[0][0].token_ids
        assert sync() > 0
        after = sampler.generate(["12+34="], n=1, max_new_tokens=3, temperature=0)[0][0].token_ids
    assert stale == before
    assert after[0] == t1


@pytest.mark.vllm
def test_two_grpo_steps_with_the_vllm_backend(tiny, problems, tmp_path, collect):
    _vllm_or_skip()
    logged, log = collect()
    final = train_grpo(small_config(tiny, backend="vllm"), problems, tmp_path / "out", log=log)
    assert [step for step, _ in logged] == [1, 2]
    assert all(metrics["perf/weight_sync_seconds"] > 0 for _, metrics in logged)
    assert all(metrics["completions/mean_length"] > 0 for _, metrics in logged)
    before, after = load_file(str(tiny / "model.safetensors")), load_file(str(final / "model.safetensors"))
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert not (tmp_path / "out" / "vllm_sync").exists()


def test_a_prompt_longer_than_the_context_is_refused_before_step_1(tiny, problems, tmp_path):
    long = pl.DataFrame({"prompt": ["1" * 251], "answer": ["1"]})
    data = pl.concat([problems.select("prompt", pl.col("answer").cast(pl.Utf8)), long])
    with pytest.raises(AlignflowError, match=rf"^grpo: 1 of {data.height} prompts do not fit the context: "
                                             rf"prompts\[{data.height - 1}\] \('1{{40}}\.\.\.'\) has 251 tokens \+ "
                                             r"max_new_tokens 6 > 256; lower max_new_tokens to 5 or leave them out "
                                             r"of the data$"):
        train_grpo(small_config(tiny), data, tmp_path / "out")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    # DAPO's line names its stage; a prompt that fills the context alone leaves no max_new_tokens to lower
    data = data.with_columns(pl.when(pl.col("prompt") == "1" * 251).then(pl.lit("1" * 256)).otherwise("prompt")
                             .alias("prompt"))
    with pytest.raises(AlignflowError, match=rf"^dapo: 1 of {data.height} prompts do not fit the context: "
                                             r".* has 256 tokens \+ max_new_tokens 6 > 256; leave them out of the "
                                             r"data \(the longest has 256 tokens\)$"):
        train_grpo(dapo_config(tiny), data, tmp_path / "out")


def test_a_policy_and_reward_model_with_their_own_code_train_only_with_trust_remote_code(tiny, reward_model, problems,
                                                                                         tmp_path, remote_code_copy):
    """The policy and the reward model scoring its rollouts load through their dirs' own code: refused in one line,
    the code never run, unless the config sets trust_remote_code."""
    policy, policy_ran = remote_code_copy(tiny, tmp_path / "policy")
    rm, rm_ran = remote_code_copy(reward_model, tmp_path / "rm-remote")
    cfg = small_config(policy, max_steps=1, reward_model_path=str(rm), rewards=({"name": "reward_model"},))
    with pytest.raises(ModelLoadError, match="contains custom code") as refused:
        train_grpo(cfg, problems, tmp_path / "refused")
    assert "\n" not in str(refused.value) and not policy_ran.exists() and not rm_ran.exists()
    assert train_grpo(cfg.model_copy(update={"trust_remote_code": True}), problems, tmp_path / "trusted").is_dir()
    assert policy_ran.exists() and rm_ran.exists()
