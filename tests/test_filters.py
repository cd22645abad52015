"""Best-of-N, West-of-N and DAPO dynamic sampling on crafted groups (ties, all-correct, shaped all-wrong)."""

from __future__ import annotations

import hashlib
import json
import math
import warnings

import polars as pl
import pytest
import torch

from pipeline_lib.filters import (
    SamplesError,
    best_of_n,
    dynamic_sampling,
    dynamic_sampling_stats,
    informative_groups,
    sampled_with_chat_template,
    west_of_n,
)
from pipeline_lib.fingerprint import content_id
from pipeline_lib.store.db import open_store
from pipeline_lib.store.ingest import ingest_file


def samples_frame(groups: dict[str, list[tuple[float | None, bool]]]) -> pl.DataFrame:
    """One row per (prompt, sample): completion `<prompt>-<idx>`, the given reward and correctness."""
    rows = [
        {
            "prompt_id": pid,
            "sample_idx": idx,
            "prompt": f"prompt {pid}",
            "completion": f"{pid}-{idx}",
            "reward": reward,
            "is_correct": correct,
        }
        for pid, group in groups.items()
        for idx, (reward, correct) in enumerate(group)
    ]
    return pl.DataFrame(rows, schema={"prompt_id": pl.String, "sample_idx": pl.Int64, "prompt": pl.String,
                                      "completion": pl.String, "reward": pl.Float64, "is_correct": pl.Boolean})


GROUPS = {
    "mixed": [(0.2, False), (0.9, True), (0.9, True), (-0.3, False)],  # tie at the top: idx 1 wins
    "all_correct": [(1.0, True)] * 4,  # every reward equal
    # all wrong, but overlong shaping made the rewards differ (reward std > 0)
    "all_wrong_shaped": [(0.0, False), (-0.25, False), (-1.0, False), (-0.5, False)],
    "low_tie": [(0.5, True), (-0.7, False), (0.1, False), (-0.7, False)],  # tie at the bottom: idx 1
}


def test_best_of_n_keeps_the_top_reward_lowest_index_on_ties():
    best = best_of_n(samples_frame(GROUPS).sample(fraction=1.0, shuffle=True, seed=3))
    assert best.columns == ["prompt_id", "prompt", "completion", "reward"]
    assert best.to_dicts() == [
        {"prompt_id": "all_correct", "prompt": "prompt all_correct", "completion": "all_correct-0", "reward": 1.0},
        {"prompt_id": "all_wrong_shaped", "prompt": "prompt all_wrong_shaped", "completion": "all_wrong_shaped-0",
         "reward": 0.0},
        {"prompt_id": "low_tie", "prompt": "prompt low_tie", "completion": "low_tie-0", "reward": 0.5},
        {"prompt_id": "mixed", "prompt": "prompt mixed", "completion": "mixed-1", "reward": 0.9},
    ]


def test_best_of_n_ignores_unscored_samples():
    frame = samples_frame({"p": [(None, False), (math.nan, False), (math.inf, False), (0.1, True), (-math.inf, False),
                                 (-0.2, False)], "unscored": [(None, False)]})
    best = best_of_n(frame)
    assert best["completion"].to_list() == ["p-3"]  # NaN would sort above every number if kept, and inf win
    pairs, skipped = west_of_n(frame)
    assert (pairs["chosen"].to_list(), pairs["rejected"].to_list(), skipped) == (["p-3"], ["p-5"], 0)
    strict = {"parse_constant": lambda name: pytest.fail(f"meta holds {name}, which is not JSON")}
    assert json.loads(pairs["meta"][0], **strict) == {
        "prompt_id": "p", "chosen_idx": 3, "rejected_idx": 5, "chosen_reward": 0.1, "rejected_reward": -0.2}


def test_samples_cut_at_max_new_tokens_neither_win_nor_lose_a_group():
    """A sample cut at max_new_tokens (finish_reason `length`) is no whole response: SFT and DPO would train it with
    eos appended, teaching the model to stop where the cut fell."""
    frame = samples_frame({"p": [(0.9, False), (0.5, True), (0.1, False), (-0.4, False)],
                           "cut": [(0.3, False), (0.2, False)]})
    frame = frame.with_columns(pl.Series("finish_reason", ["length", "stop", "stop", "length", "length", None]))
    assert best_of_n(frame)["completion"].to_list() == ["cut-1", "p-1"]  # finish_reason unknown (null): kept
    pairs, skipped = west_of_n(frame)
    assert (pairs["chosen"].to_list(), pairs["rejected"].to_list(), skipped) == (["p-1"], ["p-2"], 1)
    assert best_of_n(frame.drop("finish_reason"))["completion"].to_list() == ["cut-0", "p-0"]


def test_west_of_n_pairs_best_with_worst_and_skips_flat_groups():
    pairs, skipped = west_of_n(samples_frame(GROUPS), source="bon_test")
    assert skipped == 1  # all_correct: best reward == worst reward
    assert pairs.columns == ["pair_id", "source", "prompt", "chosen", "rejected", "prompt_messages", "meta"]
    by_prompt = {row["prompt"]: row for row in pairs.to_dicts()}
    assert set(by_prompt) == {"prompt mixed", "prompt all_wrong_shaped", "prompt low_tie"}
    mixed = by_prompt["prompt mixed"]
    assert (mixed["chosen"], mixed["rejected"], mixed["source"]) == ("mixed-1", "mixed-3", "bon_test")
    assert json.loads(mixed["meta"]) == {
        "prompt_id": "mixed", "chosen_idx": 1, "rejected_idx": 3, "chosen_reward": 0.9, "rejected_reward": -0.3,
    }
    assert by_prompt["prompt low_tie"]["rejected"] == "low_tie-1"  # lowest index among the tied worst
    expected_id = hashlib.sha256("prompt mixed\x1fmixed-1\x1fmixed-3".encode()).hexdigest()
    assert mixed["pair_id"] == expected_id == content_id("prompt mixed", "mixed-1", "mixed-3")


def test_west_of_n_single_sample_and_all_tied_prompts_give_no_pairs():
    pairs, skipped = west_of_n(samples_frame({"one": [(0.3, True)], "tied": [(0.2, False), (0.2, True)]}))
    assert pairs.height == 0 and skipped == 2
    assert pairs.columns == ["pair_id", "source", "prompt", "chosen", "rejected", "prompt_messages", "meta"]


def test_west_of_n_pairs_distinct_texts_and_never_an_empty_completion():
    frame = samples_frame({"same": [(0.5, True), (0.1, False)], "empty": [(0.0, False), (-0.5, False), (-1.0, False)],
                           "dup": [(0.9, True), (0.2, False), (0.3, False)]})
    # one text scored twice (a reward model's batch jitter), and differing only in the whitespace around it, which
    # ingest refuses as "chosen identical to rejected"; "dup-0" sampled twice (mean reward 0.6 > 0.2), the first
    # sample's text stored
    texts = {("same", 1): "42\n", ("same", 0): "42", ("empty", 0): "  ", ("dup", 2): " dup-0"}
    frame = frame.with_columns(pl.Series("completion", [texts.get((p, i), c) for p, i, c in
                                                        frame.select("prompt_id", "sample_idx", "completion").rows()]))
    pairs, skipped = west_of_n(frame)
    assert skipped == 1  # "same": one distinct text
    assert [(r["prompt"], r["chosen"], r["rejected"]) for r in pairs.to_dicts()] == [
        ("prompt dup", "dup-0", "dup-1"), ("prompt empty", "empty-1", "empty-2")]  # "  " had the best reward
    assert json.loads(pairs["meta"][0])["chosen_reward"] == pytest.approx(0.6)
    assert pairs["prompt_messages"].to_list() == [None, None]
    assert best_of_n(frame).filter(pl.col("prompt_id") == "empty")["completion"].to_list() == ["empty-1"]


def test_a_runs_rows_say_whether_it_sampled_with_the_chat_template():
    frame = samples_frame({"p": [(1.0, True), (0.0, False)]})
    assert sampled_with_chat_template(frame.with_columns(chat_template=True), "r") is True
    assert sampled_with_chat_template(frame.with_columns(chat_template=False), "r") is False
    with pytest.raises(ValueError, match="run_id 'r' has rows sampled with and without the chat template"):
        sampled_with_chat_template(frame.with_columns(chat_template=pl.Series([True, False])), "r")
    with pytest.warns(UserWarning, match="run_id 'r' was sampled before alignflow recorded the chat template"):
        assert sampled_with_chat_template(frame.with_columns(chat_template=pl.lit(None, pl.Boolean)), "r") is False
    with pytest.warns(UserWarning, match="rerun its sampling stage to record it"):
        assert sampled_with_chat_template(frame, "r") is False  # no such column: a frame from a v1 store
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # some rows recorded: no warning
        assert sampled_with_chat_template(frame.with_columns(chat_template=pl.Series([None, True])), "r") is True


def test_west_of_n_pairs_of_a_chat_template_run_are_conversations(tmp_path):
    """Pairs of a run that sampled with the chat template are stored as ingest stores that conversation (the same
    prompt text, messages and pair_id), so DPO and the reward model condition on the prompt the completions were
    sampled from, and ingesting the conversation finds the pair stored."""
    pairs, _ = west_of_n(samples_frame({"mixed": GROUPS["mixed"]}), chat_template=True)
    pair = pairs.row(0, named=True)
    conversation = {"prompt": [{"role": "user", "content": "prompt mixed"}],
                    "chosen": [{"role": "assistant", "content": "mixed-1"}],
                    "rejected": [{"role": "assistant", "content": "mixed-3"}]}
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps(conversation) + "\n")
    with open_store(tmp_path / "s.duckdb") as store:
        ingest_file(path, store)
        ingested = store.read("preference_pairs").row(0, named=True)
        assert store.insert_new("preference_pairs", pairs) == 0  # the West-of-N pair is the ingested one
    for row in (pair, ingested):
        assert (row["prompt"], row["chosen"], row["rejected"]) == ("user: prompt mixed", "mixed-1", "mixed-3")
        assert json.loads(row["prompt_messages"]) == conversation
        assert row["pair_id"] == hashlib.sha256(row["prompt_messages"].encode()).hexdigest()
    assert pair["pair_id"] == ingested["pair_id"]


def test_dynamic_sampling_uses_correctness_not_shaped_rewards():
    frame = samples_frame(GROUPS)
    shaped = frame.filter(pl.col("prompt_id") == "all_wrong_shaped")["reward"]
    assert shaped.std() > 0  # a reward-std filter would wrongly keep this group
    kept, stats = dynamic_sampling(frame.sample(fraction=1.0, shuffle=True, seed=1), group_size=4)
    assert stats == {"groups_total": 4, "groups_kept": 2, "dropped_all_correct": 1, "dropped_all_wrong": 1}
    assert kept["prompt_id"].unique(maintain_order=True).to_list() == ["low_tie", "mixed"]
    assert kept["sample_idx"].to_list() == [0, 1, 2, 3, 0, 1, 2, 3]
    assert kept.columns == frame.columns


def test_informative_groups_on_flat_tensors_and_lists():
    """Groups of 3: [T,T,T] all correct, [F,F,F] all wrong, [T,F,F] and [F,F,T] informative."""
    flat = [True, True, True, False, False, False, True, False, False, False, False, True]
    expected = [False, False, True, True]
    for correctness in (flat, torch.tensor(flat)):
        keep = informative_groups(correctness, 3)
        assert keep.dtype == torch.bool and keep.tolist() == expected
        assert dynamic_sampling_stats(correctness, 3) == \
            {"groups_total": 4, "groups_kept": 2, "dropped_all_correct": 1, "dropped_all_wrong": 1}


def test_the_frame_and_the_loops_flat_form_agree():
    """The filter stage (a samples frame) and the GRPO loop (`informative_groups` on a rollout's flat outcomes)."""
    frame = samples_frame(GROUPS).sort("prompt_id", "sample_idx")
    kept, stats = dynamic_sampling(frame, 4)
    mask = informative_groups(frame["is_correct"].to_list(), 4)
    kept_ids = frame["prompt_id"].unique(maintain_order=True).filter(pl.Series(mask.tolist())).to_list()
    assert kept_ids == kept["prompt_id"].unique(maintain_order=True).to_list()
    assert stats == dynamic_sampling_stats(frame["is_correct"].to_list(), 4)


def test_dynamic_sampling_rejects_bad_groups():
    with pytest.raises(ValueError, match="prompt 'short' has 2 samples; expected group_size=4"):
        dynamic_sampling(samples_frame({**GROUPS, "short": [(1.0, True), (0.0, False)]}), 4)
    with pytest.raises(ValueError, match="is_correct: 1 null"):
        dynamic_sampling(samples_frame({"p": [(1.0, True), (0.0, None)]}), 2)
    with pytest.raises(ValueError, match="multiple of group_size=4"):
        informative_groups(torch.ones(6, dtype=torch.bool), 4)
    with pytest.raises(ValueError, match=r"missing column\(s\) \['is_correct'\]"):
        dynamic_sampling(samples_frame(GROUPS).drop("is_correct"), 4)


@pytest.mark.parametrize("chat_template", [False, True])
def test_text_blank_or_alike_to_pythons_strip_is_no_candidate_and_no_crash(chat_template):
    """U+001C..U+001F are whitespace to str.strip() (split_chat, ingest) but not to polars' strip_chars: a "\\x1c"
    completion was a candidate and "4\\x1f" differed from "4", so the chat form of the pair (split_chat refusing it)
    crashed West-of-N with `too many values to unpack`."""
    frame = pl.DataFrame({"prompt_id": ["a"] * 3 + ["b"] * 2, "sample_idx": [0, 1, 2, 0, 1],
                          "prompt": ["What is 2+2?"] * 5, "completion": ["4", "\x1c", "5", "4\x1f", "4"],
                          "reward": [1.0, -1.0, 0.0, 1.0, 0.0]})
    pairs, skipped = west_of_n(frame, chat_template=chat_template)
    assert pairs.select("chosen", "rejected").rows() == [("4", "5")] and skipped == 1  # b: one text, no pair
    assert best_of_n(frame.with_columns(reward=pl.Series([0.0, 1.0, 0.5, 1.0, 0.0]))).select(
        "prompt_id", "completion").rows() == [("a", "5"), ("b", "4\x1f")]
    blank_prompt = frame.head(3).with_columns(prompt=pl.lit("\x1f"))  # a problem stored before ingest refused it
    if chat_template:
        with pytest.raises(SamplesError) as raised:
            west_of_n(blank_prompt, chat_template=True)
        assert str(raised.value).startswith("samples: prompt_id 'a' (prompt '\\x1f'): its West-of-N pair is no "
                                            "conversation ingest would store (empty field 'prompt'); ")
