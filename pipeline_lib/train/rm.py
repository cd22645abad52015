"""Reward-model training: Bradley-Terry on preference pairs or Plackett-Luce on rankings, a scalar head on a
causal-LM backbone (pooling from the config), a group's responses packed in one row behind the tokens they share
where that saves compute, pairwise accuracy on a seeded held-out split."""

from __future__ import annotations

import sys
import time
from collections.abc import Collection
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import polars as pl
import torch
from torch import Tensor, nn

from pipeline_lib.config import RMConfig
from pipeline_lib.logfns import LogFn, no_log
from pipeline_lib.losses import REWARD_LOSSES
from pipeline_lib.models import RewardModel, load_tokenizer
from pipeline_lib.models.loading import resolve_device
from pipeline_lib.models.logprobs import model_positions
from pipeline_lib.store.db import Store
from pipeline_lib.train.common import (
    Dist,
    autocast,
    batches,
    check_batch_split,
    check_finite,
    check_in_sync,
    choose_packed,
    clip_gradients,
    finished_final,
    init_distributed,
    load_checkpoint,
    make_optimizer,
    make_scheduler,
    mean_over_ranks,
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
    by_layout,
    cut_to,
    encode_texts,
    group_width,
    holdout_split,
    micro_batches,
    per_group,
    per_row,
    render_prompts,
    require_columns,
    row_limit,
    run_key,
    run_main,
)


@dataclass(frozen=True)
class Groups:
    """Responses to one prompt, best first: a pair is a group of 2, a ranking a group of K.

    Row `starts[g] + k` of `encoded` is response k of group g (prompt + response as one text)."""

    encoded: Encoded
    starts: list[int]
    sizes: list[int]
    chat_prompts: bool
    """Some prompts were rendered with the chat template (chat-shaped pairs)."""

    def __len__(self) -> int:
        return len(self.starts)

    def rows(self, groups: list[int]) -> list[int]:
        return [self.starts[g] + k for g in groups for k in range(self.sizes[g])]


def build_groups(tokenizer, frame: pl.DataFrame, loss: str, *, max_length: int,
                 positions: int | None = None) -> Groups:
    """Pairs (prompt, chosen, rejected) or rankings (prompt, responses) -> tokenized groups, best first, each text
    cut from the left to `max_length`, or to the backbone's `positions` where fewer (`encode_texts`).

    `rankings.responses` is ordered best -> worst by ingest (its `ranks` column is then 1..K)."""
    if loss == "bradley_terry":
        require_columns(frame, ["prompt", "chosen", "rejected"], "reward-model pairs")
        responses = [[c, r] for c, r in zip(frame["chosen"].to_list(), frame["rejected"].to_list())]
    else:
        require_columns(frame, ["prompt", "responses"], "reward-model rankings")
        responses = frame["responses"].to_list()
        short = next((row for row, group in enumerate(responses) if len(group) < 2), None)
        if short is not None:
            raise TrainDataError(f"rankings[{short}]: expected >= 2 responses, got {len(responses[short])}")
    prompts, templated = render_prompts(tokenizer, frame)
    # the scored text is prompt + response, exactly what RewardModelScorer sees when the RM is used
    encoded = encode_texts(tokenizer, [p + text for p, group in zip(prompts, responses) for text in group],
                           max_length=max_length, positions=positions)
    sizes = [len(group) for group in responses]
    starts = [0]
    for size in sizes[:-1]:
        starts.append(starts[-1] + size)
    alike = sum(len({tuple(encoded.prompt_ids[i]) for i in range(start, start + size)}) < size
                for start, size in zip(starts, sizes))
    if alike:
        print(f"warning: {alike} of {len(sizes)} {'pairs' if loss == 'bradley_terry' else 'rankings'} hold two "
              f"responses whose scored texts are the same tokens (cut to {cut_to(max_length, positions)}): the model "
              "cannot tell them apart (no gradient between them; counted as wrong in eval/rm_accuracy)",
              file=sys.stderr, flush=True)
    return Groups(encoded, starts, sizes, any(templated))


def load_rm_data(store: Store, cfg: RMConfig) -> pl.DataFrame:
    """preference_pairs (bradley_terry) or rankings (plackett_luce) from the store, optionally one source."""
    return store.read_selected("preference_pairs" if cfg.loss == "bradley_terry" else "rankings", source=cfg.source)


PAIR_STATS = ("rewards/accuracies", "rewards/margins")
# The arguments each loss of losses.REWARD_LOSSES takes from a batch's scores (B, K), best first, and their mask
LOSS_ARGUMENTS = {
    "bradley_terry": lambda cfg, scores, mask: {"chosen_scores": scores[:, 0], "rejected_scores": scores[:, 1],
                                                "margin": cfg.margin or None},
    "plackett_luce": lambda cfg, scores, mask: {"scores": scores, "mask": mask},
}


def group_scores(model: torch.nn.Module, groups: Groups, ids: list[int], *, packed: Collection[int], pad_id: int,
                 device: torch.device) -> tuple[Tensor, Tensor]:
    """r(x, y) of every response of groups `ids`: scores (B, K) best first, and their mask. The groups in `packed`
    (`packed_groups`) run a group per row, the tokens its responses share once; the others a response per row."""
    width = max(groups.sizes[g] for g in ids)

    def valid(part: list[int]) -> Tensor:  # (P, width): each group's responses, a prefix of the K columns
        return torch.arange(width, device=device) < torch.tensor([groups.sizes[g] for g in part],
                                                                 device=device).unsqueeze(1)

    def run_packed(part: list[int]) -> Tensor:  # (P, width)
        scores = per_group(lambda batch: model(batch.input_ids, batch.attention_mask, batch.packed).float(),
                           groups.encoded, [groups.rows([g]) for g in part], pad_id=pad_id, device=device)
        return nn.functional.pad(scores, (0, width - scores.shape[1]))

    def run_rows(part: list[int]) -> Tensor:  # (P, width)
        flat = per_row(lambda batch: model(batch.input_ids, batch.attention_mask).float(), groups.encoded,
                       groups.rows(part), pad_id=pad_id, device=device)  # (R,)
        return torch.zeros((len(part), width), device=device, dtype=flat.dtype).masked_scatter(valid(part), flat)

    return by_layout(ids, packed, run_packed, run_rows), valid(ids)  # (B, K), 0 past a group's size


def packed_groups(model: RewardModel, groups: Groups, *, pad_id: int, device: torch.device,
                  ctx: Dist | None = None) -> frozenset[int]:
    """The groups that run packed (`choose_packed`): where their texts share enough of their start to save compute
    and this model's packed scores hold."""
    widths = [group_width(groups.encoded, groups.rows([g])) for g in range(len(groups))]
    rows = [[len(groups.encoded.prompt_ids[r]) for r in groups.rows([g])] for g in range(len(groups))]
    return choose_packed(model, model.backbone, rows, widths,
                         lambda ids, packed: group_scores(model, groups, ids, packed=ids if packed else (),
                                                          pad_id=pad_id, device=device)[0],
                         unit="groups", fallback="each response runs as its own row", ctx=ctx)


@torch.no_grad()
def pairwise_accuracy(model: torch.nn.Module, groups: Groups, ids: list[int], *, packed: Collection[int],
                      pad_id: int, device: torch.device, batch_size: int = 128) -> dict[str, float]:
    """Share of response pairs (i ranked above j) scored r_i > r_j, and the mean r_i - r_j."""
    training = model.training
    model.eval()
    correct, margin, count = 0.0, 0.0, 0
    for start in range(0, len(ids), batch_size):
        with autocast(device):
            scores, mask = group_scores(model, groups, ids[start:start + batch_size], packed=packed, pad_id=pad_id,
                                        device=device)  # (B, K)
        gaps = scores.unsqueeze(2) - scores.unsqueeze(1)  # (B, K, K): r_i - r_j
        better = torch.ones_like(gaps, dtype=torch.bool).triu(diagonal=1) & mask.unsqueeze(2) & mask.unsqueeze(1)
        correct += float((gaps[better] > 0).sum())
        margin += float(gaps[better].sum())
        count += int(better.sum())
    model.train(training)
    return {"eval/rm_accuracy": correct / max(count, 1), "eval/rm_margin": margin / max(count, 1)}


@with_deterministic_kernels
def train_rm(cfg: RMConfig, data: pl.DataFrame, out_dir: Path, log: LogFn = no_log) -> Path:
    """Train a reward model on `data` (preference_pairs for bradley_terry, rankings for plackett_luce).

    A seeded `cfg.eval_fraction` of the rows is held out for eval/rm_accuracy. Returns `out_dir/final`
    (RewardModel.save_pretrained layout); resumes from `out_dir/checkpoint`."""
    started = time.perf_counter()
    out_dir = Path(out_dir)
    stage_key = run_key(cfg, data)  # its checkpoints and final carry it
    if (final := finished_final(out_dir, log, cfg.max_steps, stage_key)) is not None:
        return final  # finished earlier: a rerun has nothing to resume
    ctx = init_distributed(cfg.device)
    seed_everything(cfg.seed)
    device = resolve_device(cfg.device)
    tokenizer = load_tokenizer(cfg.model_path, trust_remote_code=cfg.trust_remote_code)
    model = RewardModel.from_policy(cfg.model_path, pooling=cfg.pooling, dtype="float32", device=device,
                                    trust_remote_code=cfg.trust_remote_code, seed=cfg.seed)
    model.train(not cfg.disable_dropout)  # eval mode: dropout off
    positions = model_positions(model)
    groups = build_groups(tokenizer, data, cfg.loss, max_length=cfg.max_length, positions=positions)
    model.chat_prompts = groups.chat_prompts
    model.max_length = row_limit(cfg.max_length, positions)[0]  # its scorer cuts texts as training did
    train_ids, eval_ids = holdout_split(data["prompt"].to_list(), cfg.eval_fraction, seed=cfg.seed)
    check_batch_split(ctx, cfg.batch_size, cfg.grad_accum_steps)
    pad_id = tokenizer.pad_token_id
    packed = packed_groups(model, groups, pad_id=pad_id, device=device, ctx=ctx)
    optimizer = make_optimizer(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = make_scheduler(optimizer, warmup_steps=cfg.warmup_steps, total_steps=cfg.max_steps,
                               kind=cfg.lr_schedule)
    resumed = load_checkpoint(out_dir, model=model, optimizer=optimizer, scheduler=scheduler, run_key=stage_key)
    start_step = resumed[0] if resumed else 0
    ddp_model = wrap_model(model, ctx)
    if start_step == 0 and ctx.is_main:
        log(pairwise_accuracy(model, groups, eval_ids, packed=packed, pad_id=pad_id, device=device), 0)
    metrics: dict[str, float] = {}

    for step, positions in batches(len(train_ids), cfg.batch_size, seed=cfg.seed, start_step=start_step):
        if step >= cfg.max_steps:
            break
        # ---- batch: this rank's share of the global batch of groups, in micro-batches
        local = [train_ids[p] for p in ctx.shard(positions)]
        chunks = micro_batches(local, cfg.grad_accum_steps)
        step_stats: dict[str, Tensor] = {}  # each stat summed with its weight: rankings, or adjacent pairs
        weights: dict[str, Tensor] = {}
        for k, micro in enumerate(chunks):
            sync = nullcontext() if k == len(chunks) - 1 or not ctx.enabled else ddp_model.no_sync()
            with sync:
                with autocast(device):
                    scores, mask = group_scores(ddp_model, groups, micro, packed=packed, pad_id=pad_id,
                                                device=device)  # (B, K)
                # ---- loss
                loss, stats = REWARD_LOSSES[cfg.loss](**LOSS_ARGUMENTS[cfg.loss](cfg, scores, mask))
                # a mean over this micro-batch; weighted so that the DDP average over ranks of the sum over
                # micro-batches is the mean over the global batch
                (loss * len(micro) / len(positions) * ctx.world_size).backward()
            # pair stats are means over a micro-batch's adjacent pairs, whose number varies with K (Plackett-Luce):
            # weighted by it, the logged value is the global batch's whatever its split into micro-batches/ranks
            pairs = (mask[:, 1:] & mask[:, :-1]).sum().float()
            for key, value in {"train/loss": loss, **stats}.items():
                weight = pairs if key in PAIR_STATS else torch.tensor(float(len(micro)), device=pairs.device)
                step_stats[key] = step_stats.get(key, 0.0) + value.detach() * weight
                weights[key] = weights.get(key, 0.0) + weight
        sums = mean_over_ranks(ctx, {**step_stats, **{f"{key} weight": w for key, w in weights.items()}})
        reduced = {key: sums[key] / sums[f"{key} weight"] for key in step_stats}
        check_finite(reduced["train/loss"], step + 1)

        # ---- update
        grad_norm = clip_gradients(model, cfg.max_grad_norm)
        check_finite(grad_norm, step + 1, "train/grad_norm")
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)

        # ---- log (and checkpoint)
        done = step + 1
        metrics = {**reduced, "train/grad_norm": grad_norm, "train/lr": lr}
        if ctx.is_main and (done % cfg.log_every == 0 or done == cfg.max_steps):
            log(metrics, done)
        if ctx.is_main and cfg.eval_every and done % cfg.eval_every == 0 and done < cfg.max_steps:
            log(pairwise_accuracy(model, groups, eval_ids, packed=packed, pad_id=pad_id, device=device), done)
        if done % cfg.save_every == 0 and done < cfg.max_steps:  # every rank: it gathers their RNG states
            save_checkpoint(out_dir, step=done, model=model, optimizer=optimizer, scheduler=scheduler,
                            run_key=stage_key, ctx=ctx)

    check_in_sync(model, ctx)
    final = out_dir / "final"
    if ctx.is_main:
        evaluation = pairwise_accuracy(model, groups, eval_ids, packed=packed, pad_id=pad_id, device=device)
        totals = {"eval/n_groups": float(len(eval_ids)),
                  "train/packed_groups": float(len(packed)),  # of len(groups), the others ran as rows
                  "train/seconds": time.perf_counter() - started}
        log({**evaluation, **totals}, cfg.max_steps)  # the tracking run holds every metric the final's marker does
        metrics.update({**evaluation, **totals})
        final = save_final(unwrap(model), tokenizer, out_dir, metrics=metrics, run_key=stage_key)
    ctx.barrier()
    return final


if __name__ == "__main__":
    run_main(RMConfig, train_rm)
