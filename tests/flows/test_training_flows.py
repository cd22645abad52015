"""SFT, reward-model and DPO stages through all three layers: flows under the Prefect harness read the store,
train a tiny model for a few steps, and leave an MLflow run with metrics, the model artifact and the config."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import polars as pl
import pytest
from mlflow import MlflowClient
from prefect.exceptions import ParameterTypeError

from flows.dpo import dpo_flow
from flows.rm import rm_flow
from flows.sft import sft_flow
from pipeline_lib import tracking
from pipeline_lib.config import ConfigError, DPOConfig, PPOConfig, RMConfig, SFTConfig
from pipeline_lib.errors import AlignflowError
from pipeline_lib.fingerprint import model_fingerprint
from pipeline_lib.model_dirs import FINAL_MARKER
from pipeline_lib.models import RewardModel, build_tiny_model, load_policy
from pipeline_lib.store.db import open_store
from pipeline_lib.train.common import final_metrics
from pipeline_lib.train.data import stage_dir
from tasks import training
from tasks.training import sft_task

FAST = dict(max_steps=2, batch_size=4, log_every=1, device="cpu")
SAMPLES = pl.DataFrame({  # one sampling run of 4 prompts: 2 samples each, the first one verified correct
    "run_id": "r1", "prompt_id": [f"p{i // 2}" for i in range(8)], "sample_idx": [0, 1] * 4,
    "prompt": [f"{i // 2}+1=" for i in range(8)], "completion": [str(i // 2 + 1 + i % 2) for i in range(8)],
    "reward": [1.0, 0.0] * 4, "is_correct": [True, False] * 4,
})


def fill_store(workspace) -> None:
    """Problems, pairs (one conversational) and rankings, as ingest would leave them."""
    problems = pl.DataFrame({
        "problem_id": [f"p{i}" for i in range(12)], "source": "demo",
        "split": ["train"] * 8 + ["test"] * 4,
        "prompt": [f"{i:02d}+{i + 3:02d}=" for i in range(12)], "answer": [str(2 * i + 3) for i in range(12)],
    })
    pairs = pl.DataFrame({
        "pair_id": [f"q{i}" for i in range(10)], "source": "demo",
        "prompt": [f"{i:02d}+01=" for i in range(10)], "chosen": [str(i + 1) for i in range(10)],
        "rejected": [str(i + 2) for i in range(9)] + ["no idea"],
        "prompt_messages": [None] * 9 + [json.dumps({"prompt": [{"role": "user", "content": "09+01="}]})],
    })
    rankings = pl.DataFrame({
        "ranking_id": [f"r{i}" for i in range(10)], "source": "demo", "prompt": [f"{i:02d}+02=" for i in range(10)],
        "responses": [[str(i + 2), str(i + 3), "no idea"] for i in range(10)], "ranks": [[1, 2, 3]] * 10,
    })
    with open_store(workspace.store_path) as store:
        store.insert_new("problems", problems)
        store.insert_new("preference_pairs", pairs)
        store.insert_new("rankings", rankings)


@pytest.fixture
def tiny(flow_workspace, tmp_path) -> str:
    fill_store(flow_workspace)
    return str(build_tiny_model(tmp_path / "tiny", ["0123456789+=", "no idea"], hidden_size=64, num_heads=2,
                                intermediate_size=128))


def test_sft_flow_trains_on_problems_and_logs_to_mlflow(flow_workspace, tiny, the_run, prefect_run):
    state = sft_flow(SFTConfig(model_path=tiny, **FAST), return_state=True)
    final = Path(state.result())
    assert final.parent.parent == flow_workspace.models_dir / "sft" and final.name == "final"
    load_policy(final, device="cpu")
    run, artifacts = the_run(flow_workspace, "sft")
    assert {"train/loss", "train/grad_norm", "train/lr", "eval/loss"} <= set(run.data.metrics)
    assert run.data.params["max_steps"] == "2" and run.data.params["data"] == "problems"
    assert (artifacts / "model" / "model.safetensors").is_file() and (artifacts / "config.json").is_file()
    assert (artifacts / "sft_curves.png").is_file()  # train/loss and eval/loss over the steps
    name, task_names, artifact_keys = prefect_run(state)
    assert name == "sft" and "sft" in task_names and artifact_keys == {"sft-result"}


def test_a_run_that_logged_one_point_still_gets_its_curves(flow_workspace, tiny, the_run):
    sft_flow(SFTConfig(model_path=tiny, **(FAST | {"log_every": 10})))
    run, artifacts = the_run(flow_workspace, "sft")
    assert len(MlflowClient(flow_workspace.tracking_uri).get_metric_history(run.info.run_id, "train/loss")) == 1
    assert (artifacts / "sft_curves.png").is_file()


def test_a_stage_interrupted_and_rerun_holds_the_uninterrupted_runs_curves(flow_workspace, tiny, monkeypatch):
    """Interrupted at step 5 (its checkpoint is step 3) and rerun, SFT resumes at step 4: the rerun's MLflow run
    held steps 4-6 only, so its curves started at the checkpoint. It now holds the interrupted run's points of
    steps 0-3 (eval/loss starts at 0), then its own, equal to an uninterrupted run's at every step, and draws them
    all."""
    cfg = SFTConfig(model_path=tiny, max_steps=6, batch_size=4, log_every=1, eval_every=1, save_every=3,
                    device="cpu")
    sft_task.fn(cfg)
    real_train_stage = training.train_stage

    def interrupted_at_step_5(train, cfg, data, out_dir, log, **options):
        def log_then_interrupt(metrics, step):
            log(metrics, step)
            if step == 5:
                raise KeyboardInterrupt

        return real_train_stage(train, cfg, data, out_dir, log_then_interrupt, **options)

    monkeypatch.setattr(training, "train_stage", interrupted_at_step_5)
    with pytest.raises(KeyboardInterrupt):
        sft_task.fn(cfg, force=True)
    monkeypatch.setattr(training, "train_stage", real_train_stage)
    sft_task.fn(cfg)
    resumed, killed, full = tracking.find_runs(flow_workspace)
    assert resumed.data.tags["alignflow.resumes"] == killed.info.run_id
    assert resumed.data.tags["alignflow.carried_before_step"] == "4"
    client = MlflowClient(flow_workspace.tracking_uri)
    for key in ("train/loss", "eval/loss"):
        curves = [sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
                  for run in (resumed, full)]
        assert [step for step, _ in curves[0]] == [step for step, _ in curves[1]] == [0] * (key == "eval/loss") + \
            [1, 2, 3, 4, 5, 6], key
        assert all(abs(a - b) <= 1e-6 for (_, a), (_, b) in zip(*curves)), (key, curves)
    assert "sft_curves.png" in [artifact.path for artifact in client.list_artifacts(resumed.info.run_id)]


def test_rs_sft_is_named_rs_sft_in_prefect_and_mlflow(insert_samples, flow_workspace, tiny, the_run, prefect_run):
    """The pipeline runs rs_sft through the sft flow: its flow run, task run, artifact and MLflow run say rs_sft."""
    with open_store(flow_workspace.store_path) as store:
        insert_samples(store, SAMPLES)
    state = sft_flow(SFTConfig(model_path=tiny, data="best_of_n", samples_run_id="r1", **FAST), return_state=True)
    final = Path(state.result())
    assert final.parent.parent == flow_workspace.models_dir / "rs_sft"  # an unnamed eval of it says eval-rs_sft
    assert (the_run(flow_workspace, "rs_sft")[1] / "rs_sft_curves.png").is_file()
    name, task_names, artifact_keys = prefect_run(state)
    assert name == "rs_sft" and "rs_sft" in task_names and artifact_keys == {"rs-sft-result"}


def test_sft_task_rerun_returns_the_finished_model(flow_workspace, tiny):
    cfg = SFTConfig(model_path=tiny, data="pairs", **FAST)
    first = sft_task.fn(cfg)
    stamp = (Path(first) / "model.safetensors").stat().st_mtime_ns
    assert sft_task.fn(cfg) == first  # same config + data: same dir, nothing retrained
    assert (Path(first) / "model.safetensors").stat().st_mtime_ns == stamp
    other = sft_task.fn(cfg.model_copy(update={"seed": 1}))
    assert other != first


def test_a_new_checkpoint_interval_is_a_cache_hit_and_a_new_log_interval_is_not(flow_workspace, tiny):
    """save_every changes how a stage is kept: the same Prefect cache entry, no new tracking run. log_every
    changes the logged curves: the stage runs again."""
    cfg = SFTConfig(model_path=tiny, **FAST)
    first = sft_flow(cfg)
    runs = len(tracking.find_runs(flow_workspace, "attributes.run_name = 'sft'"))
    assert sft_flow(cfg.model_copy(update={"save_every": 7})) == first
    assert len(tracking.find_runs(flow_workspace, "attributes.run_name = 'sft'")) == runs
    assert sft_flow(cfg.model_copy(update={"log_every": 2})) != first
    assert len(tracking.find_runs(flow_workspace, "attributes.run_name = 'sft'")) == runs + 1


def test_an_edit_of_the_library_code_trains_the_stage_again_into_a_new_dir(flow_workspace, tiny, monkeypatch):
    """A result is reused only by the code that made it: an edit in a checkout (the version unchanged) is a cache
    miss, and the stage trains into a new dir instead of returning the old code's final. `code_version` is
    replaced where it is read, as an edit of pipeline_lib would change it (tests/test_tracking.py edits a copy)."""
    cfg = SFTConfig(model_path=tiny, **FAST)
    first = sft_flow(cfg)
    assert sft_flow(cfg) == first
    edited = "0.0.0 code edited"
    monkeypatch.setattr("tasks.common.code_version", lambda: edited)
    monkeypatch.setattr("pipeline_lib.train.data.code_version", lambda: edited)
    again = sft_flow(cfg)
    assert again != first and Path(again).is_dir()
    assert len(tracking.find_runs(flow_workspace, "attributes.run_name = 'sft'")) == 2


def test_a_new_held_out_problem_gives_sft_a_new_final_with_its_eval_loss(flow_workspace, tiny):
    """The held-out rows are an input of the stage (its eval/loss): a test problem ingested since is not
    answered with the earlier final and its earlier loss."""
    cfg = SFTConfig(model_path=tiny, **FAST)
    first = sft_flow(cfg)
    with open_store(flow_workspace.store_path) as store:
        store.insert_new("problems", pl.DataFrame({"problem_id": ["p99"], "source": "demo", "split": "test",
                                                   "prompt": ["77+77="], "answer": ["154"]}))
    again = sft_flow(cfg)
    assert again != first
    assert final_metrics(Path(again))["eval/loss"] != final_metrics(Path(first))["eval/loss"]


def test_a_cached_stage_whose_model_dir_was_deleted_trains_again(flow_workspace, tiny):
    cfg = SFTConfig(model_path=tiny, **FAST)
    first = sft_flow(cfg)
    shutil.rmtree(Path(first).parent)  # a cleaned models/: the cache entry still names the dir
    again = sft_flow(cfg)
    assert again == first and (Path(again) / "model.safetensors").is_file()


@pytest.mark.parametrize("damage", ["weights gone", "weights cut"])
def test_a_cached_stage_whose_final_lost_a_file_trains_again(flow_workspace, tiny, damage):
    """A cache hit on a final that is no longer whole (a partial copy) is not handed on: the stage trains again
    and the next stage gets loadable weights."""
    cfg = SFTConfig(model_path=tiny, **FAST)
    first = Path(sft_flow(cfg))
    weights = first / "model.safetensors"
    if damage == "weights gone":
        weights.unlink()
    else:
        weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.warns(RuntimeWarning, match="incomplete"):
        again = sft_flow(cfg)
    assert again == str(first)
    load_policy(again, device="cpu")


def test_the_stage_dir_follows_every_model_the_config_names(flow_workspace, tiny, tmp_path):
    """A reward model retrained into the same path gives the RL stage a new dir (not the old final model)."""
    reward_model = shutil.copytree(tiny, tmp_path / "rm")
    cfg = PPOConfig(policy_path=tiny, reward_model_path=str(reward_model))
    before = stage_dir(flow_workspace.models_dir, "ppo", cfg)
    weights = reward_model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + b"\x00")
    assert stage_dir(flow_workspace.models_dir, "ppo", cfg) != before


def test_a_model_retrained_to_the_same_weights_leaves_the_next_stage_cached(flow_workspace, tiny, tmp_path):
    """A forced or deleted stage that trains again to the same files writes a new final marker (its wall time):
    the stages after it keep their dirs and cache keys instead of all running again."""
    reward_model = shutil.copytree(tiny, tmp_path / "rm")
    marker = reward_model / FINAL_MARKER
    marker.write_text(json.dumps({"metrics": {"train/seconds": 1.42}}))
    cfg = PPOConfig(policy_path=tiny, reward_model_path=str(reward_model))
    before = stage_dir(flow_workspace.models_dir, "ppo", cfg), model_fingerprint(reward_model)
    marker.write_text(json.dumps({"metrics": {"train/seconds": 1.74}}))
    assert (stage_dir(flow_workspace.models_dir, "ppo", cfg), model_fingerprint(reward_model)) == before
    (reward_model / "config.json").write_text((reward_model / "config.json").read_text() + " ")
    assert model_fingerprint(reward_model) != before[1]


def test_the_same_model_at_another_path_is_the_same_input(flow_workspace, tiny, tmp_path):
    """A base rebuilt to the same files under a new key (a pair ingested into a corpus source added no character),
    or a path written relative: the path was in the keys, so every stage after it trained again, to the same files."""
    final = sft_flow(SFTConfig(model_path=tiny, **FAST))
    copy = shutil.copytree(tiny, tmp_path / "elsewhere")
    assert sft_flow(SFTConfig(model_path=str(copy), **FAST)) == final
    assert len(tracking.find_runs(flow_workspace, "tags.`alignflow.stage` = 'sft'")) == 1


def test_a_forced_stage_leaves_the_next_unforced_run_a_cache_hit(flow_workspace, tiny):
    """`--force` on a config never run before (a changed stage forced at once): the next plain run hits its entry."""
    cfg = SFTConfig(model_path=tiny, **FAST)
    final = sft_flow(cfg, force=True)
    assert sft_flow(cfg) == final
    assert len(tracking.find_runs(flow_workspace, "tags.`alignflow.stage` = 'sft'")) == 1


def test_a_stage_whose_data_cannot_be_read_fails_its_own_run_naming_the_stage(flow_workspace, tiny):
    """The inputs are read before training starts: the error says which stage (a pipeline has several `source:`
    fields) and the stage's MLflow run is FAILED with it, as for a failure while training."""
    with pytest.raises(AlignflowError) as err:
        dpo_flow(DPOConfig(policy_path=tiny, source="nosuch", **FAST))
    assert str(err.value).startswith("dpo: ") and "nosuch" in str(err.value)
    (run,) = tracking.find_runs(flow_workspace, "tags.`alignflow.stage` = 'dpo'")
    assert run.info.status == "FAILED" and run.data.tags["alignflow.error"].endswith(str(err.value))
    assert run.data.params["source"] == "nosuch"


def test_a_stage_whose_model_dir_is_missing_fails_its_own_run(flow_workspace, tiny, tmp_path, caplog):
    """A deployment run (or a direct call) skips the CLI's model check: a model dir that is not there fails the
    stage in one line, and its MLflow run is FAILED with it, as for unreadable data. A config Prefect refuses
    never starts the stage: no run."""
    missing = tmp_path / "gone"
    with pytest.raises(AlignflowError) as err:
        sft_flow(SFTConfig(model_path=str(missing), **FAST))
    assert str(err.value).endswith(f"model {str(missing)!r}: no such directory {missing}")
    (run,) = tracking.find_runs(flow_workspace, "tags.`alignflow.stage` = 'sft'")
    assert run.info.status == "FAILED" and run.data.tags["alignflow.error"].endswith(str(err.value))
    assert str(err.value).startswith("sft: ")
    assert all(record.exc_info is None for record in caplog.records)  # Prefect logs the one line, no traceback
    assert run.data.params["model_path"] == str(missing)
    with pytest.raises(ParameterTypeError, match="max_steps"):
        sft_flow({"model_path": tiny, "max_steps": 0})
    assert len(tracking.find_runs(flow_workspace, "")) == 1


@pytest.mark.parametrize(("flow", "cfg", "field"), [
    (sft_flow, SFTConfig(model_path="from:base", **FAST), "model_path"),
    (dpo_flow, DPOConfig(policy_path="/m", samples_run_id="from:sample", **FAST), "samples_run_id"),
])
def test_a_stage_deployment_given_a_from_reference_says_so_in_one_line(flow_workspace, flow, cfg, field):
    """Only a pipeline resolves `from:<stage>`: a stage's deployment took `from:base` for a hub id relative to where
    `serve` ran, and `from:sample` for a sampling run id, each failing later with a misleading error."""
    value = getattr(cfg, field)
    with pytest.raises(ConfigError) as err:
        flow(cfg)
    instead = "a sampling run id (`alignflow sample` prints it)" if field == "samples_run_id" else \
        "a path (a stage's output is under the workspace's models/, and `alignflow run` prints it)"
    assert str(err.value) == (f"{flow.name} parameters: {field}: {value!r} names a pipeline stage, which only a "
                              f"pipeline preset can; give {instead}")
    assert tracking.find_runs(flow_workspace, "") == []  # refused before the stage's MLflow run


def test_rm_flow_reports_held_out_accuracy(flow_workspace, tiny, the_run):
    final = Path(rm_flow(RMConfig(model_path=tiny, eval_fraction=0.2, **FAST)))
    RewardModel.from_pretrained(final, device="cpu")
    run, artifacts = the_run(flow_workspace, "rm")
    assert {"train/loss", "rewards/margins", "rewards/accuracies", "eval/rm_accuracy"} <= set(run.data.metrics)
    assert 0.0 <= run.data.metrics["eval/rm_accuracy"] <= 1.0
    assert final_metrics(final)["eval/n_groups"] == 2  # 20% of 10 pairs
    assert (artifacts / "model" / "reward_head.safetensors").is_file()
    assert (artifacts / "rm_curves.png").is_file()  # train/loss and the held-out accuracy and margin over the steps

    ranked = Path(rm_flow(RMConfig(model_path=tiny, loss="plackett_luce", pooling="mean", **FAST)))
    assert ranked != final and RewardModel.from_pretrained(ranked, device="cpu").pooling == "mean"


def test_dpo_flow_logs_before_after_and_caches_reference_logps(flow_workspace, tiny, the_run):
    final = Path(dpo_flow(DPOConfig(policy_path=tiny, lr=1e-3, eval_fraction=0.2, **FAST)))
    load_policy(final, device="cpu")
    run, artifacts = the_run(flow_workspace, "dpo")
    assert {"train/loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
            "logps/chosen", "logps/rejected", "eval/pref_accuracy", "eval/logp_margin"} <= set(run.data.metrics)
    assert (artifacts / "dpo_before_after.png").is_file() and (artifacts / "dpo_curves.png").is_file()
    assert len(list((flow_workspace.root / "cache" / "ref_logps").glob("*.safetensors"))) == 1
    metrics = final_metrics(final)
    assert {"eval/pref_accuracy_start", "eval/pref_accuracy"} <= set(metrics)


@pytest.mark.parametrize(("stage", "totals"), [
    ("sft", {"data/rows", "train/seconds"}),
    ("rm", {"eval/n_groups", "train/packed_groups", "train/seconds"}),
    ("dpo", {"train/packed_pairs", "train/seconds"}),
])
def test_every_metric_a_stages_final_holds_reaches_its_mlflow_run_at_the_last_step(flow_workspace, tiny, the_run,
                                                                                   stage, totals):
    """The totals a stage computes at its end went into the final's marker and Prefect's result table, never into
    its MLflow run: each is logged there once, at the last step, with the value the marker holds."""
    flows = {"sft": lambda: sft_flow(SFTConfig(model_path=tiny, **FAST)),
             "rm": lambda: rm_flow(RMConfig(model_path=tiny, eval_fraction=0.2, **FAST)),
             "dpo": lambda: dpo_flow(DPOConfig(policy_path=tiny, eval_fraction=0.2, **FAST))}
    stored = {key: value for key, value in final_metrics(Path(flows[stage]())).items()
              if not key.endswith("_start")}  # the held-out values at the start: logged at step 0 under their names
    run, _ = the_run(flow_workspace, stage)
    assert totals <= set(stored) and set(stored) <= set(run.data.metrics)
    assert {key: run.data.metrics[key] for key in stored} == pytest.approx(stored)
    client = MlflowClient(flow_workspace.tracking_uri)
    assert {key: [m.step for m in client.get_metric_history(run.info.run_id, key)] for key in totals} == \
        {key: [2] for key in totals}
    if stage == "sft":
        assert run.data.metrics["data/rows"] == 8  # the train split's problems


def test_sft_in_two_torchrun_processes_logs_every_step_as_one_process_does(flow_workspace, tiny, the_run):
    """processes: 2 trains the stage under torchrun (gloo, 2 rows per rank): rank 0's metrics reach the MLflow run
    at every step, at full precision, equal to one process's on the same global batch, and the held-out rows go
    along (eval/loss). processes is no part of the stage's keys: one process finds the stage finished."""
    cfg = SFTConfig(model_path=tiny, **(FAST | {"max_steps": 3}), processes=2)
    final = Path(sft_flow(cfg))
    assert json.loads((final / FINAL_MARKER).read_text())["topology"] == {"world_size": 2, "device": "cpu"}
    run, _ = the_run(flow_workspace, "sft")
    client = MlflowClient(flow_workspace.tracking_uri)

    def losses(run_id: str) -> dict[int, float]:
        return {metric.step: metric.value for metric in client.get_metric_history(run_id, "train/loss")}

    in_two = losses(run.info.run_id)
    assert sorted(in_two) == [1, 2, 3] and {"eval/loss", "train/grad_norm"} <= set(run.data.metrics)
    one_process = cfg.model_copy(update={"processes": 1})
    assert sft_task.fn(one_process) == str(final)  # same stage dir and run key: nothing to train
    assert sft_task.fn(one_process, force=True) == str(final)  # trained again, in this process
    assert json.loads((final / FINAL_MARKER).read_text())["topology"]["world_size"] == 1
    in_one = losses(tracking.find_runs(flow_workspace, "attributes.run_name = 'sft'")[0].info.run_id)  # the newest
    assert in_one.keys() == in_two.keys()
    # print_log's 4 digits would be off by up to 5e-4 on a loss near 3
    assert all(abs(in_one[step] - in_two[step]) < 1e-5 for step in in_one), (in_one, in_two)


def test_dpo_in_two_torchrun_processes_caches_reference_logps_in_the_workspace(flow_workspace, tiny, the_run):
    """The task's cache_dir reaches the torchrun workers through the run file's options."""
    final = Path(dpo_flow(DPOConfig(policy_path=tiny, lr=1e-3, eval_fraction=0.2, **FAST, processes=2)))
    assert json.loads((final / FINAL_MARKER).read_text())["topology"]["world_size"] == 2
    run, _ = the_run(flow_workspace, "dpo")
    assert {"train/loss", "rewards/margins", "eval/pref_accuracy"} <= set(run.data.metrics)
    assert len(list((flow_workspace.root / "cache" / "ref_logps").glob("*.safetensors"))) == 1
    assert not (final.parent / "cache").exists()  # not the default out_dir/cache
