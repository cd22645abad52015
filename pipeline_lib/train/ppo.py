"""PPO for RLHF (InstructGPT; Ziegler et al. 2019): four models (actor, frozen reference, reward model, critic),
RM score + per-token KL penalty, GAE, several epochs of clipped policy and value updates per rollout."""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import polars as pl
import torch
from torch import Tensor, nn

from pipeline_lib.config import PPOConfig
from pipeline_lib.errors import AlignflowError
from pipeline_lib.logfns import LogFn, no_log
from pipeline_lib.losses import (
    compute_gae,
    kl_k3,
    kl_penalized_rewards,
    masked_whiten,
    ppo_policy_loss,
    ppo_value_loss,
)
from pipeline_lib.models import ValueModel, load_policy, load_tokenizer, sequence_logprobs
from pipeline_lib.models.loading import resolve_device
from pipeline_lib.models.logprobs import model_positions
from pipeline_lib.rewards.math import is_correct
from pipeline_lib.rewards.registry import build_reward
from pipeline_lib.store.db import Store
from pipeline_lib.train.common import (
    autocast,
    batches,
    check_finite,
    clip_gradients,
    finished_final,
    load_checkpoint,
    make_optimizer,
    make_scheduler,
    save_checkpoint,
    save_final,
    seed_everything,
    with_deterministic_kernels,
)
from pipeline_lib.train.data import (
    Batch,
    render_prompts,
    require_chat_template,
    require_columns,
    run_key,
    run_main,
    with_user_turns,
)
from pipeline_lib.train.rollout import (
    check_prompt_lengths,
    check_single_process,
    completions_batch,
    context_limit,
    logprobs_in_chunks,
    open_policy_sampler,
    read_problems,
    rollout_seed,
)


def load_ppo_data(store: Store, cfg: PPOConfig) -> pl.DataFrame:
    """The rollout prompts: problems (their answers give rewards/accuracy), or the distinct prompts of the
    preference pairs (conversations keep their turns for the chat template)."""
    if cfg.prompts_table == "problems":
        return read_problems(store, split=cfg.split, source=cfg.problems_source, chat_template=cfg.chat_template)
    pairs = store.read_selected("preference_pairs", source=cfg.problems_source).sort("pair_id")
    # one rollout prompt per conversation, not per display text: [user "hi", assistant "x", user "q"] and the one
    # user turn "hi\n\nassistant: x\n\nuser: q" display alike. Keyed on the messages' prompt part (the JSON also
    # holds each pair's replies, which differ between pairs on one prompt)
    conversation = pl.coalesce(pl.col("prompt_messages").str.json_path_match("$.prompt"), pl.col("prompt_messages"))
    prompts = (pairs.with_columns(conversation.alias("_turns"))
               .unique(subset=["prompt", "_turns"], keep="first", maintain_order=True)
               .select("prompt", "prompt_messages"))
    return with_user_turns(prompts) if cfg.chat_template else prompts


def state_values(critic: ValueModel, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """V(s_t) aligned with the token t it scores: the critic's value of the prefix before t, (B, T).

    The critic reads position t-1 (everything up to, not including, token t), exactly the state from which
    the policy chose token t, as sequence_logprobs aligns log π(token t) to position t."""
    values = critic(input_ids, attention_mask)  # (B, T): value of the prefix ending at each position
    return nn.functional.pad(values[:, :-1], (1, 0))  # (B, T)


def adapt_kl_coef(kl_coef: float, kl: float, *, target: float, horizon: int, n_samples: int) -> float:
    """Ziegler et al. 2019 §2.2 adaptive controller: β ← β·(1 + clip(KL/target - 1, -0.2, 0.2)·n/horizon)."""
    error = min(max(kl / target - 1.0, -0.2), 0.2)
    return kl_coef * (1.0 + error * n_samples / horizon)


@with_deterministic_kernels
def train_ppo(cfg: PPOConfig, prompts: pl.DataFrame, out_dir: Path, log: LogFn = no_log) -> Path:
    """PPO on `prompts` (prompt[, prompt_messages][, answer]); returns `out_dir/final` (the actor).

    With an `answer` column, rewards/accuracy is logged too (the reward itself is `cfg.rewards`'). Resumes from
    `out_dir/checkpoint` (actor, critic, optimizer, scheduler, RNG, KL coefficient) when one exists."""
    started = time.perf_counter()
    out_dir = Path(out_dir)
    stage_key = run_key(cfg, prompts)  # its checkpoints and final carry it
    if (final := finished_final(out_dir, log, cfg.max_steps, stage_key)) is not None:
        return final  # finished earlier: a rerun has nothing to resume
    check_single_process("ppo")
    seed_everything(cfg.seed)
    device = resolve_device(cfg.device)
    require_columns(prompts, ["prompt"], "ppo prompts")
    tokenizer = load_tokenizer(cfg.policy_path, trust_remote_code=cfg.trust_remote_code)
    require_chat_template(tokenizer, cfg.policy_path, cfg.chat_template)
    texts, templated = render_prompts(tokenizer, prompts)
    answers = prompts["answer"].cast(pl.Utf8).to_list() if "answer" in prompts.columns else None
    if any(templated) and not all(templated):  # one tokenization for every prompt: no row may lose its bos
        raise AlignflowError(f"ppo: the prompts mix conversations ({sum(templated)}, chat template) and plain "
                             f"texts ({templated.count(False)}); set chat_template: true to render every prompt as a "
                             "conversation, or select one kind with problems_source")
    add_special_tokens = not any(templated)  # a chat-rendered prompt already holds its special tokens
    if len(texts) < cfg.prompts_per_step:
        raise AlignflowError(f"ppo: {len(texts)} prompts, fewer than prompts_per_step {cfg.prompts_per_step}")

    rows_per_step = cfg.prompts_per_step
    mini_batch = min(cfg.mini_batch_size or rows_per_step, rows_per_step)
    # dropout off while sampling and updating alike: θ_old's log-probs must be those of the sampling policy
    policy = load_policy(cfg.policy_path, dtype="float32", device=device,
                         trust_remote_code=cfg.trust_remote_code).eval()
    # loaded like the policy (float32, bf16 only inside autocast on CUDA): the KL penalty is exactly 0 at the start
    ref = load_policy(cfg.policy_path, dtype="float32", device=device,
                      trust_remote_code=cfg.trust_remote_code).eval()
    ref.requires_grad_(False)
    if answers is None and any(spec["name"] == "verifier" for spec in cfg.rewards):
        raise AlignflowError("ppo: rewards name 'verifier' but the prompts have no answers (use prompts_table "
                             "problems)")
    # an RM scores the prompt as the policy read it (chat-rendered with chat_template, as the RM stage renders
    # chat-shaped pairs) + the completion, in its own tokens; the sampling stage scores the same text
    reward_fn = build_reward(cfg.rewards, reward_model_path=cfg.reward_model_path, device=device,
                             chat_prompts=any(templated), trust_remote_code=cfg.trust_remote_code)
    critic_path = cfg.reward_model_path if cfg.critic_init == "reward_model" else cfg.policy_path
    if cfg.critic_init == "reward_model":
        critic_tokenizer = load_tokenizer(critic_path, trust_remote_code=cfg.trust_remote_code)
        if critic_tokenizer.get_vocab() != tokenizer.get_vocab():
            raise AlignflowError(f"critic_init=reward_model: the tokenizer of {cfg.reward_model_path} differs from "
                                 "the policy's, so its backbone cannot read the rollouts; use critic_init=policy")
    critic = ValueModel.from_policy(critic_path, dtype="float32", device=device,
                                    trust_remote_code=cfg.trust_remote_code).eval()
    # the policy, its reference and the critic read each rollout whole: it must fit the fewest positions of them (a
    # reward-model critic's learned absolute ones raise IndexError past theirs); the reward model needs no check, its
    # scorer cuts texts from the left to its own positions (what last-token pooling reads stays)
    limit, whose = context_limit(policy, cfg.backend, cfg.vllm_max_model_len), None
    critic_positions = model_positions(critic)
    if critic_positions is not None and (limit is None or critic_positions < limit):
        limit, whose = critic_positions, f"the critic's positions, {critic_path}"
    check_prompt_lengths("ppo", tokenizer, texts, add_special_tokens=add_special_tokens,
                         max_new_tokens=cfg.max_new_tokens, limit=limit, whose=whose)
    trained = nn.ModuleDict({"policy": policy, "critic": critic})  # one checkpoint for both
    n_mini_batches = rows_per_step // mini_batch  # exact: the config makes mini_batch divide the step
    updates_per_step = cfg.ppo_epochs * n_mini_batches
    optimizer = make_optimizer(
        [{"params": list(policy.parameters()), "lr": cfg.lr}, {"params": list(critic.parameters()), "lr": cfg.critic_lr}],
        lr=cfg.lr, weight_decay=cfg.weight_decay,
    )
    scheduler = make_scheduler(optimizer, warmup_steps=cfg.warmup_steps,
                               total_steps=cfg.max_steps * updates_per_step, kind=cfg.lr_schedule)
    resumed = load_checkpoint(out_dir, model=trained, optimizer=optimizer, scheduler=scheduler, run_key=stage_key)
    start_step, extra = resumed if resumed else (0, {})
    kl_coef = float(extra.get("kl_coef", cfg.kl_coef))
    signal_steps = int(extra.get("signal_steps", 0))  # steps with an advantage != 0, resumes included
    prompt_stream = batches(len(texts), cfg.prompts_per_step, seed=cfg.seed, start_step=start_step)
    metrics: dict[str, float] = {}

    with open_policy_sampler(cfg.backend, policy, tokenizer, sync_dir=out_dir / "vllm_sync",
                             add_special_tokens=add_special_tokens,
                             vllm_max_model_len=cfg.vllm_max_model_len,
                             vllm_gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
                             trust_remote_code=cfg.trust_remote_code) as (sampler, sync):
        for step, indices in prompt_stream:
            if step >= cfg.max_steps:
                break
            step_started = time.perf_counter()
            # ---- rollout: one completion per prompt from θ_old; θ_old, π_ref, V and the rewards score it once
            sync_seconds = sync()
            groups = sampler.generate([texts[i] for i in indices], n=1, max_new_tokens=cfg.max_new_tokens,
                                      temperature=cfg.temperature, top_p=cfg.top_p,
                                      seed=rollout_seed(cfg.seed, step))
            completions = [samples[0] for samples in groups]
            batch: Batch = completions_batch(tokenizer, [texts[i] for i in indices], completions,
                                             add_special_tokens=add_special_tokens).to(device)
            mask = batch.completion_mask  # (B, T)
            old_logps = logprobs_in_chunks(policy, batch, mini_batch, device, temperature=cfg.temperature)  # (B, T)
            ref_logps = logprobs_in_chunks(ref, batch, mini_batch, device, temperature=cfg.temperature)  # (B, T)
            with torch.no_grad(), autocast(device):
                old_values = state_values(critic, batch.input_ids, batch.attention_mask).float()  # (B, T)
            lengths = [c.n_tokens for c in completions]
            totals, components = reward_fn([texts[i] for i in indices], [c.text for c in completions],
                                           answers=[None] * len(indices) if answers is None else
                                           [answers[i] for i in indices], lengths=lengths)
            scores = torch.tensor(totals, device=device)  # (B,)
            rollout_seconds = time.perf_counter() - step_started

            # ---- loss targets: sequence reward + per-token KL penalty (InstructGPT eq. 2), then GAE with the critic
            rewards, reward_stats = kl_penalized_rewards(scores, old_logps, ref_logps, mask, kl_coef=kl_coef)
            advantages, returns = compute_gae(rewards, old_values, mask, gamma=cfg.gamma, lam=cfg.lam)  # (B, T)
            if cfg.whiten_advantages:
                advantages = masked_whiten(advantages, mask)
            signal_steps += bool(advantages.any())
            kl_k3_seq = (kl_k3(old_logps, ref_logps) * mask).sum(-1).mean()  # padding holds 0 - 0: k3 = 0 there

            # ---- update: ppo_epochs passes over the rollout, one optimizer step (actor + critic) per mini-batch
            update_stats: dict[str, list[float]] = {}
            order_generator = torch.Generator().manual_seed(rollout_seed(cfg.seed, step, 997))
            for _ in range(cfg.ppo_epochs):
                order = torch.randperm(rows_per_step, generator=order_generator).to(device)
                for rows in torch.tensor_split(order, n_mini_batches):
                    with autocast(device):
                        logps, entropy = sequence_logprobs(policy, batch.input_ids[rows], batch.attention_mask[rows],
                                                           mask[rows], return_entropy=True,
                                                           temperature=cfg.temperature)  # (n, T)
                        values = state_values(critic, batch.input_ids[rows], batch.attention_mask[rows])  # (n, T)
                    policy_loss, policy_stats = ppo_policy_loss(logps.float(), old_logps[rows], advantages[rows],
                                                                mask[rows], clip_eps=cfg.clip_eps)
                    value_loss, value_stats = ppo_value_loss(values.float(), old_values[rows], returns[rows],
                                                             mask[rows], clip_eps=cfg.value_clip_eps)
                    loss = policy_loss + cfg.vf_coef * value_loss
                    check_finite(loss, step + 1)
                    loss.backward()
                    grad_norm = clip_gradients(trained, cfg.max_grad_norm)
                    check_finite(grad_norm, step + 1, "train/grad_norm")
                    lr = scheduler.get_last_lr()[0]  # this update's; train/lr is the mean over the step's updates
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad(set_to_none=True)
                    stats = policy_stats | value_stats | {
                        "train/loss": loss.detach(), "policy/loss": policy_loss.detach(), "train/grad_norm": grad_norm,
                        "train/lr": lr,
                        "policy/entropy": (entropy * mask[rows]).sum() / mask[rows].sum(),
                    }
                    for key, value in stats.items():
                        update_stats.setdefault(key, []).append(float(value))

            # ---- log (and checkpoint); the adaptive KL controller moves β for the next rollout
            done = step + 1
            kl_seq = float(reward_stats["objective/kl"])
            step_seconds = time.perf_counter() - step_started
            metrics = {
                "rewards/mean": float(scores.mean()),
                "rewards/std": float(scores.std(unbiased=False)),
                **{f"rewards/{name}": sum(values) / len(values) for name, values in components.items()},
                **({"rewards/accuracy": sum(is_correct(c.text, answers[i]) for c, i in zip(completions, indices))
                    / len(indices)} if answers is not None else {}),
                **{key: float(value) for key, value in reward_stats.items()},
                "objective/kl_k3": float(kl_k3_seq),
                "objective/kl_coef": kl_coef,
                "completions/mean_length": sum(lengths) / len(lengths),
                "completions/truncated_frac": sum(c.finish_reason == "length" for c in completions) / len(completions),
                **{key: sum(values) / len(values) for key, values in update_stats.items()},
                "perf/rollout_seconds": rollout_seconds,
                "perf/weight_sync_seconds": sync_seconds,
                "perf/step_seconds": step_seconds,
                "perf/tokens_per_s": sum(lengths) / step_seconds,
            }
            if cfg.adaptive_kl:
                kl_coef = adapt_kl_coef(kl_coef, kl_seq, target=cfg.kl_target, horizon=cfg.kl_horizon,
                                        n_samples=rows_per_step)
            if done == cfg.max_steps:  # logged with the last step: the tracking run holds what the final's marker does
                metrics["train/seconds"] = time.perf_counter() - started
            if done % cfg.log_every == 0 or done == cfg.max_steps:
                log(metrics, done)
            if done % cfg.save_every == 0 and done < cfg.max_steps:
                save_checkpoint(out_dir, step=done, model=trained, optimizer=optimizer, scheduler=scheduler,
                                extra={"kl_coef": kl_coef, "signal_steps": signal_steps}, run_key=stage_key)

    if signal_steps == 0:  # rewards, KL penalty and values all alike: GAE gives 0 everywhere, and so does the gradient
        unchanged = "the start policy" + (" but for weight decay" if cfg.weight_decay else "")
        warnings.warn(f"ppo: every advantage of the {cfg.max_steps} steps was 0 (no reward, KL penalty or value told "
                      "the samples apart), so the actor's gradient was zero throughout: the final model is "
                      f"{unchanged} (check that the rewards vary: problems it solves sometimes)", RuntimeWarning,
                      stacklevel=2)
    return save_final(policy, tokenizer, out_dir, metrics=metrics, run_key=stage_key)


if __name__ == "__main__":
    run_main(PPOConfig, train_ppo)
