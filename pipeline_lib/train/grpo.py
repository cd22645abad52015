"""GRPO (DeepSeekMath, arXiv:2402.03300) and DAPO (arXiv:2503.14476, the same loop with DAPOConfig's settings):
G samples per prompt from θ_old, group-normalized advantages, μ passes of clipped-surrogate updates."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import polars as pl
import torch
from torch import Tensor

from pipeline_lib.config import DAPOConfig, GRPOConfig
from pipeline_lib.errors import AlignflowError
from pipeline_lib.filters import informative_groups
from pipeline_lib.logfns import LogFn, no_log
from pipeline_lib.losses import LOSSES, group_advantages
from pipeline_lib.models import load_policy, load_tokenizer
from pipeline_lib.models.loading import resolve_device
from pipeline_lib.rewards.math import is_correct
from pipeline_lib.rewards.registry import CombinedReward, build_reward
from pipeline_lib.sampling import Completion, Sampler
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
from pipeline_lib.train.data import render_prompts, require_chat_template, require_columns, run_key, run_main
from pipeline_lib.train.rollout import (
    check_prompt_lengths,
    check_single_process,
    context_limit,
    grouped_completions_batch,
    grouped_logprobs,
    open_policy_sampler,
    read_problems,
    rollout_seed,
)

# The knobs each policy loss of losses.LOSSES takes: their signatures differ (grpo: symmetric clip + k3 KL to
# the reference; dr_grpo: those and the generation budget it divides by; dapo: clip-higher and the KL, 0 by
# default), the config validator keeps the unused ones consistent.
LOSS_OPTIONS: dict[str, Callable[[GRPOConfig, Tensor | None], dict]] = {
    "grpo": lambda cfg, ref_logps: {"ref_logps": ref_logps, "clip_eps": cfg.clip_eps_low, "beta": cfg.beta},
    "dr_grpo": lambda cfg, ref_logps: {"ref_logps": ref_logps, "clip_eps": cfg.clip_eps_low, "beta": cfg.beta,
                                       "max_len": cfg.max_new_tokens},
    "dapo": lambda cfg, ref_logps: {"ref_logps": ref_logps, "eps_low": cfg.clip_eps_low,
                                    "eps_high": cfg.clip_eps_high, "beta": cfg.beta},
}


@dataclass(frozen=True)
class GroupRollout:
    """What one GRPO rollout trains on (G consecutive rows per kept group) and what it saw."""

    prompts: list[str]
    completions: list[Completion]
    rewards: list[float]
    groups_kept: int
    data_step: int
    """Prompt batches drawn from the stream so far: its position to resume from."""
    metrics: dict[str, float]
    """Reward, accuracy and length stats over EVERY sampled completion, kept or not, and the filtering."""


def sample_groups(
    sampler: Sampler,
    prompt_stream: Iterator[tuple[int, list[int]]],
    prompts: list[str],
    answers: list[str],
    reward_fn: CombinedReward,
    cfg: GRPOConfig,
    step: int,
) -> GroupRollout:
    """G samples for each of `cfg.prompts_per_step` prompts from the stream, rewarded by `reward_fn`.

    With dynamic sampling (DAPO §3.2) a group is kept only when 0 < #correct < G on the RAW verifier outcome,
    and further prompt batches are sampled until the batch is full or `max_refill_rounds` extra rounds are
    spent (then a warning, and the step trains on the groups it has); surplus informative groups of the last
    round are dropped (as verl does) and not counted as filtered. Round r of step s is seeded
    rollout_seed(seed, s, r)."""
    group = cfg.group_size
    kept_prompts: list[str] = []
    kept_completions: list[Completion] = []
    kept_rewards: list[float] = []
    seen_rewards: list[float] = []
    seen_correct: list[bool] = []
    seen_lengths: list[int] = []
    truncated = 0
    component_sums: dict[str, float] = {}
    groups_sampled = groups_informative = groups_kept = rounds = data_step = 0
    for round_ in range(1 + (cfg.max_refill_rounds if cfg.dynamic_sampling else 0)):
        rounds = round_ + 1
        batch_step, indices = next(prompt_stream)
        data_step = batch_step + 1
        groups = sampler.generate([prompts[i] for i in indices], n=group, max_new_tokens=cfg.max_new_tokens,
                                  temperature=cfg.temperature, top_p=cfg.top_p,
                                  seed=rollout_seed(cfg.seed, step, round_))
        row_prompts = [prompts[i] for i in indices for _ in range(group)]
        row_answers = [answers[i] for i in indices for _ in range(group)]
        completions = [c for samples in groups for c in samples]
        texts = [c.text for c in completions]
        lengths = [c.n_tokens for c in completions]
        rewards, components = reward_fn(row_prompts, texts, answers=row_answers, lengths=lengths)
        # the raw verifier outcome: the verifier reward's own values when the config uses it (not verified twice)
        correct = [value == 1.0 for value in components["verifier"]] if "verifier" in components \
            else [is_correct(text, answer) for text, answer in zip(texts, row_answers)]
        seen_rewards += rewards
        seen_correct += correct
        seen_lengths += lengths
        truncated += sum(c.finish_reason == "length" for c in completions)
        for name, values in components.items():
            component_sums[name] = component_sums.get(name, 0.0) + sum(values)
        groups_sampled += len(indices)
        keep = informative_groups(correct, group) if cfg.dynamic_sampling else torch.ones(len(indices), dtype=torch.bool)
        groups_informative += int(keep.sum())
        for g in keep.nonzero().flatten().tolist()[:cfg.prompts_per_step - groups_kept]:
            rows = slice(g * group, (g + 1) * group)
            kept_prompts += row_prompts[rows]
            kept_completions += completions[rows]
            kept_rewards += rewards[rows]
            groups_kept += 1
        if groups_kept == cfg.prompts_per_step:
            break
    if groups_kept < cfg.prompts_per_step:
        warnings.warn(f"step {step + 1}: dynamic sampling found {groups_kept} of {cfg.prompts_per_step} groups with "
                      f"0 < #correct < G in {rounds} round(s); {'training on them' if groups_kept else 'no update'} "
                      "(raise max_refill_rounds to keep sampling)", RuntimeWarning, stacklevel=2)

    n = len(seen_rewards)
    reward_tensor = torch.tensor(seen_rewards)
    metrics = {
        "rewards/mean": float(reward_tensor.mean()),
        "rewards/std": float(reward_tensor.std(unbiased=False)),
        "rewards/accuracy": sum(seen_correct) / n,
        **{f"rewards/{name}": total / n for name, total in component_sums.items()},
        "completions/mean_length": sum(seen_lengths) / n,
        "completions/truncated_frac": truncated / n,
        "completions/tokens": float(sum(seen_lengths)),
        "rollout/groups_filtered_frac": 1.0 - groups_informative / groups_sampled,  # not the surplus ones
        "rollout/groups_kept": float(groups_kept),
        "rollout/refill_rounds": float(rounds - 1),
    }
    return GroupRollout(kept_prompts, kept_completions, kept_rewards, groups_kept, data_step, metrics)


def load_grpo_data(store: Store, cfg: GRPOConfig) -> pl.DataFrame:
    """The config's problems (split, source) in problem_id order, as user turns when cfg.chat_template."""
    return read_problems(store, split=cfg.split, source=cfg.problems_source, chat_template=cfg.chat_template)


@with_deterministic_kernels
def train_grpo(cfg: GRPOConfig, problems: pl.DataFrame, out_dir: Path, log: LogFn = no_log) -> Path:
    """GRPO/DAPO on `problems` (prompt, answer[, prompt_messages]); returns `out_dir/final`.

    Resumes from `out_dir/checkpoint` when one exists: rollouts are seeded by (seed, step, round) and the
    prompt stream's position is checkpointed, so a resumed run ends with the weights of an uninterrupted one."""
    started = time.perf_counter()
    out_dir = Path(out_dir)
    stage_key = run_key(cfg, problems)  # its checkpoints and final carry it
    if (final := finished_final(out_dir, log, cfg.max_steps, stage_key)) is not None:
        return final  # finished earlier: a rerun has nothing to resume
    stage = "dapo" if isinstance(cfg, DAPOConfig) else "grpo"
    check_single_process(stage)
    seed_everything(cfg.seed)
    device = resolve_device(cfg.device)
    require_columns(problems, ["prompt", "answer"], f"{stage} problems")
    tokenizer = load_tokenizer(cfg.policy_path, trust_remote_code=cfg.trust_remote_code)
    require_chat_template(tokenizer, cfg.policy_path, cfg.chat_template)
    prompts, templated = render_prompts(tokenizer, problems)
    answers = problems["answer"].cast(pl.Utf8).to_list()
    # a chat-rendered prompt already holds its special tokens (the samplers add them to raw prompts)
    add_special_tokens = not any(templated)
    if len(prompts) < cfg.prompts_per_step:
        raise AlignflowError(f"{stage}: {len(prompts)} problems, fewer than prompts_per_step {cfg.prompts_per_step}")

    policy = load_policy(cfg.policy_path, dtype="float32", device=device, trust_remote_code=cfg.trust_remote_code)
    check_prompt_lengths(stage, tokenizer, prompts, add_special_tokens=add_special_tokens,
                         max_new_tokens=cfg.max_new_tokens,
                         limit=context_limit(policy, cfg.backend, cfg.vllm_max_model_len))
    # dropout off while sampling and updating alike: θ_old's log-probs must be those of the sampling policy
    policy.eval()
    # β = 0 (DAPO): no reference model at all, not a loaded-and-unused one. The reference is loaded like the
    # policy (float32, bf16 only inside autocast on CUDA), so the KL to it is exactly 0 before the first update
    ref = None
    if cfg.beta > 0:
        ref = load_policy(cfg.policy_path, dtype="float32", device=device,
                          trust_remote_code=cfg.trust_remote_code).eval()
        ref.requires_grad_(False)
    reward_fn = build_reward(cfg.rewards, reward_model_path=cfg.reward_model_path, device=device,
                             chat_prompts=any(templated), trust_remote_code=cfg.trust_remote_code)
    policy_loss = LOSSES[cfg.loss]
    mini_batch = min(cfg.mini_batch_size or cfg.rows_per_step, cfg.rows_per_step)
    optimizer = make_optimizer(policy.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    # the schedule counts training steps (rollouts), as verl does: dynamic sampling makes the number of
    # updates per step vary, and a step whose groups were all filtered out makes none
    scheduler = make_scheduler(optimizer, warmup_steps=cfg.warmup_steps, total_steps=cfg.max_steps,
                               kind=cfg.lr_schedule)
    resumed = load_checkpoint(out_dir, model=policy, optimizer=optimizer, scheduler=scheduler, run_key=stage_key)
    start_step, extra = resumed if resumed else (0, {})
    # refills draw extra prompt batches, so the stream's position is its own counter
    data_step = int(extra.get("data_step", start_step))
    # optimizer steps over the whole run, resumes included: dynamic sampling can leave every step without one
    updates = int(extra.get("updates", 0))
    # steps with a non-zero advantage, resumes included: groups whose rewards are all equal (a model the verifier
    # scores 0 on every sample) give advantages of exactly 0, and the updates they make carry no policy gradient. A
    # checkpoint written before this count existed says nothing of its steps: they are taken to have had a signal.
    signal_steps = int(extra.get("signal_steps", start_step))
    prompt_stream = batches(len(prompts), cfg.prompts_per_step, seed=cfg.seed, start_step=data_step)
    metrics: dict[str, float] = {}

    with open_policy_sampler(cfg.backend, policy, tokenizer, sync_dir=out_dir / "vllm_sync",
                             add_special_tokens=add_special_tokens,
                             vllm_max_model_len=cfg.vllm_max_model_len,
                             vllm_gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
                             trust_remote_code=cfg.trust_remote_code) as (sampler, sync):
        for step in range(start_step, cfg.max_steps):
            step_started = time.perf_counter()
            # ---- rollout: G samples per prompt from θ_old; dynamic sampling keeps informative groups, refills
            sync_seconds = sync()
            rollout = sample_groups(sampler, prompt_stream, prompts, answers, reward_fn, cfg, step)
            rollout_seconds = time.perf_counter() - step_started

            # ---- loss: advantages, θ_old and reference log-probs (one no-grad pass each); the G samples of a
            # prompt share one pass over the prompt in every forward (GroupedBatch)
            update_stats: dict[str, list[float]] = {}
            if rollout.groups_kept:
                batch = grouped_completions_batch(tokenizer, rollout.prompts, rollout.completions,
                                                  add_special_tokens=add_special_tokens).to(device)
                advantages = group_advantages(torch.tensor(rollout.rewards), group_size=cfg.group_size,
                                              scale=cfg.scale_rewards)  # (N,)
                signal_steps += bool(advantages.any())  # on the CPU, before the copy: no device sync
                advantages = advantages.to(device)
                n_rows = len(batch)
                # the config makes mini_batch divide a full step; a step short of groups (dynamic sampling gave up
                # refilling) is split into nearly equal mini-batches of at most mini_batch rows, not a short last one
                n_mini_batches = -(-n_rows // mini_batch)
                # the mini-batches are drawn once and kept for the μ passes, each visiting them in a new order:
                # θ_old's and the reference's log-probs come from passes over the policy's own mini-batches, so they
                # equal its log-probs bit for bit while its weights are theirs. (Over other row groupings they were
                # ~1e-7 apart: with all-zero advantages the KL term's gradient, zero at π = π_ref, was that noise,
                # which Adam turned into full steps away from the reference.)
                order_generator = torch.Generator().manual_seed(rollout_seed(cfg.seed, step, 997))
                mini_batches = torch.tensor_split(torch.randperm(n_rows, generator=order_generator).to(device),
                                                  n_mini_batches)
                ref_logps = grouped_logprobs(ref, batch, mini_batches, temperature=cfg.temperature) \
                    if ref is not None else None  # (N, C)
                # one mini-batch: θ_old = θ at its first pass, so its log-probs come free from that pass
                old_logps = grouped_logprobs(policy, batch, mini_batches, temperature=cfg.temperature) \
                    if n_mini_batches > 1 else None

                # ---- update: μ passes over the rollout, one optimizer step per mini-batch
                for _ in range(cfg.num_iterations):
                    for k in torch.randperm(n_mini_batches, generator=order_generator).tolist():
                        rows = mini_batches[k]
                        micro = batch.select(rows)
                        mask = micro.completion_mask
                        with autocast(device):
                            logps, entropy = micro.logprobs(policy, return_entropy=True,
                                                            temperature=cfg.temperature)  # (n, C)
                        if old_logps is None:
                            old_logps = torch.empty_like(logps)
                            old_logps[rows] = logps.detach().float()
                        loss, stats = policy_loss(
                            logps=logps.float(), old_logps=old_logps[rows], advantages=advantages[rows], mask=mask,
                            **LOSS_OPTIONS[cfg.loss](cfg, None if ref_logps is None else ref_logps[rows]),
                        )
                        check_finite(loss, step + 1)
                        loss.backward()
                        grad_norm = clip_gradients(policy, cfg.max_grad_norm)
                        check_finite(grad_norm, step + 1, "train/grad_norm")
                        optimizer.step()
                        optimizer.zero_grad(set_to_none=True)
                        updates += 1
                        stats |= {"train/loss": loss.detach(), "train/grad_norm": grad_norm,
                                  "policy/entropy": (entropy * mask).sum() / mask.sum()}
                        for key, value in stats.items():
                            update_stats.setdefault(key, []).append(float(value))

            lr = scheduler.get_last_lr()[0]  # every update of this step used it
            with warnings.catch_warnings():  # a step without updates advances the schedule too, on purpose
                warnings.filterwarnings("ignore", r"Detected call of `lr_scheduler.step\(\)` before", UserWarning)
                scheduler.step()

            # ---- log (and checkpoint)
            done = step + 1
            step_seconds = time.perf_counter() - step_started
            metrics = {
                **rollout.metrics,
                **{key: sum(values) / len(values) for key, values in update_stats.items()},
                "train/lr": lr,
                "train/updates": float(updates),  # so far, resumes included
                "perf/rollout_seconds": rollout_seconds,
                "perf/weight_sync_seconds": sync_seconds,
                "perf/step_seconds": step_seconds,
                "perf/tokens_per_s": rollout.metrics["completions/tokens"] / step_seconds,
            }
            if done == cfg.max_steps:  # logged with the last step: the tracking run holds what the final's marker does
                metrics["train/seconds"] = time.perf_counter() - started
            if done % cfg.log_every == 0 or done == cfg.max_steps:
                log(metrics, done)
            if done % cfg.save_every == 0 and done < cfg.max_steps:
                save_checkpoint(out_dir, step=done, model=policy, optimizer=optimizer, scheduler=scheduler,
                                extra={"data_step": rollout.data_step, "updates": updates,
                                       "signal_steps": signal_steps}, run_key=stage_key)

    if updates == 0:
        warnings.warn(f"{stage}: no step of {cfg.max_steps} kept a group with 0 < #correct < G, so the final model "
                      "is the start policy (it solves every problem or none; raise max_refill_rounds or pick problems "
                      "it solves sometimes)", RuntimeWarning, stacklevel=2)
    elif signal_steps == 0:
        # all-zero advantages zero the clipped surrogate's gradient, and the k3 KL term's gradient is zero at
        # π = π_ref: only weight decay (then the KL's pull back to the reference) moves the weights off the start
        unchanged = "the start policy" + (" but for weight decay" if cfg.weight_decay else "")
        warnings.warn(f"{stage}: no step of {cfg.max_steps} had a group whose rewards differ, so every advantage was 0 "
                      f"and the policy gradient zero throughout: the final model is {unchanged} (it solves every "
                      "problem or none, or the rewards cannot tell its samples apart; pick problems it solves "
                      "sometimes)", RuntimeWarning, stacklevel=2)
    return save_final(policy, tokenizer, out_dir, metrics=metrics, run_key=stage_key)


if __name__ == "__main__":
    run_main(GRPOConfig, train_grpo)
