"""Evaluation and filter stages through their flows: eval_results rows, MLflow metrics and plots,
West-of-N pairs in the store, Best-of-N and dynamic-filter statistics."""

from __future__ import annotations

import polars as pl
from mlflow.tracking import MlflowClient

from flows.evaluate import eval_flow
from flows.filters import filter_flow
from pipeline_lib import tracking
from pipeline_lib.config import EvalConfig
from pipeline_lib.models import build_tiny_model
from pipeline_lib.store.db import open_store
from tasks.filters import filter_task

SAMPLES = pl.DataFrame({
    "run_id": "r1", "prompt_id": ["a"] * 4 + ["b"] * 4 + ["c"] * 4, "sample_idx": [0, 1, 2, 3] * 3,
    "prompt": ["1+1="] * 4 + ["2+2="] * 4 + ["3+3="] * 4,
    "completion": ["2", "3", "2", "5", "4", "4", "4", "4", "1", "2", "9", "8"],
    "reward": [1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0],
    "is_correct": [True, False, True, False, True, True, True, True, False, False, False, False],
})


def test_eval_flow_writes_results_metrics_and_plots(flow_workspace, tmp_path):
    problems = pl.DataFrame({"problem_id": ["p1", "p2"], "source": "demo", "split": "test",
                             "prompt": ["12+34=", "5+6="], "answer": ["46", "11"]})
    with open_store(flow_workspace.store_path) as store:
        store.insert_new("problems", problems)
    model = build_tiny_model(tmp_path / "tiny", ["0123456789+="])
    cfg = EvalConfig(model_path=str(model), model_name="tiny", n=4, ks=(1, 2, 4), max_new_tokens=3, device="cpu")

    rows = eval_flow(cfg)
    again = eval_flow(cfg)  # resumes the finished sampling run: same numbers, rows replaced not duplicated

    assert [r["k"] for r in rows] == [1, 2, 4] and rows == again
    with open_store(flow_workspace.store_path) as store:
        stored = store.read("eval_results")
    assert stored.height == 3 and set(stored["model"]) == {"tiny"}
    run = tracking.find_runs(flow_workspace, "tags.`alignflow.stage` = 'eval-tiny'")[0]
    assert run.data.metrics["eval/pass_at_4"] == rows[2]["pass_at_k"]
    assert "eval/maj_at_1" in run.data.metrics
    plots = {a.path for a in MlflowClient(flow_workspace.tracking_uri).list_artifacts(run.info.run_id, "plots")}
    assert plots == {"plots/pass_at_k.png", "plots/maj_at_k.png", "plots/reward_length_hist.png"}


def test_filter_flows_on_a_sampling_run(flow_workspace):
    with open_store(flow_workspace.store_path) as store:
        store.insert_new("samples", SAMPLES)
    won = filter_flow("west_of_n", "r1")
    assert won == {"filter/prompts": 3, "filter/pairs": 1, "filter/pairs_inserted": 1, "filter/skipped_ties": 2}
    with open_store(flow_workspace.store_path) as store:
        pairs = store.read("preference_pairs", source="west_of_n")
    assert pairs.select("prompt", "chosen", "rejected").row(0) == ("1+1=", "2", "3")
    assert filter_flow("west_of_n", "r1") == won  # a cache hit
    assert filter_task.fn("west_of_n", "r1")["filter/pairs_inserted"] == 0  # and the body is idempotent

    bon = filter_flow("best_of_n", "r1")
    assert bon["filter/best_accuracy"] == 2 / 3 and bon["filter/all_accuracy"] == 6 / 12
    with open_store(flow_workspace.store_path) as store:  # an unscored (NaN) sample counts in neither mean
        store.insert_new("samples", SAMPLES.with_columns(run_id=pl.lit("r2"), reward=pl.col("reward").replace(0.0, float("nan"))))
    assert filter_task.fn("best_of_n", "r2")["filter/all_reward_mean"] == 1.0
    dyn = filter_flow("dynamic", "r1", group_size=4)
    assert dyn == {"filter/groups_total": 3, "filter/groups_kept": 1, "filter/dropped_all_correct": 1,
                   "filter/dropped_all_wrong": 1}
