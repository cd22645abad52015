"""MLflow tracking against the real sqlite store: experiment location, nested stage runs, FAILED runs."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import duckdb
import mlflow
import pytest
from matplotlib.figure import Figure
from prefect.exceptions import TerminationSignal
from mlflow.tracking import MlflowClient

from pipeline_lib import alignflow_version, code_version, tracking
from pipeline_lib.config import EvalConfig, IngestConfig
from pipeline_lib.errors import AlignflowError
from pipeline_lib.train.common import CheckpointWriteError
from pipeline_lib.workspace import Workspace


def test_stage_run_logs_params_metrics_config_and_tags(workspace):
    cfg = EvalConfig(model_path="/m/" + "x" * 900, n=4, ks=(1, 2, 4))
    with tracking.stage_run(workspace, "eval", cfg, tags={"prefect.flow_run_id": "abc"}, echo=False) as log:
        log({"eval/pass_at_1": 0.25}, 0)
        log({"eval/pass_at_1": 0.5}, 1)
        fig = Figure()
        fig.add_subplot().plot([1, 2], [3, 4])
        tracking.log_figure(fig, "plots/curve.png")
    (run,) = tracking.find_runs(workspace)
    assert run.info.status == "FINISHED"
    assert run.info.artifact_uri.startswith(workspace.mlflow_artifacts.as_uri())
    assert run.data.tags["prefect.flow_run_id"] == "abc"
    assert run.data.params["ks"] == "[1, 2, 4]"
    assert run.data.params["model_path"].endswith("...[truncated]") and len(run.data.params["model_path"]) <= 500
    history = MlflowClient(workspace.tracking_uri).get_metric_history(run.info.run_id, "eval/pass_at_1")
    assert [(m.step, m.value) for m in history] == [(0, 0.25), (1, 0.5)]
    artifacts = {a.path for a in MlflowClient(workspace.tracking_uri).list_artifacts(run.info.run_id, "plots")}
    assert artifacts == {"plots/curve.png"}
    assert mlflow.artifacts.load_dict(f"{run.info.artifact_uri}/config.json")["n"] == 4


def _model_dir(root: Path, big_bytes: int) -> Path:
    """config.json, a tokenizer file in a subdirectory and a (sparse) weights file of `big_bytes`."""
    (root / "tokenizer").mkdir(parents=True)
    (root / "config.json").write_text('{"n": 1}')
    (root / "tokenizer" / "vocab.txt").write_text("a b")
    with open(root / "model.safetensors", "wb") as weights:
        weights.truncate(big_bytes)
    return root


def _artifacts(workspace: Workspace, run_id: str, path: str) -> dict[str, int]:
    client = MlflowClient(workspace.tracking_uri)
    found = {}
    for item in client.list_artifacts(run_id, path):
        found |= _artifacts(workspace, run_id, item.path) if item.is_dir else {item.path: item.file_size}
    return found


def test_a_model_dir_is_copied_whole_up_to_the_limit_and_its_small_files_above_it(workspace, tmp_path, monkeypatch):
    small = _model_dir(tmp_path / "small", 2048)
    big = _model_dir(tmp_path / "big", tracking.SMALL_FILE_BYTES + 1)  # over 64 MiB, and over a 0 MiB limit
    (big / "model-00002-of-00002.safetensors").write_bytes(b"w" * 100)  # a small shard: weights all the same
    (big / "notes.bin.txt").write_text("kept")  # not a weights file
    with tracking.stage_run(workspace, "sft", echo=False):
        tracking.log_model(small)
    monkeypatch.setenv(tracking.MODEL_COPY_ENV, "0")
    with tracking.stage_run(workspace, "dpo", echo=False):
        tracking.log_model(big)
    runs = {run.info.run_name: run for run in tracking.find_runs(workspace)}
    assert _artifacts(workspace, runs["sft"].info.run_id, "model") == {
        "model/config.json": 8, "model/tokenizer/vocab.txt": 3, "model/model.safetensors": 2048}
    copied = _artifacts(workspace, runs["dpo"].info.run_id, "model")
    assert sorted(copied) == ["model/config.json", "model/not_copied.json", "model/notes.bin.txt",
                              "model/tokenizer/vocab.txt"]
    listed = mlflow.artifacts.load_dict(f"{runs['dpo'].info.artifact_uri}/model/not_copied.json")
    assert listed == {"model_path": str(big.resolve()), "bytes": {"model-00002-of-00002.safetensors": 100,
                                                                  "model.safetensors": tracking.SMALL_FILE_BYTES + 1}}
    assert runs["sft"].data.tags["alignflow.model_path"] == str(small.resolve())
    assert runs["dpo"].data.tags["alignflow.model_path"] == str(big.resolve())



def test_a_model_an_earlier_run_copied_is_named_not_copied_again(workspace, tmp_path):
    """A stage returning its finished final, or retrained to the same weights, logged a whole copy more each
    time (a soak audit: 19 runs, one full set of models, after Prefect's result storage was cleared)."""
    model = _model_dir(tmp_path / "m", 2048)
    same = shutil.copytree(model, tmp_path / "same-content")
    with tracking.stage_run(workspace, "sft", echo=False):
        tracking.log_model(model)
    with tracking.stage_run(workspace, "sft-again", echo=False):
        tracking.log_model(same)
    (model / "config.json").write_text('{"n": 2}')  # retrained to other weights: its own copy
    with tracking.stage_run(workspace, "sft-changed", echo=False):
        tracking.log_model(model)
    runs = {run.info.run_name: run for run in tracking.find_runs(workspace)}
    first, again, changed = runs["sft"], runs["sft-again"], runs["sft-changed"]
    assert _artifacts(workspace, first.info.run_id, "model") == {
        "model/config.json": 8, "model/tokenizer/vocab.txt": 3, "model/model.safetensors": 2048}
    assert _artifacts(workspace, again.info.run_id, "model") == {}
    assert again.data.tags["alignflow.model_logged_in"] == first.info.run_id
    assert again.data.tags["alignflow.model_path"] == str(same.resolve())
    assert "model/config.json" in _artifacts(workspace, changed.info.run_id, "model")
    assert "alignflow.model_logged_in" not in changed.data.tags
    MlflowClient(workspace.tracking_uri).delete_run(first.info.run_id)  # deleted (then gc'd): copied again
    with tracking.stage_run(workspace, "sft-after-delete", echo=False):
        tracking.log_model(same)
    [after] = tracking.find_runs(workspace, "attributes.run_name = 'sft-after-delete'")
    assert "model/model.safetensors" in _artifacts(workspace, after.info.run_id, "model")

@pytest.mark.parametrize("value", ["1GB", "-1", "1.5", "\u00b2"])  # superscript two: a digit, not a decimal
def test_a_bad_model_copy_setting_fails_before_the_stage_starts(workspace, monkeypatch, value):
    monkeypatch.setenv(tracking.MODEL_COPY_ENV, value)
    with pytest.raises(AlignflowError, match=r"^\$ALIGNFLOW_MLFLOW_MODEL_MIB: expected a whole number of MiB .*got"):
        with tracking.stage_run(workspace, "sft", echo=False):
            raise AssertionError("the stage must not start")
    assert tracking.find_runs(workspace) == []


def test_model_copy_setting_defaults_when_unset_or_empty_and_a_missing_model_dir_is_an_error(workspace, monkeypatch,
                                                                                              tmp_path):
    monkeypatch.setenv(tracking.MODEL_COPY_ENV, "")
    assert tracking.model_copy_limit() == tracking.DEFAULT_MODEL_COPY_MIB
    monkeypatch.setenv(tracking.MODEL_COPY_ENV, " 5 ")
    assert tracking.model_copy_limit() == 5
    with pytest.raises(FileNotFoundError, match="not a directory"):
        with tracking.stage_run(workspace, "sft", echo=False):
            tracking.log_model(tmp_path / "missing")


def test_stage_runs_nest_under_the_pipeline_run_and_failures_are_marked(workspace):
    cfg = EvalConfig(model_path="/m", n=1, ks=(1,))
    with tracking.pipeline_run(workspace, "demo", cfg) as parent_id:
        with tracking.stage_run(workspace, "sft", {"lr": 0.1}, echo=False) as log:
            log({"train/loss": 1.0}, 0)
        with pytest.raises(RuntimeError):
            with tracking.stage_run(workspace, "dpo", {"beta": 0.1}, echo=False):
                raise RuntimeError("boom")
    runs = {r.info.run_name: r for r in tracking.find_runs(workspace)}
    assert runs["demo"].info.status == "FINISHED"
    assert runs["sft"].data.tags["mlflow.parentRunId"] == parent_id
    assert runs["dpo"].data.tags["mlflow.parentRunId"] == parent_id
    assert runs["dpo"].info.status == "FAILED" and runs["sft"].info.status == "FINISHED"
    assert runs["dpo"].data.tags["alignflow.error"] == "RuntimeError: boom"
    assert "alignflow.error" not in runs["sft"].data.tags
    for run in runs.values():
        assert run.data.tags["alignflow.version"] == alignflow_version() != "unknown"
        assert run.data.tags["alignflow.code"] == code_version()
        commit = subprocess.run(["git", "-C", str(Path(tracking.__file__).parents[1]), "rev-parse", "HEAD"],
                                capture_output=True, text=True).stdout.strip()
        assert run.data.tags.get("mlflow.source.git.commit") == (commit or None)  # None outside a checkout
        assert run.data.tags["alignflow.pid"] == str(os.getpid())


def test_flatten_params_nests_and_truncates():
    flat = tracking.flatten_params({"a": {"b": 1, "c": [1, 2]}, "d": "x" * 600,
                                    "files": ({"path": "a.jsonl"}, IngestConfig(path="b.csv"))})
    assert flat["a.b"] == "1" and flat["a.c"] == "[1, 2]"
    assert flat["files.0.path"] == "a.jsonl" and flat["files.1.path"] == "b.csv"
    assert len(flat["d"]) == tracking.MAX_PARAM_CHARS and flat["d"].endswith("[truncated]")


def test_a_moved_workspace_logs_into_its_own_artifacts_and_keeps_the_old_ones(workspace, tmp_path):
    with tracking.stage_run(workspace, "sft", {"lr": 0.1}, echo=False):
        tracking.log_text("before the move", "note.txt")
    moved = Workspace(tmp_path / "moved")
    shutil.move(workspace.root, moved.root)
    with tracking.stage_run(moved, "sft", {"lr": 0.2}, echo=False):
        tracking.log_text("after the move", "note.txt")
    runs = tracking.find_runs(moved)
    assert [r.data.params["lr"] for r in runs] == ["0.2", "0.1"]
    for run, text in zip(runs, ("after the move", "before the move")):
        assert run.info.artifact_uri.startswith(moved.mlflow_artifacts.as_uri() + "/")
        assert mlflow.artifacts.load_text(f"{run.info.artifact_uri}/note.txt") == text
    assert not workspace.root.exists()
    own = Workspace(tmp_path / "own-root").create()  # an artifact root the user chose is not the workspace's to move
    client = MlflowClient(own.tracking_uri)
    chosen = client.create_experiment(tracking.EXPERIMENT, artifact_location="s3://bucket/mlflow")
    run = client.create_run(chosen)
    assert tracking.configure(own) == chosen
    assert client.get_experiment(chosen).artifact_location == "s3://bucket/mlflow"
    assert client.get_run(run.info.run_id).info.artifact_uri.startswith("s3://bucket/mlflow/")


def test_a_killed_stage_run_is_marked_killed_and_its_rerun_says_it_resumes_it(workspace):
    """A process that dies inside a stage leaves its run RUNNING; the next run in the workspace ends it as
    KILLED with the reason, and the rerun of the same stage and config is tagged with the run it resumes."""
    script = (f"import os; from pathlib import Path; from pipeline_lib import tracking\n"
              f"from pipeline_lib.workspace import Workspace\n"
              f"with tracking.stage_run(Workspace(Path({str(workspace.root)!r})), 'sft', {{'lr': 0.1}},\n"
              f"                        echo=False) as log:\n"
              f"    log({{'train/loss': 1.0}}, 5)\n"
              f"    os._exit(9)\n")
    assert subprocess.run([sys.executable, "-c", script]).returncode == 9
    (killed,) = tracking.find_runs(workspace)
    assert killed.info.status == "RUNNING"
    with tracking.stage_run(workspace, "rm", {"lr": 0.1}, echo=False):  # another stage first: it ends the run
        pass
    with tracking.stage_run(workspace, "sft", {"lr": 0.2}, echo=False):  # another config: not a resume
        pass
    for _ in range(2):  # only the first rerun resumes the killed run
        with tracking.stage_run(workspace, "sft", {"lr": 0.1}, echo=False):
            pass
    again, rerun, other, first, killed = tracking.find_runs(workspace)
    assert killed.info.status == "KILLED" and "ended without closing the run" in killed.data.tags["alignflow.error"]
    assert rerun.data.tags["alignflow.resumes"] == killed.info.run_id and rerun.info.status == "FINISHED"
    assert not any("alignflow.resumes" in run.data.tags for run in (again, other, first))


def test_a_killed_run_is_resumed_only_from_its_own_workspace_when_workspaces_share_a_tracking_store(tmp_path,
                                                                                                     monkeypatch):
    """Two workspaces logging into one exported MLFLOW_TRACKING_URI: a helper saw workspace B's fresh run of the same
    stage and config tagged as resuming A's killed run, and A's real resume then linked to nothing."""
    uri = f"sqlite:///{tmp_path / 'shared.db'}"
    monkeypatch.setattr("pipeline_lib.workspace.USER_TRACKING_URI", uri)
    first, second = Workspace(tmp_path / "a").create(), Workspace(tmp_path / "b").create()
    script = (f"import os; from pathlib import Path; from pipeline_lib import tracking\n"
              f"from pipeline_lib.workspace import Workspace\n"
              f"with tracking.stage_run(Workspace(Path({str(first.root)!r})), 'sft', {{'lr': 0.1}}, echo=False):\n"
              f"    os._exit(9)\n")
    assert subprocess.run([sys.executable, "-c", script], env={**os.environ, "MLFLOW_TRACKING_URI": uri}).returncode == 9
    with tracking.stage_run(second, "sft", {"lr": 0.1}, echo=False):  # B's own first run
        pass
    with tracking.stage_run(first, "sft", {"lr": 0.1}, echo=False):  # A's rerun
        pass
    rerun, fresh, killed = tracking.find_runs(first)
    assert {killed.data.tags["alignflow.workspace"], rerun.data.tags["alignflow.workspace"]} == {str(first.root)}
    assert fresh.data.tags["alignflow.workspace"] == str(second.root) and "alignflow.resumes" not in fresh.data.tags
    assert rerun.data.tags["alignflow.resumes"] == killed.info.run_id


def test_two_workspaces_starting_together_on_a_new_shared_sqlite_store_both_work(tmp_path):
    """MLflow creates and migrates a sqlite store's schema on first use: two processes doing it at once on a new
    shared file (an exported MLFLOW_TRACKING_URI) failed one of them with alembic tracebacks (a helper: 3 of 3;
    this test on the code before: 4 of 4 trials). The first use holds a lock beside the file."""
    script = ("import sys; from pathlib import Path; from pipeline_lib import tracking; from pipeline_lib.workspace "
              "import Workspace; print(tracking.configure(Workspace(Path(sys.argv[1])).create()))")
    for trial in range(2):
        env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / f'shared{trial}.db'}"}
        both = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path / f"w{trial}{i}")], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
        results = [(process.wait(), *process.communicate()) for process in both]
        assert [code for code, _, _ in results] == [0, 0], results[0][2][-2000:] + results[1][2][-2000:]
        assert len({out for _, out, _ in results}) == 1  # one experiment, not one each


def test_a_rerun_carries_the_points_its_resumed_run_logged_before_its_own_first_step(workspace, monkeypatch):
    """The killed run logged steps 1-5 (its checkpoint was at 3); the rerun resumes at 4: it holds the killed run's
    points of steps 1-3, their values and timestamps, then its own, once each, and says where its own begin. In
    batches of CARRY_BATCH, here 2."""
    monkeypatch.setattr(tracking, "CARRY_BATCH", 2)
    with pytest.raises(KeyboardInterrupt):
        with tracking.stage_run(workspace, "sft", {"lr": 0.1}, echo=False) as log:
            for step in range(1, 6):
                log({"train/loss": 10.0 - step, **({"eval/loss": 20.0 - step} if step % 2 else {})}, step)
            raise KeyboardInterrupt
    with tracking.stage_run(workspace, "sft", {"lr": 0.1}, echo=False) as log:
        for step in range(4, 7):
            log({"train/loss": 100.0 + step}, step)
        curves = tracking.metric_history(["train/loss", "eval/loss", "never/logged"])
    rerun, killed = tracking.find_runs(workspace)
    client = MlflowClient(workspace.tracking_uri)

    def points(run, key: str) -> list[tuple[int, float, int]]:
        return sorted((m.step, m.value, m.timestamp) for m in client.get_metric_history(run.info.run_id, key))

    assert [(step, value) for step, value, _ in points(rerun, "train/loss")] == \
        [(1, 9.0), (2, 8.0), (3, 7.0), (4, 104.0), (5, 105.0), (6, 106.0)]
    assert points(rerun, "train/loss")[:3] == points(killed, "train/loss")[:3]
    assert points(rerun, "eval/loss") == points(killed, "eval/loss")[:2]  # steps 1 and 3; not 5
    assert rerun.data.tags["alignflow.carried_before_step"] == "4"
    assert curves == [(1, {"train/loss": 9.0, "eval/loss": 19.0}), (2, {"train/loss": 8.0}),
                      (3, {"train/loss": 7.0, "eval/loss": 17.0}), (4, {"train/loss": 104.0}),
                      (5, {"train/loss": 105.0}), (6, {"train/loss": 106.0})]


def test_a_rerun_carries_the_points_past_a_resume_killed_before_it_logged(workspace):
    """Killed at step 5 (checkpoint 3), then a rerun killed while its model loaded (it logged nothing), then a
    third: it resumed the second, which held no points, so its curves started at step 4 (the review's case)."""
    with pytest.raises(KeyboardInterrupt):
        with tracking.stage_run(workspace, "rm", {"lr": 0.1}, echo=False) as log:
            for step in range(1, 6):
                log({"train/loss": 10.0 - step}, step)
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        with tracking.stage_run(workspace, "rm", {"lr": 0.1}, echo=False):
            raise KeyboardInterrupt
    with tracking.stage_run(workspace, "rm", {"lr": 0.1}, echo=False) as log:
        log({"train/loss": 104.0}, 4)
    third, second, first = tracking.find_runs(workspace)
    assert third.data.tags["alignflow.resumes"] == second.info.run_id
    assert second.data.tags["alignflow.resumes"] == first.info.run_id
    points = MlflowClient(workspace.tracking_uri).get_metric_history(third.info.run_id, "train/loss")
    assert sorted((m.step, m.value) for m in points) == [(1, 9.0), (2, 8.0), (3, 7.0), (4, 104.0)]


def test_a_failed_stage_run_is_resumed_by_its_rerun_with_its_points(workspace):
    """A failure (here a full disk while checkpointing, as an error) leaves the stage's checkpoint as a kill does, so
    the rerun resumes it: the FAILED run is linked and its points before the rerun's first step carried. Before, only
    KILLED runs were, and a failed run's rerun started its curves at its checkpoint."""
    with pytest.raises(OSError):
        with tracking.stage_run(workspace, "dpo", {"beta": 0.1}, echo=False) as log:
            for step in range(1, 4):
                log({"train/loss": 10.0 - step}, step)
            raise OSError("no checkpoint written")
    with tracking.stage_run(workspace, "dpo", {"beta": 0.1}, echo=False) as log:
        log({"train/loss": 103.0}, 3)
    with tracking.stage_run(workspace, "dpo", {"beta": 0.1}, echo=False):  # a finished run is no resume
        pass
    again, rerun, failed = tracking.find_runs(workspace)
    assert failed.info.status == "FAILED" and failed.data.tags["alignflow.error"] == "OSError: no checkpoint written"
    assert rerun.data.tags["alignflow.resumes"] == failed.info.run_id and "alignflow.resumes" not in again.data.tags
    points = MlflowClient(workspace.tracking_uri).get_metric_history(rerun.info.run_id, "train/loss")
    assert sorted((m.step, m.value) for m in points) == [(1, 9.0), (2, 8.0), (3, 103.0)]


def test_an_interrupted_stage_run_is_killed_and_a_rerun_with_another_save_every_resumes_it(workspace):
    """Ctrl-C (KeyboardInterrupt) is no failure of the stage: its run ends KILLED, as a killed process's does, and
    the rerun that resumes its checkpoint links to it, also under a new checkpoint interval (`save_every` is not
    part of what the run trains: the stage resumes its checkpoint, so the run must say so)."""
    with pytest.raises(KeyboardInterrupt):
        with tracking.stage_run(workspace, "sft", {"lr": 0.1, "save_every": 50}, echo=False):
            raise KeyboardInterrupt
    with tracking.stage_run(workspace, "sft", {"lr": 0.1, "save_every": 40}, echo=False):
        pass
    rerun, interrupted = tracking.find_runs(workspace)
    assert interrupted.info.status == "KILLED" and interrupted.data.tags["alignflow.error"] == "interrupted (Ctrl-C)"
    assert rerun.data.tags["alignflow.resumes"] == interrupted.info.run_id


def test_a_run_stopped_by_sigterm_is_killed_and_only_a_rerun_on_the_same_data_and_code_resumes_it(workspace,
                                                                                                   monkeypatch):
    """Prefect raises its TerminationSignal on SIGTERM (a cancel in its UI, a `serve` stopped mid-run, `kill`): the
    stage's and the pipeline's runs ended FAILED with the reason 'TerminationSignal: ' and the rerun resumed none.
    A killed run whose data or code differ trained in another dir, from the start: its rerun resumed nothing,
    but said it did."""
    with pytest.raises(TerminationSignal):
        with tracking.pipeline_run(workspace, "p", EvalConfig(model_path="m")):
            with tracking.stage_run(workspace, "sft", {"lr": 0.1}, tags={"data.fingerprint": "d1"}, echo=False):
                raise TerminationSignal(signal.SIGTERM)
    stopped, pipeline = tracking.find_runs(workspace)
    for run in (stopped, pipeline):
        assert (run.info.status, run.data.tags["alignflow.error"]) == ("KILLED", "interrupted (SIGTERM)")
    with tracking.stage_run(workspace, "sft", {"lr": 0.1}, tags={"data.fingerprint": "d2"}, echo=False):
        pass
    monkeypatch.setattr(tracking, "code_version", lambda: "another code")
    with tracking.stage_run(workspace, "sft", {"lr": 0.1}, tags={"data.fingerprint": "d1"}, echo=False):
        pass
    monkeypatch.undo()
    with tracking.stage_run(workspace, "sft", {"lr": 0.1}, tags={"data.fingerprint": "d1"}, echo=False):
        pass
    rerun, other_code, other_data = tracking.find_runs(workspace)[:3]
    assert rerun.data.tags["alignflow.resumes"] == stopped.info.run_id
    assert "alignflow.resumes" not in other_code.data.tags and "alignflow.resumes" not in other_data.data.tags


_WAL = 'Could not write file "/ws/store.duckdb.wal"'


@pytest.mark.parametrize(("error", "expected"), [
    (sqlite3.OperationalError("database or disk is full"),  # MLflow's store, logging a metric
     "no space left on the disk (OperationalError: an sqlite database (MLflow's) is full); free some"),
    (OSError(errno.ENOSPC, "No space left on device"),  # its artifact copy of the model
     "no space left on the disk (OSError: [Errno 28] No space left on device); free some"),
    (OSError(errno.EDQUOT, "Disk quota exceeded"),
     "the disk quota is used up (OSError: [Errno 122] Disk quota exceeded); free some"),
    (duckdb.TransactionException(f"TransactionContext Error: Failed to commit: {_WAL}: File too large"),  # ulimit -f
     f"a file reached the file-size limit (ulimit -f) (TransactionException: TransactionContext Error: Failed to "
     f"commit: {_WAL}: File too large); raise it"),
], ids=["sqlite", "ENOSPC", "EDQUOT", "duckdb-EFBIG"])
def test_a_full_disk_under_a_stage_is_one_line(workspace, error, expected, monkeypatch):
    """A disk filling up mid-stage printed hundreds of lines of tracebacks (27 for the store's), from whichever
    library hit it first; recording the failure in the full store failed too. So did a file-size limit (`ulimit
    -f`) the store's write-ahead log reached during an ingest (a 26 MB file: 217 lines)."""
    with pytest.raises(tracking.DiskFullError) as raised:
        with tracking.stage_run(workspace, "rm", {"lr": 0.1}, echo=False):
            raise error
    assert str(raised.value) == f"{expected} and rerun: a training stage resumes from its last checkpoint"
    assert raised.value.__cause__ is error
    with pytest.raises(tracking.DiskFullError):  # recording the failure fails too: the same line
        with tracking.stage_run(workspace, "rm", {"lr": 0.1}, echo=False):
            monkeypatch.setattr(mlflow, "set_tag", lambda *_: (_ for _ in ()).throw(error))
            raise error
    monkeypatch.undo()
    mlflow.end_run()  # the run that could not be ended
    with pytest.raises(CheckpointWriteError):  # one that says it already stays itself
        with tracking.stage_run(workspace, "rm", {"lr": 0.1}, echo=False):
            raise CheckpointWriteError("out: cannot write the step 2 checkpoint (OSError: [Errno 28] No space left "
                                       "on device); the previous checkpoint is kept")


def test_the_code_version_follows_the_librarys_files_not_where_they_are(tmp_path):
    """What cache keys and sampling run ids hold: the same files give the same value wherever they lie, and an edit
    that keeps the version (a checkout's) gives another."""
    copy = tmp_path / "pipeline_lib"
    shutil.copytree(Path(tracking.__file__).parent, copy, ignore=shutil.ignore_patterns("__pycache__"))

    def copy_version() -> str:
        return subprocess.run([sys.executable, "-c", "import pipeline_lib; print(pipeline_lib.code_version())"],
                              cwd=tmp_path, capture_output=True, text=True, check=True).stdout.strip()

    assert copy_version() == code_version()
    losses = copy / "losses" / "dpo.py"
    losses.write_text(losses.read_text() + "\n# an edit\n")
    edited = copy_version()
    assert edited != code_version() and edited.split(" code ")[0] == code_version().split(" code ")[0]


def test_a_run_from_a_checkout_with_local_changes_says_so_beside_its_commit(workspace, tmp_path):
    """`mlflow.source.git.commit` alone named code the run may not have run (runs of one commit had other code
    fingerprints): `alignflow.git.dirty` says whether the working tree differed from it, `alignflow.git.changes`
    which files. Stage runs of a copy of the library in a temporary git repo, clean then edited."""
    repo = tmp_path / "repo"
    shutil.copytree(Path(tracking.__file__).parent, repo / "pipeline_lib", ignore=shutil.ignore_patterns("__pycache__"))

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                              capture_output=True, text=True, check=True).stdout.strip()

    def run_tags(stage: str) -> dict[str, str]:
        script = ("import sys; from pathlib import Path; from pipeline_lib import tracking; "
                  "from pipeline_lib.workspace import Workspace\n"
                  "with tracking.stage_run(Workspace(Path(sys.argv[1])), sys.argv[2], echo=False): pass")
        subprocess.run([sys.executable, "-c", script, str(workspace.root), stage], cwd=repo, check=True)
        return next(run for run in tracking.find_runs(workspace) if run.info.run_name == stage).data.tags

    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "copy")
    clean = run_tags("clean")
    assert clean["mlflow.source.git.commit"] == git("rev-parse", "HEAD")
    assert clean["alignflow.git.dirty"] == "false" and "alignflow.git.changes" not in clean
    losses = repo / "pipeline_lib" / "losses" / "dpo.py"
    losses.write_text(losses.read_text() + "\n# an edit\n")
    (repo / "notes.txt").write_text("untracked\n")
    edited = run_tags("edited")
    assert edited["mlflow.source.git.commit"] == clean["mlflow.source.git.commit"]
    assert edited["alignflow.code"] != clean["alignflow.code"]
    assert edited["alignflow.git.dirty"] == "true"
    assert edited["alignflow.git.changes"] == "2 changed: pipeline_lib/losses/dpo.py, notes.txt"
