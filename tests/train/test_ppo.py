"""PPO loop: the critic's values line up with the tokens they score, the adaptive KL controller (hand-computed),
2-step runs (actor and critic change, KL 0 at the first rollout, metrics finite), crash + resume equals an
uninterrupted run (adaptive β included), the NaN guard."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import polars as pl
import pytest
import torch
from safetensors.torch import load_file

from pipeline_lib.config import PPOConfig
from pipeline_lib.errors import AlignflowError
from pipeline_lib.model_dirs import ModelLoadError
from pipeline_lib.models import RewardModel, ValueModel, build_tiny_model, load_tokenizer
from pipeline_lib.sampling import SamplingError
from pipeline_lib.store.db import open_store
from pipeline_lib.store.ingest import ingest_file
from pipeline_lib.train.common import CHECKPOINT_DIR, NonFiniteLossError
from pipeline_lib.train.ppo import adapt_kl_coef, load_ppo_data, state_values, train_ppo

DEMO = Path(__file__).resolve().parents[2] / "data" / "demo"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("ppo") / "tiny", ["0123456789+="], hidden_size=64,
                            num_heads=2, intermediate_size=128)


@pytest.fixture(scope="module")
def problems() -> pl.DataFrame:
    return pl.read_ndjson(DEMO / "problems.jsonl").filter(pl.col("split") == "train").head(64)


def small_config(tiny: Path, reward_model: Path, **overrides) -> PPOConfig:
    settings = dict(policy_path=str(tiny), reward_model_path=str(reward_model), max_steps=2, prompts_per_step=8,
                    mini_batch_size=4, ppo_epochs=2, lr=1e-3, critic_lr=1e-3, max_new_tokens=6, kl_coef=0.05,
                    device="cpu")
    return PPOConfig(**(settings | overrides))


def test_state_values_are_the_critics_values_of_the_prefix_before_each_token(tiny):
    """V(s_t) for token t must see tokens < t only: equal to the critic's last value on the cut prefix."""
    critic = ValueModel.from_policy(tiny, device="cpu")
    torch.nn.init.normal_(critic.head.weight, std=0.5, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([[9, 10, 11, 12, 13, 14]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        values = state_values(critic, ids, mask)  # (1, 6)
        for t in range(1, 6):
            prefix_value = critic(ids[:, :t], mask[:, :t])[0, -1]
            assert values[0, t] == pytest.approx(float(prefix_value), abs=1e-5)
    assert values[0, 0] == 0.0  # no state before the first token


def test_adaptive_kl_controller_moves_beta_proportionally_and_clips_the_error():
    """β·(1 + clip(KL/target - 1, ±0.2)·n/horizon): KL 6.6 vs 6 -> error 0.1 -> 0.1·(1 + 0.1·10/100) = 0.101;
    KL 30 -> error clipped to 0.2 -> 0.102; KL 0 -> -0.2 -> 0.098."""
    assert adapt_kl_coef(0.1, 6.6, target=6.0, horizon=100, n_samples=10) == pytest.approx(0.101)
    assert adapt_kl_coef(0.1, 30.0, target=6.0, horizon=100, n_samples=10) == pytest.approx(0.102)
    assert adapt_kl_coef(0.1, 0.0, target=6.0, horizon=100, n_samples=10) == pytest.approx(0.098)


def test_two_steps_change_actor_and_log_finite_metrics(tiny, reward_model, problems, tmp_path, collect):
    logged, log = collect()
    final = train_ppo(small_config(tiny, reward_model), problems, tmp_path / "out", log=log)

    assert [step for step, _ in logged] == [1, 2]
    for _, metrics in logged:
        assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
        for key in ("objective/kl", "objective/kl_k3", "objective/kl_coef", "rewards/mean", "rewards/accuracy",
                    "value/loss", "value/clipfrac", "policy/clipfrac", "policy/approx_kl", "policy/entropy",
                    "completions/mean_length", "perf/tokens_per_s"):
            assert key in metrics, key
    first = logged[0][1]
    assert first["objective/kl"] == 0.0 and first["objective/kl_k3"] == 0.0  # θ_old = π_ref at the first rollout
    assert first["objective/kl_coef"] == logged[1][1]["objective/kl_coef"] == 0.05  # fixed β
    before, after = load_file(str(tiny / "model.safetensors")), load_file(str(final / "model.safetensors"))
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert not (tmp_path / "out" / CHECKPOINT_DIR).exists()


def test_every_log_prob_pass_uses_the_rollout_temperature(tiny, reward_model, problems, tmp_path, monkeypatch):
    """The actor, θ_old and the reference divide the logits by the sampling temperature, as TRL does."""
    from pipeline_lib.train import ppo as ppo_module
    from pipeline_lib.train import rollout as rollout_module

    temperatures: list[float] = []
    real = rollout_module.sequence_logprobs

    def recording(*args, temperature=1.0, **kwargs):
        temperatures.append(temperature)
        return real(*args, temperature=temperature, **kwargs)

    for module in (ppo_module, rollout_module):
        monkeypatch.setattr(module, "sequence_logprobs", recording)
    train_ppo(small_config(tiny, reward_model, temperature=1.5, max_steps=1), problems, tmp_path / "out")
    assert len(temperatures) >= 3 and set(temperatures) == {1.5}


def test_rewards_mix_the_reward_model_with_the_verifier_or_use_the_verifier_alone(tiny, reward_model, problems,
                                                                                   tmp_path, collect):
    """rewards = 0.5·RM + verifier: each component is logged, rewards/mean is their weighted sum; the verifier
    alone needs no reward model at all (critic from the policy), and its mean is the rollout accuracy."""
    logged, log = collect()
    mixed = [{"name": "reward_model", "weight": 0.5}, {"name": "verifier", "weight": 1.0}]
    train_ppo(small_config(tiny, reward_model, max_steps=1, rewards=mixed), problems, tmp_path / "mixed", log=log)
    metrics = logged[0][1]
    assert metrics["rewards/mean"] == pytest.approx(0.5 * metrics["rewards/reward_model"] + metrics["rewards/verifier"],
                                                    abs=1e-5)
    assert metrics["rewards/verifier"] == metrics["rewards/accuracy"]

    logged, log = collect()
    cfg = small_config(tiny, reward_model, max_steps=1, rewards=[{"name": "verifier"}], critic_init="policy")
    train_ppo(cfg.model_copy(update={"reward_model_path": None}), problems, tmp_path / "verifier", log=log)
    assert logged[0][1]["rewards/mean"] == logged[0][1]["rewards/accuracy"]
    assert "rewards/reward_model" not in logged[0][1]


def test_ppo_without_any_advantage_warns_that_the_actor_is_unchanged(tiny, reward_model, tmp_path, collect):
    """No sample is correct and the verifier is the only reward; the critic starts at 0 (critic_init policy) and the
    actor is its reference: every advantage is 0 at every step, the actor comes out as it went in, and the run
    says so (it exited 0 in silence, GRPO warning in the same case)."""
    unsolved = pl.DataFrame({"prompt": ["1+2=", "123+45=", "12+3=", "9+8="] * 2, "answer": ["-1"] * 8})
    cfg = small_config(tiny, reward_model, rewards=[{"name": "verifier"}], critic_init="policy") \
        .model_copy(update={"reward_model_path": None})
    logged, log = collect()
    with pytest.warns(RuntimeWarning, match=r"ppo: every advantage of the 2 steps was 0 \(no reward, KL penalty or "
                                            r"value told the samples apart\), so the actor's gradient was zero "
                                            r"throughout: the final model is the start policy \(check"):
        final = train_ppo(cfg, unsolved, tmp_path / "ppo", log=log)
    assert [metrics["rewards/mean"] for _, metrics in logged] == [0.0, 0.0]
    before, after = load_file(str(tiny / "model.safetensors")), load_file(str(final / "model.safetensors"))
    assert all(torch.equal(before[k], after[k]) for k in before)
    with warnings.catch_warnings(record=True) as caught:  # advantages from the reward model: no warning
        warnings.simplefilter("always")
        train_ppo(small_config(tiny, reward_model, max_steps=1), unsolved, tmp_path / "rm")
    assert not [w for w in caught if "every advantage" in str(w.message)]


def test_reward_settings_fail_fast(tiny, reward_model, problems, tmp_path):
    with pytest.raises(ValueError, match="critic_init 'reward_model' needs reward_model_path"):
        PPOConfig(policy_path=str(tiny), rewards=[{"name": "verifier"}])
    with pytest.raises(ValueError, match="rewards name 'reward_model' but reward_model_path is not set"):
        PPOConfig(policy_path=str(tiny), critic_init="policy")
    cfg = small_config(tiny, reward_model, rewards=[{"name": "verifier"}])
    with pytest.raises(AlignflowError, match="rewards name 'verifier' but the prompts have no answers"):
        train_ppo(cfg, problems.drop("answer"), tmp_path / "out")
    # a conversation and plain prompts (pairs of several sources): one would lose the bos the other's template has
    turn = json.dumps([{"role": "user", "content": "1+1="}])
    mixed = problems.select("prompt").with_columns(
        pl.Series("prompt_messages", [turn] + [None] * (problems.height - 1), dtype=pl.String))
    with pytest.raises(AlignflowError, match=r"ppo: the prompts mix conversations \(1, chat template\) and plain "
                                             r"texts \(63\); set chat_template: true"):
        train_ppo(small_config(tiny, reward_model), mixed, tmp_path / "mixed")


def test_adaptive_kl_updates_beta_from_each_rollouts_kl(tiny, reward_model, problems, tmp_path, collect):
    """Step 1's KL is 0, so β_2 = 0.05·(1 - 0.2·8/40) = 0.048; β_3 follows from step 2's logged KL."""
    cfg = small_config(tiny, reward_model, max_steps=3, adaptive_kl=True, kl_target=0.5, kl_horizon=40)
    logged, log = collect()
    train_ppo(cfg, problems, tmp_path / "out", log=log)
    coefs = [metrics["objective/kl_coef"] for _, metrics in logged]
    assert coefs[0] == 0.05
    assert coefs[1] == pytest.approx(0.048)
    kl_2 = logged[1][1]["objective/kl"]
    assert coefs[2] == pytest.approx(adapt_kl_coef(0.048, kl_2, target=0.5, horizon=40, n_samples=8))


def test_crash_then_resume_ends_with_the_weights_of_an_uninterrupted_run(one_thread, tiny, reward_model, problems,
                                                                          tmp_path, collect):
    cfg = small_config(tiny, reward_model, max_steps=3, save_every=1, adaptive_kl=True, kl_target=0.5,
                       kl_horizon=40)
    full_log, log = collect()
    uninterrupted = train_ppo(cfg, problems, tmp_path / "a", log=log)

    def crash_at_step_3(metrics, step):
        if step == 3:
            raise KeyboardInterrupt("killed")  # after step 2's checkpoint

    with pytest.raises(KeyboardInterrupt):
        train_ppo(cfg, problems, tmp_path / "b", log=crash_at_step_3)
    resumed_log, log = collect()
    resumed = train_ppo(cfg, problems, tmp_path / "b", log=log)

    assert [step for step, _ in resumed_log] == [3]
    assert resumed_log[0][1]["objective/kl_coef"] == full_log[2][1]["objective/kl_coef"]  # β restored
    assert resumed_log[0][1]["train/loss"] == full_log[2][1]["train/loss"]
    a, b = load_file(str(uninterrupted / "model.safetensors")), load_file(str(resumed / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_nan_loss_stops_with_the_step_and_no_final_model(tiny, reward_model, problems, tmp_path):
    cfg = small_config(tiny, reward_model, lr=1e30, critic_lr=1e30, max_grad_norm=None)
    with pytest.raises(NonFiniteLossError, match=r"train/loss is (nan|inf) at step 1; stopping"):
        train_ppo(cfg, problems, tmp_path / "out")
    assert not (tmp_path / "out" / "final").exists()


def test_a_rollout_from_diverged_weights_is_a_one_line_error_and_no_final_model(tiny, reward_model, problems,
                                                                               tmp_path):
    """One update per rollout: the step-1 update (lr 1e30) leaves an actor whose logits are inf/NaN, and the
    step-2 rollout samples from it; the sampler says so in one line."""
    cfg = small_config(tiny, reward_model, lr=1e30, critic_lr=1e30, max_grad_norm=None, ppo_epochs=1,
                       mini_batch_size=8)
    with pytest.raises(SamplingError, match=r"logits (are not finite|became inf or NaN).*diverged or are damaged$"):
        train_ppo(cfg, problems, tmp_path / "out")
    assert not (tmp_path / "out" / "final").exists()


def test_a_prompt_longer_than_the_context_is_refused_before_step_1(tiny, reward_model, problems, tmp_path):
    """The sampler would refuse it only when its batch came up (after steps were trained), and a seeded resume
    would draw that batch again: every prompt is measured first."""
    long = pl.DataFrame({"prompt": ["1" * 300], "answer": ["1"]})
    data = pl.concat([problems.select("prompt", pl.col("answer").cast(pl.Utf8)), long])
    with pytest.raises(AlignflowError, match=r"^ppo: 1 of 65 prompts do not fit the context: prompts\[64\] "
                                             r"\('1{40}\.\.\.'\) has 300 tokens \+ max_new_tokens 6 > 256; leave "
                                             r"them out of the data \(the longest has 300 tokens\)$"):
        train_ppo(small_config(tiny, reward_model), data, tmp_path / "out")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_a_rollout_past_a_reward_model_critics_positions_is_refused_before_step_1_naming_them(
        tiny, short_positions, problems, tmp_path, capsys):
    """The policy holds 256 positions, a reward model on GPT-2 16 learned ones: its critic (critic_init reward_model)
    reads every rollout whole, and crashed with IndexError in `state_values` at step 1. The fewest positions of the
    policy and the critic bound prompt + max_new_tokens, named in the one-line error. The reward model alone needs no
    bound: its scorer reads a longer text's last 16 tokens, with a note, so with critic_init policy the run trains."""
    rm_dir = RewardModel.from_policy(short_positions["gpt2"], device="cpu", seed=1).save_pretrained(
        tmp_path / "rm", load_tokenizer(tiny))
    data = problems.select("prompt", pl.col("answer").cast(pl.Utf8)).head(8)
    with pytest.raises(AlignflowError, match=r"^ppo: 8 of 8 prompts do not fit the context: prompts\[0\] \('.*'\) "
                                             r"has \d+ tokens \+ max_new_tokens 12 > 16 \(the critic's positions, "
                                             r".*rm\); lower max_new_tokens to \d+ or leave them out of the data$"):
        train_ppo(small_config(tiny, rm_dir, max_steps=1, max_new_tokens=12), data, tmp_path / "out")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    capsys.readouterr()
    final = train_ppo(small_config(tiny, rm_dir, max_steps=1, max_new_tokens=12, critic_init="policy"), data,
                      tmp_path / "policy_critic")
    assert final.is_dir() and "longer than the reward model's 16 positions" in capsys.readouterr().err


def test_the_logged_learning_rate_is_the_mean_of_the_rates_the_steps_updates_used(tiny, reward_model, problems,
                                                                                   tmp_path, collect):
    """4 updates a step (2 mini-batches x 2 epochs), 8 in all, linear decay from 1e-3: step 1 used
    1e-3 * (1 - u/8) for u = 0..3, step 2 for u = 4..7. The rate read after the step's last update was the
    next step's (0 after the last step)."""
    logged, log = collect()
    train_ppo(small_config(tiny, reward_model, lr_schedule="linear", warmup_steps=0), problems, tmp_path / "out",
              log=log)
    assert [metrics["train/lr"] for _, metrics in logged] == pytest.approx([1e-3 * (1 - 1.5 / 8),
                                                                            1e-3 * (1 - 5.5 / 8)])


def test_rollout_prompts_of_pairs_are_one_per_conversation_not_per_display_text(tmp_path):
    """Conversations that display alike stay two rollout prompts; two pairs on one conversation give one."""

    def reply(text):
        return [{"role": "assistant", "content": text}]

    turns = [{"role": "user", "content": "hi"}, *reply("x"), {"role": "user", "content": "q"}]
    one_turn = [{"role": "user", "content": "hi\n\nassistant: x\n\nuser: q"}]
    records = [{"prompt": turns, "chosen": reply("good"), "rejected": reply("bad")},
               {"prompt": one_turn, "chosen": reply("good"), "rejected": reply("bad")},
               {"prompt": turns, "chosen": reply("fine"), "rejected": reply("poor")}]
    plain = [{"prompt": "plain", "chosen": "a", "rejected": "b"}, {"prompt": "plain", "chosen": "c", "rejected": "d"}]
    with open_store(tmp_path / "s.duckdb") as store:
        for name, lines in (("chat", records), ("plain", plain)):
            path = tmp_path / f"{name}.jsonl"
            path.write_text("".join(json.dumps(record) + "\n" for record in lines))
            ingest_file(path, store, source="c")
        assert store.count("preference_pairs") == 5
        for chat_template in (False, True):
            cfg = PPOConfig(policy_path="/m", reward_model_path="/rm", prompts_table="preference_pairs",
                            problems_source="c", chat_template=chat_template, rewards=[{"name": "reward_model"}])
            prompts = load_ppo_data(store, cfg)
            assert sorted(prompts["prompt"].to_list()) == ["plain", *["user: hi\n\nassistant: x\n\nuser: q"] * 2]
            messages = sorted(json.dumps(json.loads(m)["prompt"] if m.startswith("{") else json.loads(m))
                              for m in prompts["prompt_messages"].to_list() if m is not None)
            user_turn = [json.dumps([{"role": "user", "content": "plain"}])] if chat_template else []
            assert messages == sorted([json.dumps(turns), json.dumps(one_turn), *user_turn])


def test_models_with_their_own_code_train_only_with_trust_remote_code(tiny, reward_model, problems, tmp_path,
                                                                      remote_code_copy):
    """A reward model dir of its own code as the critic only (critic_init reward_model, verifier reward): its
    tokenizer, compared with the policy's, and its backbone load only with trust_remote_code, refused in one line
    otherwise with the code never run; with it, a policy of its own code and that reward model scoring train too."""
    rm, rm_ran = remote_code_copy(reward_model, tmp_path / "rm-remote")
    critic_only = small_config(tiny, rm, max_steps=1, rewards=[{"name": "verifier"}])
    with pytest.raises(ModelLoadError, match="contains custom code") as refused:
        train_ppo(critic_only, problems, tmp_path / "refused")
    assert "\n" not in str(refused.value) and not rm_ran.exists()
    assert train_ppo(critic_only.model_copy(update={"trust_remote_code": True}), problems, tmp_path / "critic").is_dir()
    assert rm_ran.exists()
    policy, policy_ran = remote_code_copy(tiny, tmp_path / "policy")
    scored = small_config(policy, rm, max_steps=1, trust_remote_code=True)
    assert scored.rewards[0]["name"] == "reward_model" and train_ppo(scored, problems, tmp_path / "scored").is_dir()
    assert policy_ran.exists()
