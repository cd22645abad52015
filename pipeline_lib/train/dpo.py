"""Direct Preference Optimization: reference log-probs computed once per dataset (batched, cached on disk by
reference weights + data fingerprint), an explicit loop over pairs (each packed in one row behind its prompt where
that saves compute and the model allows it), optional LoRA policy through peft whose reference is the same model with
its adapters disabled; eval on held-out pairs before and after."""

from __future__ import annotations

import os
import sys
import time
import warnings
from collections.abc import Collection, Sequence
from contextlib import nullcontext
from pathlib import Path

import polars as pl
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from pipeline_lib import code_version
from pipeline_lib.config import DPOConfig
from pipeline_lib.errors import AlignflowError, one_line
from pipeline_lib.filters import west_of_n_of_run
from pipeline_lib.fingerprint import content_id, model_fingerprint
from pipeline_lib.logfns import LogFn, no_log
from pipeline_lib.losses import dpo_loss
from pipeline_lib.models import completion_logprob_sums, load_policy, load_tokenizer
from pipeline_lib.models.loading import apply_umask, resolve_device
from pipeline_lib.models.logprobs import model_positions, pair_logprob_sums, stop_token_ids, transformers_model
from pipeline_lib.store.db import Store
from pipeline_lib.train.common import (
    CheckpointWriteError,
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
    replace_durably,
    save_checkpoint,
    save_final,
    seed_everything,
    unwrap,
    visited,
    with_deterministic_kernels,
    wrap_model,
)
from pipeline_lib.train.data import (
    Encoded,
    TrainDataError,
    by_layout,
    cut_to,
    encode,
    holdout_split,
    micro_batches,
    packed_width,
    per_pair,
    per_row,
    render_prompts,
    require_columns,
    run_key,
    run_main,
)


def load_dpo_data(store: Store, cfg: DPOConfig) -> pl.DataFrame:
    """preference_pairs from the store, optionally one source; with samples_run_id, the West-of-N pairs of that
    sampling run alone (made from its samples as the filter stage makes them: no pair of another run)."""
    if cfg.samples_run_id:
        pairs, stats = west_of_n_of_run(store, cfg.samples_run_id)
        if pairs.height == 0:
            raise TrainDataError(f"samples run {cfg.samples_run_id!r}: no West-of-N pairs to train on (of its "
                                 f"{stats['filter/prompts']} prompts, none has samples whose rewards differ)")
        return pairs
    return store.read_selected("preference_pairs", source=cfg.source)


def encode_pairs(tokenizer, pairs: pl.DataFrame, *, max_length: int, positions: int | None = None,
                 stops: Collection[int] = ()) -> Encoded:
    """Row 2i is pair i's prompt + chosen, row 2i+1 its prompt + rejected; cut to `max_length`, or to the model's
    `positions` where fewer; chat rows end with the template's end of turn where it is one of `stops` (`encode`)."""
    require_columns(pairs, ["prompt", "chosen", "rejected"], "dpo pairs")
    prompts, templated = render_prompts(tokenizer, pairs)
    completions = [text for pair in zip(pairs["chosen"].to_list(), pairs["rejected"].to_list()) for text in pair]
    encoded = encode(tokenizer, [p for p in prompts for _ in range(2)], completions, max_length=max_length,
                     templated=[t for t in templated for _ in range(2)], group_size=2, positions=positions,
                     stops=stops)
    alike = sum(encoded.completion_ids[i] == encoded.completion_ids[i + 1] for i in range(0, len(encoded), 2))
    if alike:  # answers differing past the cut, or in characters the tokenizer maps to one token (<unk>)
        print(f"warning: {alike} of {len(pairs)} pairs hold a chosen and a rejected answer that are the same tokens "
              f"(cut to {cut_to(max_length, positions)}): DPO cannot tell them apart (loss log 2 and no gradient "
              "from them; counted as wrong in eval/pref_accuracy)", file=sys.stderr, flush=True)
    return encoded


def pair_rows(pair_ids: list[int]) -> list[int]:
    return [row for i in pair_ids for row in (2 * i, 2 * i + 1)]


def pair_logps(model: nn.Module, encoded: Encoded, pair_ids: list[int], *, packed: Collection[int], pad_id: int,
               device: torch.device) -> Tensor:
    """(len(pair_ids), 2): log π(chosen|x), log π(rejected|x) in length buckets; a pair in `packed` (`packed_pairs`)
    runs as one row, its prompt once, the others as two rows."""

    def run_packed(part: list[int]) -> Tensor:
        return per_pair(lambda batch: pair_logprob_sums(
            model, batch.input_ids, batch.attention_mask, batch.position_ids, batch.segments, batch.sources,
            batch.targets, batch.target_sides).float(), encoded, part, pad_id=pad_id, device=device)

    def run_rows(part: list[int]) -> Tensor:
        return per_row(lambda batch: completion_logprob_sums(
            model, batch.input_ids, batch.attention_mask, batch.completion_mask).float(),
            encoded, pair_rows(part), pad_id=pad_id, device=device).view(-1, 2)

    return by_layout(pair_ids, packed, run_packed, run_rows)


@torch.no_grad()
def logprob_sums(model: nn.Module, encoded: Encoded, pair_ids: list[int], *, packed: Collection[int], pad_id: int,
                 device: torch.device, batch_size: int) -> Tensor:
    """`pair_logps` without gradients (dropout off), over pairs sorted by length (little padding), batch_size rows
    (a pair counting as two) per forward."""
    training = model.training
    model.eval()
    order = sorted(range(len(pair_ids)), key=lambda k: packed_width(encoded, pair_ids[k]))
    out = torch.zeros((len(pair_ids), 2), dtype=torch.float32)
    step = max(1, batch_size // 2)
    for start in range(0, len(order), step):
        chunk = order[start:start + step]
        with autocast(device):
            out[chunk] = pair_logps(model, encoded, [pair_ids[k] for k in chunk], packed=packed, pad_id=pad_id,
                                    device=device).cpu()
    model.train(training)
    return out


def packed_pairs(model: nn.Module, encoded: Encoded, *, pad_id: int, device: torch.device,
                 ctx: Dist | None = None) -> frozenset[int]:
    """The pairs that run packed (`choose_packed`): where that saves compute and this model's packed sums hold."""
    widths = [packed_width(encoded, i) for i in range(len(encoded) // 2)]
    rows = [[len(encoded.prompt_ids[r]) + len(encoded.completion_ids[r]) for r in (2 * i, 2 * i + 1)]
            for i in range(len(widths))]
    return choose_packed(model, transformers_model(model), rows, widths,
                         lambda pairs, packed: pair_logps(model, encoded, pairs, packed=pairs if packed else (),
                                                          pad_id=pad_id, device=device),
                         unit="pairs", fallback="each pair runs as two rows", ctx=ctx)


def reference_logps(model: nn.Module, encoded: Encoded, *, parts: Sequence[list[int]], packed: Collection[int],
                    policy_path: str, cache_dir: Path, pad_id: int, device: torch.device, batch_size: int,
                    ctx: Dist) -> Tensor:
    """log π_ref(y|x) of the rows of `parts`' pairs (0 for the others), computed once and cached at
    cache_dir/ref_logps/<key>.safetensors.

    Each of `parts` (the pairs the run trains on, the held-out pairs) runs as its own `logprob_sums`, as
    `preference_eval` runs the held-out pairs, so at step 0 the policy's held-out log-probs equal the reference's
    bit for bit (rewards 0, `eval/rewards_accuracy` 0, `eval/loss` log 2). One pass over all pairs batched them with
    others, and its float noise counted as preferences (0.208 on the demo model, a policy equal to its reference).

    The key hashes the reference model's dir (`model_fingerprint`: its weights and its config, which changes the
    log-probs as much), the tokenized data, the numeric setting (device type, dtype, which pairs run packed, the
    parts and the batch size: the float sums differ in their last bits) and the code, so a rerun, a resumed run or
    another stage on the same data reuses the file. Rank 0 computes and writes (atomically and durably; a failed
    write is a one-line CheckpointWriteError, a file that does not read back whole is computed again with a
    warning); every rank then reads the same file. A peft model is evaluated with its adapters disabled: that is the
    reference, without a second copy of the weights."""
    dtype = "bf16" if device.type == "cuda" else "fp32"
    layout = content_id(*map(str, sorted(packed)))
    split = content_id(*(",".join(map(str, part)) for part in parts))  # with batch_size: how the parts were batched
    key = content_id(model_fingerprint(policy_path), encoded.fingerprint(), device.type, dtype,
                     layout, split, str(batch_size), code_version())
    path = Path(cache_dir) / "ref_logps" / f"{key[:32]}.safetensors"
    if ctx.is_main and not _cached_whole(path, rows=len(encoded)):
        adapters_off = model.disable_adapter() if hasattr(model, "disable_adapter") else nullcontext()
        pairs = torch.zeros((len(encoded) // 2, 2), dtype=torch.float32)
        with adapters_off:
            for part in parts:
                pairs[part] = logprob_sums(model, encoded, part, packed=packed, pad_id=pad_id, device=device,
                                           batch_size=batch_size)
        logps = pairs.flatten()  # rows 2i, 2i + 1
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            save_file({"logps": logps.contiguous()}, str(tmp))
            apply_umask(tmp)
            replace_durably(tmp, path)
        except (OSError, SafetensorError) as exc:  # a full disk
            tmp.unlink(missing_ok=True)
            raise CheckpointWriteError(f"{path}: cannot write the reference log-probs ({one_line(exc)})") from exc
    ctx.barrier()
    return load_file(str(path))["logps"]  # (2N,)


def _cached_whole(path: Path, rows: int) -> bool:
    """Whether `path` holds the reference log-probs of `rows` rows; one that is there but does not read back whole
    (cut, damaged) gets a warning, and is computed again."""
    if not path.is_file():
        return False
    try:
        logps = load_file(str(path))["logps"]
        if logps.shape != (rows,):
            raise ValueError(f"{tuple(logps.shape)} log-probs for {rows} rows")
    except (OSError, SafetensorError, KeyError, ValueError) as exc:
        warnings.warn(f"{path} is unreadable ({one_line(exc)}); computing the reference log-probs again",
                      RuntimeWarning, stacklevel=3)
        return False
    return True


def chosen_lengths(encoded: Encoded, pair_ids: list[int]) -> Tensor:
    """(len(pair_ids),): tokens in each pair's chosen completion, the per-token denominator of RPO's NLL term."""
    return torch.tensor([len(encoded.completion_ids[2 * i]) for i in pair_ids])


def preference_eval(model: nn.Module, encoded: Encoded, ref: Tensor, pair_ids: list[int], *, beta: float,
                    label_smoothing: float, rpo_alpha: float, packed: Collection[int], pad_id: int,
                    device: torch.device, batch_size: int) -> dict[str, float]:
    """Held-out pairs: how often the policy prefers chosen (log π(y_w) > log π(y_l)), by how much, and the loss the
    training minimizes (label smoothing and RPO's NLL term included), so eval/loss and train/loss measure one
    objective, as TRL's DPOTrainer computes its eval loss with its training loss."""
    logps = logprob_sums(model, encoded, pair_ids, packed=packed, pad_id=pad_id, device=device,
                         batch_size=batch_size)  # (P, 2)
    ref_logps = ref[pair_rows(pair_ids)].view(-1, 2)
    loss, stats = dpo_loss(logps[:, 0], logps[:, 1], ref_logps[:, 0], ref_logps[:, 1], beta=beta,
                           label_smoothing=label_smoothing, rpo_alpha=rpo_alpha,
                           chosen_lengths=chosen_lengths(encoded, pair_ids))
    return {
        "eval/pref_accuracy": float((logps[:, 0] > logps[:, 1]).float().mean()),
        "eval/logp_margin": float((logps[:, 0] - logps[:, 1]).mean()),
        "eval/loss": float(loss),
        "eval/rewards_accuracy": float(stats["rewards/accuracies"]),
    }


def add_lora(model: nn.Module, cfg: DPOConfig) -> nn.Module:
    """Wrap the policy with trainable LoRA adapters (peft imported here: it costs seconds to import). A target that
    names no module of this model (the default names Llama's attention projections; peft drops such a name beside
    one that matches) is a one-line error listing the model's own projection names; so is an embedding tied to the
    output layer (Qwen2.5, Llama 3.2, Gemma): merging its adapter into the one shared matrix would change both
    layers, so the final would not be the model trained."""
    from peft import LoraConfig, get_peft_model

    targets = list(cfg.lora_target_modules)
    modules = dict(model.named_modules())

    def named(target: str) -> list[str]:
        return [name for name in modules if name == target or name.endswith(f".{target}")]

    weights = sorted({name.rsplit(".", 2)[-2] for name, param in model.named_parameters()
                      if name.endswith(".weight") and param.dim() == 2})
    missing = [target for target in targets if not named(target)]
    if missing:
        raise AlignflowError(f"lora_target_modules {targets}: {missing} name no module of {cfg.policy_path}; its 2-D "
                             f"weights belong to {weights}")
    embeddings, output = model.get_input_embeddings(), model.get_output_embeddings()
    if output is not None and output.weight is embeddings.weight:
        tied = [target for target in targets if any(modules[name] in (embeddings, output) for name in named(target))]
        if tied:
            raise AlignflowError(f"lora_target_modules {targets}: {tied}: {cfg.policy_path} ties its embeddings to its "
                                 "output layer (one matrix), so merging an adapter of either would change both layers "
                                 "and the final would not be the model trained; leave them out")
    lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout, target_modules=targets,
                      task_type="CAUSAL_LM")
    try:
        return get_peft_model(model, lora)
    except ValueError as exc:  # a module peft cannot adapt: "Target module LlamaMLP(...) is not supported. ..."
        raise AlignflowError(f"lora_target_modules {targets}: {one_line(exc, width=300)} ({cfg.policy_path}); its "
                             f"2-D weights belong to {weights}") from None


@with_deterministic_kernels
def train_dpo(cfg: DPOConfig, pairs: pl.DataFrame, out_dir: Path, log: LogFn = no_log, *,
              cache_dir: Path | str | None = None) -> Path:
    """DPO on `pairs` (prompt, chosen, rejected[, prompt_messages]); reference = the starting policy.

    Reference log-probs are cached under `cache_dir` (default `out_dir/cache`). A seeded `cfg.eval_fraction`
    of the pairs is held out. Returns `out_dir/final` (merged weights with LoRA); resumes from a checkpoint."""
    started = time.perf_counter()
    out_dir = Path(out_dir)
    stage_key = run_key(cfg, pairs)  # its checkpoints and final carry it
    if (final := finished_final(out_dir, log, cfg.max_steps, stage_key)) is not None:
        return final  # finished earlier: a rerun has nothing to resume
    ctx = init_distributed(cfg.device)
    seed_everything(cfg.seed)
    device = resolve_device(cfg.device)
    tokenizer = load_tokenizer(cfg.policy_path, trust_remote_code=cfg.trust_remote_code)
    model = load_policy(cfg.policy_path, dtype="float32", device=device, trust_remote_code=cfg.trust_remote_code)
    if cfg.lora_r:
        model = add_lora(model, cfg)
    model.train(not cfg.disable_dropout)  # eval mode: dropout off, as the cached reference log-probs were taken
    # the ids (so the reference cache key, `Encoded.fingerprint`) hold the cut to the model's positions
    encoded = encode_pairs(tokenizer, pairs, max_length=cfg.max_length, positions=model_positions(model),
                           stops=stop_token_ids(model, tokenizer))
    train_ids, eval_ids = holdout_split(pairs["prompt"].to_list(), cfg.eval_fraction, seed=cfg.seed)
    check_batch_split(ctx, cfg.batch_size, cfg.grad_accum_steps)
    pad_id = tokenizer.pad_token_id
    packed = packed_pairs(model, encoded, pad_id=pad_id, device=device, ctx=ctx)
    # the reference log-probs of the pairs this run trains on (max_steps batches of a large set are a few of its
    # pairs) and of the held-out ones
    trained = visited(len(train_ids), cfg.batch_size, seed=cfg.seed, steps=cfg.max_steps)
    parts = ([pair for k, pair in enumerate(train_ids) if k in trained], eval_ids)
    ref = reference_logps(model, encoded, parts=parts, packed=packed, policy_path=cfg.policy_path,
                          cache_dir=Path(cache_dir or out_dir / "cache"), pad_id=pad_id, device=device,
                          batch_size=cfg.ref_batch_size, ctx=ctx)  # (2N,)
    optimizer = make_optimizer(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = make_scheduler(optimizer, warmup_steps=cfg.warmup_steps, total_steps=cfg.max_steps,
                               kind=cfg.lr_schedule)
    resumed = load_checkpoint(out_dir, model=model, optimizer=optimizer, scheduler=scheduler, run_key=stage_key)
    start_step, extra = resumed if resumed else (0, {})
    ddp_model = wrap_model(model, ctx)

    def evaluate() -> dict[str, float]:
        return preference_eval(model, encoded, ref, eval_ids, beta=cfg.beta, label_smoothing=cfg.label_smoothing,
                               rpo_alpha=cfg.rpo_alpha, packed=packed, pad_id=pad_id, device=device,
                               batch_size=cfg.ref_batch_size)

    # the start's held-out numbers travel in the checkpoint, so a resumed run still reports before/after
    before = extra.get("eval_start") or (evaluate() if ctx.is_main else {})
    if start_step == 0 and ctx.is_main:
        log(before, 0)
    metrics: dict[str, float] = {}

    for step, positions in batches(len(train_ids), cfg.batch_size, seed=cfg.seed, start_step=start_step):
        if step >= cfg.max_steps:
            break
        # ---- batch: this rank's pairs, chosen and rejected in one forward
        local = [train_ids[p] for p in ctx.shard(positions)]
        chunks = micro_batches(local, cfg.grad_accum_steps)
        step_stats: dict[str, Tensor] = {}
        for k, micro in enumerate(chunks):
            rows = pair_rows(micro)
            ref_logps = ref[rows].to(device).view(-1, 2)  # (B, 2): chosen, rejected
            sync = nullcontext() if k == len(chunks) - 1 or not ctx.enabled else ddp_model.no_sync()
            with sync:
                with autocast(device):
                    logps = pair_logps(ddp_model, encoded, micro, packed=packed, pad_id=pad_id,
                                       device=device)  # (B, 2): chosen, rejected
                # ---- loss
                loss, stats = dpo_loss(logps[:, 0], logps[:, 1], ref_logps[:, 0], ref_logps[:, 1],
                                       beta=cfg.beta, label_smoothing=cfg.label_smoothing,
                                       rpo_alpha=cfg.rpo_alpha,
                                       chosen_lengths=chosen_lengths(encoded, micro).to(device))
                # mean over the micro-batch, weighted so the DDP average of the sums is the global-batch mean
                (loss * len(micro) / len(positions) * ctx.world_size).backward()
            for key, value in {"train/loss": loss, **stats}.items():
                step_stats[key] = step_stats.get(key, 0.0) + value.detach() / len(chunks)
        reduced = mean_over_ranks(ctx, step_stats)
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
            log(evaluate(), done)
        if done % cfg.save_every == 0 and done < cfg.max_steps:  # every rank: it gathers their RNG states
            save_checkpoint(out_dir, step=done, model=model, optimizer=optimizer, scheduler=scheduler,
                            extra={"eval_start": before}, run_key=stage_key, ctx=ctx)

    check_in_sync(model, ctx)
    final = out_dir / "final"
    if ctx.is_main:
        after = evaluate()
        totals = {"train/packed_pairs": float(len(packed)),  # of all pairs, the others ran as two rows
                  "train/seconds": time.perf_counter() - started}
        # the tracking run holds every metric the final's marker does (the `_start` ones as step 0's)
        log({**after, **totals}, cfg.max_steps)
        metrics.update({**after, **{f"{k}_start": v for k, v in before.items()}, **totals})
        policy = unwrap(model)
        final = save_final(policy.merge_and_unload() if cfg.lora_r else policy, tokenizer, out_dir, metrics=metrics,
                           run_key=stage_key)
    ctx.barrier()
    return final


if __name__ == "__main__":
    run_main(DPOConfig, train_dpo)
