"""Evaluation and filter stages through their flows: eval_results rows, MLflow metrics, plots and data
fingerprints, West-of-N pairs in the store, Best-of-N and dynamic-filter statistics, and the names a user
tells their runs apart by in the Prefect and MLflow UIs."""

from __future__ import annotations

import json
import math

import polars as pl
import pytest
from mlflow.tracking import MlflowClient

from flows.evaluate import eval_flow
from flows.filters import filter_flow
from pipeline_lib import tracking
from pipeline_lib.config import DPOConfig, EvalConfig
from pipeline_lib.errors import AlignflowError
from pipeline_lib.evaluation import run_eval_stage
from pipeline_lib.filters import SamplesError
from pipeline_lib.fingerprint import frame_fingerprint
from pipeline_lib.models import build_tiny_model
from pipeline_lib.store.db import open_store
from pipeline_lib.train.dpo import load_dpo_data
from tasks.evaluation import model_label
from tasks.filters import filter_task
from tasks.store import inputs_fingerprint_task

SAMPLES = pl.DataFrame({
    "run_id": "r1", "prompt_id": ["a"] * 4 + ["b"] * 4 + ["c"] * 4, "sample_idx": [0, 1, 2, 3] * 3,
    "prompt": ["1+1="] * 4 + ["2+2="] * 4 + ["3+3="] * 4,
    "completion": ["2", "3", "2", "5", "4", "4", "4", "4", "1", "2", "9", "8"],
    "reward": [1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0],
    "is_correct": [True, False, True, False, True, True, True, True, False, False, False, False],
    "chat_template": False,
})


def add_problems(workspace) -> None:
    problems = pl.DataFrame({"problem_id": ["p1", "p2"], "source": "demo", "split": "test",
                             "prompt": ["12+34=", "5+6="], "answer": ["46", "11"]})
    with open_store(workspace.store_path) as store:
        store.insert_new("problems", problems)


def test_eval_flow_writes_results_metrics_and_plots(flow_workspace, tmp_path, prefect_run):
    add_problems(flow_workspace)
    model = build_tiny_model(tmp_path / "tiny", ["0123456789+="])
    cfg = EvalConfig(model_path=str(model), model_name="tiny", n=4, max_new_tokens=3, device="cpu")  # ks: default

    state = eval_flow(cfg, return_state=True)
    rows = state.result()
    again = eval_flow(cfg)  # resumes the finished sampling run: same numbers, rows replaced not duplicated

    assert [r["k"] for r in rows] == [1, 2, 4] and rows == again
    with open_store(flow_workspace.store_path) as store:
        stored = store.read("eval_results")
    assert stored.height == 3 and set(stored["model"]) == {"tiny"}
    run = tracking.find_runs(flow_workspace, "tags.`alignflow.stage` = 'eval-tiny'")[0]
    assert run.data.metrics["eval/pass_at_4"] == rows[2]["pass_at_k"]
    assert "eval/maj_at_1" in run.data.metrics
    assert run.data.params["ks"] == "[1, 2, 4]"  # the K values evaluated, not the config's unset `ks`
    assert run.data.tags["data.fingerprint"] == inputs_fingerprint_task.fn(cfg, "eval-tiny")
    plots = {a.path for a in MlflowClient(flow_workspace.tracking_uri).list_artifacts(run.info.run_id, "plots")}
    assert plots == {"plots/pass_at_k.png", "plots/maj_at_k.png", "plots/reward_length_hist.png"}
    name, _, artifact_keys = prefect_run(state)
    assert name == "eval-tiny" and artifact_keys == {"eval-results-tiny"}  # one table per model in Prefect

    renamed = eval_flow(cfg.model_copy(update={"model_name": "base"}))  # the same dir under another name
    assert [r["pass_at_k"] for r in renamed] == [r["pass_at_k"] for r in rows]  # from the same samples
    with open_store(flow_workspace.store_path) as store:
        assert store.read("eval_results").sort("model", "k").select("model", "k").rows() == [
            ("base", 1), ("base", 2), ("base", 4), ("tiny", 1), ("tiny", 2), ("tiny", 4)]


def test_a_cache_hit_whose_results_left_the_store_evaluates_again(flow_workspace, tmp_path):
    add_problems(flow_workspace)
    model = build_tiny_model(tmp_path / "tiny", ["0123456789+="])
    cfg = EvalConfig(model_path=str(model), model_name="tiny", n=2, ks=(1, 2), max_new_tokens=3, device="cpu")
    rows = eval_flow(cfg)
    assert eval_flow(cfg) == rows  # a cache hit
    assert len(tracking.find_runs(flow_workspace, "tags.`alignflow.stage` = 'eval-tiny'")) == 1
    with open_store(flow_workspace.store_path) as store:
        store.con.execute("DELETE FROM eval_results")
    assert eval_flow(cfg) == rows
    with open_store(flow_workspace.store_path) as store:
        assert store.read("eval_results").sort("k").select("model", "k").rows() == [("tiny", 1), ("tiny", 2)]


def test_a_cache_hit_whose_results_were_replaced_by_other_ks_evaluates_again(flow_workspace, tmp_path):
    """Another evaluation under the same name and sampling run replaced the rows with as many others: the cache hit
    evaluates again rather than print rows the store no longer holds."""
    add_problems(flow_workspace)
    model = build_tiny_model(tmp_path / "tiny", ["0123456789+="])
    cfg = EvalConfig(model_path=str(model), model_name="tiny", n=4, ks=(1, 2), max_new_tokens=3, device="cpu")
    rows = eval_flow(cfg)
    eval_flow(cfg.model_copy(update={"ks": (2, 4)}))
    assert eval_flow(cfg) == rows
    with open_store(flow_workspace.store_path) as store:
        assert store.read("eval_results").sort("k").select("k", "pass_at_k").rows() == [
            (row["k"], row["pass_at_k"]) for row in rows]


def test_samples_of_problems_no_longer_selected_are_not_scored(flow_workspace, tmp_path):
    """A problem deleted (or re-ingested with another answer, a new problem_id) since its sampling run, which keeps
    its id without max_problems: its samples stay in the run and are left out of the scores."""
    add_problems(flow_workspace)
    model = build_tiny_model(tmp_path / "tiny", ["0123456789+="])
    cfg = EvalConfig(model_path=str(model), model_name="tiny", n=2, ks=(1, 2), max_new_tokens=3, device="cpu")
    eval_flow(cfg)
    with open_store(flow_workspace.store_path) as store:
        store.con.execute("DELETE FROM problems WHERE problem_id = 'p2'")
    rows = eval_flow(cfg)
    with open_store(flow_workspace.store_path) as store:
        results, samples, _ = run_eval_stage(cfg, store, progress=False)
        assert store.count("samples") == 4  # p2's samples are still in the run
    assert set(samples["prompt_id"]) == {"p1"} and results.to_dicts() == rows


def test_an_eval_run_names_the_sampling_run_it_scored(flow_workspace, tmp_path):
    """The sample stage tags its MLflow run with the samples run id and policy; the eval stage samples into such a
    run too, and its MLflow run did not say which: its tags name the run whose rows eval_results scored."""
    add_problems(flow_workspace)
    model = build_tiny_model(tmp_path / "tiny", ["0123456789+="])
    cfg = EvalConfig(model_path=str(model), model_name="tiny", n=2, ks=(1, 2), max_new_tokens=3, device="cpu")
    eval_flow(cfg)
    tags = tracking.find_runs(flow_workspace, "tags.`alignflow.stage` = 'eval-tiny'")[0].data.tags
    with open_store(flow_workspace.store_path) as store:
        scored = store.read("eval_results")
        samples = store.read("samples", run_id=tags["samples.run_id"])
    assert set(scored["run_id"]) == {tags["samples.run_id"]} and samples.height == 4  # 2 problems x n 2
    assert set(samples["policy"]) == {tags["samples.policy"]} == {"tiny"}


def test_an_unnamed_model_is_named_after_the_stage_that_wrote_it(flow_workspace, tmp_path, prefect_run):
    """`alignflow eval --model ws/models/sft/<hash>/final` shows as eval-sft, not eval-/abs/path/.../final."""
    add_problems(flow_workspace)
    model = build_tiny_model(flow_workspace.models_dir / "sft" / "0123456789abcdef" / "final", ["0123456789+="])
    cfg = EvalConfig(model_path=str(model), n=2, ks=(1, 2), max_new_tokens=3, device="cpu")

    state = eval_flow(cfg, return_state=True)

    run = tracking.find_runs(flow_workspace, "tags.`alignflow.stage` = 'eval-sft'")[0]
    assert run.info.run_name == "eval-sft"
    name, _, artifact_keys = prefect_run(state)
    assert name == "eval-sft" and artifact_keys == {"eval-results-sft"}
    outside = build_tiny_model(tmp_path / "Tiny_Model", ["0123456789+="])
    assert model_label(cfg.model_copy(update={"model_path": str(outside)})) == "Tiny_Model"  # its dir name


def test_west_of_n_accounts_for_every_prompt_of_the_run(insert_samples, flow_workspace):
    """A prompt without a scored sample (all rewards NaN) gives no pair and is no tie: it is counted on its own."""
    unscored = SAMPLES.head(4).with_columns(prompt_id=pl.lit("d"), reward=pl.lit(float("nan")))
    with open_store(flow_workspace.store_path) as store:
        insert_samples(store, pl.concat([SAMPLES, unscored]).with_columns(run_id=pl.lit("r4")))
    stats = filter_task.fn("west_of_n", "r4")
    assert (stats["filter/prompts"], stats["filter/pairs"], stats["filter/skipped_ties"],
            stats["filter/skipped_unscored"]) == (4, 1, 2, 1)


def test_filter_flows_on_a_sampling_run(insert_samples, flow_workspace, the_run, prefect_run):
    with open_store(flow_workspace.store_path) as store:
        insert_samples(store, SAMPLES)
    state = filter_flow("west_of_n", "r1", return_state=True)
    won = state.result()
    assert won == {"filter/prompts": 3, "filter/pairs": 1, "filter/pairs_inserted": 1, "filter/skipped_ties": 2,
                   "filter/skipped_unscored": 0, "filter/chat_template": 0, "filter/pairs_elsewhere": 0}
    with open_store(flow_workspace.store_path) as store:
        read = frame_fingerprint(store.run_samples("r1"))
    assert the_run(flow_workspace, "west_of_n")[0].data.tags["data.fingerprint"] == read  # the rows it filtered
    assert prefect_run(state)[0] == "west_of_n-r1"
    with open_store(flow_workspace.store_path) as store:
        pairs = store.read("preference_pairs", source="west_of_n")
    assert pairs.select("prompt", "chosen", "rejected").row(0) == ("1+1=", "2", "3")
    assert filter_flow("west_of_n", "r1") == won  # a cache hit
    assert filter_task.fn("west_of_n", "r1")["filter/pairs_inserted"] == 0  # and the body is idempotent

    state = filter_flow("best_of_n", "r1", return_state=True)
    bon = state.result()
    assert bon["filter/best_accuracy"] == 2 / 3 and bon["filter/all_accuracy"] == 6 / 12
    assert prefect_run(state)[0] == "best_of_n-r1"
    with open_store(flow_workspace.store_path) as store:  # an unscored (NaN) sample counts in neither mean
        insert_samples(store, SAMPLES.with_columns(run_id=pl.lit("r2"),
                                                   reward=pl.col("reward").replace(0.0, float("nan"))))
    assert filter_task.fn("best_of_n", "r2")["filter/all_reward_mean"] == 1.0
    dyn = filter_flow("dynamic", "r1", group_size=4)
    assert dyn == {"filter/groups_total": 3, "filter/groups_kept": 1, "filter/dropped_all_correct": 1,
                   "filter/dropped_all_wrong": 1}
    assert filter_task.fn("dynamic", "r1") == dyn  # no group_size: the run's 4 samples per prompt (a TypeError)


def test_best_of_n_of_a_run_without_a_whole_scored_sample_reports_nan_means(insert_samples, flow_workspace):
    """Every sample cut at max_new_tokens (a preset with few new tokens): the stage crashed on float(None)."""
    with open_store(flow_workspace.store_path) as store:
        insert_samples(store, SAMPLES.with_columns(run_id=pl.lit("cut"), finish_reason=pl.lit("length")))
    stats = filter_task.fn("best_of_n", "cut")
    assert (stats["filter/prompts"], stats["filter/skipped_unscored"]) == (0, 3)
    assert math.isnan(stats["filter/best_reward_mean"]) and math.isnan(stats["filter/best_accuracy"])
    assert stats["filter/all_accuracy"] == 6 / 12  # every sample still counts in the run's own figures


def test_west_of_n_pairs_go_under_their_source_and_dpo_trains_on_one_runs_alone(insert_samples, flow_workspace):
    """Two sampling runs (an earlier SFT model's, this one's) both leave West-of-N pairs under the pipeline's
    source; DPO with samples_run_id reads the pairs of its run alone, not the earlier run's."""
    later = SAMPLES.with_columns(run_id=pl.lit("r2"), completion=pl.col("completion").replace({"3": "7", "5": "6"}))
    with open_store(flow_workspace.store_path) as store:
        insert_samples(store, pl.concat([SAMPLES, later]))
    for run in ("r1", "r2"):
        assert filter_flow("west_of_n", run, source="won_custom")["filter/pairs_inserted"] == 1
    with open_store(flow_workspace.store_path) as store:
        assert store.count("preference_pairs", source="won_custom") == 2
        assert store.count("preference_pairs", source="west_of_n") == 0
        pairs = load_dpo_data(store, DPOConfig(policy_path="/m", samples_run_id="r2"))
    assert pairs.select("prompt", "chosen", "rejected").rows() == [("1+1=", "2", "7")]


def test_west_of_n_pairs_deleted_since_a_cached_filter_run_are_written_again(insert_samples, flow_workspace):
    """`alignflow data delete --source` frees a source; the pipeline's next (cached) filter run puts its pairs back
    instead of leaving the source empty, and a run whose pairs are all stored stays a cache hit."""
    with open_store(flow_workspace.store_path) as store:
        insert_samples(store, SAMPLES.with_columns(run_id=pl.lit("d1")))
    assert filter_flow("west_of_n", "d1", source="won_d")["filter/pairs_inserted"] == 1
    assert filter_flow("west_of_n", "d1", source="won_d")["filter/pairs_inserted"] == 1  # cached: the first stats
    runs = len(tracking.find_runs(flow_workspace, "tags.`alignflow.stage` = 'west_of_n'"))
    with open_store(flow_workspace.store_path) as store:
        assert store.delete_source("won_d")["preference_pairs"] == 1
    assert filter_flow("west_of_n", "d1", source="won_d")["filter/pairs_inserted"] == 1
    with open_store(flow_workspace.store_path) as store:
        assert store.count("preference_pairs", source="won_d") == 1
    assert len(tracking.find_runs(flow_workspace, "tags.`alignflow.stage` = 'west_of_n'")) == runs + 1


def test_west_of_n_pairs_stored_under_another_source_are_counted_and_warned_of(insert_samples, flow_workspace):
    """A preset's west_of_n_source renamed: its run's pairs are held under the old name (a pair is stored once), so
    the filter inserted none, in silence, and DPO on the new source found no rows. Now it counts and warns of them
    (no refusal: a preset whose DPO reads `samples_run_id` needs no source, and the holder may be an ingested
    dataset); the pairs not held elsewhere are stored under the new source."""
    with open_store(flow_workspace.store_path) as store:
        insert_samples(store, SAMPLES.with_columns(run_id=pl.lit("w1")))
    assert filter_flow("west_of_n", "w1", source="won_a")["filter/pairs_inserted"] == 1
    with pytest.warns(UserWarning, match=r"^West-of-N: 1 of the 1 pairs of run 'w1' are stored already \(1 under "
                                         r"source 'won_a'\) and stay there \(a pair is stored once\): a stage reading "
                                         r"source 'won_b' will not see them"):
        stats = filter_flow("west_of_n", "w1", source="won_b")
    assert (stats["filter/pairs_inserted"], stats["filter/pairs_elsewhere"]) == (0, 1)
    another = SAMPLES.with_columns(run_id=pl.lit("w2"), reward=pl.Series([1.0, 0, 1, 0, 1, 1, 1, 1, 1, 0, 0, 0]))
    with open_store(flow_workspace.store_path) as store:
        insert_samples(store, another)
    with pytest.warns(UserWarning, match=r"^West-of-N: 1 of the 2 pairs of run 'w2'"):
        stats = filter_flow("west_of_n", "w2", source="won_c")
    assert (stats["filter/pairs"], stats["filter/pairs_inserted"], stats["filter/pairs_elsewhere"]) == (2, 1, 1)


def test_a_filter_on_a_run_without_rows_is_one_line_and_not_retried(flow_workspace, insert_samples):
    with pytest.raises(SamplesError, match=r"^samples: no rows for run_id 'nosuch' \(of problems the store holds\); "
                                           r"the store holds no sampling run; run the sampling stage first, or name "
                                           r"one of them$"):
        filter_flow("west_of_n", "nosuch")
    assert isinstance(SamplesError("x"), AlignflowError)
    assert len(tracking.find_runs(flow_workspace, "tags.`alignflow.stage` = 'west_of_n'")) == 1  # no retry
    with open_store(flow_workspace.store_path) as store:
        insert_samples(store, SAMPLES)
    # a mistyped run id: the runs it could be (a helper found no command that lists them)
    with pytest.raises(SamplesError, match=r"; the store holds runs 'r1' \(12 rows\); run the sampling stage"):
        filter_flow("west_of_n", "r1x")


def test_west_of_n_of_a_chat_template_run_stores_conversations(insert_samples, flow_workspace, the_run):
    with open_store(flow_workspace.store_path) as store:
        insert_samples(store, SAMPLES.with_columns(run_id=pl.lit("c1"), chat_template=True))
    assert filter_flow("west_of_n", "c1")["filter/pairs_inserted"] == 1  # the samples say how they were made
    with open_store(flow_workspace.store_path) as store:
        pair = store.read("preference_pairs").row(0, named=True)
    assert json.loads(pair["prompt_messages"])["prompt"] == [{"role": "user", "content": "1+1="}]
    assert the_run(flow_workspace, "west_of_n")[0].data.metrics["filter/chat_template"] == 1


def test_samples_of_problems_deleted_since_are_left_out_of_the_filters(insert_samples, flow_workspace):
    """A problem deleted since its run sampled it (or re-ingested with a corrected answer: a new problem_id) leaves
    samples scored against what it was: the filters run again without them, and RS-SFT does not train on them."""
    with open_store(flow_workspace.store_path) as store:
        insert_samples(store, SAMPLES)
    assert filter_flow("best_of_n", "r1")["filter/prompts"] == 3
    with open_store(flow_workspace.store_path) as store:
        store.con.execute("DELETE FROM problems WHERE problem_id = 'a'")
        assert sorted(store.run_samples("r1")["prompt_id"].unique()) == ["b", "c"]
        assert store.count("samples", run_id="r1") == 12
    stats = filter_flow("best_of_n", "r1")  # its input changed: not a cache hit
    assert stats["filter/prompts"] == 2 and stats["filter/all_accuracy"] == 4 / 8
    assert filter_flow("west_of_n", "r1")["filter/pairs"] == 0  # 'a' held the only pair


def test_a_sampling_run_that_gained_rows_is_filtered_again(insert_samples, flow_workspace):
    """A sampling run resumed on newly ingested problems keeps its id: West-of-N must see the new samples."""
    with open_store(flow_workspace.store_path) as store:
        insert_samples(store, SAMPLES)
    assert filter_flow("west_of_n", "r1")["filter/pairs_inserted"] == 1
    more = SAMPLES.filter(pl.col("prompt_id") == "a").with_columns(prompt_id=pl.lit("d"), prompt=pl.lit("0+2="))
    with open_store(flow_workspace.store_path) as store:
        insert_samples(store, more)
    again = filter_flow("west_of_n", "r1")
    assert (again["filter/prompts"], again["filter/pairs_inserted"]) == (4, 1)
