"""Supervised fine-tuning: next-token loss on the completion tokens only, over task gold answers, preference
"chosen" responses, or the Best-of-N selection of a sampling run (rejection-sampling SFT)."""

from __future__ import annotations

import time
from contextlib import nullcontext
from pathlib import Path

import polars as pl
import torch

from pipeline_lib.config import SFTConfig
from pipeline_lib.filters import best_of_n, recorded_chat_template
from pipeline_lib.logfns import LogFn, no_log
from pipeline_lib.models import load_policy, load_tokenizer, sequence_logprobs
from pipeline_lib.models.loading import resolve_device
from pipeline_lib.models.logprobs import model_positions, stop_token_ids
from pipeline_lib.store.db import Store
from pipeline_lib.train.common import (
    autocast,
    batches,
    check_batch_split,
    check_finite,
    check_in_sync,
    clip_gradients,
    finished_final,
    init_distributed,
    load_checkpoint,
    make_optimizer,
    make_scheduler,
    save_checkpoint,
    save_final,
    seed_everything,
    unwrap,
    with_deterministic_kernels,
    wrap_model,
)
from pipeline_lib.train.data import (
    Encoded,
    TrainDataError,
    collate,
    encode_frame,
    micro_batches,
    require_chat_template,
    require_columns,
    run_key,
    run_main,
    with_user_turns,
)


def sft_rows(frame: pl.DataFrame, data: str, *, chat_template: bool = False) -> pl.DataFrame:
    """(prompt, completion[, prompt_messages]) rows for SFT from a store table.

    `problems`: the worked solution where the problem has one (GSM8K's, ending in `#### N`, kept in
    meta.solution at ingest), else the gold `answer`; `pairs`: the `chosen` response (conversation kept for the
    chat template); `best_of_n`: the output of filters.best_of_n — the kept `completion` of each prompt.
    chat_template wraps plain prompts as one user turn, as the sampling stage does for instruct models."""
    column = {"problems": "answer", "pairs": "chosen", "best_of_n": "completion"}.get(data)
    if column is None:
        raise ValueError(f"data={data!r}: expected 'problems', 'pairs' or 'best_of_n'")
    require_columns(frame, ["prompt", column], f"sft data={data}")
    completion = pl.col(column).cast(pl.Utf8)
    if data == "problems" and "meta" in frame.columns:
        solution = pl.col("meta").str.json_path_match("$.solution")
        completion = pl.when(solution.str.strip_chars() != "").then(solution).otherwise(completion)
    keep = [pl.col("prompt"), completion.alias("completion")]
    if "prompt_messages" in frame.columns:
        keep.append(pl.col("prompt_messages"))
    rows = frame.select(keep)
    # plain prompts (all, or the plain pairs beside conversations) become one user turn
    return with_user_turns(rows) if chat_template else rows


def load_sft_data(store: Store, cfg: SFTConfig) -> tuple[pl.DataFrame, pl.DataFrame | None]:
    """(training rows, held-out rows for eval/loss or None) of `cfg.data` from the store."""
    source = {"source": cfg.source} if cfg.source else {}
    if cfg.data == "problems":
        rows = sft_rows(store.read_selected("problems", source=cfg.source, split=cfg.split), "problems",
                        chat_template=cfg.chat_template)
        held = store.read("problems", split="test", **source) if cfg.split != "test" else None
        if held is None or held.height == 0:
            return rows, None
        return rows, sft_rows(held, "problems", chat_template=cfg.chat_template)
    if cfg.data == "pairs":
        return sft_rows(store.read_selected("preference_pairs", source=cfg.source), "pairs",
                        chat_template=cfg.chat_template), None
    samples = store.run_samples(cfg.samples_run_id)
    # the prompts must be rendered as they were sampled (as DPO's West-of-N pairs of the run are): an error, not the
    # run's flag silently overriding the config's (SFT's default false would train a chat run on raw prompts)
    sampled = recorded_chat_template(samples, cfg.samples_run_id)
    if sampled is not None and sampled != cfg.chat_template:
        raise TrainDataError(f"samples run {cfg.samples_run_id!r} was sampled with chat_template={sampled}, but this "
                             f"SFT config has chat_template={cfg.chat_template}: Best-of-N rows would train on other "
                             f"prompts than their completions answered; set chat_template: {str(sampled).lower()}")
    selected = best_of_n(samples)
    if cfg.min_reward is not None:
        selected = selected.filter(pl.col("reward") >= cfg.min_reward)
    if selected.height == 0:
        threshold = "" if cfg.min_reward is None else f", or none with reward >= {cfg.min_reward}"
        raise TrainDataError(f"samples run {cfg.samples_run_id!r}: no Best-of-N rows to train on "
                             f"(no such run, no whole scored samples{threshold})")
    return sft_rows(selected, "best_of_n", chat_template=cfg.chat_template), None


@torch.no_grad()
def completion_nll(model: torch.nn.Module, encoded: Encoded, *, pad_id: int, device: torch.device,
                   batch_size: int = 256) -> float:
    """Mean negative log-likelihood per completion token (the SFT loss without gradients)."""
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(encoded), batch_size):
        batch = collate(encoded, range(start, min(start + batch_size, len(encoded))), pad_id=pad_id).to(device)
        with autocast(device):
            logps = sequence_logprobs(model, batch.input_ids, batch.attention_mask, batch.completion_mask)
        total -= float(logps.sum())
        count += int(batch.completion_mask.sum())
    model.train()
    return total / max(count, 1)


@with_deterministic_kernels
def train_sft(cfg: SFTConfig, rows: pl.DataFrame, out_dir: Path, log: LogFn = no_log, *,
              eval_rows: pl.DataFrame | None = None) -> Path:
    """SFT on `rows` (prompt, completion[, prompt_messages]); eval/loss on `eval_rows`. Returns `out_dir/final`.

    Resumes from `out_dir/checkpoint` when one exists; under torchrun each rank takes its share of every
    global batch and only rank 0 writes."""
    started = time.perf_counter()
    out_dir = Path(out_dir)
    stage_key = run_key(cfg, rows)  # its checkpoints and final carry it (eval rows change no weight)
    if (final := finished_final(out_dir, log, cfg.max_steps, stage_key)) is not None:
        return final  # finished earlier: a rerun has nothing to resume
    ctx = init_distributed(cfg.device)
    seed_everything(cfg.seed)
    device = resolve_device(cfg.device)
    tokenizer = load_tokenizer(cfg.model_path, trust_remote_code=cfg.trust_remote_code)
    require_chat_template(tokenizer, cfg.model_path, cfg.chat_template)
    # fp32 master weights; bf16 only inside autocast on CUDA
    model = load_policy(cfg.model_path, dtype="float32", device=device, trust_remote_code=cfg.trust_remote_code)
    model.train()
    # cut to the model's positions where fewer than max_length: learned absolute ones raise IndexError past them;
    # chat rows end with the template's end of turn where the model stops on it
    limits = {"max_length": cfg.max_length, "positions": model_positions(model),
              "stops": stop_token_ids(model, tokenizer)}
    train_set = encode_frame(tokenizer, rows, "completion", **limits)
    eval_set = encode_frame(tokenizer, eval_rows, "completion", **limits) \
        if eval_rows is not None and eval_rows.height else None
    check_batch_split(ctx, cfg.batch_size, cfg.grad_accum_steps)
    pad_id = tokenizer.pad_token_id
    optimizer = make_optimizer(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = make_scheduler(optimizer, warmup_steps=cfg.warmup_steps, total_steps=cfg.max_steps,
                               kind=cfg.lr_schedule)
    resumed = load_checkpoint(out_dir, model=model, optimizer=optimizer, scheduler=scheduler, run_key=stage_key)
    start_step = resumed[0] if resumed else 0
    ddp_model = wrap_model(model, ctx)
    metrics: dict[str, float] = {}
    if eval_set is not None and start_step == 0 and ctx.is_main:
        log({"eval/loss": completion_nll(model, eval_set, pad_id=pad_id, device=device)}, 0)

    for step, indices in batches(len(train_set), cfg.batch_size, seed=cfg.seed, start_step=start_step):
        if step >= cfg.max_steps:
            break
        # ---- batch: this rank's share of the global batch, in micro-batches
        local = ctx.shard(indices)
        # normalise by the global batch's completion tokens: summed over ranks (DDP averages, hence
        # x world_size) the gradient is that of the token mean over the whole batch
        scale = ctx.world_size / train_set.completion_tokens(indices)
        step_loss = torch.zeros((), device=device)
        chunks = micro_batches(local, cfg.grad_accum_steps)
        for k, micro in enumerate(chunks):
            batch = collate(train_set, micro, pad_id=pad_id).to(device)
            sync = nullcontext() if k == len(chunks) - 1 or not ctx.enabled else ddp_model.no_sync()
            with sync:
                # ---- loss: -Σ log π(y_t | x, y_<t) over completion tokens / tokens in the batch
                with autocast(device):
                    logps = sequence_logprobs(ddp_model, batch.input_ids, batch.attention_mask,
                                              batch.completion_mask)  # (B, T), 0 off the completion
                loss = -logps.sum() * scale
                loss.backward()
            step_loss += loss.detach()
        step_loss = ctx.all_reduce_mean(step_loss)  # the global batch's token-mean NLL
        check_finite(step_loss, step + 1)

        # ---- update
        grad_norm = clip_gradients(model, cfg.max_grad_norm)
        check_finite(grad_norm, step + 1, "train/grad_norm")
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)

        # ---- log (and checkpoint)
        done = step + 1
        metrics = {"train/loss": float(step_loss), "train/grad_norm": grad_norm, "train/lr": lr}
        if done == cfg.max_steps:  # logged with the last step: the tracking run holds what the final's marker does
            metrics.update({"data/rows": float(rows.height), "train/seconds": time.perf_counter() - started})
        if ctx.is_main and (done % cfg.log_every == 0 or done == cfg.max_steps):
            log(metrics, done)
        if eval_set is not None and ctx.is_main and cfg.eval_every and done % cfg.eval_every == 0 \
                and done < cfg.max_steps:
            log({"eval/loss": completion_nll(model, eval_set, pad_id=pad_id, device=device)}, done)
        if done % cfg.save_every == 0 and done < cfg.max_steps:  # every rank: it gathers their RNG states
            save_checkpoint(out_dir, step=done, model=model, optimizer=optimizer, scheduler=scheduler,
                            run_key=stage_key, ctx=ctx)

    check_in_sync(model, ctx)
    if eval_set is not None and ctx.is_main:
        metrics["eval/loss"] = completion_nll(model, eval_set, pad_id=pad_id, device=device)
        log({"eval/loss": metrics["eval/loss"]}, cfg.max_steps)
    final = out_dir / "final"
    if ctx.is_main:
        final = save_final(unwrap(model), tokenizer, out_dir, metrics=metrics, run_key=stage_key)
    ctx.barrier()
    return final


if __name__ == "__main__":
    run_main(SFTConfig, train_sft)
