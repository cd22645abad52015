"""Rejection and dynamic filtering of sampled groups: Best-of-N (SFT data), West-of-N (preference pairs),
DAPO dynamic sampling (keep groups with 0 < #correct < G), over `samples`-shaped polars frames."""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence

import polars as pl
import torch
from torch import Tensor

from pipeline_lib.errors import AlignflowError, text_start
from pipeline_lib.store.db import Store
from pipeline_lib.store.shapes import BLANK, WHITESPACE, pair_id, split_chat


class SamplesError(AlignflowError, ValueError):
    """Samples a filter cannot use (none for the run, missing columns, groups of the wrong size): one line."""


def _require(samples: pl.DataFrame, columns: Sequence[str]) -> None:
    missing = [c for c in columns if c not in samples.columns]
    if missing:
        raise SamplesError(f"samples: missing column(s) {missing}; expected {list(columns)}")


def _scored(samples: pl.DataFrame) -> pl.DataFrame:
    """Rows that can win or lose a group: scored (null, NaN and infinite rewards are unscored samples: an infinite
    one ties with its like and has no mean with its opposite, and West-of-N's meta is JSON), with text (an
    empty or whitespace-only completion, to Python's str.strip() as ingest tests it (shapes.BLANK), is no response
    to train on; the store refuses such pairs at ingest) and whole: a sample cut at max_new_tokens (finish_reason
    `length`) is no response either, and SFT and DPO end every completion they train on with eos, which would
    teach the model to stop where the cut fell."""
    _require(samples, ("prompt_id", "sample_idx", "prompt", "completion", "reward"))
    reward = pl.col("reward").cast(pl.Float64)
    has_text = ~pl.col("completion").str.contains(BLANK)
    whole = (pl.col("finish_reason") != "length").fill_null(True) if "finish_reason" in samples.columns else True
    return samples.with_columns(reward).filter(reward.is_finite() & has_text & whole)


def best_of_n(samples: pl.DataFrame) -> pl.DataFrame:
    """The top-reward whole completion of each prompt (ties: the lowest sample_idx), as an SFT dataset.

    Returns columns prompt_id, prompt, completion, reward; one row per prompt with a scored sample,
    sorted by prompt_id."""
    ranked = _scored(samples).sort(["prompt_id", "reward", "sample_idx"], descending=[False, True, False])
    best = ranked.unique(subset="prompt_id", keep="first", maintain_order=True)
    return best.select("prompt_id", "prompt", "completion", "reward")


def west_of_n(samples: pl.DataFrame, *, source: str = "west_of_n", chat_template: bool = False
              ) -> tuple[pl.DataFrame, int]:
    """Per prompt, the best and the worst completion as a synthetic preference pair (West-of-N).

    Candidates are the distinct completion texts of whole scored samples (`_scored`), compared without their
    surrounding whitespace as ingest compares a pair's sides (a text sampled several times counts once, with its
    mean reward and its first sample's idx and text: a reward model may score one text slightly differently in two
    batches), so chosen and rejected always differ. Ties pick the lowest sample_idx on both ends. Prompts whose best and
    worst rewards are equal (all samples tie, a single distinct text) give no pair and are counted. Returns
    (pairs, n_skipped); pairs have the preference_pairs columns pair_id (store.shapes.pair_id, as ingest keys
    the same pair), source, prompt, chosen, rejected, prompt_messages (with `chat_template`, the samples' prompts
    were user turns of the chat template: the pair is that conversation, which DPO and RM training render
    alike; else null), meta (JSON: prompt_id, both sample_idx and rewards), sorted by prompt_id."""
    scored = (
        _scored(samples)
        .sort("sample_idx")
        .group_by("prompt_id", "prompt", pl.col("completion").str.strip_chars(WHITESPACE).alias("text"))
        .agg(pl.col("completion").first(), pl.col("reward").mean(), pl.col("sample_idx").first())
    )
    best = (
        scored.sort(["prompt_id", "reward", "sample_idx"], descending=[False, True, False])
        .unique(subset="prompt_id", keep="first", maintain_order=True)
        .select("prompt_id", "prompt", chosen="completion", chosen_idx="sample_idx", chosen_reward="reward")
    )
    worst = (
        scored.sort(["prompt_id", "reward", "sample_idx"])
        .unique(subset="prompt_id", keep="first", maintain_order=True)
        .select("prompt_id", rejected="completion", rejected_idx="sample_idx", rejected_reward="reward")
    )
    joined = best.join(worst, on="prompt_id", how="inner", maintain_order="left")
    kept = joined.filter(pl.col("chosen_reward") > pl.col("rejected_reward"))
    rows = kept.to_dicts()
    for row in rows:  # the prompt text and messages a conversation gets at ingest, so both give one pair_id
        row["prompt"], row["prompt_messages"] = _chat_form(row) if chat_template else (row["prompt"], None)
    pairs = pl.DataFrame(
        {
            "pair_id": [pair_id(r["prompt"], r["chosen"], r["rejected"], r["prompt_messages"]) for r in rows],
            "source": [source] * len(rows),
            "prompt": [r["prompt"] for r in rows],
            "chosen": [r["chosen"] for r in rows],
            "rejected": [r["rejected"] for r in rows],
            "prompt_messages": [r["prompt_messages"] for r in rows],
            "meta": [
                json.dumps({
                    "prompt_id": r["prompt_id"],
                    "chosen_idx": r["chosen_idx"],
                    "rejected_idx": r["rejected_idx"],
                    "chosen_reward": r["chosen_reward"],
                    "rejected_reward": r["rejected_reward"],
                })
                for r in rows
            ],
        },
        schema={name: pl.String for name in
                ("pair_id", "source", "prompt", "chosen", "rejected", "prompt_messages", "meta")},
    )
    return pairs, joined.height - kept.height


def _chat_form(pair: dict) -> tuple[str, str]:
    """(prompt text, prompt_messages JSON) of a pair whose prompt was one user turn and whose completions are
    assistant replies, exactly as ingest stores such a conversation (store.shapes.split_chat). The candidates have
    text and differ as split_chat compares them, so only a blank prompt (a problem stored before ingest refused
    it) is refused: a one-line SamplesError."""
    result = split_chat({"prompt": pair["prompt"], "chosen": [{"role": "assistant", "content": pair["chosen"]}],
                         "rejected": [{"role": "assistant", "content": pair["rejected"]}]})
    if isinstance(result, str):
        raise SamplesError(f"samples: prompt_id {pair['prompt_id']!r} (prompt {text_start(pair['prompt'])}): its "
                           f"West-of-N pair is no conversation ingest would store ({result}); ingest its problems "
                           "again (`alignflow ingest FILE --replace`: such a prompt is quarantined now) "
                           "and filter again")
    prompt_text, _, _, messages = result
    return prompt_text, messages


def _group_correct_counts(is_correct: Tensor | Sequence[bool], group_size: int) -> Tensor:
    """#correct per group of `group_size` consecutive samples: (B*G,) -> (B,)."""
    flat = torch.as_tensor(is_correct).reshape(-1)  # (B*G,)
    if group_size < 1 or flat.numel() % group_size:
        raise SamplesError(f"is_correct: expected a multiple of group_size={group_size} values, got {flat.numel()}")
    return flat.to(torch.long).reshape(-1, group_size).sum(dim=-1)  # (B,)


def informative_groups(is_correct: Tensor | Sequence[bool], group_size: int) -> Tensor:
    """DAPO dynamic sampling (arXiv:2503.14476 eq. 11): keep groups with 0 < #correct < G.

    `is_correct` is the RAW verifier outcome, flat (B*G,) with each group's G samples consecutive; returns a
    bool (B,) mask. Not the shaped reward: with overlong shaping an all-wrong group still has unequal rewards,
    yet its advantages carry no signal about correctness."""
    counts = _group_correct_counts(is_correct, group_size)  # (B,)
    return (counts > 0) & (counts < group_size)


def dynamic_sampling_stats(is_correct: Tensor | Sequence[bool], group_size: int) -> dict[str, int]:
    """groups_total, groups_kept, dropped_all_correct, dropped_all_wrong of `informative_groups`."""
    counts = _group_correct_counts(is_correct, group_size)  # (B,)
    return {
        "groups_total": int(counts.numel()),
        "groups_kept": int(informative_groups(is_correct, group_size).sum()),
        "dropped_all_correct": int((counts == group_size).sum()),
        "dropped_all_wrong": int((counts == 0).sum()),
    }


def dynamic_sampling(samples: pl.DataFrame, group_size: int) -> tuple[pl.DataFrame, dict[str, int]]:
    """DAPO dynamic sampling over a samples frame (columns prompt_id, sample_idx, is_correct; exactly group_size
    rows per prompt): (its rows of kept prompts sorted by prompt_id, sample_idx; `dynamic_sampling_stats`). The
    GRPO loop applies `informative_groups` to each rollout's flat correctness instead."""
    _require(samples, ("prompt_id", "sample_idx", "is_correct"))
    if samples["is_correct"].null_count():
        raise SamplesError(
            f"samples.is_correct: {samples['is_correct'].null_count()} null value(s); dynamic sampling needs "
            "the verifier's outcome for every sample"
        )
    ordered = samples.sort(["prompt_id", "sample_idx"])
    sizes = ordered.group_by("prompt_id", maintain_order=True).len()
    wrong = sizes.filter(pl.col("len") != group_size)
    if wrong.height:
        raise SamplesError(
            f"samples: prompt {wrong['prompt_id'][0]!r} has {wrong['len'][0]} samples; expected group_size={group_size}"
        )
    correct = ordered["is_correct"].to_torch().to(torch.bool)  # (B*G,)
    keep = informative_groups(correct, group_size)  # (B,)
    kept_ids = sizes["prompt_id"].filter(pl.Series(keep.tolist(), dtype=pl.Boolean))
    kept = ordered.filter(pl.col("prompt_id").is_in(kept_ids.implode()))
    return kept, dynamic_sampling_stats(correct, group_size)


# ---- the filter stages over a sampling run in the store


def run_samples(store: Store, run_id: str) -> pl.DataFrame:
    """The rows of one sampling run whose problem is still stored (`Store.run_samples`); none is a one-line
    SamplesError."""
    samples = store.run_samples(run_id)
    if samples.height == 0:
        runs = [f"{run!r} ({count} rows{f' of {policy}' if policy else ''})"
                for run, policy, count in store.sampling_runs()]
        held = f"; the store holds runs {', '.join(runs[:5])}{' and more' if len(runs) > 5 else ''}" if runs else \
            "; the store holds no sampling run"
        raise SamplesError(f"samples: no rows for run_id {run_id!r} (of problems the store holds){held}; run the "
                           "sampling stage first, or name one of them")
    return samples


def west_of_n_of_run(store: Store, run_id: str, source: str = "west_of_n") -> tuple[pl.DataFrame, dict[str, int]]:
    """The West-of-N pairs of one sampling run and their counts; the pairs of a run that sampled with the chat
    template are conversations. What the filter stage stores, and what DPO trains on with `samples_run_id`."""
    samples = run_samples(store, run_id)
    chat_template = sampled_with_chat_template(samples, run_id)
    pairs, skipped = west_of_n(samples, source=source, chat_template=chat_template)
    prompts = samples["prompt_id"].n_unique()
    # prompts = pairs + ties + prompts without a whole, scored sample with text (no candidate at all)
    return pairs, {"filter/prompts": prompts, "filter/pairs": pairs.height, "filter/skipped_ties": skipped,
                   "filter/skipped_unscored": prompts - pairs.height - skipped,
                   "filter/chat_template": int(chat_template)}


def run_west_of_n_stage(store: Store, *, run_id: str, source: str = "west_of_n") -> dict[str, int]:
    """West-of-N pairs of a sampling run into preference_pairs under `source` (idempotent: content-hash ids). A pair
    the store holds under another source stays there (a pair is stored once): counted in `filter/pairs_elsewhere`
    and warned of, as a stage reading `source` will not see it (DPO on the run's own pairs, `samples_run_id`, reads
    every one; a preset's renamed west_of_n_source finds the pairs of its earlier runs under the old name)."""
    pairs, stats = west_of_n_of_run(store, run_id, source)
    elsewhere = store.stored_elsewhere("preference_pairs", pairs, ["source"])
    held = sum(count for _, count in elsewhere)
    if held:
        where = ", ".join(f"{count} under source {other!r}" for other, count in elsewhere)
        warnings.warn(f"West-of-N: {held} of the {pairs.height} pairs of run {run_id!r} are stored already ({where}) "
                      f"and stay there (a pair is stored once): a stage reading source {source!r} will not see them "
                      "(`samples_run_id` reads every pair of the run)", UserWarning, stacklevel=2)
    return stats | {"filter/pairs_inserted": store.insert_new("preference_pairs", pairs),
                    "filter/pairs_elsewhere": held}


def recorded_chat_template(samples: pl.DataFrame, run_id: str) -> bool | None:
    """Whether a sampling run's prompts went through the chat template, as its rows record; None where they record
    nothing (a run sampled before schema v2, or no rows)."""
    flags = set(samples["chat_template"].drop_nulls()) if "chat_template" in samples.columns else set()
    if len(flags) > 1:
        raise SamplesError(f"samples: run_id {run_id!r} has rows sampled with and without the chat template "
                           "(a run_id reused with another chat_template); sample into a new run_id")
    return flags.pop() if flags else None


def sampled_with_chat_template(samples: pl.DataFrame, run_id: str) -> bool:
    """`recorded_chat_template`, for West-of-N. A run sampled before schema v2 has no record until its sampling
    stage runs again (which records it): read as plain prompts, with a warning."""
    recorded = recorded_chat_template(samples, run_id)
    if recorded is None:
        warnings.warn(f"samples: run_id {run_id!r} was sampled before alignflow recorded the chat template; its "
                      "West-of-N pairs are plain prompts (rerun its sampling stage to record it)", stacklevel=2)
    return recorded is True


def run_best_of_n_stage(store: Store, *, run_id: str) -> dict[str, float]:
    """Best-of-N statistics of a sampling run (the selection itself is RS-SFT's data, `data: best_of_n`):
    the reward and accuracy of the selected completions against all samples'."""
    samples = run_samples(store, run_id)
    best = best_of_n(samples).join(samples.select("prompt_id", "completion", "is_correct").unique(),
                                   on=["prompt_id", "completion"], how="left")

    def mean(values: pl.Series) -> float:  # NaN where no value counts (no prompt had a whole, scored sample)
        value = values.cast(pl.Float64).fill_nan(None).mean()  # NaN rewards: unscored, as in best_of_n
        return float("nan") if value is None else float(value)

    return {"filter/prompts": best.height,
            "filter/skipped_unscored": samples["prompt_id"].n_unique() - best.height,  # no whole, scored sample
            "filter/best_reward_mean": mean(best["reward"]), "filter/all_reward_mean": mean(samples["reward"]),
            "filter/best_accuracy": mean(best["is_correct"]), "filter/all_accuracy": mean(samples["is_correct"])}


def run_dynamic_filter_stage(store: Store, *, run_id: str, group_size: int | None = None) -> dict[str, int]:
    """DAPO dynamic-sampling statistics of a sampling run: how many groups carry a learning signal. A group is a
    prompt's `group_size` samples; None: the run's samples per prompt (its `n`)."""
    samples = run_samples(store, run_id)
    if group_size is None:  # a prompt short of samples (a run still sampling) is then dynamic_sampling's error
        group_size = max(store.samples_per_prompt(run_id))
    _, stats = dynamic_sampling(samples, group_size)
    return {f"filter/{key}": value for key, value in stats.items()}
